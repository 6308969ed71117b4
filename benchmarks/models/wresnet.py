"""Wide-ResNet (bottleneck ResNet-50 layout) with BatchNorm, as in Alpa's benchmark suite.

Follows ``alpa/model/wide_resnet.py``: the 3x3 conv of each bottleneck block is ``width_factor``
times wider, the block output is ``4 * filters``, the last BatchNorm of a block starts at zero
scale, and the classifier has 1024 classes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, build_spec, make_optimizer, softmax_cross_entropy


@dataclasses.dataclass(frozen=True)
class WResNetConfig:
    image_size: int = 224
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)  # ResNet-50
    num_filters: int = 64
    width_factor: int = 2
    num_classes: int = 1024


# Alpa's suite: image 224, 50 layers, base channels C, width factor 2.
CONFIGS = {
    "tiny": WResNetConfig(image_size=32, stage_sizes=(1, 1), num_filters=8, width_factor=2, num_classes=8),
    "250M": WResNetConfig(num_filters=160),
    "500M": WResNetConfig(num_filters=224),
    "1B": WResNetConfig(num_filters=320),
}


def _batch_norm(features: int, *, dtype, rngs: nnx.Rngs, zero_scale: bool = False) -> nnx.BatchNorm:
    scale_init = jax.nn.initializers.zeros if zero_scale else jax.nn.initializers.ones
    return nnx.BatchNorm(features, momentum=0.9, epsilon=1e-5, scale_init=scale_init, dtype=dtype, rngs=rngs)


class Bottleneck(nnx.Module):
    def __init__(self, cin: int, filters: int, width_factor: int, strides: int, *, dtype, rngs: nnx.Rngs):
        wide, cout = filters * width_factor, filters * 4

        def conv(a, b, k, s=1):
            return nnx.Conv(a, b, (k, k), (s, s), use_bias=False, dtype=dtype, rngs=rngs)

        self.conv1, self.bn1 = conv(cin, filters, 1), _batch_norm(filters, dtype=dtype, rngs=rngs)
        self.conv2, self.bn2 = conv(filters, wide, 3, strides), _batch_norm(wide, dtype=dtype, rngs=rngs)
        self.conv3 = conv(wide, cout, 1)
        self.bn3 = _batch_norm(cout, dtype=dtype, rngs=rngs, zero_scale=True)
        if cin != cout or strides != 1:
            self.proj = conv(cin, cout, 1, strides)
            self.proj_bn = _batch_norm(cout, dtype=dtype, rngs=rngs)
        else:
            self.proj = self.proj_bn = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = jax.nn.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        residual = x if self.proj is None else self.proj_bn(self.proj(x))
        return jax.nn.relu(residual + y)


class WResNet(nnx.Module):
    def __init__(self, config: WResNetConfig, *, dtype, rngs: nnx.Rngs):
        f = config.num_filters
        self.conv_init = nnx.Conv(
            3, f, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, dtype=dtype, rngs=rngs
        )
        self.bn_init = _batch_norm(f, dtype=dtype, rngs=rngs)
        blocks, cin = [], f
        for i, size in enumerate(config.stage_sizes):
            for j in range(size):
                strides = 2 if i > 0 and j == 0 else 1
                blocks.append(Bottleneck(cin, f * 2**i, config.width_factor, strides, dtype=dtype, rngs=rngs))
                cin = f * 2**i * 4
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, config.num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn_init(self.conv_init(x)))
        x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def build(
    config: WResNetConfig | str,
    batch_size: int,
    *,
    optimizer: str = "sgd",
    learning_rate: float = 0.01,
    dtype=jnp.float32,
) -> ModelSpec:
    """An image classifier train step. Batch: ``{"images": [B, H, W, 3], "labels": int32[B]}``.

    The default optimizer is Alpa's: SGD with Nesterov momentum 0.9.
    """
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    def module_loss(model: WResNet, batch):
        logits = model(batch["images"].astype(dtype))
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
        return softmax_cross_entropy(logits, batch["labels"]), {"accuracy": accuracy}

    def make_batch(key: jax.Array):
        ki, kl = jax.random.split(key)
        shape = (batch_size, config.image_size, config.image_size, 3)
        return {
            "images": jax.random.normal(ki, shape, jnp.float32),
            "labels": jax.random.randint(kl, (batch_size,), 0, config.num_classes, jnp.int32),
        }

    return build_spec(
        f"wresnet-{name}",
        lambda rngs: WResNet(config, dtype=dtype, rngs=rngs),
        module_loss,
        make_batch,
        batch_size,
        make_optimizer(optimizer, learning_rate),
    )
