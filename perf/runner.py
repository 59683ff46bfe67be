"""Running a bench plan: every case's inputs built, the reference and each viable implementation
checked against it, then timed, placed on the run's measured roofline, and returned as one
``kernelmux.bench/2`` result."""

from __future__ import annotations

import os
import platform as host_platform
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.engine import Engine, Settings
from kernelmux.engine import tuning
from kernelmux.engine.report import distribution_version
from kernelmux.platforms import synchronize
from kernelmux.specs import ALL_SPECS
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.report import describe
from kernelmux.perf.schema import ABOVE_CEILING, REFERENCE, SCHEMA
from kernelmux.perf.timing import Method, rotated_inputs, time_calls
from kernelmux.registry import Backend

__all__ = ["Plan", "REFERENCE_BUDGET_S", "REFERENCE_CALL_LIMIT_S", "WALL_PHASES", "environment", "error_stats",
           "reference_method", "run"]

# The reference is called once for correctness; that call is its warm-up, and it is then timed
# for at most REFERENCE_BUDGET_S (at least one call), and only if the correctness call took at
# most REFERENCE_CALL_LIMIT_S. So timing a case's reference costs at most 1.1 s past the call
# every case needs anyway, whatever the reference does. Timed as the rows were (graph replay of
# 1027 calls where a reference captures; 3 warm-ups, a capture attempt, 3 more warm-ups and 3+
# calls where it cannot), the references kept the full H100 bench from finishing in 300 s
# (issue 24). The speed-up over the reference stays a measured median, of fewer calls (samples).
REFERENCE_BUDGET_S = 0.1
REFERENCE_CALL_LIMIT_S = 1.0
_deadline_clock = time.monotonic  # the clock --deadline is read on (apart from the timers)


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
    deadline_s: Optional[float] = None  # start no case after this many seconds (the rest: "not_run")

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
        # What a tuning table made from this run is for (kernelmux tune --load).
        "tuning_device": tuning.device_identity(engine.platform_for(torch.device(device))),
        "versions": tuning.versions(engine.registry),
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
    return spec.model_cases(plan.quick, plan.device)


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
    deadline = None if plan.deadline_s is None else _deadline_clock() + plan.deadline_s
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
    if env["tuning_device"] is not None and plan.device == "cpu":
        env["tuning_device"]["units"] = method.threads  # a CPU's units are the threads it was timed on
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
    buckets: dict[str, dict[str, Any]] = {}
    selection: list[dict[str, Any]] = []
    not_run: list[str] = []
    for index, (op, case) in enumerate(work, 1):
        if deadline is not None and _deadline_clock() > deadline:
            # A run cut short keeps what it measured: a killed process would write nothing.
            not_run = [f"{o}/{c.name}" for o, c in work[index - 1:]]
            progress(f"deadline: {plan.deadline_s:g} s passed; {len(not_run)} case(s) not run")
            break
        spec = engine.specs[op]
        since = time.perf_counter()
        kwargs = case.build(plan.device, plan.seed)
        since = lap("inputs", since)
        ref_kwargs = _clone(kwargs)  # in-place ops: outputs() reads the arguments the call wrote
        expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
        synchronize(plan.device)
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
        ordered = engine.explain(op, kwargs)
        answers = {impl.backend: reason for impl, reason in ordered}
        buckets[f"{op}/{case.name}"] = tuning.bucket(spec.validate(**kwargs))
        implementations = _implementations(engine, op, plan)
        case_rows: list[dict[str, Any]] = []
        # Every implementation is checked before anything is timed: timing calls an in-place op
        # (selective_state_update's state, a cache write) on ``inputs``, whose first entry is
        # ``kwargs``, so a check after a timing would start from arguments the timing moved on.
        for backend, fn in implementations:
            row: dict[str, Any] = {
                "op": op, "case": case.name, "backend": backend, "status": "ok",
                "flops": cost.flops, "bytes": cost.bytes, "matmul": rate_name,
            }
            if backend != REFERENCE:  # the reference defines the expected outputs: no second check
                _check(row, spec, fn, kwargs, expected, answers.get(backend), lap)
            case_rows.append(row)
        for row, (backend, fn) in zip(case_rows, implementations):
            since = time.perf_counter()
            if backend == REFERENCE:
                if reference_call_s > REFERENCE_CALL_LIMIT_S:
                    row["not_timed"] = (f"one call took {reference_call_s:.1f} s; a reference is timed only "
                                        f"when its correctness call takes at most {REFERENCE_CALL_LIMIT_S:g} s")
                else:
                    _time_row(row, fn, inputs, ref_method)
                lap("reference_timing", since)
            elif row["status"] == "ok":
                _time_implementation(row, fn, inputs, method)
                lap("implementation_timing", since)
            if "median_us" in row:
                _place_on_roofline(row, cost, ceilings, rate, rate_name)
        _speedups(case_rows, plan.baseline)
        choice = _selection(op, case.name, case_rows, ordered)
        if choice is not None:
            selection.append(choice)
        elapsed = time.perf_counter() - started
        left = elapsed / index * (len(work) - index)
        for row in case_rows:
            progress(f"[{index}/{len(work)} {elapsed:.0f} s, ~{left:.0f} s left] {describe(row)}")
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
        "buckets": buckets,
        "selection": selection,
        "not_run": not_run,
        "wall_s": wall,
        # Vendor first calls (JIT compiles) this process made, kept apart from the rows' times.
        "first_calls": [{"vendor": vendor, "op": op, "variant": str(variant), "seconds": round(seconds, 2)}
                        for (vendor, op, variant), seconds in first_calls.seconds().items()],
    }


