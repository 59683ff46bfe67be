"""The `kernelmux` command: `info` (platform, plugins, selection per op) and `explain OP`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

__all__ = ["main"]


def _engine(platform: str | None):
    """The current engine, or a separate one for a simulated platform (the current stays)."""
    from kernelmux import engine
    from kernelmux.ops.specs import ALL_SPECS

    if platform:
        return engine.Engine(ALL_SPECS, engine.Settings.from_env().with_changes(platform=platform))
    return engine.current()


def _print(renderable) -> None:
    from rich.console import Console

    Console(soft_wrap=False, width=max(100, Console().width)).print(renderable)


def _info(args: argparse.Namespace) -> int:
    from kernelmux.engine.report import render_report, report

    data = report(_engine(args.platform))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(render_report(data))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from kernelmux.engine.report import explain_report, render_explain

    engine = _engine(args.platform)
    if args.op not in engine.specs:
        print(f"kernelmux: unknown op {args.op!r}; ops: {', '.join(sorted(engine.specs))}", file=sys.stderr)
        return 2
    spec = engine.specs[args.op]
    kwargs = None
    if args.case:
        try:
            case = spec.case(args.case)
        except KeyError as error:
            print(f"kernelmux: {error.args[0]}", file=sys.stderr)
            return 2
        # On a simulated platform the inputs cannot live on its device: build them as meta
        # tensors (shapes and dtypes only) and let the engine answer for the simulated device.
        simulated = engine.platform.simulated
        kwargs = case.build("meta" if simulated else engine.platform.device_type)
    data = explain_report(engine, args.op, kwargs, args.case)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(render_explain(data))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelmux", description="LLM-serving ops behind a plugin registry: what runs here, and why."
    )
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
    bench.set_defaults(run=bench_module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kernelmux.errors import KernelmuxError

    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KernelmuxError as error:  # bad platform names, settings, strict-mode plugin failures
        print(f"kernelmux: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
