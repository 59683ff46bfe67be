"""kernelmux bench: every viable implementation of the named ops on their specs' cases, checked
against the reference, timed, placed on a roofline measured in the same run, and reported (JSON,
markdown, console, plots); perf/README.md documents the command, the method and the JSON schema."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as host_platform
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import torch

from kernelmux.engine import Engine, Settings
from kernelmux.engine.report import distribution_version
from kernelmux.errors import ConfigurationError, UnknownOpError
from kernelmux.specs import ALL_SPECS
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import Method, default_budget_s, rotated_inputs, time_calls
from kernelmux.registry import Backend

# /2: rows above their roofline carry flag/ceiling/ceiling_ratio instead of roofline_pct; timed
# rows carry samples; the reference is timed under its own budget (may be not_timed, and the
# other rows' speedup_vs_reference null); method.timing, method.reference, method.ceilings and
# wall_s are new. --load upgrades /1 files.
SCHEMA = "kernelmux.bench/2"
SCHEMA_V1 = "kernelmux.bench/1"
REFERENCE = "reference"
# Statuses that fail the run (the exit status is 1); "declined" is an answer, not a failure.
FAILED = ("wrong", "error")
ABOVE_CEILING = "above-ceiling"
# The reference is called once for correctness; that call is its warm-up, and it is then timed
# for at most REFERENCE_BUDGET_S (at least one call), and only if the correctness call took at
# most REFERENCE_CALL_LIMIT_S. So timing a case's reference costs at most 1.1 s past the call
# every case needs anyway, whatever the reference does. Timed as the rows were (graph replay of
# 1027 calls where a reference captures; 3 warm-ups, a capture attempt, 3 more warm-ups and 3+
# calls where it cannot), the references kept the full H100 bench from finishing in 300 s
# (issue 24). The speed-up over the reference stays a measured median, of fewer calls (samples).
REFERENCE_BUDGET_S = 0.1
REFERENCE_CALL_LIMIT_S = 1.0


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
    threads: Optional[int] = None  # CPU threads for every timing; None: torch's count at the start

    def method(self, l2_bytes: int) -> Method:
        """How this run times its rows and its ceilings (one method for both)."""
        return Method.for_run(self.device, self.quick, self.budget_s, threads=self.threads,
                              flush_l2_bytes=2 * l2_bytes if self.flush_l2 else 0)


def reference_method(method: Method) -> Method:
    """The reference's timing: the run's timer and statistic, no capture (the references sync
    with the host, and one that captures would be replayed ~1000 times), no warm-up past its
    correctness call, at least one call, within REFERENCE_BUDGET_S."""
    return replace(method, capture=False, warmup=0, min_calls=1,
                   budget_s=min(method.budget_s, REFERENCE_BUDGET_S))


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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


WALL_PHASES = ("ceilings", "inputs", "reference_check", "reference_timing", "implementation_check",
               "implementation_timing")


def run(
    plan: Plan,
    progress: Callable[[str], None] = print,
    *,
    engine: Optional[Engine] = None,
    ceilings: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Run ``plan``. ``engine`` (default: one built from the environment's settings) supplies
    the implementations; ``ceilings`` replaces the measurement (tests and perf/diag/compare_demo.py
    only: a report's ceilings belong to its run)."""
    started = time.perf_counter()
    wall = dict.fromkeys(WALL_PHASES, 0.0)

    def lap(phase: str, since: float) -> float:
        now = time.perf_counter()
        wall[phase] += now - since
        return now

    engine = engine or Engine(ALL_SPECS, Settings.from_env())
    env = environment(engine, plan.device)
    l2_bytes = env["l2_bytes"] or 0
    method = plan.method(l2_bytes)
    env["threads"] = method.threads
    ref_method = reference_method(method)
    work = [(op, case) for op in plan.ops for case in _cases(engine.specs[op], plan)]
    progress(f"kernelmux bench on {env['device_name']} ({plan.device}): {len(work)} cases of "
             f"{len(plan.ops)} op(s); " + _method_line(method))
    progress(f"the reference: one correctness call per case, then timed within {ref_method.budget_s:g} s "
             f"(at least one call; not timed when that call took over {REFERENCE_CALL_LIMIT_S:g} s); "
             "measuring ceilings...")
    since = time.perf_counter()
    if ceilings is None:
        ceilings, ceilings_how = ceilings_module.measure_run(method)
    else:
        ceilings_how = {"supplied": "by the caller, not measured in this run"}
    since = lap("ceilings", since)
    sheet = ceilings_module.datasheet(env["device_name"] or "")
    progress(f"ceilings ({wall['ceilings']:.1f} s): " + ", ".join(
        f"{k} {v:.3g}" for k, v in ceilings.items() if isinstance(v, (int, float))))

    rows: list[dict[str, Any]] = []
    for index, (op, case) in enumerate(work, 1):
        spec = engine.specs[op]
        since = time.perf_counter()
        kwargs = case.build(plan.device, plan.seed)
        since = lap("inputs", since)
        ref_kwargs = _clone(kwargs)  # in-place ops: outputs() reads the arguments the call wrote
        expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
        _sync(plan.device)
        reference_call_s = time.perf_counter() - since
        since = lap("reference_check", since)
        cost = spec.cost(kwargs)
        rate, rate_name = _rate(ceilings, cost.matmul)
        # The timed calls rotate through copies of the checked inputs made on the device: distinct
        # memory, which is what rotating is for (each call reads DRAM, not the L2 the last one
        # filled), without drawing GB-sized inputs on the host again (146 of the H100 bench's
        # 280 s at 2861b00).
        inputs = (rotated_inputs(lambda _seed: _clone(kwargs), l2_bytes, cap=8, first=kwargs)
                  if plan.device == "cuda" else [kwargs])
        since = lap("inputs", since)
        answers = {impl.backend: reason for impl, reason in engine.explain(op, kwargs)}
        case_rows: list[dict[str, Any]] = []
        for backend, fn in _implementations(engine, op, plan):
            row: dict[str, Any] = {
                "op": op, "case": case.name, "backend": backend, "status": "ok",
                "flops": cost.flops, "bytes": cost.bytes, "matmul": rate_name,
            }
            since = time.perf_counter()
            if backend == REFERENCE:
                # The reference defines the expected outputs: no error statistics, no second check.
                if reference_call_s > REFERENCE_CALL_LIMIT_S:
                    row["not_timed"] = (f"one call took {reference_call_s:.1f} s; a reference is timed only "
                                        f"when its correctness call takes at most {REFERENCE_CALL_LIMIT_S:g} s")
                else:
                    _time_row(row, fn, inputs, ref_method)
                lap("reference_timing", since)
            else:
                _check_and_time(row, spec, fn, kwargs, expected, answers.get(backend), inputs, method, lap)
            if "median_us" in row:
                _place_on_roofline(row, cost, ceilings, rate, rate_name)
            case_rows.append(row)
        _speedups(case_rows, plan.baseline)
        elapsed = time.perf_counter() - started
        left = elapsed / index * (len(work) - index)
        for row in case_rows:
            progress(f"[{index}/{len(work)} {elapsed:.0f} s, ~{left:.0f} s left] {_describe(row)}")
        rows.extend(case_rows)
    wall["total"] = time.perf_counter() - started
    progress("wall time " + ", ".join(f"{k} {v:.1f} s" for k, v in wall.items()))
    return {
        "schema": SCHEMA,
        "environment": env,
        "ceilings": ceilings,
        "datasheet": sheet,
        "method": {
            "quick": plan.quick, "flush_l2": plan.flush_l2, "budget_s": plan.budget_s, "seed": plan.seed,
            "baseline": plan.baseline, "timing": method.describe(),
            "reference": {**ref_method.describe(), "call_limit_s": REFERENCE_CALL_LIMIT_S},
            "ceilings": ceilings_how,
        },
        "rows": rows,
        "wall_s": wall,
    }


