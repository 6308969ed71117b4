"""Graph networks on padded molecule batches, as flax's ogbg_molpcba example writes them.

Two linen models over a ``GraphsTuple`` (jraph's layout, written here without jraph): ``GraphNet``
(edge, node and global MLPs with skip connections and LayerNorm, as jraph's ``GraphNetwork``) and
``GraphConvNet`` (jraph's ``GraphConvolution`` with self edges and symmetric normalisation, then
mean pooling per graph). Messages are gathered with ``nodes[senders]`` and summed into their
receivers with ``jax.ops.segment_sum``; per-graph features are broadcast to nodes and edges with
``jnp.repeat(..., total_repeat_length=...)``. A batch holds 31 molecules and the padding graph that
jraph's ``pad_with_graphs`` appends (the rest of the node and edge budget, its edges on its own
first node); the labels ride in its ``globals``, as the example's input pipeline puts them. The loss
is the example's binary cross entropy over 128 tasks, masked where a label is NaN (unlabelled) and on
the padding graph; dropout draws from a key passed into the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


class GraphsTuple(NamedTuple):
    """jraph's batch of graphs: nodes and edges of every graph concatenated, ``n_node``/``n_edge`` per graph."""

    nodes: jax.Array  # [sum_n_node, F]
    edges: jax.Array  # [sum_n_edge, E]
    receivers: jax.Array  # int32[sum_n_edge]
    senders: jax.Array  # int32[sum_n_edge]
    globals: jax.Array  # [n_graph, G]
    n_node: jax.Array  # int32[n_graph]
    n_edge: jax.Array  # int32[n_graph]


# ---- graph ops, as jraph writes them ----------------------------------------------------------------


def segment_mean(data, segment_ids, num_segments):
    total = jax.ops.segment_sum(data, segment_ids, num_segments)
    count = jax.ops.segment_sum(jnp.ones_like(data), segment_ids, num_segments)
    return total / jnp.maximum(count, 1.0)


def concatenated_args(fn: Callable) -> Callable:
    """jraph's decorator: an update function that sees its arguments concatenated on the last axis."""
    return lambda *args: fn(jnp.concatenate(args, axis=-1))


def map_features(graphs: GraphsTuple, *, node_fn=None, edge_fn=None, global_fn=None) -> GraphsTuple:
    """jraph's ``GraphMapFeatures``: each feature field through its own function, topology untouched."""
    return graphs._replace(
        nodes=graphs.nodes if node_fn is None else node_fn(graphs.nodes),
        edges=graphs.edges if edge_fn is None else edge_fn(graphs.edges),
        globals=graphs.globals if global_fn is None else global_fn(graphs.globals))


def graph_index(counts, total: int):
    """For each of ``total`` nodes (edges), the graph it belongs to: ``[1, 2] -> [0, 1, 1]``."""
    return jnp.repeat(jnp.arange(counts.shape[0]), counts, axis=0, total_repeat_length=total)


def graph_network(graphs: GraphsTuple, *, update_edge_fn, update_node_fn, update_global_fn) -> GraphsTuple:
    """jraph's ``GraphNetwork`` with sum aggregation (Battaglia et al. 2018, Algorithm 1)."""
    nodes, edges, receivers, senders, globals_, n_node, n_edge = graphs
    sum_n_node, sum_n_edge = nodes.shape[0], senders.shape[0]
    if update_edge_fn is not None:
        edge_globals = jnp.repeat(globals_, n_edge, axis=0, total_repeat_length=sum_n_edge)
        edges = update_edge_fn(edges, nodes[senders], nodes[receivers], edge_globals)
    sent = jax.ops.segment_sum(edges, senders, sum_n_node)
    received = jax.ops.segment_sum(edges, receivers, sum_n_node)
    node_globals = jnp.repeat(globals_, n_node, axis=0, total_repeat_length=sum_n_node)
    nodes = update_node_fn(nodes, sent, received, node_globals)
    n_graph = n_node.shape[0]
    node_sum = jax.ops.segment_sum(nodes, graph_index(n_node, sum_n_node), n_graph)
    edge_sum = jax.ops.segment_sum(edges, graph_index(n_edge, sum_n_edge), n_graph)
    globals_ = update_global_fn(node_sum, edge_sum, globals_)
    return graphs._replace(nodes=nodes, edges=edges, globals=globals_)


