"""The result of planning: a frozen :class:`Plan` with shardings, costs and a report."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from autoshard.cost import Collective
from autoshard.errors import PlanError
from autoshard.report import Report, format_bytes
from autoshard.spec import MeshInfo, ShardingSpec, dtype_itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class PlanCost:
    """Predicted per-device cost of one step.

    Attributes:
      compute_seconds: every op's roofline time on the cluster's hardware (:mod:`autoshard.perf`), or its
        flops over the cluster's flop/s without a hardware model.
      communication_seconds: the time of every collective and reshard on its network tier.
      communication_bytes: the bytes those collectives move per device (Alpa's B).
      peak_memory_bytes: the predicted peak of live values per device.
      objective: what the solver minimised (its pairwise sum of compute and communication seconds).
      step_seconds: the predicted step: compute and communication list-scheduled, overlapped where the
        backend runs collectives asynchronously (:func:`autoshard.planner.simulate_step`). None for a plan
        saved before it was recorded (then :attr:`total_seconds` is the plain sum).
      exposed_communication_seconds: the part of the step spent waiting on communication.
      flops, hbm_bytes: per device per step, from every op's work (0 without a hardware model).
    """

    compute_seconds: float
    communication_seconds: float
    communication_bytes: float
    peak_memory_bytes: float
    objective: float
    step_seconds: float | None = None
    exposed_communication_seconds: float | None = None
    flops: float = 0.0
    hbm_bytes: float = 0.0

    @property
    def total_seconds(self) -> float:
        """The one predicted step time of the plan: :attr:`step_seconds`, or the plain sum for an old plan."""
        if self.step_seconds is not None:
            return self.step_seconds
        return self.compute_seconds + self.communication_seconds


@dataclasses.dataclass(frozen=True, slots=True)
class PlanCheck:
    """Predicted against compiled communication, per collective kind (bytes per device per step)."""

    predicted: dict
    compiled: dict

    @property
    def predicted_bytes(self) -> float:
        return float(sum(self.predicted.values()))

    @property
    def compiled_bytes(self) -> float:
        return float(sum(self.compiled.values()))

    @property
    def ratio(self) -> float:
        """compiled / predicted bytes (1.0 is perfect; inf when nothing was predicted)."""
        if self.predicted_bytes == 0:
            return 1.0 if self.compiled_bytes == 0 else math.inf
        return self.compiled_bytes / self.predicted_bytes

    def __str__(self) -> str:
        kinds = sorted(set(self.predicted) | set(self.compiled))
        lines = [f"{'collective':<16}{'predicted':>14}{'compiled':>14}"]
        for k in kinds:
            lines.append(f"{k:<16}{format_bytes(self.predicted.get(k, 0)):>14}{format_bytes(self.compiled.get(k, 0)):>14}")
        lines.append(f"{'total':<16}{format_bytes(self.predicted_bytes):>14}{format_bytes(self.compiled_bytes):>14}"
                     f"   ratio {self.ratio:.3f}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan(Report):
    """A sharding plan for one step function and one set of argument shapes.

    Attributes:
      mesh: the ``jax.sharding.Mesh`` the plan runs on.
      in_specs, out_specs: one :class:`ShardingSpec` per flat argument / output leaf.
      in_paths, out_paths: readable pytree paths of those leaves.
      in_avals: ``(shape, dtype)`` per flat argument.
      cost: the predicted :class:`PlanCost`.
      collectives: predicted ``(Collective, times per step)`` pairs.
      value_specs, operand_specs: the layout of every value, for lowering.
      fingerprint: identifies the captured program the plan belongs to.
      stats: timings per pass and solver diagnostics.
      warnings: primitives that ran replicated for lack of a rule.
      memory: the predicted :class:`~autoshard.memory.MemoryEstimate` (peak and its breakdown).
      host_inputs, host_outputs: flat arguments / outputs kept in host memory (``pinned_host``),
        chosen when no sharding fits the device budget (see :mod:`autoshard.offload`).
      remat: the :class:`~autoshard.remat.RematChoice` when the planner considered recomputing
        forward segments (the budget bound); None otherwise.
      replan: ``replan(hints) -> Plan``, the same planning with more leaves pinned, which the
        planner leaves for :meth:`explain`. Not saved: a plan loaded from JSON has None.
      in_roles: each flat argument's role (:data:`autoshard.roles.ROLES`), aligned with ``in_paths``;
        ``()`` for a plan saved before roles were recorded.
      deferred: value ids of the gradients a pipeline stage's plan keeps as unreduced partial sums over
        its microbatches although it reduce-scatters them, reducing them once per step
        (:mod:`autoshard.pipeline.deferred`); the plan's memory counts their unreduced size.
    """

    mesh: Any
    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    in_paths: tuple[str, ...]
    out_paths: tuple[str, ...]
    in_avals: tuple[tuple[tuple[int, ...], str], ...]
    cost: PlanCost
    collectives: tuple[tuple[Collective, int], ...]
    value_specs: dict
    operand_specs: dict
    fingerprint: str
    stats: dict = dataclasses.field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    in_tree: Any = None
    out_tree: Any = None
    memory: Any = None
    host_inputs: tuple[int, ...] = ()
    host_outputs: tuple[int, ...] = ()
    remat: Any = None
    replan: Any = dataclasses.field(default=None, repr=False, compare=False)
    in_roles: tuple[str, ...] = ()
    deferred: frozenset = frozenset()

    @property
    def mesh_info(self) -> MeshInfo:
        return MeshInfo.from_mesh(self.mesh)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Pytree paths of the arguments kept in host memory (see :mod:`autoshard.offload`)."""
        return tuple(self.in_paths[i] for i in self.host_inputs)

    @property
    def in_shardings(self):
        """``NamedSharding``s mirroring the (dynamic) arguments."""
        import jax

        from autoshard.compile import named_shardings

        flat = named_shardings(self, self.in_specs, self.host_inputs)
        return flat if self.in_tree is None else jax.tree_util.tree_unflatten(self.in_tree, flat)

    @property
    def out_shardings(self):
        """``NamedSharding``s mirroring the outputs."""
        import jax

        from autoshard.compile import named_shardings

        flat = named_shardings(self, self.out_specs, self.host_outputs)
        return flat if self.out_tree is None else jax.tree_util.tree_unflatten(self.out_tree, flat)

    def predicted_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c, times in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.bytes * times
        return out

    def verify(self, compiled) -> PlanCheck:
        """Compare predicted communication with what XLA compiled.

        Bytes follow Alpa's convention on both sides: the all-reduced buffer, the
        gathered result, the buffer before a reduce-scatter, the all-to-all buffer.
        On CPU, XLA emits reduce-scatters as all-reduces (and a slice), and the CPU
        cost model prices them so; the predicted reduce-scatters are then listed as
        the all-reduces they compile to.
        """
        return self.check_against(compiled_bytes_by_kind(compiled))

    def check_against(self, compiled: dict[str, float]) -> PlanCheck:
        """:meth:`verify` from compiled bytes per collective kind (summed over one or more programs)."""
        predicted = self.predicted_bytes_by_kind()
        from autoshard.backends import profile_for_mesh

        if ("reduce-scatter" in predicted and "reduce-scatter" not in compiled
                and profile_for_mesh(self.mesh).reduce_scatter_as_all_reduce):
            predicted["all-reduce"] = predicted.get("all-reduce", 0.0) + predicted.pop("reduce-scatter")
        return PlanCheck(predicted, dict(compiled))

    def parameter_table(self) -> list[tuple[str, tuple[int, ...], str, str, int]]:
        """(path, shape, dtype, PartitionSpec, bytes per device) for every argument leaf."""
        info = self.mesh_info
        rows = []
        for path, (shape, dtype), spec in zip(self.in_paths, self.in_avals, self.in_specs, strict=True):
            nbytes = math.prod(spec.shard_shape(shape, info)) * dtype_itemsize(dtype) if shape else \
                dtype_itemsize(dtype)
            rows.append((path, tuple(shape), str(dtype), str(spec.to_partition_spec(info)), int(nbytes)))
        return rows

    def summary(self, max_rows: int = 40, *, rich: bool | None = None) -> str:
        """A readable report: mesh, cost, every argument's spec, the costliest collectives.

        ``rich``: draw rich tables (with the time split and memory, see :mod:`autoshard.report`).
        None: when rich is installed and stdout is a terminal; otherwise plain text.
        """
        if rich is None:
            import importlib.util
            import sys

            rich = sys.stdout.isatty() and importlib.util.find_spec("rich") is not None
        if rich:
            from autoshard.report import rich_summary

            return rich_summary(self, max_rows=max_rows)
        info = self.mesh_info
        c = self.cost
        lines = [
            f"autoshard plan on mesh {dict(zip(info.names, info.shape, strict=True))}",
            f"  predicted step: compute {c.compute_seconds * 1e3:.3f} ms + communication "
            f"{c.communication_seconds * 1e3:.3f} ms ({format_bytes(c.communication_bytes)}/device)",
            f"  predicted peak memory: {format_bytes(c.peak_memory_bytes)}/device",
        ]
        if self.memory is not None:
            parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.memory.breakdown.items() if v)
            lines[-1] += f" ({parts})"
        if self.host_inputs:
            host = f" ({format_bytes(self.memory.host_bytes)}/device)" if self.memory is not None else ""
            seconds = self.stats.get("host_transfer_seconds")
            moved = f" ({seconds * 1e3:.3f} ms over the host link)" if seconds is not None else ""
            lines.append(f"  offloaded to host memory: {len(self.host_inputs)} optimizer-state leaves{host}, "
                         f"moved in and out every step{moved}")
        if self.remat is not None and self.remat.units:
            lines.append(f"  {self.remat.describe()}")
        if self.stats.get("timings"):
            t = self.stats["timings"]
            lines.append("  planning: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items()))
        rows = self.parameter_table()
        lines.append(f"\n  {'argument':<50} {'shape':<18} {'spec':<28} {'bytes/dev':>10}")
        for path, shape, _, spec, nbytes in rows[:max_rows]:
            shown = path if len(path) <= 50 else "…" + path[-49:]
            lines.append(f"  {shown:<50} {str(shape):<18} {spec:<28} {format_bytes(nbytes):>10}")
        if len(rows) > max_rows:
            lines.append(f"  ... and {len(rows) - max_rows} more")
        agg: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        for col, times in self.collectives:
            key = (col.kind, tuple(info.names[a] for a in col.axes))
            e = agg.setdefault(key, [0, 0.0])
            e[0] += times
            e[1] += col.bytes * times
        if agg:
            lines.append(f"\n  {'collective':<16} {'axes':<16} {'count':>6} {'bytes/dev':>12}")
            for (kind, axes), (n, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:10]:
                lines.append(f"  {kind:<16} {','.join(axes):<16} {n:>6} {format_bytes(b):>12}")
        if self.warnings:
            lines.append("\n  replicated for lack of a rule: " + ", ".join(self.warnings))
        return "\n".join(lines)

    def explain(self, path: str, *, layouts=None):
        """Why the argument leaf ``path`` has its layout: each other layout it could take, with the
        predicted step of the best plan that has the leaf pinned to it.

        Args:
          path: a path from :attr:`in_paths`, or a regex or substring that matches exactly one.
          layouts: ``PartitionSpec``s to compare; None: every layout that divides the leaf.

        Returns:
          An :class:`~autoshard.explain.Explanation`: a table (``str()``, or HTML in Jupyter) of the
          chosen layout and the alternatives, with the layouts of the leaf's optimizer state in each
          plan (a kernel kept whole while its moments are split is ZeRO-1, and the text says so).

        Raises:
          PlanError: the path names no leaf or several; or the plan was loaded from JSON, so there is
            no program to plan again.

        Each alternative is a full re-plan on the plan's mesh, as long as planning took.

        Example:
          >>> import autoshard, jax, jax.numpy as jnp
          >>> def step(w, x):
          ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w), x.sum()
          >>> mesh = autoshard.make_mesh((2, 4), ("data", "model"))
          >>> plan = autoshard.parallelize(step, mesh=mesh, progress=None).plan(jnp.ones((8, 8)), jnp.ones((16, 8)))
          >>> why = plan.explain("[0]")
          >>> why.chosen.objective <= min(o.objective for o in why.alternatives)
          True
        """
        from autoshard.explain import explain

        return explain(self, path, layouts=layouts)

    def html(self) -> str:
        """The HTML report (Jupyter's view): leaf table, predicted time per collective kind, memory per device."""
        from autoshard.report import plan_html

        return plan_html(self)

    def figure(self, *, budget: float | None = None):
        """The plan drawn with matplotlib (:func:`autoshard.report.plan_figure`)."""
        from autoshard.report import plan_figure

        return plan_figure(self, budget=budget)

    def __repr__(self) -> str:
        info = self.mesh_info
        return (f"Plan(mesh={dict(zip(info.names, info.shape, strict=True))}, args={len(self.in_specs)}, "
                f"step≈{self.cost.total_seconds * 1e3:.3f}ms, peak≈{format_bytes(self.cost.peak_memory_bytes)})")

    def to_json(self) -> str:
        """Serialise everything needed to apply the plan again without solving."""
        info = self.mesh_info
        return json.dumps({
            "format": "autoshard-plan/1",
            "mesh": {"shape": list(info.shape), "names": list(info.names)},
            "fingerprint": self.fingerprint,
            "in_specs": [_spec_json(s) for s in self.in_specs],
            "out_specs": [_spec_json(s) for s in self.out_specs],
            "in_paths": list(self.in_paths),
            "out_paths": list(self.out_paths),
            "in_avals": [[list(s), d] for s, d in self.in_avals],
            "cost": dataclasses.asdict(self.cost),
            "collectives": [[c.kind, list(c.axes), c.bytes, t] for c, t in self.collectives],
            "value_specs": [[v, _spec_json(s)] for v, s in sorted(self.value_specs.items())],
            "operand_specs": [[k[0], k[1], _spec_json(s)] for k, s in sorted(self.operand_specs.items())],
            "warnings": list(self.warnings),
            "host_inputs": list(self.host_inputs),
            "host_outputs": list(self.host_outputs),
            "in_roles": list(self.in_roles),
            "deferred": sorted(self.deferred),
            **({"remat": [self.remat.units, self.remat.num_units, self.remat.max_units, self.remat.extra_flops]}
               if self.remat is not None else {}),
        })

    @classmethod
    def from_json(cls, text: str, mesh=None) -> Plan:
        """Load a plan saved by :meth:`to_json`. ``mesh`` defaults to a new Auto mesh of the saved shape."""
        try:
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise PlanError(f"saved plan is not JSON ({e}); pass the text Plan.to_json() returned") from None
            fmt = d.get("format") if isinstance(d, dict) else None
            if fmt != "autoshard-plan/1":
                raise PlanError(f"not an autoshard plan (format {fmt!r}); expected 'autoshard-plan/1'")
            shape, names = tuple(d["mesh"]["shape"]), tuple(d["mesh"]["names"])
            if mesh is None:
                from autoshard.cluster import make_mesh

                mesh = make_mesh(shape, names)
            elif MeshInfo.from_mesh(mesh) != MeshInfo(shape, names):
                raise PlanError(f"the plan was made for mesh {dict(zip(names, shape, strict=True))}, "
                                f"not {dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))}")
            return cls(
                mesh=mesh,
                in_specs=tuple(_spec_from(s) for s in d["in_specs"]),
                out_specs=tuple(_spec_from(s) for s in d["out_specs"]),
                in_paths=tuple(d["in_paths"]),
                out_paths=tuple(d["out_paths"]),
                in_avals=tuple((tuple(s), dt) for s, dt in d["in_avals"]),
                cost=PlanCost(**d["cost"]),
                collectives=tuple((Collective(k, tuple(a), b), t) for k, a, b, t in d["collectives"]),
                value_specs={v: _spec_from(s) for v, s in d["value_specs"]},
                operand_specs={(i, j): _spec_from(s) for i, j, s in d["operand_specs"]},
                fingerprint=d["fingerprint"],
                warnings=tuple(d.get("warnings", ())),
                host_inputs=tuple(d.get("host_inputs", ())),
                host_outputs=tuple(d.get("host_outputs", ())),
                remat=_remat_from(d.get("remat")),
                in_roles=tuple(d.get("in_roles", ())),
                deferred=frozenset(d.get("deferred", ())),
            )
        except KeyError as e:
            raise PlanError(f"saved plan is missing field {e.args[0]!r}") from None


def compiled_bytes_by_kind(compiled) -> dict[str, float]:
    """Bytes per device per collective kind in a compiled program, by Alpa's convention (see
    :meth:`Plan.verify`)."""
    from autoshard.hlo import collective_stats

    got: dict[str, float] = {}
    for c in collective_stats(compiled).collectives:
        nbytes = c.operand_bytes if c.kind == "reduce-scatter" and c.operand_bytes else c.bytes
        got[c.kind] = got.get(c.kind, 0.0) + nbytes * c.multiplicity
    return got


def _remat_from(r):
    if r is None:
        return None
    from autoshard.remat import RematChoice

    return RematChoice(int(r[0]), int(r[1]), int(r[2]), float(r[3]))


def _spec_json(s: ShardingSpec):
    return [list(d) for d in s.dims]


def _spec_from(d) -> ShardingSpec:
    return ShardingSpec(tuple(tuple(x) for x in d))
