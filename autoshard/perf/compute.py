"""Compute on one device: a roofline per kernel.

An op's cost is a :class:`Work`: its flops, the HBM bytes it reads and writes once fused with its
neighbours, what kind of unit runs it and, for a matmul, its local shape. :func:`seconds` prices it on an
:class:`~autoshard.perf.hardware.Accelerator`::

    time = max(flops / achievable rate, bytes / HBM stream bandwidth)

- A **matmul** runs at the chip's sustained matmul rate for its operand class (fp8, bf16, tf32), times the
  tile quantization of its local shape (:func:`matmul_efficiency`): a 100-row output in 128-row tiles uses
  78% of them, and a matmul of fewer tiles than the chip has SMs (MXUs) leaves the rest idle; on a TPU the
  operands are padded to the MXU's tile.
- A **fused attention** kernel (FlashAttention, cuDNN, Splash) runs at the chip's measured attention rate,
  forward or backward; its score matrix never reaches HBM.
- **Elementwise**, reduction and layout work runs on the vector units, and is nearly always bound by the
  bytes it moves.

Example:
    >>> from autoshard.perf.hardware import H100
    >>> from autoshard.perf.compute import Work, seconds
    >>> adam = Work(flops=0.0, bytes=36e9, kind="vector")   # AdamW over 1.3B fp32 parameters
    >>> round(seconds(adam, H100) * 1e3, 1)                   # milliseconds
    11.5
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.perf.hardware import Accelerator

__all__ = ["KINDS", "Work", "matmul_efficiency", "operand_class", "seconds"]

KINDS = ("vector", "matmul", "attention_fwd", "attention_bwd")


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    """What one op does on one device.

    Attributes:
      flops: floating-point operations.
      bytes: HBM bytes read and written (after fusion: values that stay in registers count nothing).
      kind: one of :data:`KINDS`.
      operand_class: ``"fp8"``, ``"bf16"``, ``"tf32"`` or ``"fp32"`` (:func:`operand_class`).
      gemm: for a matmul, its local ``(batch, m, n, k)``.
    """

    flops: float = 0.0
    bytes: float = 0.0
    kind: str = "vector"
    operand_class: str = "fp32"
    gemm: tuple[int, int, int, int] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Work.kind {self.kind!r} is not one of {KINDS}")

    def scaled(self, shards: float) -> Work:
        """The work of one of ``shards`` equal parts (a split op on one device)."""
        if shards == 1:
            return self
        return dataclasses.replace(self, flops=self.flops / shards, bytes=self.bytes / shards)


def operand_class(dtypes, platform: str = "gpu") -> str:
    """The matmul rate class of operands of ``dtypes``: ``"fp8"`` if any is an 8-bit float, ``"bf16"`` for
    2-byte floats, ``"tf32"`` for wider floats (jax's default matmul precision on GPU runs fp32 operands
    on the tensor cores as TF32; on TPU as bf16 passes)."""
    widths = []
    for dt in dtypes:
        if dt is None:
            continue
        try:
            d = np.dtype(dt)
        except TypeError:
            continue
        name = d.name
        if "float8" in name or "e4m3" in name or "e5m2" in name:
            widths.append(1)
        elif d.kind == "f" or name in ("bfloat16", "float16"):
            widths.append(d.itemsize)
    if not widths:
        return "fp32"
    if min(widths) == 1:
        return "fp8"
    return "bf16" if max(widths) <= 2 else "tf32"


def _quantized(size: int, tile: int) -> float:
    """The fraction of ``ceil(size / tile) * tile`` that ``size`` fills."""
    return size / (math.ceil(size / tile) * tile) if size > 0 else 1.0


def matmul_efficiency(acc: Accelerator, batch: int, m: int, n: int, k: int) -> float:
    """The fraction of the sustained matmul rate a local ``(batch, m, n, k)`` matmul reaches.

    The output is cut into ``matmul_tile`` tiles ([cublas-tile], [mxu]); a dimension that does not fill its
    last tile wastes the rest of it (tile quantization), and a matmul of fewer tiles than the chip has
    compute units leaves the others idle. Beyond one tile per unit the libraries balance the last wave
    (cuBLAS's heuristics pick among tile shapes and split-K; Hopper's stream-K schedules), so whole waves
    are not counted. On a TPU ``k`` is padded to the MXU too."""
    if min(batch, m, n, k) <= 0:
        return 1.0
    tm, tn = acc.matmul_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    eff = _quantized(m, tm) * _quantized(n, tn) * min(1.0, tiles / acc.compute_units)
    if acc.platform == "tpu":
        eff *= _quantized(k, tm)
    return eff


def seconds(work: Work, acc: Accelerator) -> float:
    """Roofline seconds of ``work`` on ``acc``: the larger of its compute time and its HBM time."""
    mem = work.bytes / acc.stream_bandwidth if work.bytes else 0.0
    if not work.flops:
        return mem
    if work.kind == "matmul":
        rate = acc.matmul_rate(work.operand_class)
        if work.gemm is not None:
            rate *= matmul_efficiency(acc, *work.gemm)
    elif work.kind in ("attention_fwd", "attention_bwd"):
        fwd, bwd = acc.attention_efficiency
        rate = acc.peak_flops["bf16"] * (fwd if work.kind == "attention_fwd" else bwd)
    else:
        rate = acc.vector_flops
    return max(work.flops / rate, mem)
