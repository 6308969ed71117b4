"""Every error autoshard raises on purpose.

Each message says what is wrong, where (argument, pytree path, primitive or
node), and how to fix it.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base class of every error raised by autoshard on purpose."""


class InputError(AutoshardError, TypeError):
    """An argument to a parallelized function cannot be traced or placed."""


class MeshError(AutoshardError, ValueError):
    """The mesh, or a sharding pinned on it, does not fit the arguments."""


class InfeasibleError(AutoshardError, ValueError):
    """No strategy assignment meets the constraints (memory limit, forbidden strategies).

    Attributes:
      smallest_memory: the least per-device peak seen, in bytes (None: memory is not why).
      checked: ``smallest_memory`` is a whole plan's peak as a lever's final check measured it (XLA's
        compiled peak; the model's own on an AbstractMesh), not a bound from the solver's memory row.
    """

    def __init__(self, message: str, *, smallest_memory: float | None = None, checked: bool = False):
        super().__init__(message)
        self.smallest_memory = smallest_memory
        self.checked = checked


class ProblemFormatError(AutoshardError, ValueError):
    """A solver problem file is malformed."""


class PlanError(AutoshardError, ValueError):
    """A saved plan does not match the function or the mesh it is applied to."""


class InvalidProgramError(AutoshardError, AssertionError):
    """A ``CapturedProgram`` breaks an invariant (``CapturedProgram.validate``): a bug in the pass that built it."""
