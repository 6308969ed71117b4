"""A DDPM UNet in flax linen, as yiyixuxu/denoising-diffusion-flax writes it, and its train step.

The network (``Unet``): a 7x7 stem, a sinusoidal time embedding through a GELU MLP, then per
resolution two ResNet blocks (weight-standardised 3x3 convolutions, GroupNorm, a scale and shift
from the time embedding) and a linear-attention block, a strided 4x4 convolution down; a middle of
two ResNet blocks around full attention (l2-normalised queries and keys); the mirror path up,
concatenating the skips and upsampling with ``jax.image.resize`` (nearest) and a 3x3 convolution.

The step (``make_train_step``) is the repository's ``p_loss``: draw a timestep per image and
Gaussian noise, noise the batch with the beta schedule (``q_sample``), and regress the noise with
the config's loss (l1 for fashion_mnist), weighted by the P2 weight (1 at gamma = 0). The key is an
argument of the step, as the repository passes one per step. EMA parameters, updated outside the
step there, are left out.

Example:
    >>> cfg = DDPMConfig(dim=8)
    >>> model, tx = cfg.build(), optax.adam(1e-3)
    >>> state = init_state(cfg, model, tx, jax.random.key(0))
    >>> step = jax.jit(make_train_step(cfg, model, tx))
    >>> state, loss = step(state, make_batch(cfg, jax.random.key(1)), jax.random.key(2))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from einops import rearrange


def l2norm(t, axis=1, eps=1e-12):
    return t / jnp.clip(jnp.linalg.norm(t, ord=2, axis=axis, keepdims=True), eps)


class SinusoidalPosEmb(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, time):
        half = self.dim // 2
        freqs = jnp.exp(jnp.arange(half) * -(math.log(10000) / (half - 1)))
        emb = time.astype(jnp.float32)[:, None] * freqs[None, :]
        return jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=-1)


class Downsample(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        return nn.Conv(self.dim, kernel_size=(4, 4), strides=(2, 2), padding=1)(x)


class Upsample(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        b, h, w, c = x.shape
        x = jax.image.resize(x, (b, h * 2, w * 2, c), "nearest")
        return nn.Conv(self.dim, kernel_size=(3, 3), padding=1)(x)


class WeightStandardizedConv(nn.Module):
    """A convolution whose kernel is standardised per output channel (Qiao et al. 2019, arXiv:1903.10520)."""

    features: int
    kernel_size: Sequence[int] = (3, 3)
    padding: Any = 1

    @nn.compact
    def __call__(self, x):
        conv = nn.Conv(self.features, self.kernel_size, padding=self.padding, parent=None)
        kernel = self.param("kernel", lambda rng, x: conv.init(rng, x)["params"]["kernel"], x)
        bias = self.param("bias", lambda rng, x: conv.init(rng, x)["params"]["bias"], x)
        axes = tuple(range(kernel.ndim - 1))  # every axis but the output channels
        mean = jnp.mean(kernel, axis=axes, keepdims=True)
        var = jnp.var(kernel, axis=axes, keepdims=True)
        kernel = (kernel - mean) / jnp.sqrt(var + 1e-5)
        return conv.apply({"params": {"kernel": kernel, "bias": bias}}, x)


class ResnetBlock(nn.Module):
    dim: int
    groups: int = 8

    @nn.compact
    def __call__(self, x, time_emb):
        h = WeightStandardizedConv(self.dim, name="conv_0")(x)
        h = nn.GroupNorm(num_groups=self.groups, name="norm_0")(h)
        time_emb = nn.Dense(2 * self.dim, name="time_mlp.dense_0")(nn.swish(time_emb))
        scale, shift = jnp.split(time_emb[:, None, None, :], 2, axis=-1)
        h = nn.swish(h * (1 + scale) + shift)
        h = WeightStandardizedConv(self.dim, name="conv_1")(h)
        h = nn.swish(nn.GroupNorm(num_groups=self.groups, name="norm_1")(h))
        if x.shape[-1] != self.dim:
            x = nn.Conv(self.dim, kernel_size=(1, 1), name="res_conv_0")(x)
        return x + h


class Attention(nn.Module):
    heads: int = 4
    dim_head: int = 32
    scale: float = 10.0

    @nn.compact
    def __call__(self, x):
        _, h, _, c = x.shape
        qkv = nn.Conv(3 * self.heads * self.dim_head, (1, 1), use_bias=False, name="to_qkv.conv_0")(x)
        q, k, v = (rearrange(t, "b x y (h d) -> b (x y) h d", h=self.heads) for t in jnp.split(qkv, 3, axis=-1))
        q, k = l2norm(q), l2norm(k)
        attn = nn.softmax(jnp.einsum("b i h d, b j h d -> b h i j", q, k) * self.scale, axis=-1)
        out = jnp.einsum("b h i j, b j h d -> b h i d", attn, v)
        out = rearrange(out, "b h (x y) d -> b x y (h d)", x=h)
        return nn.Conv(c, (1, 1), name="to_out.conv_0")(out)


class LinearAttention(nn.Module):
    heads: int = 4
    dim_head: int = 32

    @nn.compact
    def __call__(self, x):
        _, h, w, c = x.shape
        qkv = nn.Conv(3 * self.heads * self.dim_head, (1, 1), use_bias=False, name="to_qkv.conv_0")(x)
        q, k, v = (rearrange(t, "b x y (h d) -> b (x y) h d", h=self.heads) for t in jnp.split(qkv, 3, axis=-1))
        q = nn.softmax(q, axis=-1) / jnp.sqrt(self.dim_head)  # over each query's features
        k = nn.softmax(k, axis=-3)  # over positions
        v = v / (h * w)
        context = jnp.einsum("b n h d, b n h e -> b h d e", k, v)
        out = jnp.einsum("b h d e, b n h d -> b h e n", context, q)
        out = rearrange(out, "b h e (x y) -> b x y (h e)", x=h)
        out = nn.Conv(c, (1, 1), name="to_out.conv_0")(out)
        return nn.LayerNorm(epsilon=1e-5, use_bias=False, name="to_out.norm_0")(out)


class AttnBlock(nn.Module):
    heads: int = 4
    dim_head: int = 32
    linear: bool = True

    @nn.compact
    def __call__(self, x):
        normed = nn.LayerNorm(epsilon=1e-5, use_bias=False)(x)
        attn = LinearAttention if self.linear else Attention
        return x + attn(self.heads, self.dim_head)(normed)


class Unet(nn.Module):
    dim: int
    out_dim: int
    dim_mults: tuple[int, ...] = (1, 2, 4, 8)
    groups: int = 8
    heads: int = 4
    dim_head: int = 32

    @nn.compact
    def __call__(self, x, time):
        def block(dim, name):
            return ResnetBlock(dim, self.groups, name=name)

        def attn(name, linear=True):
            return AttnBlock(self.heads, self.dim_head, linear, name=name)

        h = nn.Conv(self.dim, (7, 7), padding=3, name="init.conv_0")(x)
        hs = [h]
        t = SinusoidalPosEmb(self.dim)(time)
        t = nn.Dense(4 * self.dim, name="time_mlp.dense_0")(t)
        t = nn.Dense(4 * self.dim, name="time_mlp.dense_1")(nn.gelu(t))

        levels = len(self.dim_mults)
        for i in range(levels):
            dim_in = h.shape[-1]
            h = block(dim_in, f"down_{i}.resblock_0")(h, t)
            hs.append(h)
            h = attn(f"down_{i}.attnblock_0")(block(dim_in, f"down_{i}.resblock_1")(h, t))
            hs.append(h)
            if i < levels - 1:
                h = Downsample(self.dim * self.dim_mults[i], name=f"down_{i}.downsample_0")(h)

        mid = self.dim * self.dim_mults[-1]
        h = nn.Conv(mid, (3, 3), padding=1, name=f"down_{levels - 1}.conv_0")(h)
        h = block(mid, "mid.resblock_0")(h, t)
        h = attn("mid.attenblock_0", linear=False)(h)
        h = block(mid, "mid.resblock_1")(h, t)

        for i in reversed(range(levels)):
            dim_in = self.dim * self.dim_mults[i]
            dim_out = self.dim * self.dim_mults[i - 1] if i > 0 else self.dim
            h = block(dim_in, f"up_{i}.resblock_0")(jnp.concatenate([h, hs.pop()], axis=-1), t)
            h = block(dim_in, f"up_{i}.resblock_1")(jnp.concatenate([h, hs.pop()], axis=-1), t)
            h = attn(f"up_{i}.attnblock_0")(h)
            if i > 0:
                h = Upsample(dim_out, name=f"up_{i}.upsample_0")(h)

        h = nn.Conv(self.dim, (3, 3), padding=1, name="up_0.conv_0")(h)
        h = block(self.dim, "final.resblock_0")(jnp.concatenate([h, hs.pop()], axis=-1), t)
        return nn.Conv(self.out_dim, (1, 1), name="final.conv_0")(h)


@dataclass(frozen=True)
class DDPMConfig:
    """The repository's configs/fashion_mnist.py, at a small width (there: dim 64, dim_mults (1, 2, 4))."""

    image_size: int = 28
    channels: int = 1
    dim: int = 16
    dim_mults: tuple[int, ...] = (1, 2)
    heads: int = 4
    dim_head: int = 32
    timesteps: int = 1000
    beta_schedule: str = "linear"
    loss_type: str = "l1"
    p2_loss_weight_gamma: float = 0.0
    p2_loss_weight_k: float = 1.0
    batch: int = 8

    def __post_init__(self):
        if self.image_size % 2 ** (len(self.dim_mults) - 1):
            raise ValueError(f"DDPMConfig.image_size ({self.image_size}) must be divisible by "
                             f"2**(len(dim_mults) - 1) = {2 ** (len(self.dim_mults) - 1)}: each level but the last halves it")
        if self.dim % 8:
            raise ValueError(f"DDPMConfig.dim ({self.dim}) must be a multiple of 8, GroupNorm's groups")

    def build(self) -> Unet:
        return Unet(self.dim, self.channels, self.dim_mults, heads=self.heads, dim_head=self.dim_head)


