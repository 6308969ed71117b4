"""A small causal language model whose attention is a Pallas kernel.

The kernel runs one (batch, head) pair per grid step (``grid=(batch, heads)``, each block the whole
``(seq, head_dim)`` slice of that pair), in interpret mode so it runs on CPU. ``pallas_call`` has no
transpose rule, so the kernel sits in a ``jax.custom_vjp`` whose backward is plain jax (the VJP of
the same attention written with ``jnp``), and the model trains with optax's Adam.

Under autoshard the kernel's grid axes are parallel (every output block is written by one step, the
body never reads ``program_id``), so the planner may split the batch and the heads of its operands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class AttentionLMConfig:
    vocab: int = 32
    seq: int = 16
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    batch: int = 8


def _attention_kernel(q_ref, k_ref, v_ref, o_ref):
    """Causal softmax attention of one (batch, head) pair: blocks of shape (seq, head_dim)."""
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = (q @ k.T) / math.sqrt(q.shape[-1])
    rows = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols <= rows, s, -1e30)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o_ref[...] = (p / jnp.sum(p, axis=-1, keepdims=True)) @ v


def pallas_attention(q, k, v):
    """``q, k, v``: (batch, heads, seq, head_dim). One grid step per (batch, head)."""
    b, h, s, d = q.shape
    block = pl.BlockSpec((None, None, s, d), lambda i, j: (i, j, 0, 0))
    return pl.pallas_call(_attention_kernel, grid=(b, h), in_specs=[block, block, block], out_specs=block,
                          out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=True)(q, k, v)


def reference_attention(q, k, v):
    """The same attention in plain jax."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool))
    s = jnp.where(causal, s, -1e30)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


@jax.custom_vjp
def attention(q, k, v):
    return pallas_attention(q, k, v)


def _attention_fwd(q, k, v):
    return pallas_attention(q, k, v), (q, k, v)


def _attention_bwd(residuals, g):
    _, vjp = jax.vjp(reference_attention, *residuals)
    return vjp(g)


attention.defvjp(_attention_fwd, _attention_bwd)


def _layer_norm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def init_params(key, cfg: AttentionLMConfig):
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))
    d = cfg.hidden

    def dense(shape):
        return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

    layers = [{"ln1": jnp.ones((d,)), "qkv": dense((d, 3 * d)), "out": dense((d, d)), "ln2": jnp.ones((d,)),
               "up": dense((d, 4 * d)), "down": dense((4 * d, d))} for _ in range(cfg.layers)]
    return {"embed": jax.random.normal(next(keys), (cfg.vocab, d)) * 0.1,
            "pos": jax.random.normal(next(keys), (cfg.seq, d)) * 0.1, "layers": layers}


def forward(params, tokens, cfg: AttentionLMConfig):
    b, s = tokens.shape
    h, dh = cfg.heads, cfg.hidden // cfg.heads
    x = params["embed"][tokens] + params["pos"][None]
    for layer in params["layers"]:
        qkv = _layer_norm(x, layer["ln1"]) @ layer["qkv"]
        q, k, v = (t.reshape(b, s, h, dh).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, axis=-1))
        a = attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, s, cfg.hidden)
        x = x + a @ layer["out"]
        x = x + jax.nn.gelu(_layer_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
    return x @ params["embed"].T


def make_batch(cfg: AttentionLMConfig = AttentionLMConfig()):
    tokens = jax.random.randint(jax.random.key(7), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def case(cfg: AttentionLMConfig = AttentionLMConfig()) -> FunctionalCase:
    tx = optax.adam(1e-2, eps=ADAM_EPS)

    def init_state():
        params = init_params(jax.random.key(0), cfg)
        return {"params": params, "opt_state": tx.init(params)}

    def train_step(state, batch):
        def loss_fn(params):
            logits = forward(params, batch["inputs"], cfg)
            log_probs = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return FunctionalCase("pallas_attention", init_state, lambda: make_batch(cfg), train_step)
