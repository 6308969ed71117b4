"""A decoder language model in plain JAX, configured the way published training runs describe theirs.

One functional model covers the GPT of Megatron-LM (LayerNorm, learned positions, GeLU MLP, tied
embeddings), Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head) and MaxText's
"scaleN" decoders (RMSNorm, ReLU MLP, head dim 256, tied embeddings). The layers are stacked on a leading
axis and run under ``jax.lax.scan``, each under ``jax.checkpoint`` when recomputed, as MaxText runs them.
Mixed precision as the large runs do it: the optimizer holds fp32 master weights and AdamW moments, and
once per step writes the bf16 copy that the forward and backward passes read (and, with ``fp8=True``, the
fp8 copy of every matmul weight: e4m3 operands forward, e5m2 gradients, as Transformer Engine caches its
fp8 weights across microbatches). Matmuls accumulate in fp32; their results and the gradients are bf16.

A pipeline stage is a slice of the layers (:class:`Stage`): the first holds the embedding, the last the
final norm, head and loss. :func:`stage_programs` gives the three functions a performance prediction plans
for a stage: its forward, its forward and backward for one microbatch, and its optimizer update.

Example:
    >>> cfg = LMConfig(vocab=256, seq=16, hidden=32, layers=2, heads=4, kv_heads=4, head_dim=8, ffn=64)
    >>> round(cfg.num_params() / 1e3, 1)
    25.2
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["LMConfig", "Stage", "stage_params", "stage_programs"]

_MLPS = ("gelu", "relu", "swiglu")
_F8, _E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rope")
_REMATS = ("none", "full", "minimal")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """A decoder's shape and the few choices that change its work.

    Attributes:
      vocab, seq, hidden, layers, heads, kv_heads, head_dim, ffn: the model's dimensions.
      mlp: ``"gelu"``, ``"relu"`` (two matrices) or ``"swiglu"`` (three).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      positions: ``"learned"`` (an embedding table) or ``"rope"``.
      tied: the output head is the token embedding's transpose.
      remat: ``"none"``, ``"full"`` (each layer recomputed in the backward pass) or ``"minimal"`` (only the
        matmuls' results are kept: ``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims``).
      fp8: matmuls on fp8 operands.
    """

    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    tied: bool = True
    remat: str = "none"
    fp8: bool = False

    def __post_init__(self):
        problems = []
        for field, options in (("mlp", _MLPS), ("norm", _NORMS), ("positions", _POSITIONS), ("remat", _REMATS)):
            if getattr(self, field) not in options:
                problems.append(f"{field}={getattr(self, field)!r} is not one of {options}")
        if self.heads % self.kv_heads:
            problems.append(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if problems:
            raise ValueError("invalid LMConfig: " + "; ".join(problems))

    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn
        return self.hidden * (q + 2 * kv) + q * self.hidden + mlp + 2 * self.hidden

    def num_params(self) -> int:
        """Every parameter (the embedding counted once when tied)."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        pos = self.seq * self.hidden if self.positions == "learned" else 0
        return self.layers * self.layer_params() + embed + pos + self.hidden


@dataclasses.dataclass(frozen=True)
class Stage:
    """A pipeline stage (or a model chunk of an interleaved one): ``layers`` of them, with the embedding
    when ``first`` and the final norm, head and loss when ``last``."""

    layers: int
    first: bool = True
    last: bool = True


_MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "wi", "wg", "wd")


