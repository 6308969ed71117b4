"""Gradient accumulation as the last memory lever: ``parallelize(..., accumulate=True)``.

When no plan of the full batch fits the memory budget (sharding, recomputation and host offload
all tried, see ``autoshard.driver.LEVERS``), the step is split into ``k`` microbatches, the
smallest ``k`` dividing the batch whose tasks fit: activations shrink by ``k``, parameters and
optimizer state do not. "Fit" is XLA's compiled peak of every task (microbatch forward/backward
with its running gradient sum, and the update), not the planner's estimate: the accumulator and
the un-donated update are not in the microbatch plan's memory row. A ``k`` whose compiled peak is
over the budget is planned again under a budget shrunk by the ratio, as every memory lever does
(:func:`autoshard.compile.fit_compiled`), before a larger ``k`` is tried.

Only steps that :func:`~autoshard.pipeline.accumulate.analyze_step` accepts are split: their
gradients are sums over the batch, so the split step equals the full step up to float reordering.
"""

from __future__ import annotations

import dataclasses

from autoshard.compile import fit_compiled
from autoshard.errors import InfeasibleError, InputError
from autoshard.hlo import memory_stats


def compiled_task_peaks(executable) -> dict[tuple, float]:
    """XLA's per-device peak (``memory_stats(...)["peak"]``) of every task of a single-stage executable."""
    return {key: memory_stats(compiled)["peak"] for key, compiled in executable.compiled_tasks().items()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def choose_microbatches(make_step, args: tuple, budget_of, error: InfeasibleError):
    """The smallest ``k`` whose accumulated step fits; raises ``error`` (annotated) when none does.

    Args:
      make_step: ``(k, memory_budget) -> PipelinedStep`` with ``num_microbatches=k``, its stage planned within
        ``memory_budget`` (None: the step's own).
      args: the step's (dynamic) arguments.
      budget_of: ``PipelinePlan -> bytes`` per device the tasks must fit.
      error: the full batch's :class:`InfeasibleError`.

    Returns:
      ``(step, program)``: the step and its :class:`~autoshard.pipeline.step.PipelinedProgram` for
      ``args`` (``program.plan.stats["num_microbatches"] == k``).
    """
    probe = make_step(1, None)
    call = probe.bind(args)
    try:
        batch_size = probe.batch_size(call)
    except InputError as e:
        raise _annotated(error, f"it has no batch to split ({e})") from None

    def attempt(k):
        """``(step, entry, peaks)`` when k microbatches fit, else why not."""

        def build(limit):
            step = make_step(k, limit)
            entry = step.build(step.bind(args))
            return step, entry, compiled_task_peaks(entry.executable)

        try:
            first = build(None)
        except InfeasibleError as e:
            return f"k={k}: planner's smallest peak {e.smallest_memory or 0:.4g} bytes"
        except InputError as e:  # not accumulation-compatible at this k (see below)
            return e
        try:
            return fit_compiled(build, lambda got: max(got[2].values(), default=0.0), budget_of(first[1].plan),
                                refuse=lambda peak: _Over(f"k={k}: compiled peak {peak:.4g} bytes"), planned=first)
        except _Over as e:
            return str(e)

    candidates = _divisors(batch_size)
    if not candidates:
        raise _annotated(error, f"the batch size is {batch_size}")
    # Activations shrink with k, parameters and optimizer state do not: when the most microbatches do
    # not fit, fewer will not either. Try them first, so that a hopeless budget costs one plan, not many.
    # A k the step cannot be split into is skipped: microbatches of one example trace differently
    # (jax writes a bias gradient's sum over a batch of 1 as a reshape); a max over the batch or
    # BatchNorm rejects every k.
    most, rejected = None, None
    for k in reversed(candidates):
        got = attempt(k)
        if isinstance(got, InputError):
            rejected = got
            continue
        most = k, got
        break
    if most is None:
        raise _annotated(error, str(rejected))
    k_most, got_most = most
    if isinstance(got_most, str):
        raise _annotated(error, f"not even {k_most} microbatches fit ({got_most})")
    for k in candidates:
        if k >= k_most:
            break
        got = attempt(k)
        if not isinstance(got, (str, InputError)):
            return _chosen(k, *got, error)
    return _chosen(k_most, *got_most, error)


class _Over(Exception):
    """No plan at this ``k`` compiles within the budget (its message says by how much)."""


def _chosen(k, step, entry, peaks, error):
    stats = {**entry.plan.stats, "num_microbatches": k,
             "task_peaks": {"/".join(map(str, key)): p for key, p in peaks.items()},
             "accumulated_because": str(error).split("\n")[0]}
    return step, dataclasses.replace(entry, plan=dataclasses.replace(entry.plan, stats=stats))


def _annotated(error: InfeasibleError, why: str) -> InfeasibleError:
    return InfeasibleError(f"{error}\nGradient accumulation (accumulate=True) cannot help: {why}",
                           smallest_memory=error.smallest_memory)
