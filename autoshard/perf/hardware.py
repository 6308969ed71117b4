"""What an accelerator and its network can do: the hardware facts the performance model prices with.

Every number here is a hardware fact with its source, or a measurement of a real device with the
measurement named. None is fitted to a published training run (``benchmarks/published.py`` is checked
against those, so fitting to them would make the check meaningless).

Sources, cited by key in the comments below:

- ``[nv-a100]``, ``[nv-h100]``, ``[nv-h200]``, ``[nv-b200]``: NVIDIA's data sheets (dense, no
  sparsity), as tabulated in jax-ml/scaling-book ``gpus.md`` ("Summary of GPU specs": SMs, HBM bandwidth,
  bf16/fp8 FLOPs/s) and its NVLink table (25 GB/s per link per direction; 12 links on A100, 18 on H100/B200
  at 25/50 GB/s).
- ``[sb-tpu]``: jax-ml/scaling-book ``tpus.md``, "specific numbers for our chips": HBM capacity and
  bandwidth, bf16/int8 FLOPs/s, ICI bandwidth per link one way, host size (chips per host), DCN about
  2.5e10 bytes/s per host; v4 and v5p are 3-D tori (6 neighbours, wraparound on axes that are multiples of
  4), v5e and v6e 2-D (4 neighbours, wraparound on axes of 16).
- ``[mamf]``: stas00/ml-engineering, ``compute/accelerator/README.md``, "Maximum Achievable Matmul FLOPS
  comparison table" (the best large bf16/fp8 ``matmul`` measured, boost clocks), and
  ``compute/accelerator/benchmarks/README.md``, "What we measured: alone vs all-8 concurrent": the
  *sustainable* rate with the chip at its power limit (MSMF) against the boost burst (MAMF) on the same
  chip: H200 bf16 MSMF 698.6-702.9 against MAMF 823.9-828.0 TFLOPS (0.847), B200 1426-1456 against
  1732-1758 (0.825). Training runs at the sustainable rate.
- ``[hpl-clock]``: glennklockwood.com/garden/peak-FLOPS: NVIDIA computes the A100's HPL peak at the clock
  sustained at its power limit, 1305 MHz, against a 1410 MHz boost (0.926).
- ``[sb-hbm]``: scaling-book ``gpus.md`` Quiz 1, Question 7: adding two fp32 vectors of 2^30 elements on an
  H100 took 4.1 ms against a 3.84 ms HBM roofline: 0.937 of the data-sheet bandwidth.
- ``[sb-nvlink]``: scaling-book ``gpus.md`` "Empirical measurements": an 8xH100 AllReduce reaches about
  370 GB/s of bus bandwidth against 450 GB/s of NVLink (0.82), for messages of about 10 GB per device.
- ``[fa2]``: Dao, FlashAttention-2 (ICLR 2024), abstract: "reaching 50-73% of the theoretical maximum
  FLOPs/s on A100" (forward; the backward runs at the low end).
- ``[fa3-bench]``: pytorch/benchmark commit ff65cb67 (FlashAttention-3 on H100, head dim 128): 566 TFLOPS
  forward at sequence 2k, 590 at 4k, 614 at 8k (0.57-0.62 of 989).
- ``[cublas-tile]``: NVIDIA, "Matrix Multiplication Background User's Guide", §2.3 and §3: cuBLAS runs a
  GEMM as thread-block tiles of the output, one tile per SM at a time; a dimension that does not fill its
  last tile wastes the rest (tile quantization). 128x128 is the granularity counted here (cuBLAS picks
  among 256x128, 128x256, 128x128 and smaller, and balances the last wave by split-K, stream-K on Hopper).
- ``[mxu]``: scaling-book ``tpus.md``: the MXU is a 128x128 systolic array (256x256 on v6e), fed from
  VMEM with the HBM copies pipelined under the MXU work, so a large aligned matmul is compute bound;
  operands are padded to the MXU tile.
- ``[tpu-gemm]``: yangwhale/gpu-tpu-pedia, ``tpu/v7_perf/README.md``: bf16 GEMMs timed from the profiler's device
  trace (``device_duration_ps``) reach "90%+" of peak on TPU v6e and v7 (65-75% with host timing around
  them); a TPU's clock is fixed, so that is also its sustained rate. Taken as 0.9 for every generation.
- ``[ib]``: InfiniBand line rates: HDR 200 Gb/s (25 GB/s), NDR 400 Gb/s (50 GB/s), one NIC per GPU in
  DGX A100 / DGX H100 / DGX B200 nodes (scaling-book ``gpus.md``, "8 400Gbps CX7 NICs (one per GPU)";
  Selene: 8x200 Gb/s HDR per node, Narayanan et al. SC'21).

Example:
    >>> from autoshard.perf.hardware import hardware_preset
    >>> hw = hardware_preset("h100")
    >>> hw.accelerator.peak_flops["bf16"]
    989000000000000.0
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from collections.abc import Mapping

__all__ = [
    "HARDWARE",
    "Accelerator",
    "Hardware",
    "LinkTier",
    "hardware_for_device_kind",
    "hardware_preset",
]

_GiB = 2**30
_GB = 1e9


def _frozen(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True, slots=True)
class Accelerator:
    """One chip: its compute rates, its memory and how well kernels use them.

    Attributes:
      name: a short label (``"h100"``).
      platform: ``"gpu"`` or ``"tpu"``.
      peak_flops: data-sheet dense flop/s per operand class: ``"fp8"``, ``"bf16"`` (bf16 and fp16),
        ``"tf32"`` (fp32 matmuls at jax's default precision on GPU), ``"fp32"`` (vector units).
      matmul_efficiency: the fraction of ``peak_flops`` a large, well-shaped matmul sustains, per class.
        Smaller or oddly shaped matmuls lose more (:func:`autoshard.perf.compute.matmul_seconds`).
      attention_efficiency: ``(forward, backward)`` fraction of the bf16 peak a fused attention kernel
        (FlashAttention, cuDNN, Splash) sustains.
      hbm_bytes: device memory.
      hbm_bandwidth: data-sheet HBM bytes/s.
      hbm_efficiency: the fraction of it a streaming kernel reaches.
      compute_units: SMs (GPU) or MXUs (TPU) that matmul tiles are spread over.
      matmul_tile: ``(rows, cols)`` of the output tile one compute unit works on at a time.
      vector_flops: flop/s of the elementwise units (CUDA cores, VPU), for elementwise work.
      source: where the efficiencies come from: the sources of this module, or the committed calibration
        file measured on the chip (``autoshard/perf/calibration/<preset>.json``, :func:`calibrated`).
    """

    name: str
    platform: str
    peak_flops: Mapping[str, float]
    matmul_efficiency: Mapping[str, float]
    attention_efficiency: tuple[float, float]
    hbm_bytes: float
    hbm_bandwidth: float
    hbm_efficiency: float
    compute_units: int
    matmul_tile: tuple[int, int]
    vector_flops: float
    source: str = "data sheets and published measurements (autoshard.perf.hardware)"

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", _frozen({k: float(v) for k, v in self.peak_flops.items()}))
        object.__setattr__(self, "matmul_efficiency", _frozen(self.matmul_efficiency))
        problems = [f"{k}: {v}" for k, v in self.matmul_efficiency.items() if not 0 < v <= 1]
        if not 0 < self.hbm_efficiency <= 1:
            problems.append(f"hbm_efficiency {self.hbm_efficiency}")
        if problems:
            raise ValueError(f"Accelerator {self.name!r}: efficiencies must be in (0, 1]: {', '.join(problems)}")

    def __hash__(self):  # the mappings are read-only views; the name and numbers identify the chip
        return hash((self.name, tuple(sorted(self.peak_flops.items())), tuple(sorted(self.matmul_efficiency.items())),
                     self.hbm_bandwidth, self.hbm_bytes))

    def matmul_rate(self, operand_class: str) -> float:
        """Sustained flop/s of a large matmul on operands of ``operand_class`` (falls back to bf16)."""
        cls = operand_class if operand_class in self.peak_flops else "bf16"
        return self.peak_flops[cls] * self.matmul_efficiency.get(cls, self.matmul_efficiency["bf16"])

    @property
    def stream_bandwidth(self) -> float:
        """HBM bytes/s a streaming (memory-bound) kernel reaches."""
        return self.hbm_bandwidth * self.hbm_efficiency


@dataclasses.dataclass(frozen=True, slots=True)
class LinkTier:
    """One level of the network, from a device's point of view.

    Attributes:
      name: ``"nvlink"``, ``"ib"``, ``"ici"``, ``"dcn"``, ...
      span: devices one group of this tier holds (a node's 8 GPUs, a TPU slice's chips); the outermost
        tier has ``None`` (it spans everything).
      bandwidth: bytes/s one device can send through this tier, one direction (for ICI: per link).
      efficiency: the fraction of ``bandwidth`` a large collective reaches.
      latency: seconds of fixed cost of one collective whose slowest link is this tier.
      torus: ICI only: the torus edge (4 for v4/v5p cubes, 16 for v5e/v6e pods); a collective over a group
        spanning ``k`` torus dimensions runs rings on all of them at once (two links each with wraparound).
      per_host: devices sharing one host's link (TPU DCN: the host's bandwidth is split between its chips).
    """

    name: str
    span: int | None
    bandwidth: float
    efficiency: float
    latency: float
    torus: int = 0
    per_host: int = 1

    def __post_init__(self):
        if not (self.bandwidth > 0 and 0 < self.efficiency <= 1 and self.latency >= 0):
            raise ValueError(f"LinkTier {self.name!r}: bandwidth must be > 0, efficiency in (0, 1], latency >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    """A chip and the network tiers around it, innermost first.

    Devices are numbered row-major over the mesh and filled into the tiers in that order: devices
    ``0..span-1`` share the first tier's group (a node), and so on outwards. A collective over a group of
    devices runs at its slowest tier's per-device bandwidth (:mod:`autoshard.perf.comm`).

    Attributes:
      name: the preset's name.
      accelerator: the :class:`Accelerator`.
      tiers: the :class:`LinkTier` s, innermost first; the last spans everything.
      host_bandwidth: device <-> host bytes/s (PCIe).
      device_kinds: lower-case substrings of ``jax.Device.device_kind`` this preset describes.
    """

    name: str
    accelerator: Accelerator
    tiers: tuple[LinkTier, ...]
    host_bandwidth: float
    device_kinds: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.tiers or self.tiers[-1].span is not None:
            raise ValueError(f"Hardware {self.name!r}: the last tier must span everything (span=None)")
        spans = [t.span for t in self.tiers[:-1]]
        if any(s is None or s < 1 for s in spans) or spans != sorted(spans):
            raise ValueError(f"Hardware {self.name!r}: inner tiers need growing spans, got {spans}")

    @property
    def memory(self) -> float:
        return self.accelerator.hbm_bytes

    def tier_of(self, group_span: int, inner_span: int | None = None) -> int:
        """Index of the innermost tier whose groups hold ``group_span`` consecutive devices
        (``inner_span`` replaces the innermost tier's span: a cluster's own node or slice size)."""
        for i, t in enumerate(self.tiers):
            span = inner_span if i == 0 and inner_span is not None and len(self.tiers) > 1 else t.span
            if span is None or group_span <= span:
                return i
        return len(self.tiers) - 1


# ---------------------------------------------------------------------------------------------------------
# Chips.

_H200_SUSTAINED = 700.8 / 826.0  # [mamf] H200 MSMF / MAMF, bf16 (means of the two runs alone and all-8)
_B200_SUSTAINED = 1440.0 / 1747.0  # [mamf] B200 MSMF / MAMF, bf16
_A100_SUSTAINED = 1305.0 / 1410.0  # [hpl-clock] the clock sustained at the power limit over the boost clock
_HBM_STREAM = 3.84 / 4.1  # [sb-hbm]

A100_80 = Accelerator(
    "a100-80",
    "gpu",
    # [nv-a100] 312 TFLOP/s bf16/fp16 dense, 156 TF32, 19.5 fp32 (CUDA cores).
    peak_flops={"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    # [mamf] A100 SXM bf16 MAMF 271.2 of 312 (0.869) at boost, times [hpl-clock] 0.926 sustained.
    matmul_efficiency={"bf16": 271.2 / 312 * _A100_SUSTAINED, "tf32": 271.2 / 312 * _A100_SUSTAINED},
    # [fa2] forward 0.50-0.73 of peak; taken at 0.6 forward, 0.5 backward, times the sustained clock.
    attention_efficiency=(0.6 * _A100_SUSTAINED, 0.5 * _A100_SUSTAINED),
    hbm_bytes=80 * _GiB,
    hbm_bandwidth=2.039e12,  # [nv-a100] 80 GB SXM: 2,039 GB/s
    hbm_efficiency=_HBM_STREAM,
    compute_units=108,  # [nv-a100] SMs
    matmul_tile=(128, 128),  # [cublas-tile]
    vector_flops=19.5e12,
)
A100_40 = dataclasses.replace(A100_80, name="a100-40", hbm_bytes=40 * _GiB,
                              hbm_bandwidth=1.555e12)  # [nv-a100] 40 GB SXM: 1,555 GB/s

H100 = Accelerator(
    "h100",
    "gpu",
    # [nv-h100] SXM: 989 TFLOP/s bf16 dense, 1,979 fp8, 494 TF32, 67 fp32.
    peak_flops={"fp8": 1979e12, "bf16": 989e12, "tf32": 494e12, "fp32": 67e12},
    # [mamf] H200 (the same GPU and 700 W limit) sustains 700.8 TFLOPS bf16; H100 SXM fp8 MAMF 1402.6 times
    # the same sustained/burst ratio.
    matmul_efficiency={"bf16": 700.8 / 989, "tf32": 700.8 / 989, "fp8": 1402.6 / 1979 * _H200_SUSTAINED},
    # [fa3-bench] 566-614 TFLOPS forward (0.57-0.62): 0.59 forward, 0.5 backward, at the sustained clock.
    attention_efficiency=(0.59 * _H200_SUSTAINED, 0.5 * _H200_SUSTAINED),
    hbm_bytes=80 * _GiB,
    hbm_bandwidth=3.35e12,  # [nv-h100] HBM3
    hbm_efficiency=_HBM_STREAM,
    compute_units=132,  # [nv-h100] SMs
    matmul_tile=(128, 128),  # [cublas-tile]
    vector_flops=67e12,
)
# [nv-h200] HBM3e; [mamf] H200 SXM fp8 MAMF 1453.4
H200 = dataclasses.replace(H100, name="h200", hbm_bytes=141e9, hbm_bandwidth=4.8e12,
                           matmul_efficiency={"bf16": 700.8 / 989, "tf32": 700.8 / 989,
                                              "fp8": 1453.4 / 1979 * _H200_SUSTAINED})

B200 = Accelerator(
    "b200",
    "gpu",
    # [nv-b200] 2,250 TFLOP/s bf16 dense, 4,500 fp8; fp32 80 TFLOP/s (scaling-book Quiz 1, Question 6).
    peak_flops={"fp8": 4500e12, "bf16": 2250e12, "tf32": 1125e12, "fp32": 80e12},
    # [mamf] B200 sustains 1,440 TFLOPS bf16 (MSMF); fp8 MAMF 3432.5 times the bf16 sustained/burst ratio.
    matmul_efficiency={"bf16": 1440.0 / 2250, "tf32": 1440.0 / 2250, "fp8": 3432.5 / 4500 * _B200_SUSTAINED},
    # No published Blackwell attention kernel rate in [fa2]/[fa3-bench]; the H100's fractions.
    attention_efficiency=(0.59 * _B200_SUSTAINED, 0.5 * _B200_SUSTAINED),
    hbm_bytes=180e9,
    hbm_bandwidth=8.0e12,  # [nv-b200]
    hbm_efficiency=_HBM_STREAM,
    compute_units=148,  # [nv-b200] SMs
    matmul_tile=(128, 128),
    vector_flops=80e12,
)

_TPU_MATMUL = 0.9  # [tpu-gemm]


def _tpu(name: str, bf16: float, *, hbm: float, hbm_bw: float, mxu: int, units: int) -> Accelerator:
    # [mxu] a large aligned matmul is compute bound on the MXUs; [tpu-gemm] they sustain 0.9 of peak; further
    # losses are the padding to the MXU tile (autoshard.perf.compute). Fused attention: no published TPU
    # kernel rate, so the [fa2] A100 fractions stand in.
    return Accelerator(name, "tpu", peak_flops={"bf16": bf16, "tf32": bf16, "fp8": 2 * bf16, "fp32": bf16 / 8},
                       matmul_efficiency={"bf16": _TPU_MATMUL, "tf32": _TPU_MATMUL, "fp8": _TPU_MATMUL},
                       attention_efficiency=(0.6, 0.5), hbm_bytes=hbm, hbm_bandwidth=hbm_bw,
                       hbm_efficiency=_HBM_STREAM, compute_units=units, matmul_tile=(mxu, mxu),
                       vector_flops=bf16 / 8)


# [sb-tpu] bf16 FLOPs/s, HBM capacity and bandwidth; MXUs per chip: 4 per TensorCore on v4/v5 (two cores on
# v4 and v5p), 2x 256-wide on v6e.
TPU_V4 = _tpu("tpu-v4", 2.75e14, hbm=32 * _GiB, hbm_bw=1.2e12, mxu=128, units=8)
TPU_V5E = _tpu("tpu-v5e", 1.97e14, hbm=16 * _GiB, hbm_bw=8.1e11, mxu=128, units=4)
TPU_V5P = _tpu("tpu-v5p", 4.59e14, hbm=95 * _GiB, hbm_bw=2.8e12, mxu=128, units=8)
TPU_V6E = _tpu("tpu-v6e", 9.2e14, hbm=32 * _GiB, hbm_bw=1.6e12, mxu=256, units=2)


# ---------------------------------------------------------------------------------------------------------
# Networks.

_NVLINK_EFFICIENCY = 370 / 450  # [sb-nvlink]
# IB: 64b/66b encoding (0.97) and packet headers; NCCL's large-message bus bandwidth over one NIC is close to
# the line rate. No per-GPU measurement is cited, so the encoding bound less headers: 0.9.
_IB_EFFICIENCY = 0.9


def _nvlink(per_direction: float, latency: float = 10e-6) -> LinkTier:
    # latency: NCCL's fixed cost of a collective inside a node (kernel launch and one ring step; about
    # 10 us for small messages in nccl-tests on NVSwitch systems).
    return LinkTier("nvlink", 8, per_direction, _NVLINK_EFFICIENCY, latency)


def _ib(per_gpu: float, latency: float = 25e-6) -> LinkTier:
    # latency: a collective across nodes crosses the NIC and switches (a few us per hop) on top of NVLink's.
    return LinkTier("ib", None, per_gpu, _IB_EFFICIENCY, latency)


def _gpu(name, acc, nvlink, ib, kinds) -> Hardware:
    return Hardware(name, acc, (_nvlink(nvlink), _ib(ib)), host_bandwidth=_PCIE[acc.name], device_kinds=kinds)


# PCIe to the host: Gen4 x16 (A100) and Gen5 x16 (H100, B200), one direction.
_PCIE = {"a100-80": 25e9, "a100-40": 25e9, "h100": 50e9, "h200": 50e9, "b200": 50e9}


def _tpu_hw(name, acc, *, link, torus, host, slice_max, kinds) -> Hardware:
    # [sb-tpu] ICI one-way bandwidth per link; wraparound rings use both directions. DCN about 2.5e10
    # bytes/s per host, shared by the host's chips; PCIe 1.5e10 per chip.
    ici = LinkTier("ici", slice_max, link, 1.0, 5e-6, torus=torus)
    dcn = LinkTier("dcn", None, 2.5e10 / host, _IB_EFFICIENCY, 50e-6, per_host=host)
    return Hardware(name, acc, (ici, dcn), host_bandwidth=1.5e10, device_kinds=kinds)


HARDWARE: dict[str, Hardware] = {
    # [nv-a100] NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction; [ib] 8x HDR per node.
    "a100-80": _gpu("a100-80", A100_80, 300 * _GB, 25 * _GB, ("a100-sxm4-80gb", "a100 80gb", "a100-80")),
    "a100-40": _gpu("a100-40", A100_40, 300 * _GB, 25 * _GB, ("a100-sxm4-40gb", "a100-pcie-40gb", "a100")),
    # [nv-h100] NVLink 4: 18 links x 25 GB/s = 450 GB/s; [ib] 8x NDR 400 Gb/s per node.
    "h100": _gpu("h100", H100, 450 * _GB, 50 * _GB, ("h100",)),
    "h200": _gpu("h200", H200, 450 * _GB, 50 * _GB, ("h200", "gh200")),
    # [nv-b200] NVLink 5: 18 links x 50 GB/s = 900 GB/s; [ib] 8x 400 Gb/s ConnectX-7 per node.
    "b200": _gpu("b200", B200, 900 * _GB, 50 * _GB, ("b200", "b300", "gb200")),
    # [sb-tpu] ICI per link one way: v4 4.5e10, v5p 9e10 (3-D, cubes of 4); v5e 4.5e10, v6e 9e10 (2-D,
    # 16x16 pods). Hosts: 4 chips (v4, v5p), 8 chips (v5e, v6e). Largest slices: v4 4,096, v5p 8,960,
    # v5e and v6e 256 chips.
    "tpu-v4": _tpu_hw("tpu-v4", TPU_V4, link=4.5e10, torus=4, host=4, slice_max=4096, kinds=("tpu v4",)),
    "tpu-v5e": _tpu_hw("tpu-v5e", TPU_V5E, link=4.5e10, torus=16, host=8, slice_max=256,
                       kinds=("tpu v5 lite", "tpu v5e")),
    "tpu-v5p": _tpu_hw("tpu-v5p", TPU_V5P, link=9e10, torus=4, host=4, slice_max=8960, kinds=("tpu v5p", "tpu v5")),
    "tpu-v6e": _tpu_hw("tpu-v6e", TPU_V6E, link=9e10, torus=16, host=8, slice_max=256, kinds=("tpu v6", "trillium")),
}


CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "calibration")
"""Committed calibration files: ``<preset>.json`` holds efficiencies measured on that chip by
``python -m benchmarks.gpu --calibrate`` (its ``"table"``), with where and when it was measured."""


def calibrated(hw: Hardware, path: str | None = None) -> Hardware:
    """``hw`` with the efficiencies of its calibration file (``CALIBRATION_DIR/<name>.json``, or ``path``)
    in place of the sourced ones; ``hw`` unchanged when there is none. The file is JSON:
    ``{"device": ..., "measured": ..., "table": {"matmul_efficiency": {"bf16": ...}, "hbm_efficiency": ...,
    "attention_efficiency": [fwd, bwd]}}``; ``Accelerator.source`` then names it."""
    path = path or os.path.join(CALIBRATION_DIR, f"{hw.name}.json")
    if not os.path.exists(path):
        return hw
    with open(path) as f:
        data = json.load(f)
    table = data.get("table", data)
    acc = hw.accelerator
    changes = {"source": f"calibrated: {os.path.basename(path)} ({data.get('device', '?')}, "
                         f"{data.get('measured', '?')})"}
    if "matmul_efficiency" in table:
        changes["matmul_efficiency"] = {**acc.matmul_efficiency, **table["matmul_efficiency"]}
    if "hbm_efficiency" in table:
        changes["hbm_efficiency"] = float(table["hbm_efficiency"])
    if "attention_efficiency" in table:
        changes["attention_efficiency"] = tuple(float(x) for x in table["attention_efficiency"])
    return dataclasses.replace(hw, accelerator=dataclasses.replace(acc, **changes))


def hardware_preset(name: str) -> Hardware:
    """The named :class:`Hardware` (see ``HARDWARE``), with its committed calibration file when there is one
    (:func:`calibrated`).

    Raises:
      ValueError: no such preset; the message lists them.
    """
    try:
        hw = HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(HARDWARE)}") from None
    return calibrated(hw)


def hardware_for_device_kind(device_kind: str) -> Hardware | None:
    """The preset whose ``device_kinds`` match ``jax.Device.device_kind`` (longest match wins), or None.

    Example:
        >>> hardware_for_device_kind("NVIDIA H200").name
        'h200'
        >>> hardware_for_device_kind("cpu") is None
        True
    """
    kind = device_kind.lower()
    best, length = None, 0
    for hw in HARDWARE.values():
        for k in hw.device_kinds:
            if k in kind and len(k) > length:
                best, length = hw, len(k)
    return best


def ring_span(mesh_shape: tuple[int, ...], axes) -> int:
    """How many consecutive devices (row-major over the mesh) one group over ``axes`` stretches across:
    the stride of its outermost axis times that axis's size."""
    axes = sorted(axes)
    if not axes:
        return 1
    outer = axes[0]
    return math.prod(mesh_shape[outer:])