def beta_schedule(cfg: DDPMConfig) -> np.ndarray:
    if cfg.beta_schedule == "linear":  # Ho et al. 2020, scaled to the number of steps
        scale = 1000 / cfg.timesteps
        return np.linspace(scale * 1e-4, scale * 0.02, cfg.timesteps, dtype=np.float64)
    if cfg.beta_schedule == "cosine":  # Nichol & Dhariwal 2021
        s = np.linspace(0, 1, cfg.timesteps + 1)
        alphas_bar = np.cos((s + 0.008) / 1.008 * np.pi / 2) ** 2
        return np.clip(1 - alphas_bar[1:] / alphas_bar[:-1], 0, 0.999)
    raise ValueError(f"unknown beta schedule {cfg.beta_schedule!r}; expected 'linear' or 'cosine'")


def ddpm_params(cfg: DDPMConfig) -> dict[str, np.ndarray]:
    """The schedule's tables, computed in float64 and stored in float32 (constants of the step)."""
    alphas_bar = np.cumprod(1.0 - beta_schedule(cfg))
    p2 = (cfg.p2_loss_weight_k + alphas_bar / (1 - alphas_bar)) ** -cfg.p2_loss_weight_gamma
    tables = {"sqrt_alphas_bar": np.sqrt(alphas_bar), "sqrt_1m_alphas_bar": np.sqrt(1 - alphas_bar),
              "p2_loss_weight": p2}
    return {k: v.astype(np.float32) for k, v in tables.items()}


