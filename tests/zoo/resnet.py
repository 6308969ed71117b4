"""A ResNet with BatchNorm in flax linen; ``batch_stats`` are mutable and updated in the step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class ResNetConfig:
    image: int = 16
    channels: int = 3
    widths: tuple = (8, 16)
    classes: int = 10
    batch: int = 8


class BasicBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        residual = x
        y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), padding="SAME", use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), padding="SAME", use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), (self.strides, self.strides), use_bias=False,
                               name="proj")(residual)
            residual = norm(name="proj_norm")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    cfg: ResNetConfig

    @nn.compact
    def __call__(self, x, train: bool = True):
        cfg = self.cfg
        x = nn.Conv(cfg.widths[0], (3, 3), padding="SAME", use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x))
        for i, width in enumerate(cfg.widths):
            x = BasicBlock(width, strides=1 if i == 0 else 2)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.classes)(x)


CFG = ResNetConfig()
MODEL = ResNet(CFG)
TX = optax.adam(1e-3, eps=ADAM_EPS)


def make_batch(cfg: ResNetConfig = CFG):
    k1, k2 = jax.random.split(jax.random.key(31))
    images = jax.random.normal(k1, (cfg.batch, cfg.image, cfg.image, cfg.channels))
    return {"images": images, "labels": jax.random.randint(k2, (cfg.batch,), 0, cfg.classes)}


def init_state():
    variables = MODEL.init(jax.random.key(0), make_batch()["images"], train=False)
    params = variables["params"]
    return {"params": params, "batch_stats": variables["batch_stats"], "opt_state": TX.init(params)}


def train_step(state, batch):
    def loss_fn(params):
        logits, updates = MODEL.apply({"params": params, "batch_stats": state["batch_stats"]},
                                      batch["images"], train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "batch_stats": batch_stats,
                 "opt_state": opt_state}
    return new_state, loss


def case() -> FunctionalCase:
    return FunctionalCase("resnet", init_state, make_batch, train_step)
