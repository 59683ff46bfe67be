"""kernelmux tune: measure every implementation of the named ops (the reference too) on their cases
and write the tuning table that orders this device's calls (engine/tuning.py says how it is used).

It runs the bench's runner (same checks, timers and rows), or reads bench runs that recorded their
buckets (``--load``, e.g. one made on a GPU machine), and writes ``$KERNELMUX_CACHE_DIR/tuning/
<device>.json``, or the checkout's shipped table with ``--ship``. A table of the same device and
versions is updated: the new measurements replace those of the same op and bucket, and an old one
whose bucket its cases no longer give (a key or a bucket rule changed, a case is gone) is dropped.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from kernelmux.engine import Engine, Settings, tuning
from kernelmux.errors import ConfigurationError, UnknownOpError
from kernelmux.perf.bench import _read_run
from kernelmux.perf.runner import Plan, run
from kernelmux.perf.timing import default_budget_s
from kernelmux.specs import ALL_SPECS

__all__ = ["add_arguments", "case_bucket", "compatible", "current", "main", "merge", "table_of_run"]

_SPECS = {spec.name: spec for spec in ALL_SPECS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="*", help="ops to measure (default: all)")
    parser.add_argument("--case", action="append", dest="cases", help="only these cases (repeatable)")
    parser.add_argument("--quick", action="store_true", help="the quick model cases and short timing")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed calls per row (default 0.5, --quick 0.05)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", metavar="RUN.json", action="append",
                        help="make the table from saved bench runs (repeatable; later runs win) instead of measuring")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="F.json", help="write the table here")
    where.add_argument("--ship", action="store_true",
                       help="write it into this checkout's engine/tables (the tables kernelmux ships)")


def table_of_run(result: dict[str, Any], source: str = "this run") -> dict[str, Any]:
    """The tuning table of one bench run (``perf/runner.py``'s result)."""
    env = result["environment"]
    if not result.get("buckets") or not env.get("versions"):
        raise ConfigurationError(f"{source} has no buckets or versions (a run before tuning tables): rerun it")
    if env.get("tuning_device") is None:
        raise ConfigurationError(f"{source} ran on a simulated platform: it measured no device")
    buckets = {tuple(name.split("/", 1)): bucket for name, bucket in result["buckets"].items()}
    return tuning.make_table(result["rows"], buckets, env["tuning_device"], env["versions"], env.get("commit", ""),
                             env.get("timestamp", ""))


def compatible(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two tables are of one device and one set of versions (and so can be merged)."""
    return old.get("device") == new["device"] and old.get("versions") == new["versions"]


@functools.cache
def case_bucket(op: str, case: str) -> Optional[dict[str, Any]]:
    """The bucket a spec case's key falls in now, its tensors made on the meta device (a key needs no
    values); None where the op or the case is gone."""
    spec = _SPECS.get(op)
    if spec is None or case not in {c.name for c in spec.cases}:
        return None
    return tuning.bucket(spec.validate(**spec.case(case).make(torch.device("meta"), torch.Generator())))


def current(measurement: dict[str, Any]) -> bool:
    """Whether each case a measurement names still falls in its bucket: one that does not (the key grew,
    a size class moved, the case is gone) can never order a call."""
    return all(case_bucket(measurement["op"], case) == measurement["bucket"]
               for case in measurement["case"].split(tuning.CASE_SEPARATOR))


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the measurements of ``old`` it does not replace (same op and bucket) and that are
    still ``current``, when both are of one device and versions; else ``new`` alone."""
    if not compatible(old, new):
        return new
    replaced = {(m["op"], json.dumps(m["bucket"], sort_keys=True)) for m in new["measurements"]}
    kept = [m for m in old.get("measurements", ())
            if (m["op"], json.dumps(m["bucket"], sort_keys=True)) not in replaced and current(m)]
    return {**new, "measurements": kept + new["measurements"]}


def main(args: argparse.Namespace) -> int:
    names = [spec.name for spec in ALL_SPECS]
    unknown = [op for op in args.ops if op not in names]
    if unknown:
        raise UnknownOpError(unknown[0], names)
    if args.load:
        table: dict[str, Any] | None = None
        for path in args.load:
            made = table_of_run(_read_run(path), path)
            if table is not None and not compatible(table, made):
                raise ConfigurationError(f"{path} ran on another device or with other versions than the runs "
                                         "before it: one table is one device and one set of versions")
            table = made if table is None else merge(table, made)
    else:
        engine = Engine(ALL_SPECS, Settings.from_env())
        device = "cuda" if torch.cuda.is_available() else "cpu"
        plan = Plan(ops=args.ops or names, backends=None, cases=args.cases, quick=args.quick, baseline=None,
                    flush_l2=False, budget_s=args.budget if args.budget is not None else default_budget_s(args.quick),
                    seed=args.seed, device=device)
        table = table_of_run(run(plan, progress=lambda line: print(line, file=sys.stderr, flush=True), engine=engine))
    assert table is not None
    if args.ops:
        table = {**table, "measurements": [m for m in table["measurements"] if m["op"] in args.ops]}
    if args.out:
        path = Path(args.out)
    else:
        path = (tuning.shipped_dir() if args.ship else tuning.user_dir()) / f"{tuning.slug(table['device'])}.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        merged = merge(old, table)
        if old and not compatible(old, table):
            print(f"kernelmux tune: {path} was measured with other versions or on another device: replaced",
                  file=sys.stderr)
        table = merged
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}: {len(table['measurements'])} measured buckets, fastest first")
    for m in table["measurements"]:
        times = m["times_us"]
        print(f"  {m['op']} {m['case']}: " + ", ".join(f"{b} {times[b]:.4g} us" for b in sorted(times, key=times.get)))
    return 0
