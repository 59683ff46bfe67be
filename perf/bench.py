"""kernelmux bench: every viable implementation of the named ops on their spec's cases, checked
against the reference in the same run, timed, and placed on a roofline measured in the same run.

    kernelmux bench [OPS...] [--backend B ...] [--case NAME ...] [--quick] [--baseline B]
                    [--json F] [--md F] [--plot F] [--compare OLD.json [--threshold PCT]]
                    [--load RUN.json] [--flush-l2] [--budget S] [--seed N]

Rows are (op, case, implementation); the reference is always one of them. A row's ``status`` is
``ok`` (matches the reference within the spec's tolerance, then timed), ``wrong`` (outside it:
reported with the error, never timed), ``error`` (raised), or ``declined`` (the implementation's
``supports`` refused the call). The JSON schema is documented in perf/README.md
(``SCHEMA`` below names its version).

Timers (perf/timing.py): on CUDA, graph replay of 32 calls cycling through rotated input sets
(each call then reads device memory, not the L2 the last call filled), falling back to per-call
CUDA events for code a graph cannot capture (the references sync with the host); ``--flush-l2``
forces the event timer with the L2 overwritten before each call. On CPUs, the wall clock.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as host_platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import torch

from kernelmux.engine import Engine, Settings
from kernelmux.engine.report import distribution_version
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import (Timing, event_time, graph_replay_time, replay_trials, rotated_inputs,
                                   wall_time)
from kernelmux.registry import Backend

SCHEMA = "kernelmux.bench/1"
REFERENCE = "reference"


@dataclass(frozen=True)
class Plan:
    """What one run covers."""

    ops: list[str]
    backends: Optional[list[str]]  # None: every viable one
    cases: Optional[list[str]]  # None: by tag
    quick: bool
    baseline: Optional[str]
    flush_l2: bool
    budget_s: float
    seed: int
    device: str


# ---------------------------------------------------------------------------------------------
# Environment and ceilings


def environment(engine: Engine, device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": device,
        "device_name": engine.platform.device_name,
        "platform": engine.platform.kind.value,
        "arch": engine.platform.arch,
        "machine": host_platform.machine(),
        "torch": torch.__version__,
        "triton": distribution_version("triton"),
        "kernelmux": distribution_version("kernelmux"),
        "python": sys.version.split()[0],
        "commit": records.commit(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "driver": None,
        "cuda": torch.version.cuda,
        "l2_bytes": None,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["l2_bytes"] = props.L2_cache_size
        env["sms"] = props.multi_processor_count
        env["driver"] = records.driver_version()
    return env


def _rate(ceilings: dict[str, Any], matmul: str) -> tuple[Optional[float], str]:
    """The matrix rate (TFLOP/s) bounding a cost's flops, and its name; FP4 and FP8 fall back to
    the next measured precision (Hopper has no FP4 units; CPUs no FP8 ones)."""
    order = {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",), "fp32": ("fp32",)}
    for name in order.get(matmul, ("bf16",)):
        value = ceilings.get(f"{name}_tflops")
        if value:
            return value, name
    return None, matmul


# ---------------------------------------------------------------------------------------------
# Running


def _clone(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _tensors(outputs: Any) -> list[torch.Tensor]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def error_stats(actual: Any, expected: Any) -> dict[str, float]:
    """Normwise errors over every floating output: max |a - e| / max |e| and ||a - e|| / ||e||
    (worst output). Positions that are NaN in both count as equal; integer outputs (ids, packed
    codes) count the fraction of elements that differ as both errors."""
    worst = {"max_rel_err": 0.0, "rms_rel_err": 0.0}
    for a, e in zip(_tensors(actual), _tensors(expected)):
        if a.numel() == 0 or a.shape != e.shape:
            continue
        if not e.is_floating_point():
            frac = (a.cpu() != e.cpu()).double().mean().item()
            worst = {k: max(v, frac) for k, v in worst.items()}
            continue
        a64, e64 = a.detach().cpu().double(), e.detach().cpu().double()
        both_nan = a64.isnan() & e64.isnan()
        diff = (a64 - e64).masked_fill(both_nan, 0.0).abs()
        e64 = e64.masked_fill(both_nan, 0.0)
        tiny = torch.finfo(torch.float32).tiny
        max_rel = (diff.max() / e64.abs().max().clamp_min(tiny)).item()
        rms_rel = (diff.pow(2).mean().sqrt() / e64.pow(2).mean().sqrt().clamp_min(tiny)).item()
        worst = {"max_rel_err": max(worst["max_rel_err"], max_rel),
                 "rms_rel_err": max(worst["rms_rel_err"], rms_rel)}
    return worst


def _time(
    fn: Callable[..., Any], inputs: list[dict[str, Any]], plan: Plan, l2_bytes: int
) -> tuple[Timing, str]:
    if plan.device == "cuda":
        if not plan.flush_l2:
            try:
                return graph_replay_time(fn, inputs, trials=replay_trials(plan.quick)), "cuda-graph"
            except Exception:  # noqa: BLE001 - any capture failure means: time it another way
                torch.cuda.synchronize()
        timing = event_time(fn, inputs, reps=20 if plan.quick else 100, budget_s=plan.budget_s,
                            flush_l2_bytes=2 * l2_bytes if plan.flush_l2 else 0)
        return timing, "cuda-events" + (" +flush-l2" if plan.flush_l2 else "")
    kwargs = inputs[0]
    return wall_time(lambda: fn(**kwargs), reps=200, budget_s=plan.budget_s), "wall-clock"


def _cases(spec, plan: Plan):
    if plan.cases:
        known = {c.name for c in spec.cases}
        return [spec.case(name) for name in plan.cases if name in known]
    wanted = {"model", "quick"} if plan.quick else {"model"}
    # gpu-tagged shapes (GB-sized caches) would take minutes per row on a CPU: named only.
    return [c for c in spec.cases if wanted <= c.tags and not (plan.device == "cpu" and "gpu" in c.tags)]


def _implementations(engine: Engine, op: str, plan: Plan) -> list[tuple[str, Callable[..., Any]]]:
    """(backend, fn) for the reference and every viable implementation, or those named."""
    impls = [(REFERENCE, engine.specs[op].reference)]
    for candidate in engine.tables[op].candidates:
        impl = candidate.impl
        named = plan.backends is not None and impl.backend in plan.backends
        if plan.backends is not None and not named:
            continue
        # Interpreted Triton on a CPU is a correctness tool, not a performance target.
        if (impl.backend == Backend.TRITON and plan.device == "cpu" and not named
                and os.environ.get("TRITON_INTERPRET") == "1"):
            continue
        if impl.devices and plan.device not in impl.devices:
            continue
        impls.append((impl.backend, impl.fn))
    return impls


def run(
    plan: Plan,
    progress: Callable[[str], None] = print,
    *,
    engine: Optional[Engine] = None,
    ceilings: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Run ``plan``. ``engine`` (default: one built from the environment's settings) supplies
    the implementations; ``ceilings`` replaces the measurement (tests only: a report's ceilings
    belong to its run)."""
    engine = engine or Engine(ALL_SPECS, Settings.from_env())
    env = environment(engine, plan.device)
    progress(f"kernelmux bench on {env['device_name']} ({plan.device}); measuring ceilings...")
    ceilings = ceilings or ceilings_module.measure(plan.device, quick=plan.quick)
    sheet = ceilings_module.datasheet(env["device_name"] or "")
    progress("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items() if v is not None))
    l2_bytes = env["l2_bytes"] or 0

    work = [(op, case) for op in plan.ops for case in _cases(engine.specs[op], plan)]
    rows: list[dict[str, Any]] = []
    for index, (op, case) in enumerate(work, 1):
        spec = engine.specs[op]
        kwargs = case.build(plan.device, plan.seed)
        ref_kwargs = _clone(kwargs)  # in-place ops: outputs() reads the arguments the call wrote
        expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
        cost = spec.cost(kwargs)
        rate, rate_name = _rate(ceilings, cost.matmul)
        inputs = (rotated_inputs(lambda seed: case.build(plan.device, seed), l2_bytes, cap=8, first=kwargs,
                                 seed=plan.seed) if plan.device == "cuda" else [kwargs])
        answers = {impl.backend: reason for impl, reason in engine.explain(op, kwargs)}
        case_rows: list[dict[str, Any]] = []
        for backend, fn in _implementations(engine, op, plan):
            row: dict[str, Any] = {
                "op": op, "case": case.name, "backend": backend, "status": "ok",
                "flops": cost.flops, "bytes": cost.bytes, "matmul": rate_name,
            }
            reason = answers.get(backend) if backend != REFERENCE else None
            if reason is not None:
                row.update(status="declined", message=reason)
            else:
                try:
                    call_kwargs = _clone(kwargs)
                    actual = spec.outputs(fn(**call_kwargs), call_kwargs)
                    canonical = spec.canonical or (lambda outputs, _: outputs)
                    row.update(error_stats(canonical(actual, kwargs), canonical(expected, kwargs)))
                    try:
                        spec.check_close(actual, expected, kwargs)
                    except AssertionError as error:
                        row.update(status="wrong", message=str(error).splitlines()[0][:300])
                    if row["status"] == "ok":
                        timing, timer = _time(fn, inputs, plan, l2_bytes)
                        row.update(median_us=timing.median_us, p20_us=timing.p20_us, p80_us=timing.p80_us,
                                   timer=timer)
                except Exception as error:  # noqa: BLE001 - a crashing implementation is a result
                    row.update(status="error", message=f"{type(error).__name__}: {error}"[:300])
            if "median_us" in row:
                seconds = row["median_us"] / 1e6
                memory_s = cost.bytes / (ceilings["memory_gbps"] * 1e9)
                compute_s = cost.flops / (rate * 1e12) if rate else 0.0
                row.update(
                    tflops=cost.flops / seconds / 1e12,
                    gbps=cost.bytes / seconds / 1e9,
                    roofline_pct=100 * max(memory_s, compute_s) / seconds,
                    bound="compute" if compute_s > memory_s else "memory",
                )
            case_rows.append(row)
        _speedups(case_rows, plan.baseline)
        for row in case_rows:
            progress(f"[{index}/{len(work)}] {_describe(row)}")
        rows.extend(case_rows)
    return {
        "schema": SCHEMA,
        "environment": env,
        "ceilings": ceilings,
        "datasheet": sheet,
        "method": {
            "quick": plan.quick, "flush_l2": plan.flush_l2, "budget_s": plan.budget_s, "seed": plan.seed,
            "baseline": plan.baseline,
        },
        "rows": rows,
    }


def _speedups(case_rows: list[dict[str, Any]], baseline: Optional[str]) -> None:
    times = {r["backend"]: r["median_us"] for r in case_rows if "median_us" in r}
    for row in case_rows:
        if "median_us" not in row:
            continue
        if REFERENCE in times:
            row["speedup_vs_reference"] = times[REFERENCE] / row["median_us"]
        if baseline and baseline in times:
            row["speedup_vs_baseline"] = times[baseline] / row["median_us"]


def _describe(row: dict[str, Any]) -> str:
    head = f"{row['op']} {row['case']} {row['backend']}: "
    if row["status"] != "ok":
        return head + f"{row['status'].upper()} {row.get('message', '')}"
    text = (f"{_fmt_us(row['median_us'])} (p20-p80 {_fmt_us(row['p20_us'])}-{_fmt_us(row['p80_us'])}), "
            f"{row['roofline_pct']:.1f}% of roofline ({row['bound']})")
    if "speedup_vs_reference" in row and row["backend"] != REFERENCE:
        text += f", {row['speedup_vs_reference']:.2f}x the reference"
    return head + text


def _fmt_us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"


# ---------------------------------------------------------------------------------------------
# Reports


def markdown(result: dict[str, Any]) -> str:
    env, ceil, sheet = result["environment"], result["ceilings"], result.get("datasheet")
    lines = [
        f"# kernelmux bench: {env['device_name']}", "",
        f"kernelmux {env['kernelmux']} at {env['commit']}, torch {env['torch']}, triton {env['triton']}, "
        f"driver {env['driver']}, {env['timestamp']}.", "",
        "| ceiling | measured (as the rows are timed) | one call at a time | datasheet |", "|---|---|---|---|",
    ]
    for key, unit in (("memory_gbps", "GB/s"), ("bf16_tflops", "TFLOP/s"), ("fp8_tflops", "TFLOP/s"),
                      ("fp32_tflops", "TFLOP/s")):
        measured, burst = (f"{ceil[k]:.1f} {unit}" if ceil.get(k) else "-" for k in (key, f"{key}_burst"))
        listed = f"{sheet[key]:.0f} {unit}" if sheet and sheet.get(key) else "-"
        lines.append(f"| {key.rsplit('_', 1)[0]} | {measured} | {burst} | {listed} |")
    lines += ["", "| op | case | backend | status | median | p20-p80 | TFLOP/s | GB/s | % roofline | bound "
              "| vs reference | vs baseline | max rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "median_us" in r:
            cells = [_fmt_us(r["median_us"]), f"{_fmt_us(r['p20_us'])}-{_fmt_us(r['p80_us'])}",
                     f"{r['tflops']:.2f}", f"{r['gbps']:.1f}", f"{r['roofline_pct']:.1f}", r["bound"],
                     f"{r['speedup_vs_reference']:.2f}x" if "speedup_vs_reference" in r else "-",
                     f"{r['speedup_vs_baseline']:.2f}x" if "speedup_vs_baseline" in r else "-",
                     f"{r.get('max_rel_err', 0):.1e}"]
        else:
            cells = [r.get("message", "")[:80].replace("|", "/")] + ["-"] * 7 + [
                f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"]
        lines.append(" | ".join(["", r["op"], r["case"], r["backend"], r["status"], *cells, ""]).strip())
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """Percent of roofline per case (one bar per implementation), one panel per op."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kernelmux[bench]'") from None
    timed = [r for r in result["rows"] if "roofline_pct" in r]
    ops = sorted({r["op"] for r in timed})
    if not ops:
        raise SystemExit("--plot: no timed rows to plot")
    fig, axes = plt.subplots(len(ops), 1, figsize=(11, 2.6 * len(ops) + 0.8), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        rows = [r for r in timed if r["op"] == op]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            values = {r["case"]: r["roofline_pct"] for r in rows if r["backend"] == backend}
            xs = [c + i * width for c, name in enumerate(cases) if name in values]
            ax.bar(xs, [values[name] for name in cases if name in values], width, label=backend)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("% of roofline")
        ax.set_yscale("log")
        ax.set_title(op, fontsize=9)
        ax.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(f"kernelmux bench, {env['device_name']}, {env['commit']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(new: dict[str, Any], old: dict[str, Any], threshold_pct: float,
            out: Callable[[str], None] = print) -> int:
    """Print new/old time ratios per row present in both; return the number of rows slower than
    ``1 + threshold_pct / 100`` (a row that was ok and is now wrong or failing counts too)."""
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return (r["op"], r["case"], r["backend"])

    before = {key(r): r for r in old["rows"]}
    limit = 1 + threshold_pct / 100
    regressions, ratios = 0, []
    out(f"compare: {new['environment']['commit']} against {old['environment']['commit']} "
        f"(threshold {threshold_pct:g}%)")
    for row in new["rows"]:
        prior = before.get(key(row))
        if prior is None or "median_us" not in prior:
            continue
        name = "/".join(key(row))
        if "median_us" not in row:
            regressions += 1
            out(f"  REGRESSION {name}: was ok, now {row['status']} {row.get('message', '')}")
            continue
        ratio = row["median_us"] / prior["median_us"]
        ratios.append(ratio)
        flag = "REGRESSION" if ratio > limit else "ok"
        regressions += ratio > limit
        out(f"  {flag:10s} {name}: {_fmt_us(prior['median_us'])} -> {_fmt_us(row['median_us'])} "
            f"({ratio:.3f}x time)")
    if ratios:
        logs = [math.log(r) for r in ratios]
        out(f"  {len(ratios)} rows: time ratio geomean {math.exp(sum(logs) / len(logs)):.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}; {regressions} past the threshold")
    return regressions


# ---------------------------------------------------------------------------------------------
# Command line


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
    parser.add_argument("--plot", help="write a PNG of percent of roofline per case and implementation")
    parser.add_argument("--compare", metavar="OLD.json", help="print time ratios against an earlier run")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="with --compare: exit 1 when a row is this many percent slower (default 10)")
    parser.add_argument("--load", metavar="RUN.json", help="report or compare a saved run instead of running")
    parser.add_argument("--flush-l2", action="store_true",
                        help="CUDA: overwrite the L2 before each timed call")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed calls per row")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    if args.load:
        with open(args.load) as f:
            result = json.load(f)
        if result.get("schema") != SCHEMA:
            raise SystemExit(f"{args.load}: schema {result.get('schema')!r}, expected {SCHEMA!r}")
    else:
        names = [spec.name for spec in ALL_SPECS]
        unknown = [op for op in args.ops if op not in names]
        if unknown:
            raise SystemExit(f"unknown op(s) {unknown}; known: {names}")
        plan = Plan(
            ops=args.ops or names, backends=args.backends, cases=args.cases, quick=args.quick,
            baseline=args.baseline, flush_l2=args.flush_l2,
            budget_s=args.budget if args.budget is not None else (0.05 if args.quick else 0.5),
            seed=args.seed, device="cuda" if torch.cuda.is_available() else "cpu",
        )
        result = run(plan, progress=lambda line: print(line, file=sys.stderr, flush=True))
        _summary(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    if args.plot:
        plot(result, args.plot)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        if compare(result, old, args.threshold):
            return 1
    return 0


def _summary(result: dict[str, Any]) -> None:
    """The end-of-run table: one line per row, to stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kernelmux bench ({result['environment']['device_name']})")
    for column in ("op", "case", "backend", "status", "median", "% roofline", "vs reference"):
        table.add_column(column)
    for r in result["rows"]:
        timed = "median_us" in r
        table.add_row(r["op"], r["case"], r["backend"], r["status"],
                      _fmt_us(r["median_us"]) if timed else "-",
                      f"{r['roofline_pct']:.1f} ({r['bound']})" if timed else "-",
                      f"{r['speedup_vs_reference']:.2f}x" if timed and "speedup_vs_reference" in r else "-")
    Console(width=160).print(table)
