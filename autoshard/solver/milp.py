"""The strategy-selection MILP on a reduced core, solved with HiGHS.

Variables are ``x[i, s]`` (binary, node ``i`` takes strategy ``s``) and, per edge,
continuous ``e[g, h] >= 0`` over *groups* of identical rows ``g`` and identical
columns ``h`` of the edge matrix. Resharding matrices repeat rows and columns a
lot, so this is far smaller than one variable per matrix entry. The marginal
constraints

    sum_h e[g, h] = sum_{s in g} x[u, s]      sum_g e[g, h] = sum_{t in h} x[v, t]

force ``e`` to the single chosen cell once ``x`` is integral. Infinite cells get
no variable, which forbids the pair. A window of free nodes can be solved with
the others fixed (large-neighbourhood search).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import scipy.optimize
import scipy.sparse

from autoshard.solver.memory import MemoryRows
from autoshard.solver.reduce import Reduction


@dataclasses.dataclass(frozen=True, slots=True)
class MilpResult:
    """What one MILP solve found.

    Attributes:
      choice: full core-local choice (fixed nodes keep theirs), or ``None``.
      status: HiGHS's status: "optimal", "time_limit", "infeasible", "other".
      objective: objective value of ``choice`` as the MILP sees it.
      bound: the dual bound (a lower bound on the window's optimum), or ``nan``.
    """

    choice: np.ndarray | None
    status: str
    objective: float
    bound: float


def group_matrix(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group identical rows and columns: ``m[s, t] == r[rows[s], cols[t]]`` (groups in the rows' and the
    columns' lexicographic order, as ``np.unique(m, axis=...)`` numbers them)."""
    rows, cols = _row_groups(m), _row_groups(m.T)
    r = np.empty((rows.max() + 1, cols.max() + 1))
    r[rows[:, None], cols[None, :]] = m
    return r, rows, cols


def _row_groups(m: np.ndarray) -> np.ndarray:
    """Each row's group among the distinct rows of ``m``, numbered in lexicographic order (a sort of the rows,
    several times faster than ``np.unique(m, axis=0)`` on the small matrices of a core)."""
    order = np.lexsort(m.T[::-1])
    ordered = m[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    groups = np.empty(len(order), dtype=np.int64)
    groups[order] = np.cumsum(starts) - 1
    return groups


def solve_milp(
    red: Reduction,
    rows: MemoryRows | None,
    *,
    time_limit: float,
    free: np.ndarray | None = None,
    choice: np.ndarray | None = None,
    objective: str = "cost",
    groups: list | None = None,
    rel_gap: float = 1e-9,
    verbose: bool = False,
    relaxation_first: bool = False,
    relaxation_only: bool = False,
) -> MilpResult:
    """Solve the core MILP, or a window of it.

    Args:
      red: the reduced problem.
      rows: memory rows, or ``None`` without a memory limit.
      time_limit: seconds for HiGHS.
      free: bool mask of core nodes to optimise (default: all); the others keep
        ``choice``.
      choice: the current core-local choice (needed when ``free`` is given).
      objective: "cost" minimises the cost; "peak" minimises the peak usage.
      groups: cached :func:`group_matrix` results per core edge.
      rel_gap: relative MIP gap at which HiGHS stops.
      verbose: print HiGHS's log.
      relaxation_first: solve the LP relaxation first (dual simplex, at most
        ``RELAXATION_SHARE`` of the time) and answer from it when its optimum is
        integral, which proves it optimal; else the MILP runs in the time left.
      relaxation_only: only the LP relaxation, with all of ``time_limit``: an integral optimum is
        answered as above; a fractional one as status "relaxed", its choice each node's largest
        variable (rounded: its cost is not the objective, which is nan) and its value the bound.
    """
    n = red.num_core
    lay = _layout(red, np.ones(n, dtype=bool) if free is None else free)
    eq = _assignment_and_edge_rows(red, lay, choice, groups)
    peak = objective == "peak"
    c, nvar = eq.c, eq.nvar
    zvar = nvar  # the peak objective's variable
    if peak:
        nvar += 1
        c = np.zeros(nvar)
        c[zvar] = 1.0
    a_eq = scipy.sparse.csr_matrix((eq.vals, (eq.rows, eq.cols)), shape=(eq.nrow, nvar))
    constraints = [scipy.optimize.LinearConstraint(a_eq, eq.rhs, eq.rhs)]
    if rows is not None and rows.num_points:
        mem, infeasible = _memory_constraint(red, rows, lay, choice, nvar=nvar, zvar=zvar if peak else None)
        if infeasible:
            return MilpResult(None, "infeasible", np.inf, np.nan)
        if mem is not None:
            constraints.append(mem)
    ub_var = np.ones(nvar)
    if peak:
        ub_var[zvar] = np.inf
    const = 0.0 if peak else eq.const
    start = time.perf_counter()
    if relaxation_first or relaxation_only:
        limit = time_limit if relaxation_only else min(RELAXATION_SHARE * float(time_limit), RELAXATION_MAX_S)
        x, value, integral = _relaxation(c, constraints, ub=ub_var, nx=lay.nx, time_limit=limit)
        if integral:
            return MilpResult(_choice_of(x, lay, n, choice), "optimal", value + const, value + const)
        if relaxation_only:
            if x is None:
                return MilpResult(None, "time_limit", np.inf, np.nan)
            return MilpResult(_choice_of(x, lay, n, choice), "relaxed", np.nan, value + const)
    left = float(time_limit) - (time.perf_counter() - start)
    options = {"time_limit": max(left, 1e-3), "disp": verbose, "mip_rel_gap": rel_gap}
    res = _run_highs(c, constraints, nx=lay.nx, ub=ub_var, options=options)
    status = {0: "optimal", 1: "time_limit", 2: "infeasible"}.get(res.status, "other")
    bound = float(getattr(res, "mip_dual_bound", np.nan) or np.nan)
    if res.x is None:
        return MilpResult(None, status, np.inf, bound)
    return MilpResult(_choice_of(res.x, lay, n, choice), status, float(res.fun) + const, bound + const)


# Of a MILP's time, the most its LP relaxation may take (``relaxation_first``), and at most this many
# seconds. The planner's layer cores are integral at the root: on GPT-39B's 186 layer cores (64 devices)
# the relaxation was integral on every one and took 30 ms each against the MILP's 70 ms. A relaxation that
# takes long is a hard one whose MILP needs the time more (contest B: a fractional LP in 4.1 s, the MILP
# 4.5 s after it).
RELAXATION_SHARE = 0.5
RELAXATION_MAX_S = 0.5
# How far from 0 or 1 an assignment variable of the relaxation may be and still count as integral.
_INTEGRAL_TOL = 1e-7


def _choice_of(x: np.ndarray, lay: _Layout, n: int, choice) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64) if choice is None else np.array(choice, dtype=np.int64)
    for k in lay.fidx:
        out[k] = int(np.argmax(x[lay.block(k)]))
    return out


def _relaxation(c: np.ndarray, constraints: list, *, ub: np.ndarray, nx: int, time_limit: float):
    """The LP relaxation's optimum by HiGHS's dual simplex, ``(x, objective, integral)``: ``integral`` when
    every assignment variable is (then it is the MILP's optimum too); ``(None, nan, False)`` when none was
    found in time."""
    eq, rest = constraints[0], constraints[1:]
    a_ub = scipy.sparse.vstack([m.A for m in rest]).tocsr() if rest else None
    b_ub = np.concatenate([m.ub for m in rest]) if rest else None
    res = scipy.optimize.linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=eq.A, b_eq=eq.lb,
                                 bounds=np.stack([np.zeros(c.size), ub], axis=1), method="highs-ds",
                                 options={"time_limit": max(time_limit, 1e-3)})
    if res.status != 0 or res.x is None:
        return None, np.nan, False
    x = res.x[:nx]
    return res.x, float(res.fun), bool(np.abs(x - np.round(x)).max(initial=0.0) <= _INTEGRAL_TOL)


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """Where each free node's ``x`` variables sit: node ``k``'s are ``off[k] : off[k] + sizes[k]``."""

    free: np.ndarray
    fidx: np.ndarray
    sizes: np.ndarray
    off: np.ndarray
    nx: int

    def block(self, k) -> slice:
        return slice(self.off[k], self.off[k] + self.sizes[k])

    def columns(self, k) -> np.ndarray:
        return self.off[k] + np.arange(self.sizes[k])


