"""A Llama 2 / Llama 3 decoder in flax nnx, laid out as EasyLM and MaxText lay out theirs.

The structure is the one EasyLM's ``llama_model.py`` and MaxText's ``llama2`` decoder share: token
embeddings, then ``num_layers`` pre-norm decoder layers, then a final RMSNorm and an untied LM head.
A decoder layer is ``x + attention(attention_norm(x))`` followed by ``x + feed_forward(ffn_norm(x))``:

- RMSNorm whose statistics are always taken in fp32;
- grouped-query attention: ``num_kv_heads`` key/value heads shared by ``num_heads`` query heads, with
  rotary position embeddings on q and k, and the causal mask left to ``jax.nn.dot_product_attention``;
- a SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``;
- no biases anywhere.

Mixed precision as Llama is trained: parameters (and so AdamW's moments) are fp32, the matmuls and the
activations run in ``dtype`` (bf16 by default), and the logits are cast to fp32 before the loss.
``remat=True`` recomputes each decoder layer in the backward pass (EasyLM's ``nn.remat`` per block);
``scan_layers=True`` stacks the layers on a leading axis and runs them under ``jax.lax.scan``, with the
same math as the unrolled model (`stack_layer_params` maps one layout onto the other).

Example:
    >>> import jax
    >>> spec = build("tiny", batch_size=2)
    >>> spec.num_params()
    106816
    >>> state = spec.init_state(jax.random.key(0))
    >>> state, metrics = jax.jit(spec.train_step)(state, spec.make_batch(jax.random.key(1)))
    >>> bool(jnp.isfinite(metrics["loss"]))
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, language_model_spec, make_optimizer
from benchmarks.models.gpt import ATTENTION_IMPLS, scan_blocks, stack_block_params, stacked_blocks

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "build", "stack_layer_params", "train_flops"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama decoder's shape.

    Attributes:
        vocab_size, seq_len, hidden, num_layers: the model's dimensions.
        num_heads: query heads; the head dimension is ``hidden // num_heads``.
        num_kv_heads: key/value heads (grouped-query attention); ``num_heads`` gives plain multi-head.
        ffn: the SwiGLU intermediate size.
        rope_theta: the rotary base, 10000 in Llama 2 and 500000 in Llama 3.
        norm_eps: RMSNorm's epsilon.
        tie_embeddings: must stay False; Llama's LM head is its own matrix.
    """

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        problems = []
        for field in ("vocab_size", "seq_len", "hidden", "num_layers", "num_heads", "num_kv_heads", "ffn"):
            if getattr(self, field) < 1:
                problems.append(f"LlamaConfig.{field} must be positive, got {getattr(self, field)}")
        if self.num_heads >= 1 and self.hidden % self.num_heads:
            problems.append(
                f"LlamaConfig.hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        elif self.num_heads >= 1 and (self.hidden // self.num_heads) % 2:
            problems.append(
                f"LlamaConfig.hidden // num_heads ({self.hidden // self.num_heads}) must be even: rotary "
                "embeddings rotate pairs of channels"
            )
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            problems.append(
                f"LlamaConfig.num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads}): each key/value head serves a whole group of query heads"
            )
        if self.tie_embeddings:
            problems.append("LlamaConfig.tie_embeddings=True is not supported: Llama's LM head is untied")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


# Llama 2 7B: Meta's params.json (dim 4096, 32 layers, 32 heads, norm_eps 1e-5, vocab 32000; the SwiGLU
# width 11008 follows from multiple_of=256) and the Llama 2 paper (Touvron et al. 2023, Table 1: 4k context).
# Llama 3: "The Llama 3 Herd of Models" (Dubey et al. 2024), Table 3 (layers, model and FFN dimensions,
# 8 KV heads, RoPE theta 500000), with the 128256-entry vocabulary and 8192 pre-training context of Meta's
# model cards and params.json.
CONFIGS = {
    "tiny": LlamaConfig(
        vocab_size=256, seq_len=32, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128
    ),
    "llama2-7b": LlamaConfig(32000, 4096, 4096, 32, 32, 32, 11008, rope_theta=10000.0),
    "llama3-8b": LlamaConfig(128256, 8192, 4096, 32, 32, 8, 14336, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(128256, 8192, 8192, 80, 64, 8, 28672, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(128256, 8192, 16384, 126, 128, 8, 53248, rope_theta=500000.0),
}

# AdamW as the Llama 2 paper (Section 2.2) trains with it: beta2 0.95, eps 1e-5, weight decay 0.1.
_ADAMW_HYPERPARAMETERS = {"b1": 0.9, "b2": 0.95, "eps": 1e-5, "weight_decay": 0.1}
_INIT_STD = 0.02  # EasyLM's initializer_range


def _normal():
    return jax.nn.initializers.normal(_INIT_STD)


def _linear(d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=False, kernel_init=_normal(), dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``; the mean square is taken in fp32 whatever the compute dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return normed.astype(self.dtype) * self.scale[...].astype(self.dtype)


def apply_rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotate ``x: [batch, seq, heads, head_dim]`` by its positions' angles (RoPE), in fp32.

    Channels ``i`` and ``i + head_dim / 2`` form a pair (MaxText's and Hugging Face's layout; Meta's
    reference pairs adjacent channels, a fixed permutation of the same weights). The angles are built
    here from ``jnp.arange``, so a traced step holds no ``[seq, head_dim]`` constant.
    """
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [seq, head_dim / 2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, config: LlamaConfig, *, attention_impl: str, dtype, rngs: nnx.Rngs):
        d, hd = config.hidden, config.head_dim
        self.wq = _linear(d, config.num_heads * hd, dtype=dtype, rngs=rngs)
        self.wk = _linear(d, config.num_kv_heads * hd, dtype=dtype, rngs=rngs)
        self.wv = _linear(d, config.num_kv_heads * hd, dtype=dtype, rngs=rngs)
        self.wo = _linear(config.num_heads * hd, d, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.rope_theta = config.rope_theta
        self.attention_impl = attention_impl

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.wk(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.wv(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, self.rope_theta), apply_rotary(k, self.rope_theta)
        # dot_product_attention takes fewer K/V heads than query heads and attends per group, so the
        # K/V heads are never copied out to num_heads; is_causal keeps the mask out of the arguments.
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention_impl)
        return self.wo(out.reshape(b, s, self.num_heads * self.head_dim))


class FeedForward(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Meta's w1, w3 and w2)."""

    def __init__(self, hidden: int, ffn: int, *, dtype, rngs: nnx.Rngs):
        self.gate = _linear(hidden, ffn, dtype=dtype, rngs=rngs)
        self.up = _linear(hidden, ffn, dtype=dtype, rngs=rngs)
        self.down = _linear(ffn, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer; with ``remat`` its activations are recomputed in the backward pass."""

    def __init__(self, config: LlamaConfig, *, attention_impl: str, dtype, remat: bool, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps, dtype=dtype)
        self.attention = Attention(config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps, dtype=dtype)
        self.feed_forward = FeedForward(config.hidden, config.ffn, dtype=dtype, rngs=rngs)
        self.remat = remat

    def __call__(self, x: jax.Array) -> jax.Array:
        # Decided here rather than by the caller, so the scanned layers (gpt.scan_blocks) remat too.
        if self.remat:
            return nnx.remat(DecoderLayer._forward)(self, x)
        return self._forward(x)

    def _forward(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nnx.Module):
    """The decoder: ``tokens int32[B, S] -> logits float32[B, S, vocab]``."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype=jnp.bfloat16,
        scan_layers: bool = False,
        remat: bool = False,
        attention_impl: str = "xla",
        rngs: nnx.Rngs,
    ):
        self.tok_embeddings = nnx.Embed(
            config.vocab_size,
            config.hidden,
            embedding_init=_normal(),
            dtype=dtype,
            param_dtype=jnp.float32,
            rngs=rngs,
        )

        def make_layer(r):
            return DecoderLayer(config, attention_impl=attention_impl, dtype=dtype, remat=remat, rngs=r)

        self.scan_layers = scan_layers
        if scan_layers:
            self.layers = stacked_blocks(make_layer, config.num_layers, rngs)
        else:
            self.layers = nnx.List([make_layer(rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden, config.norm_eps, dtype=dtype)
        self.lm_head = _linear(config.hidden, config.vocab_size, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.tok_embeddings(tokens)
        if self.scan_layers:
            h = scan_blocks(self.layers, h)
        else:
            for layer in self.layers:
                h = layer(h)
        # The head runs in the compute dtype; the softmax over the vocabulary needs fp32.
        return self.lm_head(self.norm(h)).astype(jnp.float32)


def stack_layer_params(params: dict) -> dict:
    """Unrolled Llama params -> the ``scan_layers=True`` layout (same values, layers stacked)."""
    return stack_block_params(params, "layers")


def train_flops(config: LlamaConfig, batch_size: int) -> float:
    """Forward + backward flops of one step: ``6 * matmul params * tokens`` plus attention's two matmuls.

    The embedding lookup is a gather and is not counted; attention is not causally halved (as in gpt).
    """
    d, s, L, hd = config.hidden, config.seq_len, config.num_layers, config.head_dim
    attention_params = d * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    layer_params = attention_params + 3 * d * config.ffn
    matmul_params = L * layer_params + d * config.vocab_size
    attention_fwd_per_token = L * 4 * s * config.num_heads * hd  # q @ k.T and probs @ v
    tokens = batch_size * s
    return 6.0 * matmul_params * tokens + 3.0 * attention_fwd_per_token * tokens


def build(
    config: LlamaConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adamw",
    learning_rate: float = 3e-4,
    dtype=jnp.bfloat16,
    scan_layers: bool = False,
    remat: bool = False,
    attention_impl: str = "xla",
) -> ModelSpec:
    """A Llama language-model train step. Batch: ``{"tokens": int32[B, S], "targets": int32[B, S]}``.

    ``optimizer="adamw"`` uses Llama's AdamW settings (beta2 0.95, eps 1e-5, weight decay 0.1).
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    hyperparameters = _ADAMW_HYPERPARAMETERS if optimizer == "adamw" else {}
    return language_model_spec(
        f"llama{'_scan' if scan_layers else ''}-{name}",
        lambda rngs: Llama(
            config,
            dtype=dtype,
            scan_layers=scan_layers,
            remat=remat,
            attention_impl=attention_impl,
            rngs=rngs,
        ),
        config,
        batch_size,
        make_optimizer(optimizer, learning_rate, **hyperparameters),
        train_flops(config, batch_size),
    )
