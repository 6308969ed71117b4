"""A top-k routed mixture-of-experts language model, in plain jax with optax.

Two expert layers, written the two ways the community writes them:

- ``"einsum"``: GShard/Switch style. ``lax.top_k`` picks each token's experts, a one-hot dispatch
  tensor with a per-expert capacity sends tokens to expert slots, and an einsum with the gate
  weights combines them back.
- ``"ragged"``: tokens sorted by expert and run through ``jax.lax.ragged_dot`` grouped matmuls
  (no capacity, no dropped tokens), then unsorted and weighted by their gates.

Both add the Switch load-balancing loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    dim: int = 32
    ffn_dim: int = 64
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 2.0
    layers: int = 2
    seq: int = 8
    batch: int = 8
    aux_weight: float = 0.01


def init_params(key, cfg: MoEConfig):
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))
    normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / math.sqrt(fan_in)  # noqa: E731
    layers = []
    for _ in range(cfg.layers):
        layers.append({
            "attn_qkv": normal((cfg.dim, 3 * cfg.dim), cfg.dim),
            "router": normal((cfg.dim, cfg.experts), cfg.dim),
            "w_in": normal((cfg.experts, cfg.dim, cfg.ffn_dim), cfg.dim),
            "w_out": normal((cfg.experts, cfg.ffn_dim, cfg.dim), cfg.ffn_dim),
        })
    return {"embed": normal((cfg.vocab, cfg.dim), 1.0), "layers": layers,
            "unembed": normal((cfg.dim, cfg.vocab), cfg.dim)}


def route(x, router, cfg: MoEConfig):
    """Top-k gates ``(tokens, k)``, expert ids ``(tokens, k)`` and the load-balancing loss."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    gates, experts = jax.lax.top_k(probs, cfg.top_k)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    # Switch: fraction of tokens whose first choice is e, times the mean router probability of e.
    fraction = jnp.mean(jax.nn.one_hot(experts[:, 0], cfg.experts), axis=0)
    aux = cfg.experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
    return gates, experts, aux


def experts_einsum(x, gates, experts, layer, cfg: MoEConfig):
    tokens = x.shape[0]
    capacity = int(cfg.capacity_factor * tokens * cfg.top_k / cfg.experts)
    choice = jax.nn.one_hot(experts, cfg.experts, dtype=x.dtype)  # (t, k, e)
    # Position of each (token, choice) in its expert's queue, first choices first.
    flat = choice.transpose(1, 0, 2).reshape(cfg.top_k * tokens, cfg.experts)
    position = (jnp.cumsum(flat, axis=0) - 1.0) * flat
    position = position.reshape(cfg.top_k, tokens, cfg.experts).transpose(1, 0, 2)
    kept = choice * (position < capacity)
    slot = jax.nn.one_hot(jnp.sum(position * kept, axis=-1).astype(jnp.int32), capacity, dtype=x.dtype)
    dispatch = jnp.einsum("tke,tkc->tec", kept, slot)
    combine = jnp.einsum("tk,tke,tkc->tec", gates, kept, slot)
    expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
    hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, layer["w_in"]))
    expert_out = jnp.einsum("ecf,efd->ecd", hidden, layer["w_out"])
    return jnp.einsum("tec,ecd->td", combine, expert_out)


def experts_ragged(x, gates, experts, layer, cfg: MoEConfig):
    tokens = x.shape[0]
    flat_experts = experts.reshape(-1)  # (t * k,), token-major
    order = jnp.argsort(flat_experts)
    sorted_x = x[order // cfg.top_k]
    group_sizes = jnp.sum(jax.nn.one_hot(flat_experts, cfg.experts, dtype=jnp.int32), axis=0)
    hidden = jax.nn.gelu(jax.lax.ragged_dot(sorted_x, layer["w_in"], group_sizes))
    sorted_out = jax.lax.ragged_dot(hidden, layer["w_out"], group_sizes)
    out = jnp.zeros_like(sorted_out).at[order].set(sorted_out).reshape(tokens, cfg.top_k, -1)
    return jnp.einsum("tk,tkd->td", gates, out)


def causal_attention(x, qkv, heads: int = 4):
    b, s, d = x.shape
    q, k, v = jnp.split(x @ qkv, 3, axis=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, d)


def forward(params, tokens, cfg: MoEConfig, expert_layer):
    x = params["embed"][tokens]
    b, s, d = x.shape
    aux_total = 0.0
    for layer in params["layers"]:
        x = x + causal_attention(jax.nn.standardize(x, axis=-1), layer["attn_qkv"])
        h = jax.nn.standardize(x, axis=-1).reshape(b * s, d)
        gates, experts, aux = route(h, layer["router"], cfg)
        x = x + expert_layer(h, gates, experts, layer, cfg).reshape(b, s, d)
        aux_total = aux_total + aux
    return jax.nn.standardize(x, axis=-1) @ params["unembed"], aux_total


def make_train_step(cfg: MoEConfig, expert_layer, tx):
    def train_step(state, batch):
        def loss_fn(params):
            logits, aux = forward(params, batch["tokens"], cfg, expert_layer)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
            return ce + cfg.aux_weight * aux

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return train_step


LAYERS = {"einsum": experts_einsum, "ragged": experts_ragged}


def case(kind: str = "einsum", cfg: MoEConfig = MoEConfig()) -> FunctionalCase:
    tx = optax.adamw(3e-3, eps=ADAM_EPS)

    def init_state():
        params = init_params(jax.random.key(0), cfg)
        return {"params": params, "opt_state": tx.init(params)}

    def make_batch():
        tokens = jax.random.randint(jax.random.key(51), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    return FunctionalCase(f"moe_{kind}", init_state, make_batch, make_train_step(cfg, LAYERS[kind], tx))