def _layout(red: Reduction, free: np.ndarray) -> _Layout:
    sizes = np.array([c.size for c in red.node_costs], dtype=np.int64)
    fidx = np.flatnonzero(free)
    off = np.full(red.num_core, -1, dtype=np.int64)
    off[fidx] = np.concatenate([[0], np.cumsum(sizes[fidx])[:-1]]) if fidx.size else []
    return _Layout(free, fidx, sizes, off, int(sizes[fidx].sum()))


@dataclasses.dataclass(frozen=True, slots=True)
class _EqualityRows:
    """The cost objective, its constant (fixed nodes and edges), and the equality rows (COO)."""

    c: np.ndarray
    const: float
    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    rhs: np.ndarray
    nrow: int
    nvar: int


def _assignment_and_edge_rows(red: Reduction, lay: _Layout, choice, groups) -> _EqualityRows:
    """One strategy per free node, and the marginal rows of every edge between free nodes.

    An edge with one fixed end becomes node costs of the free end; one with both
    ends fixed, a constant.
    """
    free, fidx, sizes, off, nx = lay.free, lay.fidx, lay.sizes, lay.off, lay.nx
    c_parts = [red.node_costs[k] for k in fidx]
    c = np.concatenate(c_parts) if c_parts else np.zeros(0)
    const = 0.0
    if choice is not None:
        const = sum(float(red.node_costs[k][choice[k]]) for k in np.flatnonzero(~free))
    # assignment rows (= 1), then the edges' marginal rows (= 0)
    rr, cc, vv = [np.repeat(np.arange(fidx.size), sizes[fidx])], [np.arange(nx)], [np.ones(nx)]
    eq_rhs = [np.ones(fidx.size)]
    nrow = fidx.size
    ecost = []
    nvar = nx
    for k, ((u, v), m) in enumerate(zip(red.edges, red.edge_costs, strict=True)):
        fu, fv = free[u], free[v]
        if not fu and not fv:
            const += float(m[choice[u], choice[v]])
            continue
        if fu and not fv:
            c[off[u] : off[u] + sizes[u]] += m[:, choice[v]]
            continue
        if fv and not fu:
            c[off[v] : off[v] + sizes[v]] += m[choice[u], :]
            continue
        r, gr, gc = groups[k] if groups is not None else group_matrix(m)
        ng, nh = r.shape
        gi, hi = np.nonzero(np.isfinite(r))
        ne = gi.size
        evars = nvar + np.arange(ne)
        ecost.append(r[gi, hi])
        nvar += ne
        # row-group constraints: sum_h e[g,h] - sum_{s in g} x[u,s] = 0
        rr += [nrow + gi, nrow + gr]
        cc += [evars, lay.columns(u)]
        vv += [np.ones(ne), -np.ones(sizes[u])]
        nrow += ng
        rr += [nrow + hi, nrow + gc]
        cc += [evars, lay.columns(v)]
        vv += [np.ones(ne), -np.ones(sizes[v])]
        nrow += nh
        eq_rhs.append(np.zeros(ng + nh))
    c = np.concatenate([c, *ecost]) if ecost else c
    return _EqualityRows(c, const, np.concatenate(rr), np.concatenate(cc), np.concatenate(vv),
                         np.concatenate(eq_rhs), nrow, nvar)