def _method_line(method: Method) -> str:
    """How rows and ceilings are timed, in one line."""
    counts = (f"{method.warmup} warm-up(s), {method.min_calls}-{method.max_calls} calls "
              f"within {method.budget_s:g} s")
    if method.device == "cuda" and method.capture and not method.flush_l2_bytes:
        how = f"graph replay, 32 calls x {method.trials} replays (else per-call events, {counts})"
    elif method.device == "cuda":
        how = f"per-call events{' with the L2 flushed' if method.flush_l2_bytes else ''}, {counts}"
    else:
        how = f"wall clock on {method.threads} thread(s), {counts}"
    return f"rows and ceilings timed by {how}, median"


def _time_row(row: dict[str, Any], fn: Callable[..., Any], inputs: list[dict[str, Any]],
              method: Method) -> None:
    timing, timer = time_calls(method, fn, inputs)
    row.update(median_us=timing.median_us, p20_us=timing.p20_us, p80_us=timing.p80_us, samples=timing.samples,
               timer=timer)


def _check_and_time(row: dict[str, Any], spec, fn: Callable[..., Any], kwargs: dict[str, Any], expected: Any,
                    reason: Optional[str], inputs: list[dict[str, Any]], method: Method,
                    lap: Callable[[str, float], float]) -> None:
    """An implementation's row: declined (its reason), else called once and checked against the
    reference's outputs (wrong: never timed), then timed; a raise anywhere makes it an error."""
    if reason is not None:
        row.update(status="declined", message=reason)
        return
    since = time.perf_counter()
    try:
        call_kwargs = _clone(kwargs)
        actual = spec.outputs(fn(**call_kwargs), call_kwargs)
        canonical = spec.canonical or (lambda outputs, _: outputs)
        row.update(error_stats(canonical(actual, kwargs), canonical(expected, kwargs)))
        try:
            spec.check_close(actual, expected, kwargs)
        except AssertionError as error:
            row.update(status="wrong", message=str(error).splitlines()[0][:300])
        since = lap("implementation_check", since)
        if row["status"] == "ok":
            _time_row(row, fn, inputs, method)
            lap("implementation_timing", since)
    except Exception as error:  # noqa: BLE001 - a crashing implementation is a result
        row.update(status="error", message=f"{type(error).__name__}: {error}"[:300])
        lap("implementation_check", since)


