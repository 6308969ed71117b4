"""A T5-style encoder-decoder in flax linen.

Bucketed relative position bias (bidirectional in the encoder, causal in the decoder, shared
across layers as in T5), pre-norm RMSNorm without bias, cross-attention, a ReLU feed-forward,
and an embedding shared between encoder, decoder and the (tied) output projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class T5Config:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    d_kv: int = 8
    d_ff: int = 64
    n_layers: int = 2
    num_buckets: int = 8
    max_distance: int = 16
    src_len: int = 12
    tgt_len: int = 8
    batch: int = 8


class T5LayerNorm(nn.Module):
    """RMSNorm: scale only, no mean subtraction, no bias."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + self.eps) * scale


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's buckets: exact for small distances, logarithmic up to ``max_distance``."""
    bucket = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket = (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
    val_if_large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
    val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
    return bucket + jnp.where(is_small, n, val_if_large)


class RelativePositionBias(nn.Module):
    cfg: T5Config
    bidirectional: bool

    @nn.compact
    def __call__(self, q_len: int, k_len: int):
        context = jnp.arange(q_len)[:, None]
        memory = jnp.arange(k_len)[None, :]
        buckets = relative_position_bucket(memory - context, self.bidirectional,
                                           self.cfg.num_buckets, self.cfg.max_distance)
        table = nn.Embed(self.cfg.num_buckets, self.cfg.n_heads, name="rel_embedding")
        return jnp.transpose(table(buckets), (2, 0, 1))[None]  # (1, heads, q, k)


class MultiHeadAttention(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, x, kv, bias=None, mask=None):
        cfg = self.cfg
        dense = lambda name: nn.DenseGeneral((cfg.n_heads, cfg.d_kv), use_bias=False, name=name)  # noqa: E731
        q, k, v = dense("q")(x), dense("k")(kv), dense("v")(kv)
        # T5 folds the 1/sqrt(d_kv) scaling into the initialisation, not the scores.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = jnp.where(mask, scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, name="o")(out)


class FeedForward(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.cfg.d_ff, use_bias=False, name="wi")(x))
        return nn.Dense(self.cfg.d_model, use_bias=False, name="wo")(h)


class EncoderLayer(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, x, bias):
        x = x + MultiHeadAttention(self.cfg, name="self_attn")(T5LayerNorm()(x), T5LayerNorm()(x), bias)
        return x + FeedForward(self.cfg)(T5LayerNorm()(x))


class DecoderLayer(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, y, enc, bias, causal):
        h = T5LayerNorm()(y)
        y = y + MultiHeadAttention(self.cfg, name="self_attn")(h, h, bias, causal)
        y = y + MultiHeadAttention(self.cfg, name="cross_attn")(T5LayerNorm()(y), enc)
        return y + FeedForward(self.cfg)(T5LayerNorm()(y))


class T5(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, src, tgt_in):
        cfg = self.cfg
        shared = nn.Embed(cfg.vocab, cfg.d_model, name="shared")
        x = shared(src)
        enc_bias = RelativePositionBias(cfg, bidirectional=True, name="enc_rel_bias")(src.shape[1], src.shape[1])
        for i in range(cfg.n_layers):
            x = EncoderLayer(cfg, name=f"encoder_{i}")(x, enc_bias)
        enc = T5LayerNorm(name="encoder_norm")(x)

        y = shared(tgt_in)
        t = tgt_in.shape[1]
        dec_bias = RelativePositionBias(cfg, bidirectional=False, name="dec_rel_bias")(t, t)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
        for i in range(cfg.n_layers):
            y = DecoderLayer(cfg, name=f"decoder_{i}")(y, enc, dec_bias, causal)
        y = T5LayerNorm(name="decoder_norm")(y) * cfg.d_model**-0.5
        return shared.attend(y)


CFG = T5Config()
MODEL = T5(CFG)
TX = optax.adamw(3e-3, eps=ADAM_EPS)


def make_batch(cfg: T5Config = CFG):
    k1, k2 = jax.random.split(jax.random.key(11))
    src = jax.random.randint(k1, (cfg.batch, cfg.src_len), 1, cfg.vocab)
    tgt = jax.random.randint(k2, (cfg.batch, cfg.tgt_len), 1, cfg.vocab)
    tgt_in = jnp.concatenate([jnp.zeros((cfg.batch, 1), tgt.dtype), tgt[:, :-1]], axis=1)  # shift right
    return {"src": src, "tgt_in": tgt_in, "tgt": tgt}


def init_state():
    batch = make_batch()
    params = MODEL.init(jax.random.key(0), batch["src"], batch["tgt_in"])["params"]
    return {"params": params, "opt_state": TX.init(params)}


def train_step(state, batch):
    def loss_fn(params):
        logits = MODEL.apply({"params": params}, batch["src"], batch["tgt_in"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss


def case() -> FunctionalCase:
    return FunctionalCase("t5", init_state, make_batch, train_step)