def graph_convolution(graphs: GraphsTuple, *, update_node_fn) -> GraphsTuple:
    """jraph's ``GraphConvolution`` (Kipf & Welling 2017) with self edges and symmetric normalisation."""
    nodes = update_node_fn(graphs.nodes)
    total = nodes.shape[0]
    senders = jnp.concatenate([graphs.senders, jnp.arange(total)])
    receivers = jnp.concatenate([graphs.receivers, jnp.arange(total)])
    degree = partial(jax.ops.segment_sum, jnp.ones_like(senders), num_segments=total)
    nodes = nodes * jax.lax.rsqrt(jnp.maximum(degree(senders), 1.0))[:, None]
    nodes = jax.ops.segment_sum(nodes[senders], receivers, total)
    nodes = nodes * jax.lax.rsqrt(jnp.maximum(degree(receivers), 1.0))[:, None]
    return graphs._replace(nodes=nodes)


def add_graphs_tuples(graphs: GraphsTuple, other: GraphsTuple) -> GraphsTuple:
    return graphs._replace(nodes=graphs.nodes + other.nodes, edges=graphs.edges + other.edges,
                           globals=graphs.globals + other.globals)


# ---- the models (flax examples/ogbg_molpcba/models.py) ------------------------------------------------


class MLP(nn.Module):
    feature_sizes: Sequence[int]
    dropout_rate: float = 0.0
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        for size in self.feature_sizes:
            x = nn.relu(nn.Dense(size)(x))
            x = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(x)
        return x


class GraphNet(nn.Module):
    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int
    dropout_rate: float = 0.0
    deterministic: bool = True

    @nn.compact
    def __call__(self, graphs: GraphsTuple) -> GraphsTuple:
        graphs = map_features(graphs, node_fn=nn.Dense(self.latent_size), edge_fn=nn.Dense(self.latent_size),
                              global_fn=nn.Dense(self.latent_size))
        mlp = partial(MLP, [self.latent_size] * self.num_mlp_layers, self.dropout_rate, self.deterministic)
        for _ in range(self.message_passing_steps):
            updated = graph_network(graphs, update_edge_fn=concatenated_args(mlp()),
                                    update_node_fn=concatenated_args(mlp()),
                                    update_global_fn=concatenated_args(mlp()))
            graphs = add_graphs_tuples(updated, graphs)
            graphs = map_features(graphs, node_fn=nn.LayerNorm(), edge_fn=nn.LayerNorm(), global_fn=nn.LayerNorm())
        return map_features(graphs, global_fn=nn.Dense(self.output_globals_size))


class GraphConvNet(nn.Module):
    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int
    dropout_rate: float = 0.0
    deterministic: bool = True

    @nn.compact
    def __call__(self, graphs: GraphsTuple) -> GraphsTuple:
        graphs = map_features(graphs, node_fn=nn.Dense(self.latent_size))
        for _ in range(self.message_passing_steps):
            mlp = MLP([self.latent_size] * self.num_mlp_layers, self.dropout_rate, self.deterministic)
            graphs = add_graphs_tuples(graph_convolution(graphs, update_node_fn=concatenated_args(mlp)), graphs)
            graphs = graphs._replace(nodes=nn.LayerNorm()(graphs.nodes))
        n_graph = graphs.n_node.shape[0]
        pooled = segment_mean(graphs.nodes, graph_index(graphs.n_node, graphs.nodes.shape[0]), n_graph)
        return map_features(graphs._replace(globals=pooled), global_fn=nn.Dense(self.output_globals_size))


MODELS = {"graph_net": GraphNet, "gcn": GraphConvNet}


@dataclass(frozen=True)
class GNNConfig:
    model: str = "graph_net"
    # Wide and many enough that the plan on (2, 4) splits the kernels on `model` and the edges on `data`
    # (at width 32 and 7 molecules it replicates everything).
    latent_size: int = 128
    num_mlp_layers: int = 2
    message_passing_steps: int = 2
    num_tasks: int = 128  # ogbg-molpcba's binary tasks
    dropout_rate: float = 0.1
    node_features: int = 9  # ogbg-molpcba's atom and bond features
    edge_features: int = 3
    graphs: int = 31  # molecules; the padding graph makes n_graph 32
    max_nodes: int = 256  # the padded node and edge budgets
    max_edges: int = 512
    labelled: float = 0.7  # the fraction of (molecule, task) labels that are not NaN

    def build(self, *, deterministic: bool) -> nn.Module:
        return MODELS[self.model](self.latent_size, self.num_mlp_layers, self.message_passing_steps,
                                  self.num_tasks, self.dropout_rate, deterministic)


