"""A GShard-style top-2 mixture-of-experts transformer, and a standalone MoE layer.

Routing follows GShard (Lepikhin et al. 2020, Algorithm 2) and ``alpa/model/moe.py``: tokens are
split into groups of ``expert_group_size``; each token goes to its top-2 experts, each expert takes
at most ``capacity = capacity_factor * 2 * group_size / num_experts`` tokens per group (the rest are
dropped), and dispatch and combine are dense einsums with a ``[groups, tokens, experts, capacity]``
mask built with one-hot and cumsum. The load-balancing loss is GShard's
``mean_e(fraction_routed_e * mean_gate_e) * E``.

As in Alpa's and GShard's models, MoE layers alternate with dense layers (even layers are MoE),
and the FFN inner size is 8x hidden.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.common import ModelSpec, build_spec, make_optimizer, softmax_cross_entropy
from benchmarks.models.gpt import Attention, Block, GPTConfig


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    num_experts: int
    expert_group_size: int = 2048
    mlp_ratio: int = 8
    capacity_factor: float = 1.0
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(
                f"MoEConfig.hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )


@dataclasses.dataclass(frozen=True)
class MoELayerConfig:
    seq_len: int
    hidden: int
    num_experts: int
    expert_group_size: int = 2048
    mlp_ratio: int = 8
    capacity_factor: float = 1.0
    aux_loss_weight: float = 0.01


# Alpa's MoE suite (seq 1024, vocab 32000, 16 heads, expert group size 2048).
CONFIGS = {
    "tiny": MoEConfig(256, 32, 64, num_layers=2, num_heads=4, num_experts=4, expert_group_size=32),
    "380M": MoEConfig(32000, 1024, 768, num_layers=8, num_heads=16, num_experts=8),
    "690M": MoEConfig(32000, 1024, 768, num_layers=8, num_heads=16, num_experts=16),
    "1.3B": MoEConfig(32000, 1024, 768, num_layers=16, num_heads=16, num_experts=16),
    "2.4B": MoEConfig(32000, 1024, 1024, num_layers=16, num_heads=16, num_experts=16),
}

LAYER_CONFIGS = {
    "tiny": MoELayerConfig(seq_len=32, hidden=64, num_experts=4, expert_group_size=32, mlp_ratio=4),
    # One MoE FFN of the 380M model.
    "380M": MoELayerConfig(seq_len=1024, hidden=768, num_experts=8),
}


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * 2 * group_size / num_experts))


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 routing. ``gates``: softmax probabilities ``[G, S, E]``.

    Returns ``(combine [G,S,E,C] float, dispatch [G,S,E,C] 0/1 float, aux_loss scalar)``.
    A token's slot in an expert's buffer is its rank among the tokens of its group routed there;
    top-1 assignments fill the buffers before top-2 ones, and anything past ``capacity`` is dropped.
    """
    num_experts = gates.shape[-1]
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, num_experts, dtype=jnp.int32)
    gates_without_1 = gates * (1 - mask_1)
    index_2 = jnp.argmax(gates_without_1, axis=-1)
    mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.int32)

    # Load balancing: fraction of tokens whose top-1 is e, times the mean gate of e (GShard eq. 4).
    density = jnp.mean(mask_1.astype(gates.dtype), axis=1)
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * num_experts * num_experts

    # Normalize the two gates before dropping (GShard Algorithm 2).
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    denom = gate_1 + gate_2 + 1e-9
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    pos_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (pos_1 < capacity)
    count_1 = jnp.sum(mask_1, axis=1, keepdims=True)
    pos_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + count_1
    mask_2 = mask_2 * (pos_2 < capacity)

    def slots(mask, pos):  # [G,S,E] x [G,S,E] -> [G,S,E,C]
        token_pos = jnp.sum(pos * mask, axis=-1)
        return mask.astype(gates.dtype)[..., None] * jax.nn.one_hot(token_pos, capacity, dtype=gates.dtype)[
            :, :, None, :
        ]

    slots_1, slots_2 = slots(mask_1, pos_1), slots(mask_2, pos_2)
    combine = gate_1[..., None, None] * slots_1 + gate_2[..., None, None] * slots_2
    return combine, slots_1 + slots_2, aux_loss