def _memory_constraint(red: Reduction, rows: MemoryRows, lay: _Layout, choice, *, nvar: int, zvar: int | None):
    """The binding memory rows over the free nodes, and whether the fixed nodes alone overflow one.

    With ``zvar`` (the peak objective) every row is kept and bounds ``usage - z``
    by 0 instead of ``usage`` by the row's capacity. Returns ``(constraint or None, infeasible)``.
    """
    peak = zvar is not None
    row_nodes, caps = rows.binding(red.node_memory, keep_all=peak)
    mr, mc, mv, ub = [], [], [], []
    nm = 0
    for nodes, cap in zip(row_nodes, caps, strict=True):
        fixed_use = rows.limit - cap if peak else -cap
        fnodes = []
        for k in nodes:
            if lay.free[k]:
                fnodes.append(k)
            else:
                fixed_use += red.node_memory[k][choice[k]]
        if not fnodes and not peak:
            if fixed_use > rows.tol:
                return None, True
            continue
        for k in fnodes:
            mc.append(lay.columns(k))
            mv.append(red.node_memory[k])
            mr.append(np.full(lay.sizes[k], nm))
        if peak:
            mc.append(np.array([zvar]))
            mv.append(np.array([-1.0]))
            mr.append(np.array([nm]))
        ub.append(-fixed_use)
        nm += 1
    if not nm:
        return None, False
    a_mem = scipy.sparse.csr_matrix((np.concatenate(mv), (np.concatenate(mr), np.concatenate(mc))), shape=(nm, nvar))
    return scipy.optimize.LinearConstraint(a_mem, -np.inf, np.array(ub)), False


