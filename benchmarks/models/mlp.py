"""An N-layer MLP: the smallest model on which data vs. tensor parallelism is a clear choice.

With hidden 1024 and batch 32 the weights dwarf the activations, so Megatron-style tensor
parallelism is cheapest; with hidden 32 and batch 1024 it is the other way round (data parallel).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, build_spec, make_optimizer, softmax_cross_entropy


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    num_layers: int = 6
    input_dim: int = 1024
    hidden_dim: int = 1024
    output_dim: int = 1024
    loss: str = "mse"  # "mse" (regression to y) or "ce" (softmax cross entropy, output_dim classes)

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"MLPConfig.num_layers must be >= 1, got {self.num_layers}")
        if self.loss not in ("mse", "ce"):
            raise ValueError(f"MLPConfig.loss must be 'mse' or 'ce', got {self.loss!r}")


CONFIGS = {
    "tiny": MLPConfig(num_layers=3, input_dim=16, hidden_dim=32, output_dim=8, loss="ce"),
    "h1024": MLPConfig(num_layers=6, input_dim=1024, hidden_dim=1024, output_dim=1024),
    "h32": MLPConfig(num_layers=6, input_dim=32, hidden_dim=32, output_dim=32),
}


class MLP(nnx.Module):
    def __init__(self, config: MLPConfig, *, dtype, rngs: nnx.Rngs):
        dims = [config.input_dim] + [config.hidden_dim] * (config.num_layers - 1) + [config.output_dim]
        self.layers = nnx.List(
            [nnx.Linear(a, b, dtype=dtype, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def build(
    config: MLPConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adam",
    learning_rate: float = 1e-3,
    dtype=jnp.float32,
) -> ModelSpec:
    """An MLP train step. Batch: ``{"x": [B, input_dim], "y": [B, output_dim] or int32[B]}``."""
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    def module_loss(model: MLP, batch):
        out = model(batch["x"].astype(dtype))
        if config.loss == "ce":
            return softmax_cross_entropy(out, batch["y"]), {}
        return jnp.mean(jnp.square(out.astype(jnp.float32) - batch["y"])), {}

    def make_batch(key: jax.Array):
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (batch_size, config.input_dim), jnp.float32)
        if config.loss == "ce":
            y = jax.random.randint(ky, (batch_size,), 0, config.output_dim, jnp.int32)
        else:
            y = jax.random.normal(ky, (batch_size, config.output_dim), jnp.float32)
        return {"x": x, "y": y}

    dims = [config.input_dim] + [config.hidden_dim] * (config.num_layers - 1) + [config.output_dim]
    flops = 6.0 * batch_size * sum(a * b for a, b in zip(dims[:-1], dims[1:]))
    return build_spec(
        f"mlp-{name}",
        lambda rngs: MLP(config, dtype=dtype, rngs=rngs),
        module_loss,
        make_batch,
        batch_size,
        make_optimizer(optimizer, learning_rate),
        flops,
    )