def stage_params(cfg: LMConfig, stage: Stage, dtype=jnp.float32) -> dict:
    """The stage's parameters as ``ShapeDtypeStruct`` s of ``dtype`` (fp32 masters; bf16 the compute copy),
    layers stacked on axis 0."""
    def a(*shape):
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    L, h, q, kv = stage.layers, cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layers = {"ln1": a(L, h), "wq": a(L, h, q), "wk": a(L, h, kv), "wv": a(L, h, kv),
              "wo": a(L, q, h), "ln2": a(L, h), "wi": a(L, h, cfg.ffn), "wd": a(L, cfg.ffn, h)}
    if cfg.mlp == "swiglu":
        layers["wg"] = a(L, h, cfg.ffn)
    out = {"layers": layers}
    if stage.first or (stage.last and cfg.tied):
        out["embed"] = a(cfg.vocab, h)
    if stage.first and cfg.positions == "learned":
        out["pos"] = a(cfg.seq, h)
    if stage.last:
        out["final_ln"] = a(h)
        if not cfg.tied:
            out["head"] = a(h, cfg.vocab)
    return out


def fp8_weights(params: dict) -> dict:
    """The fp8 copies of a stage's matmul weights (``stage_params`` layout, e4m3)."""
    return {k: jax.ShapeDtypeStruct(v.shape, _F8) for k, v in params["layers"].items() if k in _MATMUL_WEIGHTS}


# ---- the model ------------------------------------------------------------------------------------------

@jax.custom_vjp
def _fp8_matmul(x, w, w8):
    return jnp.einsum("...k,kn->...n", x.astype(_F8), w8, preferred_element_type=jnp.bfloat16)


def _fp8_fwd(x, w, w8):
    x8 = x.astype(_F8)
    return jnp.einsum("...k,kn->...n", x8, w8, preferred_element_type=jnp.bfloat16), (x8, w8)


def _fp8_bwd(res, g):
    x8, w8 = res
    g8 = g.astype(_E5)
    dx = jnp.einsum("...n,kn->...k", g8, w8, preferred_element_type=jnp.bfloat16)
    dw = jnp.einsum("...k,...n->kn", x8, g8, preferred_element_type=jnp.bfloat16)
    return dx, dw, None


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def _matmul(cfg: LMConfig, x, w, w8=None):
    if w8 is not None:
        return _fp8_matmul(x, w, w8)
    # bf16 operands and result (the GPU and TPU matmul units accumulate in fp32): the backward's cotangents
    # are bf16 too, as in mixed-precision training
    return jnp.einsum("...k,kn->...n", x, w.astype(jnp.bfloat16))


def _norm(cfg: LMConfig, x, scale):
    x32 = x.astype(jnp.float32)
    if cfg.norm == "layernorm":
        x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-5)
    return (y * scale).astype(jnp.bfloat16)


def _rope(x):
    s, d = x.shape[1], x.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(jnp.bfloat16)


