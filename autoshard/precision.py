"""Mixed precision: matmuls and convolutions in bf16 with fp32 accumulation; state stays fp32.

``parallelize(..., precision="bf16")`` wraps the step with :func:`cast_matmuls`
before capture, so planning, costs and lowering all see the casts:

* every ``dot_general`` and ``conv_general_dilated`` whose operands are wider
  floats than the compute dtype reads them cast to it, and accumulates and
  returns the original dtype (``preferred_element_type``);
* nothing else changes: parameters (the fp32 master weights), optimizer state,
  the loss, the gradients' accumulation and the update stay in their dtypes.

The rewrite runs on the step's jaxpr, after ``jax.grad`` has been traced, so the
backward matmuls are cast as well. Each matmul casts its own operands: a weight
read forward and backward is cast twice rather than kept as a bf16 copy across
the step (measured on CPU, sharing one cast raised the compiled peak of
GPT tiny on 2x4 from 2.69 to 3.12 MB).

On CPU devices the operands are rounded to bf16 and widened back to fp32 before
an fp32 matmul (``widen=True``): XLA:CPU cannot run an unfused bf16 x bf16 -> f32
dot ("Unsupported element type for DotThunk::Execute"), and a product of two
bf16 values is exact in fp32, so the result is the same as a bf16 matmul with
fp32 accumulation (what XLA:CPU itself does inside the dots it fuses). The cost model reads dtypes from the jaxpr:
the bf16 copies of weights and activations are half the bytes in resharding and
memory (a cast that XLA fuses into its reader costs no memory).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from autoshard.capture import INLINED
from autoshard.errors import InputError

PRECISIONS = {None: None, "fp32": None, "bf16": jnp.bfloat16}
"""``parallelize(precision=...)`` values -> the compute dtype of matmuls (None: as traced)."""

_CAST = frozenset({"dot_general", "conv_general_dilated"})


def compute_dtype(precision):
    """The dtype ``precision`` computes matmuls in (None: unchanged), or an :class:`InputError`."""
    if precision not in PRECISIONS:
        raise InputError(
            f"precision={precision!r} is not supported. Fix: parallelize(..., precision='bf16') for bf16 "
            "matmuls with fp32 master weights, or precision=None to keep the step's dtypes.")
    return PRECISIONS[precision]


def with_precision(fun, precision, mesh=None):
    """``fun`` as ``parallelize(precision=...)`` runs it on ``mesh``'s platform (None: the default
    device's): :func:`cast_matmuls` for ``"bf16"``, ``fun`` itself otherwise."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return fun
    from autoshard.backends import profile_for_mesh

    # the platform of the backend that compiles the plan (an AbstractMesh's: GPU, as profile_for_mesh says)
    platform = profile_for_mesh(mesh).platform if mesh is not None else jax.devices()[0].platform
    return cast_matmuls(fun, dtype, widen=widen_operands(platform))


def widen_operands(platform: str) -> bool:
    """Whether matmuls on this platform read bf16-rounded operands widened back to fp32 (see above):
    its backend profile has no mixed-precision dots (:mod:`autoshard.backends`)."""
    from autoshard.backends import profile_for

    return not profile_for(platform).mixed_precision_dots


def cast_matmuls(fun, dtype=jnp.bfloat16, *, widen: bool = False):
    """``fun`` with every wider-float matmul and convolution computed in ``dtype``, accumulating in fp32.

    ``widen``: round the operands to ``dtype`` and widen them back, then multiply in their own
    dtype (the same numbers, for backends without mixed-dtype matmuls, see :func:`widen_operands`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = cast_matmuls(lambda w, x: x @ w)
      >>> print(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((1, 2))).eqns[-1].params["preferred_element_type"])
      float32
    """
    dtype = np.dtype(dtype)

    # traced on the argument pytrees under the step's own name and signature, so that a tracing error names
    # the user's function and argument paths (see autoshard.capture.capture_graph)
    @functools.wraps(fun)
    def cast_fun(*args):
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), dtype, widen)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return cast_fun


def _wider_float(x, dtype) -> bool:
    d = np.dtype(getattr(x, "dtype", np.float32))
    return jnp.issubdtype(d, jnp.floating) and d.itemsize > dtype.itemsize


def _eval(jaxpr, consts, args, dtype, widen):
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        if name in INLINED and INLINED[name] in params:
            inner = params[INLINED[name]]
            outs = _eval(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), invals, dtype, widen)
        else:
            if name in _CAST and all(_wider_float(x, dtype) for x in invals):
                if widen:
                    invals = [jax.lax.convert_element_type(jax.lax.convert_element_type(x, dtype), x.dtype)
                              for x in invals]
                else:
                    out_dtype = eqn.outvars[0].aval.dtype
                    invals = [jax.lax.convert_element_type(x, dtype) for x in invals]
                    params = dict(params, preferred_element_type=out_dtype)
            else:
                params = _rewrite_subjaxprs(params, dtype, widen)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _rewrite_closed(closed, dtype, widen):
    """The same ClosedJaxpr (same in/out types) with its matmuls cast."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: _eval(closed.jaxpr, closed.consts, xs, dtype, widen))(*avals)


def _rewrite_subjaxprs(params, dtype, widen):
    """Params of scan, while, cond (...) with their ClosedJaxpr bodies rewritten."""
    out = None
    for k, p in params.items():
        if isinstance(p, jex_core.ClosedJaxpr):
            new = _rewrite_closed(p, dtype, widen)
        elif isinstance(p, tuple) and p and all(isinstance(b, jex_core.ClosedJaxpr) for b in p):
            new = tuple(_rewrite_closed(b, dtype, widen) for b in p)
        else:
            continue
        out = dict(params) if out is None else out
        out[k] = new
    return params if out is None else out