def _run_highs(c: np.ndarray, constraints: list, *, nx: int, ub: np.ndarray, options: dict):
    """HiGHS on the model (the first ``nx`` variables binary), with one retry without presolve."""
    integrality = np.zeros(c.size)
    integrality[:nx] = 1
    bounds = scipy.optimize.Bounds(np.zeros(c.size), ub)
    start = time.perf_counter()
    res = scipy.optimize.milp(c, integrality=integrality, bounds=bounds, constraints=constraints, options=options)
    if res.status == 2 and len(constraints) > 1:
        # HiGHS's presolve can call a feasible model with memory rows of 1e11-byte coefficients
        # infeasible (seen on GPT-39B: feasible, optimal, without presolve); ask again without it
        left = options["time_limit"] - (time.perf_counter() - start)
        if left > 0.1:
            res = scipy.optimize.milp(c, integrality=integrality, bounds=bounds, constraints=constraints,
                                      options={**options, "time_limit": left, "presolve": False})
    return res


def restrict(red: Reduction, keep: list[np.ndarray]) -> Reduction:
    """The core with node ``k`` limited to its strategies ``keep[k]`` (core-local indices, sorted).

    A choice of the restricted core maps back as ``keep[k][choice[k]]``; its
    ``alive`` lists are left as they are (the restricted core is never expanded).
    """
    mem = tuple(None if m is None else m[kp] for m, kp in zip(red.node_memory, keep, strict=True))
    return dataclasses.replace(
        red,
        node_costs=tuple(c[kp] for c, kp in zip(red.node_costs, keep, strict=True)),
        edge_costs=tuple(m[np.ix_(keep[u], keep[v])] for (u, v), m in zip(red.edges, red.edge_costs, strict=True)),
        node_memory=mem,
        records=(),
    )


def promising(red: Reduction, choice: np.ndarray, local: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Per core node, about ``width`` strategies worth a restricted MILP, always including ``choice``'s.

    Half are the cheapest given the neighbours' current strategies (``local``, the
    node's local cost vectors), half the cheapest optimistically (node cost plus
    each incident edge's cheapest entry in that row); the least-memory strategy is kept too, so the
    restricted core can still fit where the limit binds.
    """
    opt = [c.copy() for c in red.node_costs]
    for (u, v), m in zip(red.edges, red.edge_costs, strict=True):
        opt[u] += np.min(m, axis=1)
        opt[v] += np.min(m, axis=0)
    keep = []
    half = max(width // 2, 1)
    for k, c in enumerate(red.node_costs):
        if c.size <= width:
            keep.append(np.arange(c.size))
            continue
        pick = {int(choice[k])}
        pick.update(np.argsort(local[k], kind="stable")[:half].tolist())
        pick.update(np.argsort(opt[k], kind="stable")[: width - half].tolist())
        if red.node_memory[k] is not None:
            pick.add(int(np.argmin(red.node_memory[k])))
        keep.append(np.array(sorted(pick), dtype=np.int64))
    return keep
