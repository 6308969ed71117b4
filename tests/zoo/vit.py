"""A Vision Transformer in flax linen.

Patches embedded by a strided convolution, a learned class token broadcast over the batch with
``jnp.tile``, learned position embeddings, pre-norm encoder blocks, and an MLP head on the class
token.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class ViTConfig:
    image: int = 16
    channels: int = 3
    patch: int = 4
    hidden: int = 32
    heads: int = 4
    mlp_dim: int = 64
    layers: int = 2
    classes: int = 10
    batch: int = 8


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        out_dim = x.shape[-1]
        x = nn.gelu(nn.Dense(self.mlp_dim)(x))
        return nn.Dense(out_dim)(x)


class EncoderBlock(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads)(y, y)
        x = x + y
        return x + MlpBlock(self.cfg.mlp_dim)(nn.LayerNorm()(x))


class VisionTransformer(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        x = nn.Conv(cfg.hidden, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch),
                    padding="VALID", name="embedding")(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1)
        pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, x.shape[1], c))
        x = x + pos
        for i in range(cfg.layers):
            x = EncoderBlock(cfg, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        x = nn.tanh(nn.Dense(cfg.hidden, name="pre_logits")(x[:, 0]))
        return nn.Dense(cfg.classes, name="head")(x)


CFG = ViTConfig()
# ViT-B width, 2 layers: for the plan check at wide sizes (tests/test_zoo.py, slow).
WIDE = ViTConfig(image=32, hidden=768, heads=12, mlp_dim=3072, classes=1000, batch=16)


def make_batch(cfg: ViTConfig = CFG):
    k1, k2 = jax.random.split(jax.random.key(21))
    images = jax.random.normal(k1, (cfg.batch, cfg.image, cfg.image, cfg.channels))
    return {"images": images, "labels": jax.random.randint(k2, (cfg.batch,), 0, cfg.classes)}


def case(cfg: ViTConfig = CFG) -> FunctionalCase:
    model, tx = VisionTransformer(cfg), optax.adam(1e-3, eps=ADAM_EPS)

    def init_state():
        params = model.init(jax.random.key(0), make_batch(cfg)["images"])["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def train_step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["images"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    # Flax's attention has a key bias; softmax cancels it, so its gradient is zero and its Adam steps
    # (lr = 1e-3, 2 steps) are rounding noise.
    return FunctionalCase("vit", init_state, lambda: make_batch(cfg), train_step,
                          null_paths=(r"\['key'\]\['bias'\]",), null_atol=2e-3)
