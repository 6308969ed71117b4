"""Steps with hand-partitioned regions: a ``jax.shard_map`` block and a ``custom_partitioning`` op.

- ``shard_map_case``: an MLP whose first layer is a column-parallel matmul written per shard with
  ``jax.shard_map`` (batch over ``data``, hidden units over ``model``), followed by a
  cross-replica normalisation whose per-shard sums are combined with ``lax.psum`` over ``data``
  (synchronised batch statistics, as written by hand).
- ``custom_partitioning_case``: an MLP classifier whose softmax is a
  ``jax.experimental.custom_partitioning`` op with a Shardy ``sharding_rule`` (rows may split,
  the class axis must stay whole) and a ``custom_vjp`` so it trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from tests.zoo import ADAM_EPS, FunctionalCase

MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")


@dataclass(frozen=True)
class MlpConfig:
    d_in: int = 16
    hidden: int = 32
    classes: int = 8
    batch: int = 8


def init_params(key, cfg: MlpConfig, *, bias: bool):
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (cfg.d_in, cfg.hidden)) / math.sqrt(cfg.d_in),
              "w2": jax.random.normal(k2, (cfg.hidden, cfg.classes)) / math.sqrt(cfg.hidden)}
    if bias:
        params["b1"] = jnp.zeros((cfg.hidden,))
    return params


def make_batch(cfg: MlpConfig = MlpConfig()):
    k1, k2 = jax.random.split(jax.random.key(61))
    return {"x": jax.random.normal(k1, (cfg.batch, cfg.d_in)),
            "y": jax.random.randint(k2, (cfg.batch,), 0, cfg.classes)}


def functional_step(tx, logits_fn):
    def train_step(state, batch):
        def loss_fn(params):
            log_probs = logits_fn(params, batch["x"])
            return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1))

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return train_step


def functional_case(name, logits_fn, *, bias: bool, cfg: MlpConfig = MlpConfig()) -> FunctionalCase:
    tx = optax.adam(1e-2, eps=ADAM_EPS)

    def init_state():
        params = init_params(jax.random.key(0), cfg, bias=bias)
        return {"params": params, "opt_state": tx.init(params)}

    return FunctionalCase(name, init_state, lambda: make_batch(cfg), functional_step(tx, logits_fn))


# ---- shard_map -----------------------------------------------------------------------------------


def sharded_hidden(mesh):
    """relu(x @ w1), normalised by its mean and variance over the whole batch, per shard.

    No bias before the normalisation: its gradient is exactly zero, and Adam would turn the
    reduction-order noise in that zero into steps of size lr.
    """

    def block(x, w1):
        h = jax.nn.relu(x @ w1)  # (batch / data, hidden / model): no communication
        count = jax.lax.psum(h.shape[0], "data")
        mean = jax.lax.psum(jnp.sum(h, axis=0), "data") / count
        var = jax.lax.psum(jnp.sum(jnp.square(h - mean), axis=0), "data") / count
        return (h - mean) * jax.lax.rsqrt(var + 1e-5)

    return jax.shard_map(block, mesh=mesh, in_specs=(P("data", None), P(None, "model")),
                         out_specs=P("data", "model"))


def shard_map_logits(mesh):
    hidden = sharded_hidden(mesh)

    def logits_fn(params, x):
        return jax.nn.log_softmax(hidden(x, params["w1"]) @ params["w2"])

    return logits_fn


def dense_logits(params, x):
    """The same model without shard_map: what the shard_map block computes, globally."""
    h = jax.nn.relu(x @ params["w1"])
    mean = jnp.mean(h, axis=0)
    var = jnp.mean(jnp.square(h - mean), axis=0)
    return jax.nn.log_softmax(((h - mean) * jax.lax.rsqrt(var + 1e-5)) @ params["w2"])


def shard_map_case(mesh=None) -> FunctionalCase:
    mesh = mesh if mesh is not None else autoshard.make_mesh(MESH_SHAPE, MESH_AXES)
    return functional_case("shard_map", shard_map_logits(mesh), bias=False)


def dense_case() -> FunctionalCase:
    return functional_case("dense_reference", dense_logits, bias=False)


# ---- custom_partitioning -------------------------------------------------------------------------


def _row_sharding(mesh, arg_shape):
    """Keep the operand's sharding on every dimension but the last (the softmax axis)."""
    spec = tuple(arg_shape.sharding.spec) + (None,) * (len(arg_shape.shape) - len(arg_shape.sharding.spec))
    return NamedSharding(mesh, P(*spec[:-1], None))


def _infer(mesh, arg_shapes, result_shape):
    return _row_sharding(mesh, arg_shapes[0])


def _partition(mesh, arg_shapes, result_shape):
    sharding = _row_sharding(mesh, arg_shapes[0])
    return mesh, lambda x: jax.nn.log_softmax(x, axis=-1), sharding, (sharding,)


@custom_partitioning
def partitioned_log_softmax(x):
    return jax.nn.log_softmax(x, axis=-1)


partitioned_log_softmax.def_partition(
    infer_sharding_from_operands=_infer,
    partition=_partition,
    sharding_rule="... c -> ... c",
    need_replication_factors=("c",),
)


@jax.custom_vjp
def log_softmax(x):
    return partitioned_log_softmax(x)


def _log_softmax_fwd(x):
    y = partitioned_log_softmax(x)
    return y, y


def _log_softmax_bwd(y, g):
    return (g - jnp.exp(y) * jnp.sum(g, axis=-1, keepdims=True),)


log_softmax.defvjp(_log_softmax_fwd, _log_softmax_bwd)


def custom_partitioning_logits(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return log_softmax(h @ params["w2"])


def plain_logits(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jax.nn.log_softmax(h @ params["w2"])


def custom_partitioning_case() -> FunctionalCase:
    return functional_case("custom_partitioning", custom_partitioning_logits, bias=True)


def plain_case() -> FunctionalCase:
    return functional_case("plain_reference", plain_logits, bias=True)
