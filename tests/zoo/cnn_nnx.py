"""A small CNN in flax nnx with BatchNorm and Dropout, trained in place as the nnx MNIST tutorial does.

``train_step(model, optimizer, batch)`` must update, in place, the parameters, BatchNorm's running
statistics (``nnx.BatchStat``), the dropout stream's counter and ``optimizer.step``.
"""

from __future__ import annotations

from functools import partial

import jax
import optax
from flax import nnx

from tests.zoo import ADAM_EPS, NnxCase


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, classes: int = 10):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, classes, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.bn1(self.conv1(x))))
        x = self.avg_pool(nnx.relu(self.bn2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def train_step(model: CNN, optimizer: nnx.Optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def make_objects():
    model = CNN(rngs=nnx.Rngs(params=0, dropout=1))
    model.train()  # BatchNorm on batch statistics, dropout on
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, eps=ADAM_EPS), wrt=nnx.Param)
    return model, optimizer


def make_batch(batch: int = 8):
    k1, k2 = jax.random.split(jax.random.key(71))
    return {"image": jax.random.normal(k1, (batch, 16, 16, 1)),
            "label": jax.random.randint(k2, (batch,), 0, 10)}


def rng_streams(model: CNN):
    return [stream for _, stream in nnx.iter_graph(model) if isinstance(stream, nnx.RngStream)]


def batch_stats(model: CNN):
    return nnx.state(model, nnx.BatchStat)


def case() -> NnxCase:
    return NnxCase("cnn_nnx", make_objects, make_batch, train_step, rng_streams)



