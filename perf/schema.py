"""The bench's JSON schema, ``kernelmux.bench/2``: the names its rows use, the rows that fail a
run, the upgrade of /1 files read by --load and --compare, and the merge of runs that one device
measured in parts (--load A --load B: a full bench outgrew one device call)."""

from __future__ import annotations

from typing import Any

from kernelmux.errors import ConfigurationError

__all__ = ["ABOVE_CEILING", "FAILED", "REFERENCE", "SCHEMA", "SCHEMA_V1", "above_ceiling", "failures", "merge",
           "upgrade"]


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


# What runs merged into one must share: the same code on the same device, timed the same way.
_SAME_ENVIRONMENT = ("device", "device_name", "platform", "arch", "machine", "torch", "triton", "kernelmux",
                     "python", "commit", "driver", "cuda", "tuning_device", "versions")
_SAME_METHOD = ("quick", "flush_l2", "budget_s", "seed", "baseline", "timing", "reference")


def merge(runs: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One run from ``runs`` (saved runs of one commit on one device, in this SCHEMA, read from
    ``sources``): each case's rows, bucket and selection come from the last run that measured it;
    a case is not run only when no run measured it. The first run's ceilings head the report, and
    ``parts`` keeps every run's own (each row's percentage is against its own run's ceilings)."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    for run, source in zip(runs[1:], sources[1:]):
        for part, keys in (("environment", _SAME_ENVIRONMENT), ("method", _SAME_METHOD)):
            for key in keys:
                if run[part].get(key) != first[part].get(key):
                    raise ConfigurationError(
                        f"cannot merge {source} into {sources[0]}: {part}.{key} is {run[part].get(key)!r}, "
                        f"expected {first[part].get(key)!r} (runs merge only from one commit on one device, "
                        "timed the same way)")
    measured: dict[str, int] = {}  # op/case -> the index of the last run that measured it
    for index, run in enumerate(runs):
        for row in run["rows"]:
            measured[f"{row['op']}/{row['case']}"] = index
    rows = [row for key, index in measured.items() for row in runs[index]["rows"]
            if f"{row['op']}/{row['case']}" == key]
    selection = [choice for index, run in enumerate(runs) for choice in run.get("selection", ())
                 if measured.get(f"{choice['op']}/{choice['case']}") == index]
    buckets = {key: run["buckets"][key] for index, run in enumerate(runs) for key in run.get("buckets", {})
               if measured.get(key) == index}
    not_run = list(dict.fromkeys(key for run in runs for key in run.get("not_run", ()) if key not in measured))
    wall: dict[str, float] = {}
    for run in runs:
        for phase, seconds in (run.get("wall_s") or {}).items():
            wall[phase] = wall.get(phase, 0.0) + seconds
    return {
        **first,
        "rows": rows,
        "buckets": buckets,
        "selection": selection,
        "not_run": not_run,
        "wall_s": wall,
        "first_calls": [call for run in runs for call in run.get("first_calls", ())],
        "parts": [{"timestamp": run["environment"]["timestamp"], "ceilings": run["ceilings"],
                   "cases": sum(1 for i in measured.values() if i == index),
                   "ops": list(dict.fromkeys(key.split("/")[0] for key, i in measured.items() if i == index))}
                  for index, run in enumerate(runs)],
    }
