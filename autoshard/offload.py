"""Host offload (ZeRO-Offload): keep optimizer state in host memory when the device budget demands it.

The planner first looks for a sharding that fits ``memory_budget`` on the device
(see ``autoshard.driver.offload_lever``). Only when none does, it moves optimizer
state to host memory, largest leaves first, and keeps the smallest such set
that fits:

1. ``offload_candidates``: carried leaves whose role is ``optimizer_state``
   (:mod:`autoshard.roles`: optax's state types, ``nnx.OptState``, or the user's
   ``state_roles``) that the step reads and replaces.
2. Each candidate set is solved again. An offloaded leaf's shard lives in host
   memory (``memory_kind="pinned_host"``); the device holds a copy only while the
   update reads it, and its replacement only until it is moved out
   (``device_intervals``). Every step moves the shard in and out over the host
   link, priced as ``2 * shard bytes / ClusterSpec.host_bandwidth`` on the leaf's
   input node, so the solver still prefers layouts that shard it.
3. ``plan_with_offload`` offloads the largest leaves until they cover the
   shortfall of the best plan without offload, doubles their number while that
   does not fit, then bisects back a few times: greedy by size, a few solves,
   not a minimal set.

Lowering (``autoshard.lower.make_flat_function``) gives those arguments and
outputs ``pinned_host`` shardings and moves them with ``jax.device_put`` to
device memory on entry and back on exit.

Not done: offloading parameters (the forward and backward passes read them, so
their device copy would live through the step), computing the update on the host
(ZeRO-Offload's CPU Adam), and offload in pipelined steps (stage plans ignore it).
The budget is checked on the predicted peak (:mod:`autoshard.memory`), so a plan
fits the compiled program only as well as that estimate tracks XLA's.
"""

from __future__ import annotations

import math

from autoshard.capture import op_spans
from autoshard.compile import HOST_MEMORY_KIND as MEMORY_KIND  # noqa: F401  (the memory kind of offloaded leaves)
from autoshard.errors import InfeasibleError
from autoshard.roles import program_roles

REFINE_SOLVES = 3
"""Solves spent bisecting back towards fewer offloaded leaves after doubling overshot."""


def offload_candidates(program, ties: dict[int, int]) -> tuple[int, ...]:
    """Flat input indices that may live in host memory, largest first.

    A candidate is optimizer state (its role, :func:`autoshard.roles.program_roles`) that the step
    carries: an array input replaced by a new output value, and read by the step. Parameters stay on the device: the forward and
    backward passes read them, so their device copy would live through the whole step.
    """
    out_of = {i: o for o, i in ties.items()}
    roles = program_roles(program, ties)
    found = []
    for i, v in enumerate(program.graph.invars):
        if i not in out_of or roles[i] != "optimizer_state":
            continue
        shape = tuple(getattr(program.avals[v], "shape", ()))
        new = program.graph.outvars[out_of[i]]
        if not shape or not isinstance(new, int) or new == v or not program.uses.get(v):
            continue
        nbytes = math.prod(shape) * program.avals[v].dtype.itemsize
        found.append((-nbytes, i))
    return tuple(i for _, i in sorted(found))


