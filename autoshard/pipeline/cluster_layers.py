"""Layer clustering: cut the forward pass into ``L`` layers of balanced flops and little traffic.

Alpa (§5.2) clusters the forward ops into layers with a DP over contiguous op ranges. Here the
forward ops are taken in program order; the traffic of a cut is the bytes of forward values made
before it and read after it. Among the cuts whose every layer stays within ``(1 + δ)`` of the
balanced layer flops, the DP picks the cheapest in total traffic; δ grows until a cut exists.

The balanced layer flops are the mean, or, when one op alone outweighs the mean (a 4× wider
matmul), the least achievable maximum: measured against the mean, such a model only fits at a
large δ, and the traffic-only DP would then pile the narrow ops into one layer and leave others
nearly empty, which no stage cut can balance later. Cuts of equal traffic (every cut of an MLP
carries one activation) are told apart by a small penalty on uneven layers.
"""

from __future__ import annotations

import math

import numpy as np

from autoshard.capture import Op
from autoshard.pipeline.boundary import BOUNDARY
from autoshard.strategies import op_flops as op_flops  # the registry's flop count (OpInfo.flops)

BALANCE_TOLERANCES = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, math.inf)
MAX_CANDIDATES = 400


def _size(aval) -> float:
    return float(math.prod(getattr(aval, "shape", ())))


def _nbytes(aval) -> float:
    return _size(aval) * aval.dtype.itemsize


def cut_traffic(ops: list[Op], avals) -> np.ndarray:
    """``t[i]``: bytes of values made by ``ops[:i]`` and read by ``ops[i:]`` (``len(ops) + 1`` entries)."""
    n = len(ops)
    made = {v: i for i, op in enumerate(ops) for v in op.outputs}
    last = {}
    for i, op in enumerate(ops):
        for x in op.inputs:
            if isinstance(x, int) and x in made:
                last[x] = i
    diff = np.zeros(n + 2)
    for v, j in last.items():
        i = made[v]
        if j > i:  # live over cuts i+1 .. j
            diff[i + 1] += _nbytes(avals[v])
            diff[j + 1] -= _nbytes(avals[v])
    return np.cumsum(diff)[: n + 1]


def boundary_layers(ops: list[Op]) -> list[int] | None:
    """Cut indices (into ``ops``) at each run of ``pipeline_boundary`` ops, or None if there are none."""
    cuts, prev = [], False
    for i, op in enumerate(ops):
        is_b = op.name == BOUNDARY
        if is_b and not prev:
            cuts.append(i)
        prev = is_b
    return cuts or None


