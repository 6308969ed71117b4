"""``pipeline_boundary``: a manual stage cut, visible to capture and to autodiff.

It is an identity primitive. Its JVP is itself on the tangent, and its transpose is itself on
the cotangent, so the backward pass of ``train_step`` carries a boundary too. The stage
partitioner cuts the forward pass at each run of boundary ops; the backward follows.
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from autoshard.strategies.base import register_strategy
from autoshard.strategies.elementwise import elementwise_strategies

pipeline_boundary_p = Primitive("pipeline_boundary")
pipeline_boundary_p.def_impl(lambda x: x)
pipeline_boundary_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(pipeline_boundary_p, lambda ctx, x: [x])


def _is_zero(t) -> bool:
    return type(t) is ad.Zero or getattr(getattr(t, "dtype", None), "name", "") == "float0"


def _jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return pipeline_boundary_p.bind(x), (t if _is_zero(t) else pipeline_boundary_p.bind(t))


def _transpose(ct, x):
    return [ct if _is_zero(ct) else pipeline_boundary_p.bind(ct)]


ad.primitive_jvps[pipeline_boundary_p] = _jvp
ad.primitive_transposes[pipeline_boundary_p] = _transpose
batching.primitive_batchers[pipeline_boundary_p] = lambda args, dims: (pipeline_boundary_p.bind(args[0]), dims[0])
# The intra-op planner sees an identity that keeps its operand's layout.
register_strategy("pipeline_boundary", follows=True)(elementwise_strategies)


def pipeline_boundary(x):
    """Mark a pipeline stage cut: returns ``x`` (any pytree of arrays) unchanged.

    Everything the forward pass computes before the call belongs to the earlier stage, everything
    after to the later one; the backward pass is cut at the mirror point. Pass every value that
    crosses the cut in one call (a tuple is fine): one call is one cut.

    Example:
      >>> import jax.numpy as jnp, autoshard
      >>> def loss(w, x):
      ...     h = autoshard.pipeline_boundary(jnp.tanh(x @ w[0]))
      ...     return (h @ w[1]).sum()
      >>> float(loss(jnp.ones((2, 4, 4)), jnp.ones((3, 4)))) > 0
      True
    """
    return jax.tree.map(pipeline_boundary_p.bind, x)


BOUNDARY = pipeline_boundary_p.name
