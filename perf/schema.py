"""The bench's JSON schema, ``kernelmux.bench/2``: the names its rows use, the rows that fail a
run, and the upgrade of /1 files read by --load and --compare."""

from __future__ import annotations

from typing import Any

from kernelmux.errors import ConfigurationError

__all__ = ["ABOVE_CEILING", "FAILED", "REFERENCE", "SCHEMA", "SCHEMA_V1", "above_ceiling", "failures", "upgrade"]


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

