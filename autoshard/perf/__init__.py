"""The performance model: one hardware model that every part of autoshard prices time with.

- :mod:`~autoshard.perf.hardware`: accelerators and networks as data, each number with its source.
- :mod:`~autoshard.perf.compute`: a roofline per kernel (:class:`Work` -> seconds).
- :mod:`~autoshard.perf.comm`: collectives over device groups, priced at the group's slowest tier.
- :mod:`~autoshard.perf.schedule`: a list schedule of compute and communication streams (overlap).
- :mod:`~autoshard.perf.pipeline`: pipeline schedules (GPipe, 1F1B, interleaved) from stage times.
"""

from autoshard.perf.comm import collective_seconds_on, group_link
from autoshard.perf.compute import Work, matmul_efficiency, operand_class, seconds
from autoshard.perf.hardware import (
    HARDWARE,
    Accelerator,
    Hardware,
    LinkTier,
    hardware_for_device_kind,
    hardware_preset,
)
from autoshard.perf.pipeline import PipelineTime, pipeline_seconds
from autoshard.perf.schedule import Schedule, Task, simulate

__all__ = [
    "HARDWARE",
    "Accelerator",
    "Hardware",
    "LinkTier",
    "PipelineTime",
    "Schedule",
    "Task",
    "Work",
    "collective_seconds_on",
    "group_link",
    "hardware_for_device_kind",
    "hardware_preset",
    "matmul_efficiency",
    "operand_class",
    "pipeline_seconds",
    "seconds",
    "simulate",
]
