"""Gradient accumulation as the last memory lever: ``parallelize(..., accumulate=True)``.

When no plan of the full batch fits the memory budget (sharding, recomputation and host offload
all tried, see ``autoshard.api._plan_on_mesh``), the step is split into ``k`` microbatches, the
smallest ``k`` dividing the batch whose tasks fit: activations shrink by ``k``, parameters and
optimizer state do not. "Fit" is XLA's compiled peak of every task (microbatch forward/backward
with its running gradient sum, and the update), not the planner's estimate: the accumulator and
the un-donated update are not in the microbatch plan's memory row.

Only steps that :func:`~autoshard.pipeline.accumulate.analyze_step` accepts are split: their
gradients are sums over the batch, so the split step equals the full step up to float reordering.
"""

from __future__ import annotations

import dataclasses

import jax

from autoshard.errors import InfeasibleError, InputError
from autoshard.hlo import memory_stats


def compiled_task_peaks(executable) -> dict[tuple, float]:
    """XLA's per-device peak (``memory_stats(...)["peak"]``) of every task of a single-stage executable."""
    peaks = {}
    avals = executable.analysis.avals
    for key, task in executable.part.tasks.items():
        vs = list(task.invars) + list(task.frontier)
        specs = [jax.ShapeDtypeStruct(avals[v].shape, avals[v].dtype, sharding=executable.sharding(v, task.stage))
                 for v in vs]
        compiled = executable.jitted(key, bool(task.frontier)).lower(*specs).compile()
        peaks[key] = memory_stats(compiled)["peak"]
    return peaks


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def choose_microbatches(make_step, build_args, budget_of, error: InfeasibleError):
    """The smallest ``k`` whose accumulated step fits; raises ``error`` (annotated) when none does.

    Args:
      make_step: ``k -> PipelinedStep`` with ``num_microbatches=k``.
      build_args: ``(dyn, stat, dyn_index, n_args)`` for ``PipelinedStep._build``.
      budget_of: ``PipelinePlan -> bytes`` per device the tasks must fit.
      error: the full batch's :class:`InfeasibleError`.

    Returns:
      ``(step, entry)``: the step and its built entry (``entry.plan.stats["num_microbatches"] == k``).
    """
    from autoshard.api import _abstract, _ties
    from autoshard.pipeline.accumulate import batch_leaf_positions

    dyn, stat, dyn_index, n_args = build_args
    probe = make_step(1)
    abstract = jax.tree_util.tree_map(_abstract, dyn)
    fun = probe._bound(stat, n_args, dyn_index)
    in_paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0])
    try:
        ties = _ties(abstract, jax.eval_shape(fun, *abstract))
        _, batch_size = batch_leaf_positions(abstract, probe._batch_args(abstract, dyn_index, ties), 1, in_paths)
    except InputError as e:
        raise _annotated(error, f"it has no batch to split ({e})") from None
    tried = []
    for k in _divisors(batch_size):
        step = make_step(k)
        try:
            entry = step._build(*build_args)
        except InfeasibleError as e:
            tried.append(f"k={k}: {e.smallest_memory or 0:.4g} bytes (planner)")
            continue
        except InputError as e:  # not accumulation-compatible (a max over the batch, BatchNorm): no k helps
            raise _annotated(error, str(e)) from None
        budget = budget_of(entry.plan)
        peaks = compiled_task_peaks(entry.executable)
        peak = max(peaks.values(), default=0.0)
        if peak > budget:
            tried.append(f"k={k}: {peak:.4g} bytes (compiled)")
            continue
        stats = {**entry.plan.stats, "num_microbatches": k, "task_peaks": {"/".join(map(str, t)): p
                                                                           for t, p in peaks.items()},
                 "accumulated_because": str(error).split("\n")[0]}
        entry = dataclasses.replace(entry, plan=dataclasses.replace(entry.plan, stats=stats))
        return step, entry
    raise _annotated(error, "no number of microbatches dividing the batch size "
                            f"{batch_size} fits either: " + "; ".join(tried))


def _annotated(error: InfeasibleError, why: str) -> InfeasibleError:
    err = InfeasibleError(f"{error}\nGradient accumulation (accumulate=True) cannot help: {why}",
                          smallest_memory=error.smallest_memory)
    for name, value in vars(error).items():
        setattr(err, name, value)
    return err
