"""What the suite measures: models, batch sizes, cluster presets and the meshes each method may use."""

from __future__ import annotations

import dataclasses

from benchmarks.baselines import tensor_parallel_meshes

METHODS = ("data_parallel", "zero2", "fsdp", "megatron", "autoshard")
"""Every method, baselines first. ``megatron`` is the best of its 2-D factorization sweep."""

BASELINES = METHODS[:-1]


def data_parallel_mesh_methods(methods) -> tuple[str, ...]:
    """The baselines compiled on the data-parallel mesh when measuring ``methods``: each one asked
    for, and data parallelism for ``megatron`` too (its ``tp = 1`` candidate)."""
    wanted = set(methods)
    return tuple(m for m in ("data_parallel", "zero2", "fsdp")
                 if m in wanted or m == "data_parallel" and "megatron" in wanted)

METHOD_LABELS = {
    "data_parallel": "DP",
    "zero2": "ZeRO-2",
    "fsdp": "FSDP",
    "megatron": "Megatron",
    "autoshard": "autoshard",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    """A cluster preset and how its devices split into nodes.

    ``nodes > 1`` means mesh axis 0 spans the nodes (slow links) and axis 1 stays inside a node, so
    a 2-D mesh ``(a, b)`` is valid only when ``a`` is a multiple of ``nodes``.
    """

    name: str
    nodes: int = 1

    def valid(self, shape: tuple[int, int]) -> bool:
        return shape[0] % self.nodes == 0


PRESETS = (Preset("h100-nvlink"), Preset("h100-2node-ib", nodes=2))


def autoshard_meshes(num_devices: int, preset: Preset) -> list[tuple[int, int]]:
    """The 2-D meshes autoshard plans on: every factorization the preset's topology allows."""
    shapes = [(num_devices // tp, tp) for tp in range(1, num_devices + 1) if num_devices % tp == 0]
    return [s for s in shapes if preset.valid(s)]


def megatron_meshes(num_devices: int, preset: Preset) -> list[tuple[int, int]]:
    """``(dp, tp)`` meshes of the Megatron sweep (``tp >= 2``; ``tp = 1`` is data parallelism)."""
    return tensor_parallel_meshes(num_devices, min_dp=preset.nodes)


def data_parallel_mesh(num_devices: int) -> tuple[int, int]:
    """DP, ZeRO-2 and FSDP use every device on one logical axis; laid out ``(2, n/2)`` so that the
    same program is valid on one node and on two (XLA emits the same all-device collectives)."""
    return (2, num_devices // 2) if num_devices % 2 == 0 else (1, num_devices)


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One model of a suite. The global batch is ``per_device × devices`` (at least ``min_batch``)."""

    family: str
    config: str
    per_device: int
    min_batch: int = 1

    def batch_size(self, num_devices: int) -> int:
        return max(self.min_batch, self.per_device * num_devices)

    @property
    def name(self) -> str:
        return f"{self.family}-{self.config}"

    @property
    def tiny(self) -> bool:
        return self.config == "tiny"


# Alpa's model sizes. GPT and MoE: 2 sequences of 1024 tokens per device (global batch 16 on 8 devices);
# MoE needs batch·seq to be a multiple of the expert group size (2048). Wide-ResNet: 4 images of 224².
SUITES: dict[str, tuple[Case, ...]] = {
    "gpt": tuple(Case("gpt", c, 2) for c in ("125M", "350M", "760M", "1.3B", "2.6B", "6.7B")),
    "moe": tuple(Case("moe", c, 2) for c in ("380M", "690M", "1.3B", "2.4B")),
    "wresnet": tuple(Case("wresnet", c, 4) for c in ("250M", "500M", "1B")),
}

# --quick: the tiny configs, which also execute and are checked against a single-device reference.
QUICK_SUITES: dict[str, tuple[Case, ...]] = {
    "gpt": (Case("gpt", "tiny", 2),),
    "moe": (Case("moe", "tiny", 2),),
    "wresnet": (Case("wresnet", "tiny", 2),),
}


def select_cases(suite: str, *, quick: bool, configs: tuple[str, ...] | None = None) -> list[Case]:
    """The cases of ``suite`` (``"all"`` for every family), optionally only the named configs."""
    table = QUICK_SUITES if quick else SUITES
    if suite != "all" and suite not in table:
        raise ValueError(f"unknown suite {suite!r}; expected one of {['all', *table]}")
    cases = [c for name, cs in table.items() if suite in ("all", name) for c in cs]
    if configs:
        unknown = set(configs) - {c.config for c in cases}
        if unknown:
            raise ValueError(
                f"--configs {sorted(unknown)} not in suite {suite!r}: "
                f"choose from {sorted({c.config for c in cases})}"
            )
        cases = [c for c in cases if c.config in configs]
    return cases
