"""Read IOPDDL contest problems (JSON, optionally gzip) into :class:`ShardingProblem`.

The format::

    {"problem": {"name": ...,
                 "nodes": {"costs": [[...], ...], "usages": [[...], ...],
                           "intervals": [[start, end], ...]},
                 "edges": {"nodes": [[u, v], ...], "costs": [[row-major |S_u|*|S_v|], ...]},
                 "usage_limit": L}}

The contest writes "infinite" costs as a huge finite number (1e18); costs at or
above ``inf_cost`` become ``inf`` so that the solver treats them as forbidden.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os

import numpy as np

from autoshard.errors import ProblemFormatError
from autoshard.solver.problem import ShardingProblem

CONTEST_INFINITY = 1e18


def read_iopddl(path: str | os.PathLike, *, inf_cost: float = CONTEST_INFINITY) -> ShardingProblem:
    """Read a contest problem file (``.json`` or ``.json.gz``).

    Args:
      path: the file.
      inf_cost: costs at or above this become ``inf`` (forbidden).

    Raises:
      ProblemFormatError: the file is not JSON, or a field is missing or malformed;
        the message names the field (e.g. ``problem.nodes.costs[3]``).
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        data = _loads(raw)
    except (ValueError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        # json.JSONDecodeError and orjson.JSONDecodeError are both ValueErrors
        raise ProblemFormatError(f"{path}: not a JSON problem file ({e})") from e
    return parse_iopddl(data, inf_cost=inf_cost, source=path)


def _loads(raw: bytes):
    """Decode JSON with orjson when installed (about 3x faster on the contest files)."""
    try:
        import orjson
    except ImportError:
        return json.loads(raw)
    return orjson.loads(raw)


def parse_iopddl(data, *, inf_cost: float = CONTEST_INFINITY, source: str = "<problem>") -> ShardingProblem:
    """Build a problem from the already-decoded JSON of a contest file."""
    prob = _field(data, "problem", "", source)
    nodes = _field(prob, "nodes", "problem", source)
    edges = _field(prob, "edges", "problem", source)
    costs = _list(_field(nodes, "costs", "problem.nodes", source), "problem.nodes.costs", source)
    n = len(costs)
    node_costs = _vectors(costs, "problem.nodes.costs", source, inf_cost)
    for i, c in enumerate(node_costs):
        if c.size == 0:
            raise ProblemFormatError(f"{source}: problem.nodes.costs[{i}] is empty; every node needs a strategy")

    node_memory = intervals = limit = None
    if "usages" in nodes or "intervals" in nodes or "usage_limit" in prob:
        usages = _list(_field(nodes, "usages", "problem.nodes", source), "problem.nodes.usages", source)
        ivs = _list(_field(nodes, "intervals", "problem.nodes", source), "problem.nodes.intervals", source)
        for name, seq in (("usages", usages), ("intervals", ivs)):
            if len(seq) != n:
                raise ProblemFormatError(f"{source}: problem.nodes.{name} has {len(seq)} entries for {n} nodes")
        node_memory = _vectors(usages, "problem.nodes.usages", source)
        for i, (u, c) in enumerate(zip(node_memory, node_costs, strict=True)):
            if u.size != c.size:
                raise ProblemFormatError(
                    f"{source}: problem.nodes.usages[{i}] has {u.size} entries for {c.size} strategies"
                )
        try:
            intervals = np.asarray(ivs, dtype=np.int64).reshape(n, 2)
        except (TypeError, ValueError) as e:
            raise ProblemFormatError(f"{source}: problem.nodes.intervals must be [start, end] pairs ({e})") from e
        limit = prob.get("usage_limit")
        if limit is not None and not isinstance(limit, (int, float)):
            raise ProblemFormatError(f"{source}: problem.usage_limit must be a number, got {limit!r}")

    pairs = _list(_field(edges, "nodes", "problem.edges", source), "problem.edges.nodes", source)
    mats = _list(_field(edges, "costs", "problem.edges", source), "problem.edges.costs", source)
    if len(pairs) != len(mats):
        raise ProblemFormatError(
            f"{source}: problem.edges.nodes has {len(pairs)} entries but problem.edges.costs has {len(mats)}"
        )
    try:
        edge_arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    except (TypeError, ValueError) as e:
        raise ProblemFormatError(f"{source}: problem.edges.nodes must be [u, v] pairs ({e})") from e
    if len(edge_arr) and (edge_arr.min() < 0 or edge_arr.max() >= n):
        k = int(np.flatnonzero((edge_arr < 0).any(1) | (edge_arr >= n).any(1))[0])
        raise ProblemFormatError(f"{source}: problem.edges.nodes[{k}] = {pairs[k]} names a node outside [0, {n})")
    edge_costs = []
    sizes = np.array([c.size for c in node_costs], dtype=np.int64)
    for k, (u, v, vec) in enumerate(
        zip(edge_arr[:, 0].tolist(), edge_arr[:, 1].tolist(), _vectors(mats, "problem.edges.costs", source, inf_cost), strict=True)
    ):
        su, sv = int(sizes[u]), int(sizes[v])
        if vec.size != su * sv:
            raise ProblemFormatError(
                f"{source}: problem.edges.costs[{k}] has {vec.size} entries; edge {u}->{v} needs {su}*{sv}"
            )
        edge_costs.append(vec.reshape(su, sv))
    return ShardingProblem(
        node_costs=node_costs,
        edges=edge_arr,
        edge_costs=tuple(edge_costs),
        node_memory=node_memory,
        intervals=intervals,
        memory_limit=None if limit is None else float(limit),
    )


def _field(obj, key: str, where: str, source: str):
    path = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        raise ProblemFormatError(f"{source}: {where or 'the top level'} must be an object with a {key!r} field")
    if key not in obj:
        raise ProblemFormatError(f"{source}: missing field {path}")
    return obj[key]


def _list(obj, path: str, source: str) -> list:
    if not isinstance(obj, list):
        raise ProblemFormatError(f"{source}: {path} must be a list, got {type(obj).__name__}")
    return obj


def _vectors(seq: list, path: str, source: str, inf_cost: float | None = None) -> tuple[np.ndarray, ...]:
    """``_vector`` of every item of ``seq``, converted in one pass when all are flat number lists."""
    try:
        lengths = np.fromiter(map(len, seq), dtype=np.int64, count=len(seq))
        flat = np.fromiter(itertools.chain.from_iterable(seq), dtype=np.float64, count=int(lengths.sum()))
    except (TypeError, ValueError):
        # something is malformed: convert one by one to name the offending item
        return tuple(_vector(x, f"{path}[{i}]", source, inf_cost) for i, x in enumerate(seq))
    if not all(isinstance(x, list) for x in seq):
        return tuple(_vector(x, f"{path}[{i}]", source, inf_cost) for i, x in enumerate(seq))
    if inf_cost is not None:
        flat[flat >= inf_cost] = np.inf
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    return tuple(flat[a:b] for a, b in zip(starts, ends, strict=True))


def _vector(obj, path: str, source: str, inf_cost: float | None = None) -> np.ndarray:
    if not isinstance(obj, list):
        raise ProblemFormatError(f"{source}: {path} must be a list of numbers, got {type(obj).__name__}")
    try:
        vec = np.asarray(obj, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ProblemFormatError(f"{source}: {path} must be a list of numbers ({e})") from e
    if vec.size != len(obj):
        raise ProblemFormatError(f"{source}: {path} must be a flat list of numbers")
    if inf_cost is not None:
        vec[vec >= inf_cost] = np.inf
    return vec
