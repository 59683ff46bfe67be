"""kernelmux bench: the command line (run or --load a run; --json, --md, --plot; --record and
--compare against perf/baselines) and the suite's public names. perf/README.md documents the
command, the method and the JSON schema; runner, report, plots and schema hold the rest."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kernelmux.engine import Engine, Settings
from kernelmux.errors import ConfigurationError, UnknownOpError
from kernelmux.specs import ALL_SPECS
from kernelmux.perf import records, summary
from kernelmux.perf.plots import plot, roofline_ceilings, roofline_points, speedup_path, speedups
from kernelmux.perf.report import compare, fmt_us, markdown, roofline_cell, selection_line, vs_reference_cell
from kernelmux.perf.runner import (REFERENCE_BUDGET_S, REFERENCE_CALL_LIMIT_S, WALL_PHASES, Plan, environment,
                                   error_stats, reference_method, run)
from kernelmux.perf.schema import (ABOVE_CEILING, FAILED, REFERENCE, SCHEMA, SCHEMA_V1, above_ceiling, failures,
                                   merge, upgrade)
from kernelmux.perf.timing import default_budget_s

__all__ = ["ABOVE_CEILING", "FAILED", "REFERENCE", "REFERENCE_BUDGET_S", "REFERENCE_CALL_LIMIT_S", "SCHEMA",
           "SCHEMA_V1", "WALL_PHASES", "Plan", "above_ceiling", "add_arguments", "compare", "environment",
           "error_stats", "failures", "main", "markdown", "merge", "plot", "reference_method", "roofline_ceilings",
           "roofline_points", "run", "speedup_path", "speedups", "upgrade"]

# --compare without a file: this device's perf/baselines/<device>.json.
_THIS_DEVICE = "this device's baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="*", help="ops to run (default: all)")
    parser.add_argument("--backend", action="append", dest="backends",
                        help="only these implementations (repeatable); the reference always runs")
    parser.add_argument("--case", action="append", dest="cases", help="only these cases (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="small model cases and short timing (under a minute on a 2-core CPU)")
    parser.add_argument("--baseline", help="backend to report a speed-up over (besides the reference)")
    parser.add_argument("--json", help="write the result as JSON")
    parser.add_argument("--md", help="write a markdown table")
    parser.add_argument("--plot", metavar="F.png",
                        help="write two PNGs: F, a log-log roofline (flop/byte against achieved TFLOP/s, "
                        "each timed row a point by op and backend, the ceilings of the run as lines), and "
                        "F_speedup (F with _speedup before its extension), each implementation's speed-up "
                        "over the fastest other one per case, median times on the bars")
    parser.add_argument("--compare", metavar="OLD.json", nargs="?", const=_THIS_DEVICE,
                        help="print time ratios against an earlier run; without a file, against this device's "
                        "perf/baselines/<device>.json (the --load'ed run's device with --load)")
    parser.add_argument("--record", action="store_true",
                        help="write the run (a full bench, or a --load'ed one) as its device's baseline, "
                        "perf/baselines/<device>.json and .md, and regenerate perf/README.md's tables")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="with --compare: exit 1 when a row is this many percent slower (default 10)")
    parser.add_argument("--load", metavar="RUN.json", action="append",
                        help="report or compare a saved run instead of running; repeated, the parts of one "
                        "bench (one commit, one device, split by ops over device calls) merged into one run, "
                        "a later part's case replacing an earlier's")
    parser.add_argument("--flush-l2", action="store_true",
                        help="CUDA: overwrite the L2 before each timed call")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed calls per row (default 0.5, --quick 0.05; the reference's: at "
                        "most 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="start no case after S seconds: the cases left are listed as not run and the run "
                        "is written (a device call's time limit would otherwise lose all of it)")


def _read_run(path: str) -> dict[str, Any]:
    """A saved run (--load, --compare), in this SCHEMA; a missing or unreadable file is a usage
    error (`kernelmux` exits 2 with its one line)."""
    try:
        with open(path) as f:
            return upgrade(json.load(f), path)
    except (OSError, ValueError) as error:
        raise ConfigurationError(f"cannot read the bench run {path}: {error}") from None


def _baseline_of(result_env: dict[str, Any]) -> str:
    """This device's baseline file, which --compare without a file reads; a usage error if none."""
    path = records.baseline_path(records.device_key(result_env))
    if not path.exists():
        raise ConfigurationError(f"--compare: no baseline for this device ({path} does not exist); baselines "
                                 "live in a checkout's perf/baselines (record one there with `kernelmux bench "
                                 "--record`), or name a run: --compare OLD.json")
    return str(path)