class MoEFFN(nnx.Module):
    """A top-2 MoE feed-forward layer on ``[batch, seq, hidden]``; returns ``(y, aux_loss)``."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        num_experts: int,
        *,
        expert_group_size: int,
        capacity_factor: float,
        proj_std: float = 0.02,
        dtype,
        rngs: nnx.Rngs,
    ):
        init = jax.nn.initializers.normal(0.02)
        self.gate = nnx.Param(init(rngs.params(), (hidden, num_experts)))
        self.wi = nnx.Param(init(rngs.params(), (num_experts, hidden, inner)))
        self.wo = nnx.Param(jax.nn.initializers.normal(proj_std)(rngs.params(), (num_experts, inner, hidden)))
        self.expert_group_size = expert_group_size
        self.capacity_factor = capacity_factor
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, d = x.shape
        num_tokens = b * s
        group = min(self.expert_group_size, num_tokens)
        if num_tokens % group:
            raise ValueError(
                f"MoE: batch*seq = {b}*{s} = {num_tokens} tokens must be a multiple of the expert group "
                f"size {group}; change the batch size or expert_group_size"
            )
        num_experts = self.gate.shape[-1]
        capacity = expert_capacity(group, num_experts, self.capacity_factor)
        xg = x.reshape(num_tokens // group, group, d).astype(self.dtype)
        logits = jnp.einsum("gsd,de->gse", xg, self.gate[...].astype(self.dtype))
        gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        combine, dispatch, aux_loss = top2_gating(gates, capacity)
        expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(self.dtype), xg)
        h = jax.nn.gelu(jnp.einsum("egcd,edh->egch", expert_in, self.wi[...].astype(self.dtype)))
        expert_out = jnp.einsum("egch,ehd->egcd", h, self.wo[...].astype(self.dtype))
        y = jnp.einsum("gsec,egcd->gsd", combine.astype(self.dtype), expert_out)
        return y.reshape(b, s, d), aux_loss


class MoEBlock(nnx.Module):
    def __init__(self, config: MoEConfig, attn_config: GPTConfig, *, attention_impl: str, dtype, rngs):
        d = config.hidden
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.attn = Attention(attn_config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.moe = MoEFFN(
            d,
            config.mlp_ratio * d,
            config.num_experts,
            expert_group_size=config.expert_group_size,
            capacity_factor=config.capacity_factor,
            proj_std=0.02 / (2 * config.num_layers) ** 0.5,
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.ln1(x))
        y, aux_loss = self.moe(self.ln2(x))
        return x + y, aux_loss


class MoETransformer(nnx.Module):
    """Pre-LN causal LM; even layers are MoE blocks, odd layers dense GPT blocks; tied head."""

    def __init__(self, config: MoEConfig, *, attention_impl: str, dtype, rngs: nnx.Rngs):
        d = config.hidden
        attn_config = GPTConfig(
            config.vocab_size, config.seq_len, d, config.num_layers, config.num_heads, config.mlp_ratio
        )
        normal = jax.nn.initializers.normal
        self.wte = nnx.Embed(config.vocab_size, d, embedding_init=normal(0.02), dtype=dtype, rngs=rngs)
        self.wpe = nnx.Embed(config.seq_len, d, embedding_init=normal(0.01), dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [
                MoEBlock(config, attn_config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
                if i % 2 == 0
                else Block(attn_config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        aux_loss = jnp.zeros((), jnp.float32)
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                h, aux = block(h)
                aux_loss = aux_loss + aux
            else:
                h = block(h)
        return self.wte.attend(self.ln_f(h)), aux_loss


def _moe_ffn_flops_per_token(d, inner, num_experts, group, capacity_factor):
    capacity = expert_capacity(group, num_experts, capacity_factor)
    slots_per_token = num_experts * capacity / group  # expert rows computed per input token
    experts = 2 * slots_per_token * 2 * d * inner
    dispatch_combine = 2 * 2 * num_experts * capacity * d
    return experts + dispatch_combine + 2 * d * num_experts


def train_flops(config: MoEConfig, batch_size: int) -> float:
    """Forward + backward matmul flops of one step, counting dropped-slot padding as computed."""
    d, s = config.hidden, config.seq_len
    inner = config.mlp_ratio * d
    group = min(config.expert_group_size, batch_size * s)
    attn = 2 * 4 * d * d + 4 * s * d
    num_moe = (config.num_layers + 1) // 2
    num_dense = config.num_layers - num_moe
    per_token = (
        config.num_layers * attn
        + num_dense * 2 * 2 * d * inner
        + num_moe * _moe_ffn_flops_per_token(d, inner, config.num_experts, group, config.capacity_factor)
        + 2 * d * config.vocab_size
    )
    return 3.0 * batch_size * s * per_token


def build(
    config: MoEConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adamw",
    learning_rate: float = 1e-3,
    dtype=jnp.float32,
    attention_impl: str = "xla",
) -> ModelSpec:
    """An MoE language-model train step. Batch: ``{"tokens": int32[B, S], "targets": int32[B, S]}``.

    The loss is cross entropy plus ``aux_loss_weight`` times the summed load-balancing loss;
    metrics report both parts.
    """
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = CONFIGS[config]

    def module_loss(model: MoETransformer, batch):
        logits, aux_loss = model(batch["tokens"])
        ce = softmax_cross_entropy(logits, batch["targets"])
        return ce + config.aux_loss_weight * aux_loss, {"ce_loss": ce, "aux_loss": aux_loss}

    def make_batch(key: jax.Array):
        seq = jax.random.randint(key, (batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
        return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}

    return build_spec(
        f"moe-{name}",
        lambda rngs: MoETransformer(config, attention_impl=attention_impl, dtype=dtype, rngs=rngs),
        module_loss,
        make_batch,
        batch_size,
        make_optimizer(optimizer, learning_rate),
        train_flops(config, batch_size),
    )


def build_moe_layer(
    config: MoELayerConfig | str,
    batch_size: int,
    *,
    optimizer: str = "adamw",
    learning_rate: float = 1e-3,
    dtype=jnp.float32,
) -> ModelSpec:
    """One top-2 MoE FFN regressing a random target. Batch: ``{"x": [B,S,D], "y": [B,S,D]}``.

    Loss: ``mean((moe(x) - y)**2) + aux_loss_weight * aux_loss``.
    """
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = LAYER_CONFIGS[config]
    d = config.hidden

    def make_module(rngs):
        return MoEFFN(
            d,
            config.mlp_ratio * d,
            config.num_experts,
            expert_group_size=config.expert_group_size,
            capacity_factor=config.capacity_factor,
            dtype=dtype,
            rngs=rngs,
        )

    def module_loss(model: MoEFFN, batch):
        y, aux_loss = model(batch["x"])
        mse = jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))
        return mse + config.aux_loss_weight * aux_loss, {"mse": mse, "aux_loss": aux_loss}

    def make_batch(key: jax.Array):
        kx, ky = jax.random.split(key)
        shape = (batch_size, config.seq_len, d)
        return {
            "x": jax.random.normal(kx, shape, jnp.float32),
            "y": jax.random.normal(ky, shape, jnp.float32),
        }

    group = min(config.expert_group_size, batch_size * config.seq_len)
    flops = (
        3.0
        * batch_size
        * config.seq_len
        * _moe_ffn_flops_per_token(d, config.mlp_ratio * d, config.num_experts, group, config.capacity_factor)
    )
    return build_spec(
        f"moe_layer-{name}",
        make_module,
        module_loss,
        make_batch,
        batch_size,
        make_optimizer(optimizer, learning_rate),
        flops,
    )
