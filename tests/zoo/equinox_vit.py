"""A Vision Transformer and a BatchNorm MLP in Equinox, written as Equinox's own examples write them.

The ViT follows Equinox's "Vision Transformer" example: patches cut with ``einops`` and embedded by an
``eqx.nn.Linear``, a class token and position embedding, pre-norm blocks of ``eqx.nn.MultiheadAttention``
and a GELU MLP with ``eqx.nn.Dropout`` (a PRNG key per example), and Python int fields (``patch_size``,
``num_layers``) that shape the computation. Its train step takes the optax optimizer (a
``GradientTransformation``: a NamedTuple of functions) as an argument, differentiates with
``eqx.filter_value_and_grad``, applies ``optax.adamw`` with ``eqx.apply_updates`` and returns
``(model, opt_state, loss)``.

The second case follows Equinox's "stateful" example: ``eqx.nn.BatchNorm`` built with
``eqx.nn.make_with_state``, the ``eqx.nn.State`` threaded through a ``jax.vmap`` over a named batch axis.

Each case is an :class:`EquinoxCase`; ``tests/test_equinox.py`` runs it under ``autoshard.parallelize``
and compares it with ``eqx.filter_jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from tests.zoo import ADAM_EPS

BATCH = 8


@dataclass(frozen=True)
class EquinoxCase:
    """``train_step(*arguments(carry, i)) -> (*carry, loss)``: the step's first outputs are the next
    ``carry`` (the model, its state, the optimizer state), the last its loss."""

    name: str
    init: Callable[[], tuple]
    arguments: Callable[[tuple, int], tuple]
    train_step: Callable[..., Any]


# ---- ViT ---------------------------------------------------------------------------------------------


class PatchEmbedding(eqx.Module):
    linear: eqx.nn.Linear
    patch_size: int

    def __init__(self, input_channels: int, output_shape: int, patch_size: int, key):
        self.patch_size = patch_size
        self.linear = eqx.nn.Linear(patch_size**2 * input_channels, output_shape, key=key)

    def __call__(self, x):
        x = einops.rearrange(x, "c (h ph) (w pw) -> (h w) (c ph pw)", ph=self.patch_size, pw=self.patch_size)
        return jax.vmap(self.linear)(x)


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, input_shape: int, hidden_dim: int, num_heads: int, dropout_rate: float, key):
        key1, key2, key3 = jr.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
        self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
        self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)
        self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
        self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x, enable_dropout: bool, key):
        input_x = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(input_x, input_x, input_x)
        input_x = jax.vmap(self.layer_norm2)(x)
        input_x = jax.nn.gelu(jax.vmap(self.linear1)(input_x))
        key1, key2 = jr.split(key, num=2)
        input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
        input_x = jax.vmap(self.linear2)(input_x)
        input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)
        return x + input_x


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: jax.Array
    cls_token: jax.Array
    attention_blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    mlp: eqx.nn.Sequential
    num_layers: int

    def __init__(self, embedding_dim: int, channels: int, hidden_dim: int, num_heads: int, num_layers: int,
                 dropout_rate: float, patch_size: int, num_patches: int, num_classes: int, key):
        key1, key2, key3, key4, key5 = jr.split(key, 5)
        self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)
        self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))
        self.cls_token = jr.normal(key3, (1, embedding_dim))
        self.num_layers = num_layers
        self.attention_blocks = [AttentionBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, k)
                                 for k in jr.split(key4, num_layers)]
        self.dropout = eqx.nn.Dropout(dropout_rate)
        self.mlp = eqx.nn.Sequential([eqx.nn.LayerNorm(embedding_dim),
                                      eqx.nn.Linear(embedding_dim, num_classes, key=key5)])

    def __call__(self, x, enable_dropout: bool, key):
        x = self.patch_embedding(x)
        x = jnp.concatenate((self.cls_token, x), axis=0)
        x += self.positional_embedding[: x.shape[0]]
        dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)
        x = self.dropout(x, inference=not enable_dropout, key=dropout_key)
        for block, attention_key in zip(self.attention_blocks, attention_keys, strict=True):
            x = block(x, enable_dropout, key=attention_key)
        return self.mlp(x[0])


def vit_loss(model, images, labels, keys):
    logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, keys)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def vit_step(model, optimizer, opt_state, images, labels, keys):
    loss, grads = eqx.filter_value_and_grad(vit_loss)(model, images, labels, keys)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def vit_case() -> EquinoxCase:
    image, channels, patch, classes = 16, 3, 4, 10
    optimizer = optax.adamw(1e-3, eps=ADAM_EPS, weight_decay=1e-4)
    k_images, k_labels = jr.split(jr.PRNGKey(21))
    images = jr.normal(k_images, (BATCH, channels, image, image))
    labels = jr.randint(k_labels, (BATCH,), 0, classes)

    def init():
        model = VisionTransformer(embedding_dim=32, channels=channels, hidden_dim=64, num_heads=4, num_layers=2,
                                  dropout_rate=0.1, patch_size=patch, num_patches=(image // patch) ** 2,
                                  num_classes=classes, key=jr.PRNGKey(0))
        return model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    def arguments(carry, i):
        model, opt_state = carry
        return model, optimizer, opt_state, images, labels, jr.split(jr.PRNGKey(100 + i), BATCH)

    return EquinoxCase("vit", init, arguments, vit_step)


# ---- BatchNorm with eqx.nn.State ---------------------------------------------------------------------


class BatchNormMLP(eqx.Module):
    norm: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2 = jr.split(key)
        self.norm = eqx.nn.BatchNorm(input_size=8, axis_name="batch", mode="ema")
        self.linear1 = eqx.nn.Linear(8, 32, key=key1)
        self.linear2 = eqx.nn.Linear(32, 4, key=key2)

    def __call__(self, x, state):
        x, state = self.norm(x, state)
        x = jax.nn.relu(self.linear1(x))
        return self.linear2(x), state


def batchnorm_loss(model, state, xs, ys):
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred_ys, state = batch_model(xs, state)
    return jnp.mean((pred_ys - ys) ** 2), state


BATCHNORM_OPTIMIZER = optax.adam(1e-2, eps=ADAM_EPS)


def batchnorm_step(model, state, opt_state, xs, ys):
    (loss, state), grads = eqx.filter_value_and_grad(batchnorm_loss, has_aux=True)(model, state, xs, ys)
    updates, opt_state = BATCHNORM_OPTIMIZER.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state, loss


def batchnorm_case() -> EquinoxCase:
    k_x, k_y = jr.split(jr.PRNGKey(7))
    xs, ys = jr.normal(k_x, (BATCH, 8)), jr.normal(k_y, (BATCH, 4))

    def init():
        model, state = eqx.nn.make_with_state(BatchNormMLP)(jr.PRNGKey(1))
        return model, state, BATCHNORM_OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))

    def arguments(carry, i):
        return (*carry, xs, ys)

    return EquinoxCase("batchnorm", init, arguments, batchnorm_step)
