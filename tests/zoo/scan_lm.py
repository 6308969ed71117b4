"""A decoder-only LM in flax linen with its layers under ``nn.scan`` (scan over layers).

The blocks' parameters are stacked on a leading layer axis (``variable_axes={"params": 0}``) and the
stack runs as one ``lax.scan``, as large linen models (t5x, MaxText's linen path) write it; each
block is rematerialised with ``nn.remat``.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class ScanConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 8


class Block(nn.Module):
    cfg: ScanConfig

    @nn.compact
    def __call__(self, x, _):
        s = x.shape[1]
        mask = nn.make_causal_mask(jnp.ones((x.shape[0], s)))
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=self.cfg.heads, deterministic=True)(h, mask=mask)
        h = nn.Dense(4 * self.cfg.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.cfg.dim)(nn.gelu(h)), None


class ScanLM(nn.Module):
    cfg: ScanConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.dim)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.dim))
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=cfg.layers)
        x, _ = blocks(cfg, name="blocks")(x, None)
        return embed.attend(nn.LayerNorm()(x))


CFG = ScanConfig()
MODEL = ScanLM(CFG)
TX = optax.adamw(3e-3, eps=ADAM_EPS)


def make_batch(cfg: ScanConfig = CFG):
    tokens = jax.random.randint(jax.random.key(81), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def init_state():
    params = MODEL.init(jax.random.key(0), make_batch()["tokens"])["params"]
    return {"params": params, "opt_state": TX.init(params)}


def train_step(state, batch):
    def loss_fn(params):
        logits = MODEL.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss


def case() -> FunctionalCase:
    return FunctionalCase("scan_lm", init_state, make_batch, train_step)
