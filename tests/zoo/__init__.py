"""A zoo of real architectures, written the way their communities write them.

Each module builds one small model (tiny widths, 2 layers, tiny vocab, batch 8 so a (2, 4) mesh
can split it) and its train step, and exposes ``case()``:

- functional (linen, plain jax) steps return a :class:`FunctionalCase`: ``train_step(state, batch,
  *extra) -> (state, loss)`` over a state dict ``{"params", "opt_state", ...}``;
- nnx in-place steps return an :class:`NnxCase`: ``train_step(model, optimizer, batch) -> loss``
  that updates ``model`` and ``optimizer`` in place, as the nnx docs teach.

``tests/test_zoo.py`` runs each case under ``autoshard.parallelize`` and compares it with a
single-device ``jax.jit`` (or ``nnx.jit``) of the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Adam's step is lr * g / (|g| + eps): for a gradient that is (mathematically) zero, such as an attention
# key bias under softmax or a bias before a normalisation, it turns fp32 reduction-order noise into a
# step of up to lr, so a sharded and a single-device run part by ~lr. eps = 1e-6 (BERT's and many ViT
# recipes' choice) keeps such steps ~1e-4 lr while leaving real gradients (>= 1e-5 here) undamped.
ADAM_EPS = 1e-6


@dataclass(frozen=True)
class FunctionalCase:
    """A pure step: ``train_step(state, batch, *extra_args(i)) -> (state, loss)`` for step ``i``."""

    name: str
    init_state: Callable[[], Any]
    make_batch: Callable[[], Any]
    train_step: Callable[..., Any]
    extra_args: Callable[[int], tuple] = field(default=lambda i: ())
    # Regexes over state paths whose gradient is zero in exact arithmetic (e.g. an attention key bias:
    # softmax ignores a per-query shift). Adam moves them by rounding noise of up to lr a step, so they are
    # compared at ``null_atol``; ``tests/test_zoo.py`` checks that their first moments really are ~0.
    null_paths: tuple[str, ...] = ()
    null_atol: float = 0.0


@dataclass(frozen=True)
class NnxCase:
    """An in-place nnx step: ``train_step(model, optimizer, batch) -> loss``.

    ``make_objects()`` builds a fresh ``(model, optimizer)`` from fixed seeds, so two calls give
    equal objects; ``rngs_of(model)`` lists the model's ``RngStream``s whose counters must advance.
    """

    name: str
    make_objects: Callable[[], tuple]
    make_batch: Callable[[], Any]
    train_step: Callable[..., Any]
    rngs_of: Callable[[Any], list]
