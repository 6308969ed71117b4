"""A small conv net with BatchNorm in train mode: conv -> BN -> relu blocks, pooling, a dense head.

The BatchNorm running statistics live in ``state["model_state"]`` and every train step returns
them updated, so the train step has non-parameter state that flows through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, build_spec, make_optimizer, softmax_cross_entropy


@dataclasses.dataclass(frozen=True)
class ConvNetConfig:
    image_size: int = 16
    in_channels: int = 3
    channels: tuple[int, ...] = (8, 16)  # one conv block (and one 2x2 max pool) per entry
    num_classes: int = 8

    def __post_init__(self):
        if self.image_size % 2 ** len(self.channels):
            raise ValueError(
                f"ConvNetConfig.image_size ({self.image_size}) must be divisible by "
                f"2**len(channels) = {2 ** len(self.channels)}: each block halves it"
            )


CONFIGS = {
    "tiny": ConvNetConfig(),
    "small": ConvNetConfig(image_size=32, channels=(32, 64, 128), num_classes=10),
}


class ConvBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, *, dtype, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, momentum=0.9, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn(self.conv(x)))
        return nnx.max_pool(x, (2, 2), strides=(2, 2))


class ConvNet(nnx.Module):
    def __init__(self, config: ConvNetConfig, *, dtype, rngs: nnx.Rngs):
        chans = (config.in_channels, *config.channels)
        self.blocks = nnx.List(
            [ConvBlock(a, b, dtype=dtype, rngs=rngs) for a, b in zip(chans[:-1], chans[1:])]
        )
        self.head = nnx.Linear(chans[-1], config.num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def build(
    config: ConvNetConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adam",
    learning_rate: float = 1e-3,
    dtype=jnp.float32,
) -> ModelSpec:
    """A classifier train step. Batch: ``{"images": [B, H, W, C] (NHWC), "labels": int32[B]}``."""
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    def module_loss(model: ConvNet, batch):
        logits = model(batch["images"].astype(dtype))
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
        return softmax_cross_entropy(logits, batch["labels"]), {"accuracy": accuracy}

    def make_batch(key: jax.Array):
        ki, kl = jax.random.split(key)
        shape = (batch_size, config.image_size, config.image_size, config.in_channels)
        return {
            "images": jax.random.normal(ki, shape, jnp.float32),
            "labels": jax.random.randint(kl, (batch_size,), 0, config.num_classes, jnp.int32),
        }

    return build_spec(
        f"convnet-{name}",
        lambda rngs: ConvNet(config, dtype=dtype, rngs=rngs),
        module_loss,
        make_batch,
        batch_size,
        make_optimizer(optimizer, learning_rate),
    )
