"""A GPT-2-style decoder: learned positions, pre-LN blocks, causal attention, tied output head.

With ``scan_layers=True`` the blocks' parameters are stacked on a leading layer axis and the
blocks run under ``jax.lax.scan``; the math is the same as the unrolled model, and
`stack_block_params` maps unrolled params onto the stacked layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, language_model_spec, make_optimizer

ATTENTION_IMPLS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    mlp_ratio: int = 4

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )


# Alpa's GPT-3 benchmark suite (seq 1024, vocab 51200); the names are the parameter counts.
CONFIGS = {
    "tiny": GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_layers=2, num_heads=4),
    "125M": GPTConfig(51200, 1024, 768, 12, 12),
    "350M": GPTConfig(51200, 1024, 1024, 24, 16),
    "760M": GPTConfig(51200, 1024, 1536, 24, 16),
    "1.3B": GPTConfig(51200, 1024, 2048, 24, 32),
    "2.6B": GPTConfig(51200, 1024, 2560, 32, 32),
    "6.7B": GPTConfig(51200, 1024, 4096, 32, 32),
    "15B": GPTConfig(51200, 1024, 5120, 48, 40),
    "39B": GPTConfig(51200, 1024, 8192, 48, 64),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): seq 2048, 96 layers of width 12288, 96 heads
    "175B": GPTConfig(51200, 2048, 12288, 96, 96),
}


def _normal(stddev: float):
    return jax.nn.initializers.normal(stddev)


def causal_attention(q, k, v, impl: str):
    """Multi-head causal attention over ``[batch, seq, heads, head_dim]`` inputs."""
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    seq = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1]).astype(
        jnp.float32
    )
    mask = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Attention(nnx.Module):
    def __init__(self, config: GPTConfig, *, attention_impl: str, dtype, rngs: nnx.Rngs):
        d = config.hidden
        proj_std = 0.02 / (2 * config.num_layers) ** 0.5  # GPT-2's scaled residual init

        def linear(std):
            return nnx.Linear(d, d, kernel_init=_normal(std), dtype=dtype, rngs=rngs)

        self.query, self.key, self.value = linear(0.02), linear(0.02), linear(0.02)
        self.out = linear(proj_std)
        self.num_heads = config.num_heads
        self.attention_impl = attention_impl

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        heads = (b, s, self.num_heads, d // self.num_heads)
        q, k, v = (proj(x).reshape(heads) for proj in (self.query, self.key, self.value))
        return self.out(causal_attention(q, k, v, self.attention_impl).reshape(b, s, d))


class MLPBlock(nnx.Module):
    def __init__(self, hidden: int, inner: int, num_layers: int, *, dtype, rngs: nnx.Rngs):
        proj_std = 0.02 / (2 * num_layers) ** 0.5
        self.fc = nnx.Linear(hidden, inner, kernel_init=_normal(0.02), dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(inner, hidden, kernel_init=_normal(proj_std), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, attention_impl: str, dtype, rngs: nnx.Rngs):
        d = config.hidden
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.attn = Attention(config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.mlp = MLPBlock(d, config.mlp_ratio * d, config.num_layers, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def stacked_blocks(make_block, num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """One block module whose every parameter has a leading ``[num_layers]`` axis."""
    abstract = nnx.eval_shape(lambda: make_block(nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def init_one(key):
        return nnx.to_pure_dict(nnx.state(make_block(nnx.Rngs(key))))

    keys = jax.random.split(rngs.params(), num_layers)
    return nnx.merge(graphdef, jax.vmap(init_one)(keys))


def scan_blocks(blocks: nnx.Module, x: jax.Array) -> jax.Array:
    """Run stacked blocks (see `stacked_blocks`) over ``x`` with ``lax.scan``."""
    graphdef, stacked = nnx.split(blocks)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h), None

    x, _ = jax.lax.scan(body, x, stacked)
    return x


class GPT(nnx.Module):
    def __init__(
        self, config: GPTConfig, *, scan_layers: bool, attention_impl: str, dtype, rngs: nnx.Rngs
    ):
        d = config.hidden
        self.wte = nnx.Embed(config.vocab_size, d, embedding_init=_normal(0.02), dtype=dtype, rngs=rngs)
        self.wpe = nnx.Embed(config.seq_len, d, embedding_init=_normal(0.01), dtype=dtype, rngs=rngs)

        def make_block(r):
            return Block(config, attention_impl=attention_impl, dtype=dtype, rngs=r)

        self.scan_layers = scan_layers
        if scan_layers:
            self.blocks = stacked_blocks(make_block, config.num_layers, rngs)
        else:
            self.blocks = nnx.List([make_block(rngs) for _ in range(config.num_layers)])
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        if self.scan_layers:
            h = scan_blocks(self.blocks, h)
        else:
            for block in self.blocks:
                h = block(h)
        return self.wte.attend(self.ln_f(h))  # tied output head: h @ wte.T


def stack_block_params(params: dict, key: str = "blocks") -> dict:
    """Unrolled params -> the ``scan_layers=True`` layout (same values, the blocks under ``params[key]`` stacked
    on a leading axis, as `stacked_blocks` holds them)."""
    blocks = params[key]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[i] for i in range(len(blocks))))
    return {**params, key: stacked}


def train_flops(config: GPTConfig, batch_size: int) -> float:
    """Forward + backward flops of one step (matmuls only; attention is not causally halved)."""
    d, s, L = config.hidden, config.seq_len, config.num_layers
    per_token_fwd = L * (2 * (4 + 2 * config.mlp_ratio) * d * d + 4 * s * d) + 2 * d * config.vocab_size
    return 3.0 * batch_size * s * per_token_fwd


def build(
    config: GPTConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adamw",
    learning_rate: float = 1e-3,
    dtype=jnp.float32,
    scan_layers: bool = False,
    attention_impl: str = "xla",
) -> ModelSpec:
    """A GPT language-model train step. Batch: ``{"tokens": int32[B, S], "targets": int32[B, S]}``."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    return language_model_spec(
        f"gpt{'_scan' if scan_layers else ''}-{name}",
        lambda rngs: GPT(
            config, scan_layers=scan_layers, attention_impl=attention_impl, dtype=dtype, rngs=rngs
        ),
        config,
        batch_size,
        make_optimizer(optimizer, learning_rate),
        train_flops(config, batch_size),
    )