def device_intervals(program, offloaded, ties: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Half-open top-level op intervals in which host-resident values occupy device memory.

    An offloaded input is copied in before its first use and dropped after its last; its
    replacement exists on the device from the op that makes it until its last reader, then
    moves out. Positions are :func:`autoshard.capture.op_spans`'s, as :func:`autoshard.planner.liveness`'s.
    """
    spans, _ = op_spans(program.graph)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    made: dict[int, int] = {}
    for op in program.graph.ops:
        a, b = spans[op.index]
        for x in op.inputs:
            if isinstance(x, int):
                first.setdefault(x, a)
                last[x] = b
        for v in op.outputs:
            made[v] = a
    out = {}
    for o, i in ties.items():
        if i not in offloaded:
            continue
        v = program.graph.invars[i]
        out[v] = (first[v], last[v] + 1)
        new = program.graph.outvars[o]
        if isinstance(new, int) and new in made:
            out[new] = (made[new], max(made[new], last.get(new, made[new])) + 1)
    return out


def transfer_seconds(program, in_specs, mesh, offloaded, host_bandwidth: float) -> float:
    """Seconds per step to move the offloaded shards in and their replacements out (what the solver priced)."""
    total = 0.0
    for i in offloaded:
        aval = program.avals[program.graph.invars[i]]
        total += 2 * math.prod(in_specs[i].shard_shape(tuple(aval.shape), mesh)) * aval.dtype.itemsize
    return total / host_bandwidth


def plan_with_offload(solve_with, program, ties: dict[int, int], error: InfeasibleError, *, budget: float,
                      num_devices: int, check=None, check_rounds: int = 2):
    """A plan that fits ``budget`` with few offloaded bytes, or a clear error.

    Greedy by size: offload the largest leaves until their bytes, spread over ``num_devices``,
    cover the shortfall of the best plan without offload; while that does not fit, offload twice
    as many, then bisect back for up to ``REFINE_SOLVES`` solves. A few solves, not an exact minimum.

    Args:
      solve_with: ``(offloaded, limit) -> Plan``, raising :class:`InfeasibleError` when that set
        does not fit ``limit`` bytes.
      error: why no plan fits without offload; its ``smallest_memory`` gives the shortfall.
      budget: device bytes the plan must fit.
      num_devices: devices a fully sharded leaf is spread over.
      check: ``plan -> bytes``, XLA's compiled device peak. When it exceeds ``budget`` the search
        runs again against a limit shrunk by the ratio, at most ``check_rounds`` times; a plan
        whose compiled peak stays over the budget is never returned.
    """
    from autoshard.compile import fit_compiled

    candidates = offload_candidates(program, ties)
    if not candidates:
        raise error
    return fit_compiled(
        lambda limit: _search(solve_with, program, candidates, error=error, limit=limit, budget=budget,
                             num_devices=num_devices),
        check if check is not None else (lambda plan: None), budget, limit=budget,
        refuse=lambda compiled: InfeasibleError(
            f"no plan fits memory_budget={budget:.4g} bytes per device with optimizer state in host memory: "
            f"the best offload plan found has a device peak of {compiled:.4g} bytes (compiled, or predicted "
            f"where there are no devices to compile for), above the planner's memory row. Fix: raise "
            f"memory_budget (a plan at {compiled:.4g} fits), use more devices, or pipeline the model "
            "(parallelize(..., pipeline=autoshard.PipelineOptions(num_stages='auto'))).", smallest_memory=compiled,
            checked=True),
        rounds=check_rounds if check is not None else 0)


def _search(solve_with, program, candidates, *, error, limit, budget, num_devices):
    """Offload the largest ``candidates`` until the plan fits ``limit``; see :func:`plan_with_offload`."""
    shortfall = (error.smallest_memory or math.inf) - limit
    k, covered = 0, 0.0
    while k < len(candidates) and covered < shortfall:
        aval = program.avals[program.graph.invars[candidates[k]]]
        covered += math.prod(aval.shape) * aval.dtype.itemsize / num_devices
        k += 1
    k = max(k, 1)
    fails = 0  # the most leaves known not to fit
    while True:
        try:
            best = solve_with(candidates[:k], limit)
        except InfeasibleError as e:
            if k < len(candidates):
                fails, k = k, min(2 * k, len(candidates))
                continue
            smallest = min(x for x in (e.smallest_memory, error.smallest_memory, math.inf) if x is not None)
            raise InfeasibleError(
                f"no plan fits memory_budget={budget:.4g} bytes per device, even with all "
                f"{len(candidates)} optimizer-state leaves offloaded to host memory; the smallest device peak "
                f"the planner reached is {smallest:.4g} bytes. Fix: raise memory_budget to at least "
                f"{smallest:.4g}, or use more devices.", smallest_memory=smallest) from None
        break
    for _ in range(REFINE_SOLVES if fails else 0):  # doubling overshot: bisect back towards fewer leaves
        if k - fails <= 1:
            break
        mid = (fails + k) // 2
        try:
            best, k = solve_with(candidates[:mid], limit), mid
        except InfeasibleError:
            fails = mid
    return best