def q_sample(x, t, noise, params):
    """The forward process: ``x_t = sqrt(alpha_bar_t) x + sqrt(1 - alpha_bar_t) noise``."""
    sqrt_alpha_bar = params["sqrt_alphas_bar"][t, None, None, None]
    sqrt_1m_alpha_bar = params["sqrt_1m_alphas_bar"][t, None, None, None]
    return sqrt_alpha_bar * x + sqrt_1m_alpha_bar * noise


LOSSES = {"l1": lambda pred, target: jnp.abs(pred - target), "l2": lambda pred, target: (pred - target) ** 2}


def make_batch(cfg: DDPMConfig, key) -> dict[str, jax.Array]:
    """Images in [-1, 1], as the repository's pipeline normalises them."""
    shape = (cfg.batch, cfg.image_size, cfg.image_size, cfg.channels)
    return {"image": jax.random.uniform(key, shape, minval=-1.0, maxval=1.0)}


def init_state(cfg: DDPMConfig, model: Unet, tx: optax.GradientTransformation, key) -> dict:
    shape = (1, cfg.image_size, cfg.image_size, cfg.channels)
    params = model.init({"params": key}, jnp.ones(shape), jnp.ones((1,)))["params"]
    return {"params": params, "opt_state": tx.init(params)}


def make_train_step(cfg: DDPMConfig, model: Unet, tx: optax.GradientTransformation):
    """``train_step(state, batch, rng) -> (state, loss)``: the repository's ``p_loss`` without pmap."""
    schedule, loss_fn = ddpm_params(cfg), LOSSES[cfg.loss_type]

    def train_step(state, batch, rng):
        tables = {k: jnp.asarray(v) for k, v in schedule.items()}
        x = batch["image"]
        t_rng, noise_rng = jax.random.split(rng)
        t = jax.random.randint(t_rng, (x.shape[0],), 0, cfg.timesteps, dtype=jnp.int32)
        noise = jax.random.normal(noise_rng, x.shape)
        x_t = q_sample(x, t, noise, tables)

        def compute_loss(params):
            pred = model.apply({"params": params}, x_t, t)
            loss = loss_fn(pred.reshape(pred.shape[0], -1), noise.reshape(noise.shape[0], -1)).mean(axis=1)
            return (loss * tables["p2_loss_weight"][t]).mean()

        loss, grads = jax.value_and_grad(compute_loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return train_step


def abstract_parts(cfg: DDPMConfig, tx: optax.GradientTransformation | None = None):
    """``(train_step, (state, batch, rng))`` as ``jax.ShapeDtypeStruct``s, for planning without allocating."""
    model, tx = cfg.build(), tx or optax.adam(1e-3, b1=0.9, b2=0.99, eps=1e-8)  # the config's optimizer
    state = jax.eval_shape(lambda: init_state(cfg, model, tx, jax.random.key(0)))
    batch = jax.eval_shape(lambda: make_batch(cfg, jax.random.key(0)))
    rng = jax.eval_shape(lambda: jax.random.key(0))
    return make_train_step(cfg, model, tx), (state, batch, rng)