def _attention(cfg: LMConfig, q, k, v):
    """Causal grouped-query attention over ``[batch, seq, heads, head_dim]``."""
    b, s = q.shape[:2]
    g = cfg.heads // cfg.kv_heads
    q = q.reshape(b, s, cfg.kv_heads, g, cfg.head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(cfg.head_dim)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(causal, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, cfg.heads * cfg.head_dim).astype(jnp.bfloat16)


def _layer(cfg: LMConfig, p, w8, x):
    b, s, _ = x.shape

    def mm(y, name):
        return _matmul(cfg, y, p[name], None if w8 is None else w8[name])

    y = _norm(cfg, x, p["ln1"])
    q = mm(y, "wq").reshape(b, s, cfg.heads, cfg.head_dim)
    k = mm(y, "wk").reshape(b, s, cfg.kv_heads, cfg.head_dim)
    v = mm(y, "wv").reshape(b, s, cfg.kv_heads, cfg.head_dim)
    if cfg.positions == "rope":
        q, k = _rope(q), _rope(k)
    x = x + mm(_attention(cfg, q, k, v), "wo")
    y = _norm(cfg, x, p["ln2"])
    up = mm(y, "wi")
    if cfg.mlp == "swiglu":
        up = (jax.nn.silu(up.astype(jnp.float32)) * mm(y, "wg")).astype(jnp.bfloat16)
    elif cfg.mlp == "gelu":
        up = jax.nn.gelu(up.astype(jnp.float32)).astype(jnp.bfloat16)
    else:
        up = jax.nn.relu(up)
    return x + mm(up, "wd")


def _layers(cfg: LMConfig, layers, w8, x):
    body = lambda p, q, h: _layer(cfg, p, q, h)  # noqa: E731
    if cfg.remat == "full":
        body = jax.checkpoint(body)
    elif cfg.remat == "minimal":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    x, _ = jax.lax.scan(lambda h, pq: (body(pq[0], pq[1], h), None), x, (layers, w8))
    return x


def _embed(cfg: LMConfig, params, tokens):
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.positions == "learned":
        x = x + params["pos"][None, : tokens.shape[1]]
    return x.astype(jnp.bfloat16)


def _loss(cfg: LMConfig, params, x, targets):
    y = _norm(cfg, x, params["final_ln"])
    head = params["embed"].T if cfg.tied else params["head"]
    logits = _matmul(cfg, y, head).astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def _forward(cfg: LMConfig, stage: Stage, params, inputs):
    x = _embed(cfg, params, inputs["tokens"]) if stage.first else inputs["x"]
    x = _layers(cfg, params["layers"], inputs.get("fp8"), x)
    return _loss(cfg, params, x, inputs["targets"]) if stage.last else x


def stage_inputs(cfg: LMConfig, stage: Stage, batch: int) -> dict:
    """The stage's microbatch inputs as ``ShapeDtypeStruct`` s: tokens (first stage) or activations, and
    targets (last stage); with ``"cotangent"`` for the backward of a stage that is not last."""
    out = {}
    if stage.first:
        out["tokens"] = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    else:
        out["x"] = jax.ShapeDtypeStruct((batch, cfg.seq, cfg.hidden), jnp.bfloat16)
    if stage.last:
        out["targets"] = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    else:
        out["cotangent"] = jax.ShapeDtypeStruct((batch, cfg.seq, cfg.hidden), jnp.bfloat16)
    if cfg.fp8:
        out["fp8"] = fp8_weights(stage_params(cfg, stage))
    return out


def stage_programs(cfg: LMConfig, stage: Stage):
    """``(forward, forward_backward, update)`` of one stage, for one microbatch.

    - ``forward(params, inputs)``: the stage's output (its loss when it is last); ``params`` the bf16 copy.
    - ``forward_backward(params, inputs)``: the (bf16) gradients of its parameters (and of its input
      activations when it is not first), given the cotangent of its output (when it is not last).
    - ``update(master, grads, opt_state)``: AdamW on the fp32 masters (``opt_state = {"mu", "nu"}`` like
      them), returning the new masters, moments and the compute copies: bf16 parameters (and their fp8 matmul
      weights with ``fp8``).
    """

    def forward(params, inputs):
        return _forward(cfg, stage, params, {k: v for k, v in inputs.items() if k != "cotangent"})

    def forward_backward(params, inputs):
        diff = (params,) if stage.first else (params, inputs["x"])

        def f(*args):
            ins = dict(inputs)
            if not stage.first:
                ins["x"] = args[1]
            return forward(args[0], ins)

        out, vjp = jax.vjp(f, *diff)
        seed = jnp.ones_like(out) if stage.last else inputs["cotangent"]
        return vjp(seed)

    def update(master, grads, opt_state, lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt_state["mu"], grads)
        nu = jax.tree.map(lambda n, g: b2 * n + (1 - b2) * g * g, opt_state["nu"], grads)
        new = jax.tree.map(lambda p, m, n: p - lr * (m / (jnp.sqrt(n) + eps) + wd * p), master, mu, nu)
        copy = jax.tree.map(lambda p: p.astype(jnp.bfloat16), new)
        out = {"master": new, "opt_state": {"mu": mu, "nu": nu}, "params": copy}
        if cfg.fp8:
            out["fp8"] = {k: v.astype(_F8) for k, v in copy["layers"].items() if k in _MATMUL_WEIGHTS}
        return out

    return forward, forward_backward, update
