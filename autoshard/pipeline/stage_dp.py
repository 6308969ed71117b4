"""Stage–mesh assignment: Alpa's inter-operator DP (§5.1, eq. 2–5), plus brute force for tests.

Given per-layer, per-sub-mesh costs, choose contiguous layer ranges (stages) and one sub-mesh
option per stage, using every device exactly once, to minimise the pipeline latency

    T = Σ_s t_s + (k − 1) · max_s t_s

For each candidate ``t_max`` (every distinct stage time) the DP ``F[s, l, d]`` = least Σ t over
stages covering layers ``l..L`` with ``s`` stages on ``d`` devices, every stage ``≤ t_max`` and
within memory: the stage that has ``s`` stages from the end keeps ``min(s, k)`` microbatches'
activations alive under 1F1B. ``T(t_max) = F[·, 0, N] + (k − 1) · t_max``; the search stops once
``(k − 1) · t_max`` alone exceeds the best ``T``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class StageProblem:
    """Costs of every (layer range, sub-mesh option).

    Attributes:
      stage_time: ``[L, L + 1, M]``: seconds of one microbatch (fwd + bwd) of layers
        ``[i, j)`` on option ``m`` (inf where ``j <= i``).
      sizes: devices of each option.
      num_devices: devices to use, all of them.
      num_microbatches: k.
      weight_memory, activation_memory: ``[L, L + 1, M]`` per-device bytes (optional).
      memory_limit: per-device bytes (inf: none).
      num_stages: a fixed stage count, or None.
    """

    stage_time: np.ndarray
    sizes: tuple[int, ...]
    num_devices: int
    num_microbatches: int
    weight_memory: np.ndarray | None = None
    activation_memory: np.ndarray | None = None
    memory_limit: float = math.inf
    num_stages: int | None = None

    @property
    def num_layers(self) -> int:
        return self.stage_time.shape[0]


@dataclasses.dataclass(frozen=True)
class StageSolution:
    """``stages``: ``(start, end, option)`` per stage, in order; ``latency``: T."""

    stages: tuple[tuple[int, int, int], ...]
    latency: float


def latency(problem: StageProblem, stages) -> float:
    ts = [problem.stage_time[i, j, m] for i, j, m in stages]
    return float(sum(ts) + (problem.num_microbatches - 1) * max(ts))


def _fits(problem: StageProblem, i, j, m, remaining: int) -> bool:
    if problem.weight_memory is None or not math.isfinite(problem.memory_limit):
        return True
    live = min(remaining, problem.num_microbatches)
    return problem.weight_memory[i, j, m] + live * problem.activation_memory[i, j, m] <= problem.memory_limit


def assign_stages(problem: StageProblem) -> StageSolution | None:
    """The DP of the module docstring; None when nothing fits."""
    L, N, k = problem.num_layers, problem.num_devices, problem.num_microbatches
    sizes = np.array(problem.sizes)
    M = len(sizes)
    S_max = min(L, N) if problem.num_stages is None else problem.num_stages
    T = problem.stage_time
    # Memory masks per number of stages from the end (1..S_max).
    fits = np.ones((S_max + 1, L, L + 1, M), dtype=bool)
    if problem.weight_memory is not None and math.isfinite(problem.memory_limit):
        for s in range(1, S_max + 1):
            fits[s] = problem.weight_memory + min(s, k) * problem.activation_memory <= problem.memory_limit
    candidates = np.unique(T[np.isfinite(T)])
    # A larger t_max only allows more stages: bisect for the least one that admits any assignment.
    lo, hi, first = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = _solve_for(problem, fits, candidates[mid], S_max)
        if got is None:
            lo = mid + 1
        else:
            first, hi = mid, mid - 1
    if first is None:
        return None
    best: StageSolution | None = None
    for t_max in candidates[first:]:
        if best is not None and (k - 1) * t_max >= best.latency:
            break
        sol = _solve_for(problem, fits, t_max, S_max)
        if sol is not None:
            total = sol[0] + (k - 1) * t_max
            if best is None or total < best.latency - 1e-15:
                best = StageSolution(sol[1], float(total))
    if best is not None:  # report the exact latency of the chosen stages
        best = StageSolution(best.stages, latency(problem, best.stages))
    return best


# Cells of the candidate array one vectorised step of `_solve_for` builds at most (it takes the options
# in chunks of this size): 512 KB of float64, which stays in cache (at 1,024 devices a chunk is one option;
# 32 MB chunks made the DP of GPT-175B 1.5x slower than one option at a time).
CHUNK_CELLS = 1 << 16


def _solve_for(problem: StageProblem, fits, t_max: float, S_max: int):
    """The DP for one ``t_max``: ``(least Σ t, stages)``, or None when no assignment fits.

    Each step takes the options a chunk at a time: ``cand[i, m, j, d]`` is a stage of layers ``[i, j)`` on
    option ``m`` ahead of the best ``s - 1`` stages of ``j..L`` on ``d - size_m`` devices. The least over
    ``(m, j)`` in that order keeps the first option, then the first cut, among equals."""
    L, N, T, sizes = problem.num_layers, problem.num_devices, problem.stage_time, np.array(problem.sizes)
    M = len(sizes)
    allowed = T <= t_max                                          # [L, L+1, M]
    shifted = np.arange(N + 1)[None, :] - sizes[:, None]          # [M, N+1]: d - size_m
    valid = shifted >= 0
    shifted = np.maximum(shifted, 0)
    times = np.moveaxis(T, 2, 1)                                  # [L, M, L+1]
    chunk = max(1, CHUNK_CELLS // (L * (L + 1) * (N + 1)))
    F = np.full((L + 1, N + 1), np.inf)      # F[l, d] with s stages
    F[L, 0] = 0.0
    history = []
    best = None
    for s in range(1, S_max + 1):
        ok = np.moveaxis(allowed & fits[s], 2, 1)                 # [L, M, L+1]
        new = np.full((L + 1, N + 1), np.inf)
        arg = np.full((L + 1, N + 1, 2), -1, dtype=int)
        for m0 in range(0, M, chunk):
            ms = slice(m0, min(m0 + chunk, M))
            prev = np.where(valid[ms], F[:, shifted[ms]], np.inf)   # [L+1, c, N+1]: F[j, d - size_m]
            cand = np.where(ok[:, ms, :, None], times[:, ms, :, None] + np.moveaxis(prev, 0, 1)[None], np.inf)
            flat = cand.reshape(L, -1, N + 1)                     # (m, j) pairs, m major
            pick = np.argmin(flat, axis=1)                        # [L, N+1]
            val = np.take_along_axis(flat, pick[:, None, :], axis=1)[:, 0, :]
            better = val < new[:L]
            new[:L] = np.where(better, val, new[:L])
            arg[:L, :, 0] = np.where(better, pick % (L + 1), arg[:L, :, 0])
            arg[:L, :, 1] = np.where(better, m0 + pick // (L + 1), arg[:L, :, 1])
        history.append(arg)
        F = new
        if (problem.num_stages is None or s == problem.num_stages) and np.isfinite(F[0, N]):
            if best is None or F[0, N] < best[0]:
                best = (float(F[0, N]), s, [h.copy() for h in history])
    if best is None:
        return None
    total, S, hist = best
    stages, start, d = [], 0, N
    for s in range(S, 0, -1):
        j, m = hist[s - 1][start, d]
        stages.append((int(start), int(j), int(m)))
        d -= sizes[m]
        start = j
    return total, tuple(stages)


def brute_force(problem: StageProblem) -> StageSolution | None:
    """Every composition of the layers × every option per stage (small problems only)."""
    L, N = problem.num_layers, problem.num_devices
    M = len(problem.sizes)
    best = None
    for S in range(1, L + 1):
        if problem.num_stages is not None and S != problem.num_stages:
            continue
        for cuts in itertools.combinations(range(1, L), S - 1):
            bounds = (0, *cuts, L)
            for opts in itertools.product(range(M), repeat=S):
                if sum(problem.sizes[m] for m in opts) != N:
                    continue
                stages = tuple((bounds[i], bounds[i + 1], opts[i]) for i in range(S))
                if not all(_fits(problem, a, b, m, S - i) for i, (a, b, m) in enumerate(stages)):
                    continue
                t = latency(problem, stages)
                if best is None or t < best.latency - 1e-15:
                    best = StageSolution(stages, t)
    return best
