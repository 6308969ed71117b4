"""flax's nnx MiniGPT tutorial, with its Explicit-mesh annotations, as the tutorial writes it.

The model is built under ``jax.set_mesh`` of an Explicit ``("batch", "model")`` mesh: its kernels,
biases, embeddings and LayerNorm scales carry ``nnx.with_partitioning`` layouts (created sharded), and
``MiniGPT.__call__`` ends in ``reshard(logits, jax.typeof(inputs).sharding)``. The step is the
tutorial's in-place ``train_step(model, optimizer, batch)`` with ``nnx.value_and_grad`` and
``optimizer.update(model, grads)``. Small sizes (vocabulary 64, width 32, 2 blocks, sequence 16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def explicit_mesh():
    """The tutorial's mesh: ``("batch", "model")`` with Explicit axes over the 8 devices."""
    return jax.make_mesh((4, 2), ("batch", "model"), axis_types=(AxisType.Explicit,) * 2)


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


def _sharded(init, *spec):
    return nnx.with_partitioning(init, P(*spec))


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        xavier, zeros, ones = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init(), nnx.initializers.ones_init()
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                          kernel_init=_sharded(xavier, None, "model"),
                                          bias_init=_sharded(zeros, "model"), decode=False, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, scale_init=_sharded(ones, "model"),
                                         bias_init=_sharded(zeros, "model"), rngs=rngs)
        self.linear1 = nnx.Linear(embed_dim, ff_dim, kernel_init=_sharded(xavier, None, "model"),
                                  bias_init=_sharded(zeros, "model"), rngs=rngs)
        self.linear2 = nnx.Linear(ff_dim, embed_dim, kernel_init=_sharded(xavier, None, "model"),
                                  bias_init=_sharded(zeros, "model"), rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate)
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, scale_init=_sharded(ones, None),
                                         bias_init=_sharded(zeros, None), rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        _, seq_len, _ = inputs.shape
        mask = causal_attention_mask(seq_len)
        attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
        attention_output = self.dropout1(attention_output, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
        ffn_output = self.dropout2(ffn_output, deterministic=not training)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        init = _sharded(nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0), None, "model")
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, embedding_init=init, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, embedding_init=init, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb(x, out_sharding=P("batch", None, "model")) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int,
                 num_transformer_blocks: int, *, rngs: nnx.Rngs):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List([TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                                            for _ in range(num_transformer_blocks)])
        self.output_layer = nnx.Linear(embed_dim, vocab_size,
                                       kernel_init=_sharded(nnx.initializers.xavier_uniform(), None, "model"),
                                       bias_init=_sharded(nnx.initializers.zeros_init(), "model"), rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        x = self.embedding_layer(inputs)
        for block in self.transformer_blocks:
            x = block(x, training=training)
        return jax.sharding.reshard(self.output_layer(x), jax.typeof(inputs).sharding)


def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def train_step(model: MiniGPT, optimizer: nnx.Optimizer, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, _logits), grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss


@dataclasses.dataclass(frozen=True)
class Case:
    maxlen: int = 16
    vocab_size: int = 64
    embed_dim: int = 32
    num_heads: int = 4
    ff_dim: int = 64
    blocks: int = 2
    batch: int = 8

    train_step = staticmethod(train_step)

    def make_objects(self):
        """The model and its optimizer, built under the tutorial's Explicit mesh (layouts as annotated)."""
        with jax.set_mesh(explicit_mesh()):
            model = MiniGPT(self.maxlen, self.vocab_size, self.embed_dim, self.num_heads, self.ff_dim, self.blocks,
                            rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return model, optimizer

    def make_batch(self):
        """Token ids and their next-token targets, placed on the mesh's ``batch`` axis as the tutorial does."""
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, self.vocab_size, (self.batch, self.maxlen + 1)).astype(np.int32)
        sharding = jax.sharding.NamedSharding(explicit_mesh(), P("batch", None))
        return (jax.device_put(tokens[:, :-1], sharding), jax.device_put(tokens[:, 1:], sharding))


def case() -> Case:
    return Case()