def _place_on_roofline(row: dict[str, Any], cost, ceilings: dict[str, Any], rate: Optional[float],
                       rate_name: str) -> None:
    """TFLOP/s, GB/s and the binding roofline: percent of it, or, above 100%, the flag: a row
    faster than its ceiling says the ceiling is wrong, so it gets no percentage."""
    seconds = row["median_us"] / 1e6
    memory_s = cost.bytes / (ceilings["memory_gbps"] * 1e9)
    compute_s = cost.flops / (rate * 1e12) if rate else 0.0
    fraction = max(memory_s, compute_s) / seconds
    bound = "compute" if compute_s > memory_s else "memory"
    row.update(tflops=cost.flops / seconds / 1e12, gbps=cost.bytes / seconds / 1e9, bound=bound)
    if fraction > 1.0:
        row.update(flag=ABOVE_CEILING, ceiling="memory_gbps" if bound == "memory" else f"{rate_name}_tflops",
                   ceiling_ratio=fraction)
    else:
        row["roofline_pct"] = 100 * fraction


def _speedups(case_rows: list[dict[str, Any]], baseline: Optional[str]) -> None:
    times = {r["backend"]: r["median_us"] for r in case_rows if "median_us" in r}
    for row in case_rows:
        if "median_us" not in row:
            continue
        # null: the reference was not timed (its row says why), so no speed-up over it exists.
        row["speedup_vs_reference"] = times[REFERENCE] / row["median_us"] if REFERENCE in times else None
        if baseline and baseline in times:
            row["speedup_vs_baseline"] = times[baseline] / row["median_us"]


def _roofline_cell(row: dict[str, Any]) -> str:
    """The % roofline column: the percentage, or the flag with the ratio and the ceiling."""
    if row.get("flag") == ABOVE_CEILING:
        return f"{ABOVE_CEILING} ({row['ceiling_ratio']:.2f}x {row['ceiling']})"
    return f"{row['roofline_pct']:.1f}" if "roofline_pct" in row else "-"


def _vs_reference_cell(row: dict[str, Any]) -> str:
    if "speedup_vs_reference" not in row:
        return "-"
    value = row["speedup_vs_reference"]
    return "not timed" if value is None else f"{value:.2f}x"