CFG = GNNConfig()


def make_batch(cfg: GNNConfig = CFG) -> GraphsTuple:
    """Small random molecules (a chain plus a ring bond, undirected), padded as jraph's ``pad_with_graphs``
    pads them; as in the example's input pipeline, ``globals`` holds the labels [n_graph, tasks], NaN where
    a molecule is unlabelled for a task."""
    rng = np.random.default_rng(17)
    n_node, senders, receivers = [], [], []
    for _ in range(cfg.graphs):
        n, first = int(rng.integers(4, 8)), sum(n_node)
        bonds = [(i, i + 1) for i in range(n - 1)] + [(0, int(rng.integers(2, n)))]
        senders += [first + a for a, b in bonds] + [first + b for a, b in bonds]
        receivers += [first + b for a, b in bonds] + [first + a for a, b in bonds]
        n_node.append(n)
    n_edge = [2 * (n - 1) + 2 for n in n_node]  # each bond in both directions
    pad_nodes, pad_edges = cfg.max_nodes - sum(n_node), cfg.max_edges - len(senders)
    assert pad_nodes > 0 and pad_edges >= 0, (sum(n_node), len(senders))
    # The padding graph: the rest of the budgets, every padding edge on the first padding node.
    senders += [sum(n_node)] * pad_edges
    receivers += [sum(n_node)] * pad_edges
    n_node.append(pad_nodes)
    n_edge.append(pad_edges)
    n_graph = cfg.graphs + 1
    labels = rng.integers(0, 2, (n_graph, cfg.num_tasks)).astype(np.float32)
    labels[rng.random(labels.shape) > cfg.labelled] = np.nan
    return GraphsTuple(
        nodes=jnp.asarray(rng.normal(size=(cfg.max_nodes, cfg.node_features)), jnp.float32),
        edges=jnp.asarray(rng.normal(size=(cfg.max_edges, cfg.edge_features)), jnp.float32),
        receivers=jnp.asarray(receivers, jnp.int32), senders=jnp.asarray(senders, jnp.int32),
        globals=jnp.asarray(labels), n_node=jnp.asarray(n_node, jnp.int32), n_edge=jnp.asarray(n_edge, jnp.int32))


def replace_globals(graphs: GraphsTuple) -> GraphsTuple:
    """A constant global feature per graph: the task is graph classification."""
    return graphs._replace(globals=jnp.ones([graphs.n_node.shape[0], 1]))


def graph_padding_mask(graphs: GraphsTuple):
    """jraph's ``get_graph_padding_mask``: every graph but the last, which ``pad_with_graphs`` added."""
    n_graph = graphs.n_node.shape[0]
    return jnp.arange(n_graph) < n_graph - 1


def binary_cross_entropy_with_mask(*, logits, labels, mask):
    """The example's BCE on logits (as tf.nn.sigmoid_cross_entropy_with_logits); NaN labels masked first."""
    labels = jnp.where(mask, labels, -1)
    positive = logits >= 0
    relu_logits = jnp.where(positive, logits, 0)
    abs_logits = jnp.where(positive, logits, -logits)
    return relu_logits - logits * labels + jnp.log(1 + jnp.exp(-abs_logits))


def case(cfg: GNNConfig = CFG) -> FunctionalCase:
    tx = optax.adam(1e-3, eps=ADAM_EPS)
    model = cfg.build(deterministic=False)

    def init_state():
        graphs = make_batch(cfg)
        params = cfg.build(deterministic=True).init(jax.random.key(0), replace_globals(graphs))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def train_step(state, graphs: GraphsTuple, dropout_key):
        labels = graphs.globals
        graphs = replace_globals(graphs)
        mask = ~jnp.isnan(labels) & graph_padding_mask(graphs)[:, None]

        def loss_fn(params):
            logits = model.apply({"params": params}, graphs, rngs={"dropout": dropout_key}).globals
            loss = binary_cross_entropy_with_mask(logits=logits, labels=labels, mask=mask)
            return jnp.sum(jnp.where(mask, loss, 0)) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    def dropout_key(step: int):
        return jax.random.fold_in(jax.random.key(23), step)

    return FunctionalCase(f"gnn_{cfg.model}", init_state, lambda: make_batch(cfg), train_step,
                          lambda i: (dropout_key(i),))
