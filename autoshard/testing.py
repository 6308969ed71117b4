"""Helpers for tests of programs that use autoshard (and autoshard's own tests).

Everything here is built on public names; it exists so that a test never reaches into a step's
private state to find what it runs.

Example:
  >>> import autoshard, jax.numpy as jnp
  >>> from autoshard.testing import pipeline_executable
  >>> def step(w, x):
  ...     return w - 0.1 * x.mean(0), (x @ w).sum()
  >>> piped = autoshard.parallelize(step, num_microbatches=2, progress=None)
  >>> type(pipeline_executable(piped, jnp.ones(4), jnp.ones((8, 4)))).__name__
  'PipelineExecutable'
"""

from __future__ import annotations

from autoshard.errors import InputError


def pipeline_executable(step, *args, **kwargs):
    """The executable a pipelined or accumulated step runs for these arguments (built if needed).

    Args:
      step: what :func:`autoshard.parallelize` returned.
      *args, **kwargs: a call's arguments (arrays or ``jax.ShapeDtypeStruct``s).

    Returns:
      A :class:`~autoshard.pipeline.runtime.PipelineExecutable` (``runtime="device_put"``) or a
      :class:`~autoshard.pipeline.spmd.SpmdPipelineExecutable`.

    Raises:
      InputError: the step runs these arguments as one program (it has no pipeline executable).
    """
    prepared = step.prepared(*args, **kwargs)
    program = getattr(prepared, "program", prepared)  # an accumulated step holds its pipelined program
    executable = getattr(program, "executable", None)
    if executable is None:
        raise InputError("this step runs these arguments as one program, with no pipeline executable. Fix: "
                         "step.lower(*args).compile() is the program it runs.")
    return executable


def cache_size(step) -> int:
    """How many argument signatures ``step`` has planned and compiled (one per distinct call shape)."""
    return len(step.cache)