def _describe(row: dict[str, Any]) -> str:
    head = f"{row['op']} {row['case']} {row['backend']}: "
    if row["status"] != "ok":
        return head + f"{row['status'].upper()} {row.get('message', '')}"
    if "median_us" not in row:
        return head + f"ok, not timed ({row.get('not_timed', '')})"
    text = (f"{_fmt_us(row['median_us'])} (p20-p80 {_fmt_us(row['p20_us'])}-{_fmt_us(row['p80_us'])}, "
            f"n={row['samples']}), ")
    if row.get("flag") == ABOVE_CEILING:
        text += (f"ABOVE-CEILING: {row['ceiling_ratio']:.2f}x the {row['ceiling']} ceiling (a ceiling problem, "
                 f"not a result)")
    else:
        text += f"{row['roofline_pct']:.1f}% of roofline ({row['bound']})"
    if row["backend"] != REFERENCE and "speedup_vs_reference" in row:
        value = row["speedup_vs_reference"]
        text += ", reference not timed" if value is None else f", {value:.2f}x the reference"
    return head + text


def _fmt_us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"


def failures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows that fail the run: wrong (outside the spec's tolerance) or error (raised)."""
    return [r for r in result["rows"] if r["status"] in FAILED]


def above_ceiling(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r.get("flag") == ABOVE_CEILING]


def upgrade(result: dict[str, Any], source: str = "result") -> dict[str, Any]:
    """A saved run in this SCHEMA: /1 files gain the above-ceiling flag where their roofline_pct
    passed 100 (and say they were upgraded); other schemas are refused."""
    schema = result.get("schema")
    if schema == SCHEMA:
        return result
    if schema != SCHEMA_V1:
        raise ConfigurationError(f"{source}: schema {schema!r}, expected {SCHEMA!r} (or {SCHEMA_V1!r})")
    for row in result["rows"]:
        pct = row.get("roofline_pct")
        if pct is not None and pct > 100:
            del row["roofline_pct"]
            row.update(flag=ABOVE_CEILING, ceiling_ratio=pct / 100,
                       ceiling="memory_gbps" if row.get("bound") == "memory" else f"{row['matmul']}_tflops")
    result.update(schema=SCHEMA, upgraded_from=SCHEMA_V1)
    return result


# ---------------------------------------------------------------------------------------------
# Reports


def markdown(result: dict[str, Any]) -> str:
    env, ceil, sheet = result["environment"], result["ceilings"], result.get("datasheet")
    method = result.get("method", {})
    lines = [
        f"# kernelmux bench: {env['device_name']}", "",
        f"kernelmux {env['kernelmux']} at {env['commit']}, torch {env['torch']}, triton {env['triton']}, "
        f"driver {env['driver']}, {env['timestamp']}.", "",
        "| ceiling | measured (as the rows are timed) | one call at a time | datasheet |", "|---|---|---|---|",
    ]
    for key, unit in (("memory_gbps", "GB/s"), ("bf16_tflops", "TFLOP/s"), ("fp8_tflops", "TFLOP/s"),
                      ("fp32_tflops", "TFLOP/s")):
        measured, burst = (f"{ceil[k]:.3g} {unit}" if ceil.get(k) else "-" for k in (key, f"{key}_burst"))
        listed = f"{sheet[key]:.0f} {unit}" if sheet and sheet.get(key) else "-"
        lines.append(f"| {key.rsplit('_', 1)[0]} | {measured} | {burst} | {listed} |")
    how = method.get("ceilings") or {}
    if how.get("timer"):
        lines += ["", f"Ceilings and rows timed the same way: {how['timer']}, {how['threads']} thread(s), "
                      f"{how['warmup']} warm-up(s), {how['min_calls']}-{how['max_calls']} calls within "
                      f"{how['budget_s']:g} s, median." + (f" bf16: {how['bf16']}." if how.get("bf16") else "")]
    reference = method.get("reference")
    if reference:
        lines += ["", f"The reference: its correctness call, then timed within {reference['budget_s']:g} s (at "
                      f"least one call; not timed when that call took over {reference['call_limit_s']:g} s)."]
    lines += ["", "| op | case | backend | status | median | p20-p80 | n | TFLOP/s | GB/s | % roofline | bound "
              "| vs reference | vs baseline | max rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        status = f"{r['status']}, {ABOVE_CEILING}" if r.get("flag") == ABOVE_CEILING else r["status"]
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        if "median_us" in r:
            cells = [_fmt_us(r["median_us"]), f"{_fmt_us(r['p20_us'])}-{_fmt_us(r['p80_us'])}",
                     str(r.get("samples", "-")), f"{r['tflops']:.3g}", f"{r['gbps']:.3g}", _roofline_cell(r),
                     r["bound"], _vs_reference_cell(r),
                     f"{r['speedup_vs_baseline']:.2f}x" if "speedup_vs_baseline" in r else "-", err]
        else:
            note = r.get("message") or (f"not timed: {r['not_timed']}" if "not_timed" in r else "")
            cells = [note[:80].replace("|", "/")] + ["-"] * 8 + [err]
        lines.append(" | ".join(["", r["op"], r["case"], r["backend"], status, *cells, ""]).strip())
    above, failed = above_ceiling(result), failures(result)
    if above:
        lines += ["", f"{len(above)} row(s) ran faster than their ceiling allows ({ABOVE_CEILING}): the "
                      "ceiling is wrong there, not the row, so they carry no percentage."]
    if failed:
        lines += ["", f"{len(failed)} row(s) failed (wrong or error): "
                      + ", ".join(f"{r['op']}/{r['case']}/{r['backend']}" for r in failed) + "."]
    if result.get("wall_s"):
        lines += ["", "Wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["wall_s"].items()) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Plots: the data each draws is built by a function of its own (tested), then drawn.


def roofline_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per timed row with both flops and bytes: op, case, backend, ``intensity``
    (flops per byte), ``tflops`` (achieved: flops / median time) and ``above`` (flagged
    above its ceiling). Rows without flops or bytes have no place on log axes."""
    points = []
    for r in result["rows"]:
        if "median_us" in r and r["flops"] > 0 and r["bytes"] > 0:
            points.append({"op": r["op"], "case": r["case"], "backend": r["backend"],
                           "intensity": r["flops"] / r["bytes"],
                           "tflops": r["flops"] / (r["median_us"] / 1e6) / 1e12,
                           "above": r.get("flag") == ABOVE_CEILING})
    return points


def roofline_ceilings(result: dict[str, Any]) -> dict[str, float]:
    """The ceilings the roofline draws, as measured in the run: ``memory_gbps`` (the slope) and
    each measured matrix rate, ``<precision>_tflops`` (the flat lines)."""
    ceil = result["ceilings"]
    names = ("memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops")
    return {k: float(ceil[k]) for k in names if ceil.get(k)}


def speedups(result: dict[str, Any]) -> list[dict[str, Any]]:
    """For each case with two or more timed implementations besides the reference: each one's
    speed-up over the fastest *other* one (``versus``): ``versus_us / median_us``, above 1 when
    it is the faster. The reference takes no part (its speed-up is the table's)."""
    by_case: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        if "median_us" in r and r["backend"] != REFERENCE:
            by_case.setdefault((r["op"], r["case"]), []).append(r)
    bars = []
    for (op, case), rows in by_case.items():
        if len(rows) < 2:
            continue
        for row in rows:
            other = min((r for r in rows if r is not row), key=lambda r: r["median_us"])
            bars.append({"op": op, "case": case, "backend": row["backend"], "median_us": row["median_us"],
                         "versus": other["backend"], "versus_us": other["median_us"],
                         "speedup": other["median_us"] / row["median_us"]})
    return bars


def speedup_path(path: str) -> str:
    """Where --plot F writes the speed-up chart: F with ``_speedup`` before its extension."""
    root, ext = os.path.splitext(path)
    return f"{root}_speedup{ext or '.png'}"


def plot(result: dict[str, Any], path: str) -> list[str]:
    """Write the roofline to ``path`` and the speed-up chart to speedup_path(path); return both."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError("--plot needs matplotlib: pip install 'kernelmux[bench]'") from None
    env = result["environment"]
    title = f"kernelmux bench, {env['device_name']}, {env['commit']}"
    _plot_roofline(plt, result, path, title)
    _plot_speedups(plt, result, speedup_path(path), title)
    return [path, speedup_path(path)]


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _plot_roofline(plt, result: dict[str, Any], path: str, title: str) -> None:
    points, ceilings = roofline_points(result), roofline_ceilings(result)
    fig, ax = plt.subplots(figsize=(12, 7.5))
    skipped = sum("median_us" in r for r in result["rows"]) - len(points)
    if not points or "memory_gbps" not in ceilings:
        ax.text(0.5, 0.5, "no timed row with flops and bytes, or no measured bandwidth", ha="center",
                transform=ax.transAxes)
        ax.set_axis_off()
    else:
        bandwidth = ceilings["memory_gbps"] / 1e3  # TFLOP/s per flop/byte
        rates = {k.split("_")[0]: v for k, v in ceilings.items() if k != "memory_gbps"}
        xs = [p["intensity"] for p in points] + [rate / bandwidth for rate in rates.values()]
        lo, hi = min(xs) / 4, max(xs) * 4
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        top = max(rates.values(), default=float("inf"))  # the slope up to the highest ridge
        slope = [x for x in grid if bandwidth * x <= top]
        ax.plot(slope, [bandwidth * x for x in slope], color="black", lw=1, ls="--",
                label=f"memory {ceilings['memory_gbps']:.4g} GB/s")
        for (name, rate), style in zip(sorted(rates.items(), key=lambda kv: -kv[1]), ("-", "-.", ":")):
            ax.plot(grid, [min(bandwidth * x, rate) for x in grid], color="black", lw=1.5, ls=style,
                    label=f"{name} {rate:.4g} TFLOP/s")
        ops = list(dict.fromkeys(p["op"] for p in points))
        backends = list(dict.fromkeys(p["backend"] for p in points))
        # Up to 10 ops tab10; more, tab20 taken 0, 2, ..., 18, 1, 3, ...: its neighbours are two
        # shades of one hue, so ops next to each other in the legend would look alike.
        palette, order = ((plt.get_cmap("tab10"), range(10)) if len(ops) <= 10
                          else (plt.get_cmap("tab20"), [*range(0, 20, 2), *range(1, 20, 2)]))
        colors = {op: palette(order[i % len(order)]) for i, op in enumerate(ops)}
        markers = {backend: _MARKERS[i % len(_MARKERS)] for i, backend in enumerate(backends)}
        for p in points:
            ax.scatter(p["intensity"], p["tflops"], s=46 if p["above"] else 30, color=colors[p["op"]],
                       marker=markers[p["backend"]], edgecolors="red" if p["above"] else "none",
                       linewidths=1.8 if p["above"] else 0, zorder=3)
        handles = [plt.Line2D([], [], ls="none", marker="o", color=colors[op], label=op) for op in ops]
        handles += [plt.Line2D([], [], ls="none", marker=markers[b], color="black", markerfacecolor="white",
                               label=b) for b in backends]  # hollow: a shape, not one of the ops' colours
        if any(p["above"] for p in points):
            handles.append(plt.Line2D([], [], ls="none", marker="o", color="white", markeredgecolor="red",
                                      label=f"{ABOVE_CEILING} (a ceiling problem)"))
        first = ax.legend(loc="upper left", fontsize=8, title="ceilings (this run)")
        ax.add_artist(first)
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  title="op / backend")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("arithmetic intensity (flop / byte, spec cost model)")
        ax.set_ylabel("achieved TFLOP/s (median)")
        ax.grid(True, which="both", alpha=0.3)
        if skipped:
            ax.text(0.99, 0.01, f"{skipped} timed row(s) without flops or bytes not drawn", ha="right",
                    va="bottom", fontsize=8, transform=ax.transAxes)
    ax.set_title(title + ": roofline", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _plot_speedups(plt, result: dict[str, Any], path: str, title: str) -> None:
    import matplotlib.ticker

    bars = speedups(result)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.3 * max(len(bars), 3)))
    if not bars:
        ax.text(0.5, 0.5, "no case had two implementations besides the reference timed (no peer in this run)",
                ha="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        backends = list(dict.fromkeys(b["backend"] for b in bars))
        palette = plt.get_cmap("tab10")
        colors = {backend: palette(i % palette.N) for i, backend in enumerate(backends)}
        ys = list(range(len(bars)))[::-1]  # first case at the top
        for y, b in zip(ys, bars):
            # From 1.0 to the speed-up: right of the line is faster than the best other, left slower.
            ax.barh(y, b["speedup"] - 1.0, left=1.0, height=0.7, color=colors[b["backend"]])
            label = f"{b['speedup']:.2f}x: {_fmt_us(b['median_us'])} vs {b['versus']} {_fmt_us(b['versus_us'])}"
            ax.text(max(b["speedup"], 1.0) * 1.03, y, label, va="center", fontsize=7)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ticks = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}x")
        ax.xaxis.set_major_formatter(ticks)
        ax.xaxis.set_minor_formatter(ticks)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        values = [b["speedup"] for b in bars] + [1.0]
        ax.set_xlim(min(values) / 1.5, max(values) * 3.0)  # room for the time labels
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{b['op']} / {b['case']} / {b['backend']}" for b in bars], fontsize=7)
        ax.set_ylim(-0.7, len(bars) - 0.3)
        ax.set_xlabel("speed-up over the fastest other implementation of the case (x, median times)")
        handles = [plt.Line2D([], [], ls="none", marker="s", color=colors[b], label=b) for b in backends]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.set_title(title + ": speed-up over the best other implementation", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
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
    parser.add_argument("--plot", metavar="F.png",
                        help="write two PNGs: F, a log-log roofline (flop/byte against achieved TFLOP/s, "
                        "each timed row a point by op and backend, the ceilings of the run as lines), and "
                        "F_speedup (F with _speedup before its extension), each implementation's speed-up "
                        "over the fastest other one per case, median times on the bars")
    parser.add_argument("--compare", metavar="OLD.json", help="print time ratios against an earlier run")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="with --compare: exit 1 when a row is this many percent slower (default 10)")
    parser.add_argument("--load", metavar="RUN.json", help="report or compare a saved run instead of running")
    parser.add_argument("--flush-l2", action="store_true",
                        help="CUDA: overwrite the L2 before each timed call")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed calls per row (default 0.5, --quick 0.05; the reference's: at "
                        "most 0.1)")
    parser.add_argument("--seed", type=int, default=0)


def _read_run(path: str) -> dict[str, Any]:
    """A saved run (--load, --compare), in this SCHEMA; a missing or unreadable file is a usage
    error (`kernelmux` exits 2 with its one line)."""
    try:
        with open(path) as f:
            return upgrade(json.load(f), path)
    except (OSError, ValueError) as error:
        raise ConfigurationError(f"cannot read the bench run {path}: {error}") from None


def main(args: argparse.Namespace) -> int:
    # Usage errors are kernelmux errors: `kernelmux` prints their one line and exits 2.
    if args.load:
        result = _read_run(args.load)
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
        plan = Plan(
            ops=args.ops or names, backends=args.backends, cases=args.cases, quick=args.quick,
            baseline=args.baseline, flush_l2=args.flush_l2,
            budget_s=args.budget if args.budget is not None else default_budget_s(args.quick),
            seed=args.seed, device="cuda" if torch.cuda.is_available() else "cpu",
        )
        result = run(plan, progress=lambda line: print(line, file=sys.stderr, flush=True), engine=engine)
        _summary(result)
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
    if args.compare:
        if compare(result, _read_run(args.compare), args.threshold):
            status = 1
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
        roofline = _roofline_cell(r) + (f" ({r['bound']})" if "roofline_pct" in r else "")
        table.add_row(r["op"], r["case"], r["backend"], status,
                      _fmt_us(r["median_us"]) if timed else ("not timed" if "not_timed" in r else "-"),
                      roofline if timed else "-", _vs_reference_cell(r))
    console = Console(width=160)
    console.print(table)
    above = above_ceiling(result)
    if above:
        console.print(f"[bold yellow]{len(above)} row(s) ran faster than their ceiling allows: the ceiling is "
                      "wrong there, not the row (no percentage given).[/]")
