"""Command line: ``python -m autoshard explain FILE.py:FUNCTION``.

Plans a step function from a Python file and prints the plan, without running the step::

    python -m autoshard explain train.py:train_step --devices 8 --mesh 2,4 --png plan.png

The file says what to plan for by defining, at module level, a function that returns the step's
positional arguments as a tuple (arrays or ``jax.ShapeDtypeStruct``s; shapes are all that is used):

- ``FUNCTION_example_args()`` for that function, else
- ``example_args()`` for any function in the file.

If FUNCTION is already ``@autoshard.parallelize(...)``-decorated, its own mesh, cluster, budget and
hints are used and the command-line options for them must be left out.

The solver's own command line is ``python -m autoshard.solver``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoshard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="plan FILE.py:FUNCTION and print the plan")
    ex.add_argument("target", metavar="FILE.py:FUNCTION")
    ex.add_argument("--devices", type=int, default=None,
                    help="simulate N CPU devices (sets XLA_FLAGS before jax starts); default: the real devices")
    ex.add_argument("--mesh", default=None, help="mesh shape, e.g. 2,4; default: the planner picks one")
    ex.add_argument("--axes", default=None, help="mesh axis names, e.g. data,model (default data[,model])")
    ex.add_argument("--cluster", default=None, help="a preset name (autoshard.cluster_preset), e.g. h100-nvlink")
    ex.add_argument("--memory-budget", default=None, help="bytes per device, e.g. 16GB")
    ex.add_argument("--max-rows", type=int, default=40, help="argument leaves to list")
    ex.add_argument("--rich", action=argparse.BooleanOptionalAction, default=None,
                    help="draw rich tables (default: when rich is installed and stdout is a terminal)")
    ex.add_argument("--html", default=None, help="also write the HTML report here")
    ex.add_argument("--png", default=None, help="also write the plan figure here (needs matplotlib)")
    ex.add_argument("--json", default=None, help="also save the plan (Plan.to_json) here")
    args = ap.parse_args(argv)
    try:
        return _explain(args)
    except _UsageError as e:
        print(f"autoshard explain: {e}", file=sys.stderr)
        return 2


class _UsageError(Exception):
    pass


def _explain(args) -> int:
    path, _, name = args.target.rpartition(":")
    if not path or not name:
        raise _UsageError(f"expected FILE.py:FUNCTION, got {args.target!r}; e.g. train.py:train_step")
    if args.devices is not None:
        _simulate_devices(args.devices)
    module = _load(pathlib.Path(path))
    fun = getattr(module, name, None)
    if fun is None or not callable(fun):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise _UsageError(f"{path} defines no function {name!r}; its functions are: {', '.join(found)}")
    make_args = getattr(module, f"{name}_example_args", None) or getattr(module, "example_args", None)
    if make_args is None:
        raise _UsageError(
            f"{path} says nothing about {name}'s arguments. Define, at module level,\n\n"
            f"    def {name}_example_args():      # or example_args(), for any function in the file\n"
            "        return (state, batch)          # arrays or jax.ShapeDtypeStructs\n")
    example = make_args()
    if not isinstance(example, tuple):
        raise _UsageError(f"{make_args.__name__}() must return a tuple of {name}'s positional arguments, "
                          f"got {type(example).__name__}")

    import jax

    import autoshard

    if args.devices is not None and len(jax.devices()) < args.devices:
        raise _UsageError(f"--devices {args.devices}, but jax already started with {len(jax.devices())} devices")
    options = _options(args, jax, autoshard)
    from autoshard.pipeline import PipelinedStep

    if isinstance(fun, autoshard.Parallelized | PipelinedStep):
        if options:
            raise _UsageError(f"{name} is already parallelized with its own settings; drop "
                              + ", ".join(f"--{k.replace('_', '-')}" for k in options))
        step = fun
    else:
        step = autoshard.parallelize(fun, **options)
    plan = step.plan(*example)
    print(plan.summary(max_rows=args.max_rows, rich=args.rich))
    if args.html:
        pathlib.Path(args.html).write_text(f"<!doctype html><meta charset='utf-8'>\n{plan.html()}\n")
        print(f"wrote {args.html}")
    if args.png:
        autoshard.visualize(plan, args.png)
        print(f"wrote {args.png}")
    if args.json:
        pathlib.Path(args.json).write_text(plan.to_json())
        print(f"wrote {args.json}")
    return 0


def _options(args, jax, autoshard) -> dict:
    options = {}
    if args.mesh:
        shape = tuple(int(s) for s in args.mesh.split(","))
        names = tuple(args.axes.split(",")) if args.axes else ("data", "model")[-len(shape):] if len(shape) <= 2 \
            else tuple(f"axis{i}" for i in range(len(shape)))
        n = 1
        for s in shape:
            n *= s
        options["mesh"] = autoshard.make_mesh(shape, names, devices=jax.devices()[:n])
    if args.cluster:
        try:
            options["cluster"] = autoshard.cluster_preset(args.cluster)
        except ValueError as e:
            raise _UsageError(str(e)) from None
    if args.memory_budget:
        options["memory_budget"] = args.memory_budget
    return options


def _simulate_devices(n: int) -> None:
    if "jax" in sys.modules:
        return  # too late to change the device count; _explain checks there are enough
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


def _load(path: pathlib.Path):
    if not path.is_file():
        raise _UsageError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"_autoshard_explain_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


if __name__ == "__main__":
    raise SystemExit(main())
