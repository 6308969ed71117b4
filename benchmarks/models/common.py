"""The interface every model in the zoo exposes: a pure train step over plain pytrees.

autoshard traces ``train_step(state, batch)`` with ``jax.make_jaxpr``, so both arguments must be
pytrees of arrays only. Each model is written with flax nnx, and the nnx graph is kept out of the
arguments: the train step closes over the static ``GraphDef`` and rebuilds the module with
``nnx.merge`` inside the traced function.

State layout (nested dicts of arrays)::

    {
        "params": {...},        # nnx.Param leaves, as a pure dict (nnx.to_pure_dict)
        "model_state": {...},   # every other nnx Variable (BatchNorm running stats); {} if none
        "opt_state": ...,       # the optax state for "params"
        "step": int32[],
    }
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

State = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
# (module, batch) -> (scalar loss, metrics). Runs the module in place, so it may update BatchStats.
ModuleLoss = Callable[[nnx.Module, Batch], tuple[jax.Array, Metrics]]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model with a pure functional train step, ready for ``jax.jit`` or autoshard.

    Attributes:
        name: e.g. ``"gpt-350M"``.
        init_state: rng key -> state pytree (see the module docstring for the layout).
        train_step: ``(state, batch) -> (new_state, {"loss": scalar, ...})``, pure.
        loss_fn: ``(state, batch) -> (loss, metrics)`` without the update (for checks and eval).
        make_batch: rng key -> global batch, batch is the leading axis of every leaf.
        batch_size: the global batch size.
        flops_per_step: analytic estimate of one train step's flops (forward + backward), or None.
        optimizer: the optax transform used by ``train_step``.

    Example:
        >>> spec = get_model("mlp", "tiny", batch_size=8)                # doctest: +SKIP
        >>> state = spec.init_state(jax.random.key(0))                   # doctest: +SKIP
        >>> state, metrics = jax.jit(spec.train_step)(state, spec.make_batch(jax.random.key(1)))  # doctest: +SKIP
    """

    name: str
    init_state: Callable[[jax.Array], State]
    train_step: Callable[[State, Batch], tuple[State, Metrics]]
    loss_fn: Callable[[State, Batch], tuple[jax.Array, Metrics]]
    make_batch: Callable[[jax.Array], Batch]
    batch_size: int
    flops_per_step: float | None
    optimizer: optax.GradientTransformation

    def abstract_state(self) -> State:
        """The state as ``jax.ShapeDtypeStruct``s, without allocating it."""
        return jax.eval_shape(self.init_state, jax.random.key(0))

    def abstract_batch(self) -> Batch:
        """The batch as ``jax.ShapeDtypeStruct``s, without allocating it."""
        return jax.eval_shape(self.make_batch, jax.random.key(0))

    def num_params(self) -> int:
        """The number of trainable parameters, counted from the abstract state."""
        return param_count(self.abstract_state()["params"])


def param_count(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def make_optimizer(name: str, learning_rate: float, **kwargs: Any) -> optax.GradientTransformation:
    """Build an optax transform by name: "adam", "adamw", "sgd" (momentum 0.9, nesterov)."""
    if name == "adam":
        return optax.adam(learning_rate, **kwargs)
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=kwargs.pop("weight_decay", 0.01), **kwargs)
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=kwargs.pop("momentum", 0.9), nesterov=True, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}; expected one of 'adam', 'adamw', 'sgd'")


def build_spec(
    name: str,
    make_module: Callable[[nnx.Rngs], nnx.Module],
    module_loss: ModuleLoss,
    make_batch: Callable[[jax.Array], Batch],
    batch_size: int,
    optimizer: optax.GradientTransformation,
    flops_per_step: float | None = None,
) -> ModelSpec:
    """Turn an nnx module factory and a loss into a `ModelSpec` with a pure train step.

    The module's graph is read once from an abstract module (``nnx.eval_shape``), so building a
    spec for a multi-billion parameter config allocates nothing.
    """
    abstract_module = nnx.eval_shape(lambda: make_module(nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(abstract_module, nnx.Param, ...)

    def init_state(key: jax.Array) -> State:
        module = make_module(nnx.Rngs(key))
        _, params, model_state = nnx.split(module, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return {
            "params": params,
            "model_state": nnx.to_pure_dict(model_state),
            "opt_state": optimizer.init(params),
            "step": jnp.zeros((), jnp.int32),
        }

    def objective(params, model_state, batch):
        module = nnx.merge(graphdef, params, model_state)
        loss, metrics = module_loss(module, batch)
        new_model_state = nnx.to_pure_dict(nnx.state(module, nnx.Not(nnx.Param)))
        return loss, (metrics, new_model_state)

    def loss_fn(state: State, batch: Batch) -> tuple[jax.Array, Metrics]:
        loss, (metrics, _) = objective(state["params"], state["model_state"], batch)
        return loss, {"loss": loss, **metrics}

    def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
        (loss, (metrics, new_model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"], state["model_state"], batch
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "model_state": new_model_state,
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
        return new_state, {"loss": loss, **metrics}

    return ModelSpec(
        name=name,
        init_state=init_state,
        train_step=train_step,
        loss_fn=loss_fn,
        make_batch=make_batch,
        batch_size=batch_size,
        flops_per_step=flops_per_step,
        optimizer=optimizer,
    )


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross entropy over all leading axes, computed in float32."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def language_model_spec(
    name: str,
    make_module: Callable[[nnx.Rngs], nnx.Module],
    config: Any,
    batch_size: int,
    optimizer: optax.GradientTransformation,
    flops_per_step: float | None = None,
) -> ModelSpec:
    """A `ModelSpec` for a causal language model: ``make_module(rngs)(tokens)`` gives logits, trained by
    cross-entropy on the next token. ``config`` gives ``vocab_size`` and ``seq_len``; a batch is
    ``{"tokens": int32[B, S], "targets": int32[B, S]}`` cut from random sequences of ``S + 1`` tokens."""

    def module_loss(model, batch):
        return softmax_cross_entropy(model(batch["tokens"]), batch["targets"]), {}

    def make_batch(key: jax.Array) -> Batch:
        seq = jax.random.randint(key, (batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
        return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}

    return build_spec(name, make_module, module_loss, make_batch, batch_size, optimizer, flops_per_step)
