"""A LLaMA-style decoder in flax nnx, trained in place with ``nnx.Optimizer``.

RoPE (rotate interleaved pairs, joined back with ``jnp.stack``), RMSNorm, SwiGLU, grouped-query
attention (KV heads repeated with ``einops.repeat``), and dropout drawn from ``nnx.Rngs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import einops
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tests.zoo import ADAM_EPS, NnxCase


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 64
    seq: int = 16
    batch: int = 8
    dropout: float = 0.1
    rope_base: float = 10000.0
    rope: str = "stack"  # "stack": rotate (even, odd) pairs; "complex": multiply by e^(i * angle)
    norm_eps: float = 1e-6


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x):
        rms = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return x * rms * self.weight[...]


def rope_tables(seq: int, head_dim: int, base: float):
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.outer(jnp.arange(seq, dtype=jnp.float32), inv_freq)  # (seq, head_dim / 2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope_complex(x, cos, sin):
    """The same rotation as :func:`apply_rope`, written as Meta's reference does: pairs as complex numbers."""
    pairs = jax.lax.complex(x[..., 0::2], x[..., 1::2])
    rotated = pairs * jax.lax.complex(cos, sin)[None, :, None, :]
    return jnp.stack([jnp.real(rotated), jnp.imag(rotated)], axis=-1).reshape(x.shape)


def apply_rope(x, cos, sin):
    """Rotate each (even, odd) pair of ``x: (batch, seq, heads, head_dim)`` by its position's angle."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return rotated.reshape(x.shape)


def make_dropout(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    """Dropout drawing from ``rngs``' dropout stream; without dropout, an identity holding no key."""
    if cfg.dropout == 0.0:
        return nnx.Dropout(0.0, deterministic=True)
    return nnx.Dropout(cfg.dropout, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads, self.rope = cfg.n_heads, cfg.n_kv_heads, cfg.rope
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nnx.Linear(cfg.dim, cfg.n_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.n_heads * self.head_dim, cfg.dim, use_bias=False, rngs=rngs)
        self.attn_dropout = make_dropout(cfg, rngs)

    def __call__(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).reshape(b, s, self.n_kv_heads, self.head_dim)
        rope = apply_rope_complex if self.rope == "complex" else apply_rope
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        k = einops.repeat(k, "b s h d -> b s (h g) d", g=groups)
        v = jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = self.attn_dropout(jax.nn.softmax(scores, axis=-1))
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
        return self.wo(out)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.w_gate = nnx.Linear(cfg.dim, cfg.ffn_dim, use_bias=False, rngs=rngs)
        self.w_up = nnx.Linear(cfg.dim, cfg.ffn_dim, use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(cfg.ffn_dim, cfg.dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.w_down(nnx.silu(self.w_gate(x)) * self.w_up(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg, rngs)
        self.resid_dropout = make_dropout(cfg, rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), cos, sin, mask))
        return x + self.resid_dropout(self.ffn(self.ffn_norm(x)))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        seq = tokens.shape[1]
        cos, sin = rope_tables(seq, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_base)
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def loss_fn(model: Llama, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def train_step(model: Llama, optimizer: nnx.Optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def make_objects(cfg: LlamaConfig = LlamaConfig()):
    model = Llama(cfg, nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1, eps=ADAM_EPS), wrt=nnx.Param)
    return model, optimizer


def make_batch(cfg: LlamaConfig = LlamaConfig()):
    tokens = jax.random.randint(jax.random.key(7), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def rng_streams(model: Llama):
    return [stream for _, stream in nnx.iter_graph(model) if isinstance(stream, nnx.RngStream)]


def case(cfg: LlamaConfig = LlamaConfig()) -> NnxCase:
    return NnxCase(f"llama_nnx_{cfg.rope}", lambda: make_objects(cfg), lambda: make_batch(cfg), train_step,
                   rng_streams)


WIDE = LlamaConfig(vocab=8192, dim=1024, n_layers=2, n_heads=16, n_kv_heads=4, ffn_dim=2816, seq=64,
                   batch=32, dropout=0.0)


def functional_parts(cfg: LlamaConfig):
    """The split/merge form: ``(abstract state, abstract batch, train_step(state, batch))``.

    Abstract (``jax.ShapeDtypeStruct`` leaves, from ``nnx.eval_shape``) so a wide model is planned and
    compiled without being allocated. Needs ``cfg.dropout == 0`` (the state then holds no keys).
    """
    tx = optax.adamw(1e-3, weight_decay=0.1, eps=ADAM_EPS)
    abstract_model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(params=0)))
    graphdef, params = nnx.split(abstract_model, nnx.Param)

    def train_step(state, batch):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), batch)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, value

    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    batch = jax.eval_shape(lambda: make_batch(cfg))
    return state, batch, train_step
