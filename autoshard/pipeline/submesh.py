"""Sub-mesh options of a device mesh, and handing devices out to stages.

Following Alpa (§5.1), a physical mesh of ``R`` rows (hosts) × ``C`` devices offers sub-meshes
``(1, c)`` for every power of two ``c`` dividing ``C`` (and ``C`` itself) and ``(r, C)`` for
``r <= R``; each has every 2-D logical shape of its size. Allocating the largest stages first,
aligned, always tiles the mesh when the sizes add up.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.errors import MeshError


@dataclasses.dataclass(frozen=True)
class SubmeshOption:
    physical: tuple[int, int]
    logical: tuple[int, int]

    @property
    def size(self) -> int:
        return self.physical[0] * self.physical[1]


def physical_grid(mesh) -> np.ndarray:
    """The mesh's devices as a 2-D (rows, columns) array; a 1-D mesh is one row. An ``AbstractMesh``'s
    "devices" are their positions ``0..size-1`` (stages of it are abstract too)."""
    from autoshard.cluster import is_abstract

    devs = np.arange(mesh.size).reshape(tuple(mesh.axis_sizes)) if is_abstract(mesh) else np.asarray(mesh.devices)
    return devs.reshape(1, -1) if devs.ndim == 1 else devs.reshape(devs.shape[0], -1)


MAX_OPTIONS = 128
"""Above this many sub-mesh options (hundreds of hosts), whole-row sub-meshes take only row counts that
divide the rows or are powers of two: every (r, C) for r <= R would be thousands of options, each planned."""


def submesh_options(grid_shape: tuple[int, int]) -> list[SubmeshOption]:
    """Alpa's sub-mesh shapes of a ``(rows, columns)`` device grid, each with every 2-D logical shape
    (fewer row counts on very large grids: :data:`MAX_OPTIONS`)."""
    R, C = grid_shape
    physical = []
    c = 1
    while c < C:
        if C % c == 0:
            physical.append((1, c))
        c *= 2
    rows = list(range(1, R + 1))
    if len(_with_logical(physical + [(r, C) for r in rows])) > MAX_OPTIONS:
        rows = [r for r in rows if R % r == 0 or r & (r - 1) == 0]
    return _with_logical(physical + [(r, C) for r in rows])


def _with_logical(physical) -> list[SubmeshOption]:
    out = []
    for p in physical:
        n = p[0] * p[1]
        for a in range(1, n + 1):
            if n % a == 0:
                out.append(SubmeshOption(p, (a, n // a)))
    return out


def allocate(grid: np.ndarray, physical_shapes) -> list[np.ndarray]:
    """Devices for each stage (largest first, aligned first fit)."""
    R, C = grid.shape
    free = np.ones((R, C), dtype=bool)
    out: list = [None] * len(physical_shapes)
    for s in sorted(range(len(physical_shapes)), key=lambda i: -math.prod(physical_shapes[i])):
        r, c = physical_shapes[s]
        if r > 1 or c == C:
            rows = [i for i in range(R) if free[i].all()][:r]
            if len(rows) < r:
                raise MeshError(f"cannot place a {r}x{C} sub-mesh: not enough free rows")
            free[rows] = False
            out[s] = grid[rows]
            continue
        for i in range(R):
            placed = False
            for j in range(0, C - c + 1, c):
                if free[i, j:j + c].all():
                    free[i, j:j + c] = False
                    out[s] = grid[i:i + 1, j:j + c]
                    placed = True
                    break
            if placed:
                break
        if out[s] is None:
            raise MeshError(f"cannot place a 1x{c} sub-mesh in the {R}x{C} device grid")
    return out


def check_submeshes(grid_shape, shapes) -> None:
    """Raise MeshError listing why the user's ``submeshes`` do not tile the mesh."""
    R, C = grid_shape
    total = R * C
    sizes = [math.prod(s) for s in shapes]
    problems = []
    if sum(sizes) != total:
        problems.append(f"their sizes {sizes} add up to {sum(sizes)} devices, but the mesh has {total}")
    for s, n in zip(shapes, sizes, strict=True):
        if not ((n <= C and C % n == 0) or n % C == 0):
            problems.append(f"a sub-mesh of shape {s} ({n} devices) is neither a divisor of a row of {C} devices "
                            f"nor whole rows")
    if problems:
        raise MeshError(
            f"submeshes={list(shapes)} do not tile the {R}x{C} device mesh: " + "; ".join(problems) +
            f". Fix: give shapes whose sizes add up to {total}, e.g. {[(1, C // 2)] * 2 * R if C % 2 == 0 else [(1, C)] * R}.")