def cluster_layers(ops: list[Op], avals, num_layers: int) -> list[int]:
    """Cut ``ops`` (the forward pass, in order) into ``num_layers`` contiguous layers.

    Returns:
      the ``num_layers - 1`` cut indices: layer ``l`` is ``ops[cuts[l-1]:cuts[l]]``.
    """
    n = len(ops)
    L = max(1, min(num_layers, n))
    if L == 1:
        return []
    flops = np.array([op_flops(op, avals) for op in ops])
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    traffic = cut_traffic(ops, avals)
    cand = _aligned_to_repeats(np.arange(1, n), ops, avals, traffic)
    if len(cand) > MAX_CANDIDATES:
        # Keep the cheapest cuts near every flops quantile, so a balanced cut is always reachable.
        keep = set()
        for q in np.linspace(0, prefix[-1], MAX_CANDIDATES // 4 + 2)[1:-1]:
            centre = int(np.searchsorted(prefix, q))
            lo, hi = max(1, centre - 2 * n // MAX_CANDIDATES), min(n - 1, centre + 2 * n // MAX_CANDIDATES)
            window = cand[(cand >= lo) & (cand <= hi)]
            keep.update(window[np.argsort(traffic[window], kind="stable")[:4]].tolist())
        cand = np.array(sorted(keep))
    points = np.concatenate([[0], cand, [n]])
    target = max(prefix[-1] / L, _least_max(points, prefix, L))
    for tol in BALANCE_TOLERANCES:
        cuts = _dp(points, prefix, traffic, L, cap=target * (1 + tol) if math.isfinite(tol) else math.inf,
                   target=target)
        if cuts is not None:
            return cuts
    return [round(i * n / L) for i in range(1, L)]


MIN_REPEATS = 3
"""A run of ops counts as a repeated block once it occurs this many times in a row."""


def _token(op: Op, avals) -> tuple:
    return (op.name, tuple((tuple(getattr(avals[v], "shape", ())), str(getattr(avals[v], "dtype", "")))
                           for v in op.outputs))


def repeat_period(ops: list[Op], avals) -> tuple[int, int, int] | None:
    """``(period, first, end)`` of the longest run of a repeated block in ``ops`` (the transformer layers of a
    model written as a loop), or None: ``ops[i]`` and ``ops[i + period]`` do the same (same primitive,
    same output shapes) for every ``first <= i < end - period``."""
    ids: dict = {}
    tok = np.array([ids.setdefault(_token(op, avals), len(ids)) for op in ops])
    n, best = len(tok), None
    for p in range(1, n // MIN_REPEATS + 1):
        same = np.concatenate([tok[:-p] == tok[p:], [False]])
        # the longest run of matches: ops[i] == ops[i + p] for i in [a, b)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])))
        if not len(edges):
            continue
        starts, stops = edges[::2], edges[1::2]
        k = int(np.argmax(stops - starts))
        a, b = int(starts[k]), int(stops[k])
        if b - a >= (MIN_REPEATS - 1) * p and (best is None or b - a > best[2] - best[1] - best[0]):
            best = (p, a, b + p)
    return best


def _aligned_to_repeats(cand: np.ndarray, ops: list[Op], avals, traffic: np.ndarray) -> np.ndarray:
    """Inside a repeated block's run, keep only the cuts at one place of the block (the one of least
    traffic): every layer made of whole blocks is then the same program, planned once (search.py's
    fingerprints), and cut where the block hands over one activation."""
    rep = repeat_period(ops, avals)
    if rep is None:
        return cand
    p, first, end = rep
    inside = (cand > first) & (cand < end)
    if not inside.any():
        return cand
    phases = (cand[inside] - first) % p
    cost = {ph: float(np.median(traffic[cand[inside][phases == ph]])) for ph in np.unique(phases)}
    best = min(cost, key=lambda ph: (cost[ph], ph))
    return cand[~inside | ((cand - first) % p == best)]


def _least_max(points, prefix, L) -> float:
    """The least maximum layer flops over cuts of ``points`` into at most ``L`` layers (bisection, greedy)."""
    at = prefix[points]
    lo, hi = float(np.max(np.diff(at))), float(at[-1])
    for _ in range(60):
        if hi - lo <= 1e-6 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        count, start = 1, at[0]
        for x_prev, x in zip(at[:-1], at[1:], strict=True):
            if x - start > mid:
                count, start = count + 1, x_prev
        lo, hi = (lo, mid) if count <= L else (mid, hi)
    return hi


UNEVEN_PENALTY = 0.05
"""Weight of ``Σ (layer flops / target − 1)²`` in units of the median cut traffic: a tie-breaker."""


def _dp(points, prefix, traffic, L, *, cap, target):
    """The cut of ``points`` into ``L`` layers of at most ``cap`` flops with the least traffic (plus the
    uneven penalty around ``target``), or None if none exists."""
    P = len(points)
    seg = prefix[points][None, :] - prefix[points][:, None]       # seg[i, j]: flops of points[i]..points[j]
    ok = (seg <= cap) & (np.arange(P)[None, :] > np.arange(P)[:, None])
    inner = traffic[points[1:-1]]
    scale = UNEVEN_PENALTY * (float(np.median(inner)) if len(inner) else 0.0)
    uneven = scale * (seg / max(target, 1.0) - 1.0) ** 2 if target > 0 else np.zeros_like(seg)
    cost = np.full(P, np.inf)
    cost[0] = 0.0
    back = np.zeros((L + 1, P), dtype=int)
    for layer in range(1, L + 1):
        trans = np.where(ok, cost[:, None] + uneven, np.inf)      # from i to j
        best_i = np.argmin(trans, axis=0)
        new = trans[best_i, np.arange(P)] + np.where(np.arange(P) < P - 1, traffic[points], 0.0)
        back[layer] = best_i
        cost = new
    if not np.isfinite(cost[P - 1]):
        return None
    cuts, j = [], P - 1
    for layer in range(L, 0, -1):
        j = back[layer][j]
        cuts.append(int(points[j]))
    cuts = sorted(cuts)[1:]
    return cuts if len(cuts) == L - 1 else None