def _record_problem(args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """Why ``result`` may not become its device's baseline (None: it may): a baseline is the full
    bench, every model case of every op, every row ok or declined."""
    if not args.load and (args.ops or args.backends or args.cases):
        return "a baseline is the full bench: run it without naming ops, --backend or --case"
    if result["method"].get("quick"):
        return "a baseline is the full bench, not --quick"
    if result.get("not_run"):
        return f"the run stopped at its deadline before {len(result['not_run'])} case(s); a baseline is a full run"
    # Every op's model cases (a merged run's parts, or a --case run, may leave some out).
    device = result["environment"]["device"]
    expected = [f"{spec.name}/{case.name}" for spec in ALL_SPECS for case in spec.model_cases(False, device)]
    measured = {f"{r['op']}/{r['case']}" for r in result["rows"]}
    missing = [key for key in expected if key not in measured]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        return f"a baseline covers every op's model cases; this run lacks {shown}"
    if failures(result):
        return "rows of this run failed (wrong or error); a baseline holds a passing run"
    return None


def main(args: argparse.Namespace) -> int:
    # Usage errors are kernelmux errors: `kernelmux` prints their one line and exits 2.
    compare_path = None if args.compare == _THIS_DEVICE else args.compare
    if args.load:
        result = merge([_read_run(path) for path in args.load], args.load)
        if args.compare == _THIS_DEVICE:
            compare_path = _baseline_of(result["environment"])
    else:
        names = [spec.name for spec in ALL_SPECS]
        unknown = [op for op in args.ops if op not in names]
        if unknown:
            raise UnknownOpError(unknown[0], names)
        engine = Engine(ALL_SPECS, Settings.from_env())
        known = {impl.backend for impl in engine.registry.implementations.values()}
        unknown = sorted(set(args.backends or ()) - known)
        if unknown:
            raise ConfigurationError(f"--backend names unknown backend(s) {unknown}; registered backends: "
                                     f"{', '.join(sorted(known))}")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.compare == _THIS_DEVICE:  # before the run: a missing baseline is known now
            compare_path = _baseline_of(environment(engine, device))
        plan = Plan(
            ops=args.ops or names, backends=args.backends, cases=args.cases, quick=args.quick,
            baseline=args.baseline, flush_l2=args.flush_l2,
            budget_s=args.budget if args.budget is not None else default_budget_s(args.quick),
            seed=args.seed, device=device, deadline_s=args.deadline,
        )
        result = run(plan, progress=lambda line: print(line, file=sys.stderr, flush=True), engine=engine)
        _summary(result)
    # Read before --record can overwrite it (--compare --record: the old baseline against the new run).
    old = _read_run(compare_path) if compare_path else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    if args.plot:
        for path in plot(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    status = 0
    if old is not None:
        if compare(result, old, args.threshold):
            status = 1
    if args.record:
        problem = _record_problem(args, result)
        if problem:
            print(f"kernelmux bench: not recorded: {problem}", file=sys.stderr)
            status = 1
        else:
            for path in records.write_baseline(result, markdown):
                print(f"wrote {path}", file=sys.stderr)
            if summary.rewrite():
                print(f"rewrote the tables of {summary.README}", file=sys.stderr)
    failed = failures(result)
    if failed:
        # A wrong or crashing implementation fails the run (declined rows do not): say which.
        print(f"kernelmux bench: {len(failed)} row(s) failed:", file=sys.stderr)
        for r in failed:
            print(f"  {r['op']}/{r['case']}/{r['backend']}: {r['status']}: {r.get('message', '')}",
                  file=sys.stderr)
        status = 1
    return status


def _summary(result: dict[str, Any]) -> None:
    """The end-of-run table: one line per row, to stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kernelmux bench ({result['environment']['device_name']})")
    for column in ("op", "case", "backend", "status", "median", "% roofline", "vs reference"):
        table.add_column(column)
    for r in result["rows"]:
        timed = "median_us" in r
        status = r["status"]
        if r.get("flag") == ABOVE_CEILING:
            status = f"[bold yellow]{status}, {ABOVE_CEILING}[/]"
        elif status in FAILED:
            status = f"[bold red]{status}[/]"
        roofline = roofline_cell(r) + (f" ({r['bound']})" if "roofline_pct" in r else "")
        table.add_row(r["op"], r["case"], r["backend"], status,
                      fmt_us(r["median_us"]) if timed else ("not timed" if "not_timed" in r else "-"),
                      roofline if timed else "-", vs_reference_cell(r))
    console = Console(width=160)
    console.print(table)
    line = selection_line(result)
    if line:
        console.print(line, markup=False)
    above = above_ceiling(result)
    if above:
        console.print(f"[bold yellow]{len(above)} row(s) ran faster than their ceiling allows: the ceiling is "
                      "wrong there, not the row (no percentage given).[/]")
