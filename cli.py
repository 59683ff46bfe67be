"""The `kernelmux` command: `info` (platform, plugins, selection per op, warm starts), `explain OP`,
`bench`, `tune`, `check` (the conformance kit) and `warmup`.
A usage error (unknown op, case or platform, bad settings or arguments) exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn, Sequence

__all__ = ["main"]


def _engine(platform: str | None):
    """The current engine, or a separate one for a simulated platform (the current stays)."""
    from kernelmux import engine
    from kernelmux.specs import ALL_SPECS

    if platform:
        return engine.Engine(ALL_SPECS, engine.Settings.from_env().with_changes(platform=platform))
    return engine.current()


def _usage_error(message: str) -> int:
    print(f"kernelmux: {message}", file=sys.stderr)
    return 2


def _print(renderable) -> None:
    from rich.console import Console

    Console(soft_wrap=False, width=max(100, Console().width)).print(renderable)


def _info(args: argparse.Namespace) -> int:
    from kernelmux.engine.report import render_report, report

    data = report(_engine(args.platform), cache_usage=True)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(render_report(data))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from kernelmux.engine.report import explain_report, render_explain

    engine = _engine(args.platform)
    if args.op not in engine.specs:
        return _usage_error(f"unknown op {args.op!r}; ops: {', '.join(sorted(engine.specs))}")
    spec = engine.specs[args.op]
    kwargs = None
    if args.case:
        try:
            case = spec.case(args.case)
        except KeyError as error:
            return _usage_error(error.args[0])
        # On a simulated platform the inputs cannot live on its device: they are built on this
        # machine's CPU, and the engine answers from their dispatch key moved to the simulated
        # device (implementations decide from the key and the platform alone).
        simulated = engine.platform.simulated
        kwargs = case.build("cpu" if simulated else engine.platform.device)
    data = explain_report(engine, args.op, kwargs, args.case)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(render_explain(data))
    return 0


def _bench(args: argparse.Namespace) -> int:
    """perf/bench.py's main, once the cases named exist (it would skip unknown ones and time
    nothing); it reports unknown ops itself (UnknownOpError)."""
    from kernelmux.specs import ALL_SPECS
    from kernelmux.perf import bench as bench_module

    specs = {spec.name: spec for spec in ALL_SPECS}
    if args.cases and not args.load and all(op in specs for op in args.ops):
        known = list(dict.fromkeys(case.name for op in args.ops or specs for case in specs[op].cases))
        unknown = ", ".join(repr(name) for name in args.cases if name not in known)
        if unknown and not args.ops:  # every op's cases would be hundreds of names
            return _usage_error(f"no op has a case {unknown}; name the op to see its cases "
                                "(kernelmux bench OP --case NAME)")
        if unknown:
            return _usage_error(f"unknown case(s) {unknown} for {', '.join(args.ops)}; cases: "
                                f"{', '.join(known)}")
    return bench_module.main(args)


def _check(args: argparse.Namespace) -> int:
    """The conformance kit on one backend: a line per failure as found, the summary, exit 1 on any."""
    from kernelmux.conformance import CASE_CHECKS, DRAWN_CHECKS, FAIL, OP_CHECKS, check

    def progress(finding) -> None:
        if finding.status == FAIL or args.verbose:
            print(f"{finding.status:8s} {finding.op} / {finding.case} / {finding.check}"
                  + (f": {finding.message}" if finding.message else ""), flush=True)

    # Named cases: those alone, no drawn shapes.
    checks = CASE_CHECKS + OP_CHECKS + (() if args.cases else DRAWN_CHECKS)
    report = check(args.backend, args.ops or None, cases=args.cases, seed=args.seed, checks=checks,
                   examples=args.examples, max_bytes=args.max_mib << 20 if args.max_mib is not None else None,
                   progress=progress)
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": report.backend, "device": report.device,
                       "findings": [vars(finding) for finding in report.findings]}, f, indent=1)
    return 1 if report.failures else 0


def _warmup(args: argparse.Namespace) -> int:
    """Warm starts: each op's cases through selection, a line before each call, a summary after."""
    from dataclasses import asdict

    from kernelmux.engine import current
    from kernelmux.engine.warm_start import record_path, warmup

    engine = current()
    cases = args.cases
    if args.tuned:
        cases = sorted({case for m in engine.tuning.measurements() for case in m.cases})
        if not cases:
            return _usage_error("--tuned: no tuning table measured this device (kernelmux tune makes one)")
    start = time.perf_counter()
    warmed = warmup(engine, args.ops or None, cases=cases, quick=args.quick, log=lambda line: print(line, flush=True))
    total = time.perf_counter() - start
    failed = [w for w in warmed if w.error]
    compiled = sum(w.compile_s for w in warmed)
    print(f"warmed {len(warmed) - len(failed)} call(s) of {len({w.op for w in warmed})} op(s) in {total:.1f} s "
          f"(first calls {sum(w.first_s for w in warmed):.1f} s, about {compiled:.1f} s of it compiling)"
          + (f"; {len(failed)} failed" if failed else "") + f"; recorded in {record_path(engine)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(w), compile_s=w.compile_s) for w in warmed], f, indent=1)
    return 1 if failed else 0


def _version() -> str:
    """The installed kernelmux distribution's version and torch's."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("kernelmux")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed as a distribution)"
    return f"kernelmux {version}, torch {torch.__version__}"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one ``kernelmux: ...`` line (exit 2) like the others."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kernelmux").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"kernelmux: {where}{message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kernelmux", description="LLM-serving ops behind a plugin registry: what runs here, and why."
    )
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the kernelmux and torch versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common.add_argument(
        "--platform",
        metavar="NAME",
        help="simulate a platform: sm_90, sm_100, sm_120, gfx942, gfx950, x86_64, aarch64, s390x, "
        "xpu (with +feature/-feature edits)",
    )
    info = sub.add_parser("info", parents=[common], help="platform, plugins and the selection for every op")
    info.set_defaults(run=_info)
    explain = sub.add_parser("explain", parents=[common], help="why each implementation of OP would or would not run")
    explain.add_argument("op")
    explain.add_argument("--case", metavar="NAME", help="ask supports() with this spec case's inputs")
    explain.set_defaults(run=_explain)
    bench = sub.add_parser(
        "bench", help="time every viable implementation on the specs' cases against measured ceilings",
        description="Checks each implementation against the reference, times it, and reports "
        "TFLOP/s, GB/s, percent of a roofline measured in the same run and speed-ups.",
    )
    from kernelmux.perf import bench as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(run=_bench)
    check = sub.add_parser(
        "check", help="the conformance kit: run a backend's implementations against the specs' references",
        description="Every implementation BACKEND registers that can run here, on every spec case: outputs "
        "against the reference (poisoned output memory), the spec's fake, strided inputs, CUDA-graph replay on "
        "new inputs (CUDA), per op torch.compile(fullgraph=True) and opcheck, and hypothesis-drawn shapes against "
        "the reference (a failure shrunk to the smallest shape). Exits 1 on any failure.",
    )
    check.add_argument("ops", nargs="*", help="ops to check (default: every op the backend registers)")
    check.add_argument("--backend", required=True, help="the backend's name, as it registers it")
    check.add_argument("--case", action="append", dest="cases", help="only these cases (repeatable)")
    check.add_argument("--seed", type=int, help="the inputs' seed (default: a fresh one, printed)")
    check.add_argument("--max-mib", type=int, help="skip cases that move more than this many MiB")
    check.add_argument("--examples", type=int, default=20,
                       help="shapes hypothesis draws per implementation (default 20; none with --case)")
    check.add_argument("--json", help="write every finding here")
    check.add_argument("-v", "--verbose", action="store_true", help="print every finding, not only failures")
    check.set_defaults(run=_check)
    warm = sub.add_parser(
        "warmup", help="run what selection picks on each op's cases once, so its compilations are cached "
        "before serving",
        description="For each op's model cases (or --quick ones, --case ones, or the buckets this device's tuning "
        "table measured), the call goes through selection, so the implementation that would serve it runs: its "
        "Triton, NVRTC or vendor JIT compilations land in their on-disk caches. Each call is logged before it "
        "starts and timed; kernelmux info then says which ops are warm.",
    )
    warm.add_argument("ops", nargs="*", help="ops to warm (default: all)")
    which = warm.add_mutually_exclusive_group()
    which.add_argument("--case", action="append", dest="cases", help="only these cases (repeatable)")
    which.add_argument("--quick", action="store_true", help="the quick model cases")
    which.add_argument("--tuned", action="store_true", help="the cases this device's tuning tables measured")
    warm.add_argument("--json", help="write each warmed call here")
    warm.set_defaults(run=_warmup)
    tune = sub.add_parser(
        "tune", help="measure every implementation (the reference too) per shape bucket and write this "
        "device's tuning table, which orders its calls",
        description="Runs the bench's checks and timers on the ops' cases (or reads saved runs) and writes "
        "$KERNELMUX_CACHE_DIR/tuning/<device>.json; the engine then tries, per call, the implementations "
        "in the order measured on the call's bucket.",
    )
    from kernelmux.perf import tune as tune_module

    tune_module.add_arguments(tune)
    tune.set_defaults(run=tune_module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kernelmux.errors import KernelmuxError

    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KernelmuxError as error:  # bad platforms, settings, unknown ops, strict-mode plugin failures
        return _usage_error(str(error))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