def _selection(op: str, case: str, case_rows: list[dict[str, Any]],
               ordered: list[tuple[Any, Optional[str]]]) -> Optional[dict[str, Any]]:
    """What the engine runs on this case (the first implementation that accepts, in the order the
    call tries them; the reference when none does) against the fastest timed row, or None when
    fewer than two rows were timed or the chosen one was not run (``--backend``)."""
    times = {r["backend"]: r["median_us"] for r in case_rows if "median_us" in r}
    chosen = next((impl.backend for impl, reason in ordered if reason is None), REFERENCE)
    if len(times) < 2 or chosen not in times:
        return None
    fastest = min(times, key=times.__getitem__)
    ratio = times[chosen] / times[fastest]
    return {"op": op, "case": case, "chosen": chosen, "fastest": fastest, "chosen_us": times[chosen],
            "fastest_us": times[fastest], "ratio": round(ratio, 4), "mismatch": ratio > 1 + tuning.TIE}


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


def _time_metadata(row: dict[str, Any], fn: Callable[..., Any], inputs: list[dict[str, Any]],
                   method: Method) -> None:
    """``metadata_us``: the time of what the implementation does before its kernel runs (a block
    table's conversion, a vendor's plan), when its entry module defines ``metadata(kwargs)``;
    the row's median includes it."""
    prepare = getattr(sys.modules.get(getattr(fn, "__module__", "")), "metadata", None)
    if callable(prepare):
        timing, _ = time_calls(method, lambda **kwargs: prepare(kwargs), inputs)
        row["metadata_us"] = timing.median_us


def _check(row: dict[str, Any], spec, fn: Callable[..., Any], kwargs: dict[str, Any], expected: Any,
           reason: Optional[str], lap: Callable[[str, float], float]) -> None:
    """An implementation's row before timing: declined (its reason), else called once on a copy of
    the inputs and checked against the reference's outputs (status wrong: never timed); a raise
    makes it an error."""
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
    except Exception as error:  # noqa: BLE001 - a crashing implementation is a result
        row.update(status="error", message=f"{type(error).__name__}: {error}"[:300])
    lap("implementation_check", since)


def _time_implementation(row: dict[str, Any], fn: Callable[..., Any], inputs: list[dict[str, Any]],
                         method: Method) -> None:
    """A checked row's time, and its metadata's; a raise while timing makes it an error."""
    try:
        _time_row(row, fn, inputs, method)
        _time_metadata(row, fn, inputs, method)
    except Exception as error:  # noqa: BLE001 - a crashing implementation is a result
        row.update(status="error", message=f"{type(error).__name__}: {error}"[:300])


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

