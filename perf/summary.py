"""The tables of perf/README.md, one per device, generated from perf/baselines/<device>.json: each
case's fastest implementation, its time and share of the roofline, and the best other one of the
run. ``python -m kernelmux.perf.summary --write`` rewrites them (``kernelmux bench --record`` too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from kernelmux.perf import records
from kernelmux.perf.report import fmt_us, roofline_cell
from kernelmux.perf.schema import REFERENCE, upgrade

__all__ = ["BEGIN", "END", "README", "best_rows", "device_table", "main", "render", "rewrite"]

README: Path = Path(__file__).resolve().parent / "README.md"
BEGIN = ("<!-- generated from perf/baselines/*.json by `python -m kernelmux.perf.summary --write`; "
         "tests/perf/test_summary.py fails when this block differs -->")
END = "<!-- end of the generated tables -->"


def best_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (op, case), in the run's order: ``best``, the fastest timed implementation (the
    reference only where no implementation was timed), and ``other``, the fastest other timed row
    of the case, the reference included (None when there is none)."""
    cases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in result["rows"]:
        cases.setdefault((row["op"], row["case"]), []).append(row)
    out = []
    for (op, case), rows in cases.items():
        timed = sorted((r for r in rows if "median_us" in r), key=lambda r: r["median_us"])
        kernels = [r for r in timed if r["backend"] != REFERENCE]
        best: Optional[dict[str, Any]] = (kernels or timed or [None])[0]
        others = [r for r in timed if r is not best]
        out.append({"op": op, "case": case, "best": best, "other": others[0] if others else None})
    return out


def device_table(key: str, result: dict[str, Any]) -> str:
    """One device's markdown: a heading naming the run, its ceilings, and the table."""
    env, ceil = result["environment"], result["ceilings"]
    rates = ", ".join(f"{name} {ceil[k]:.4g} {unit}" for k, name, unit in (
        ("memory_gbps", "copy", "GB/s"), ("bf16_tflops", "bf16", "TFLOP/s"), ("fp8_tflops", "fp8", "TFLOP/s"),
        ("fp32_tflops", "fp32", "TFLOP/s")) if ceil.get(k))
    lines = [f"### {key}: {env['device_name']}, bench {env['commit']}", "",
             f"perf/baselines/{key}.json: torch {env['torch']}, triton {env['triton']}, ceilings of the run: "
             f"{rates}.", "",
             "| op | case | best implementation | time | % of roofline | best other implementation (time, its time "
             "over the best's) |",
             "|---|---|---|---|---|---|"]
    for entry in best_rows(result):
        best, other = entry["best"], entry["other"]
        if best is None:
            lines.append(f"| {entry['op']} | {entry['case']} | none timed | - | - | - |")
            continue
        versus = (f"{other['backend']} {fmt_us(other['median_us'])} ({other['median_us'] / best['median_us']:.2f}x)"
                  if other else "-")
        lines.append(f"| {entry['op']} | {entry['case']} | {best['backend']} | {fmt_us(best['median_us'])} | "
                     f"{roofline_cell(best)} | {versus} |")
    return "\n".join(lines)


def render(runs: dict[str, dict[str, Any]]) -> str:
    """The generated block: every device's table between BEGIN and END."""
    tables = [device_table(key, upgrade(result, f"perf/baselines/{key}.json")) for key, result in runs.items()]
    return "\n\n".join([BEGIN, *tables, END])


def rewrite(readme: Optional[Path] = None, runs: Optional[dict[str, dict[str, Any]]] = None) -> bool:
    """Replace the generated block of ``readme`` (default: perf/README.md) by render(runs)
    (default: perf/baselines/*.json); True when the file changed."""
    readme = readme or README
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render(records.baselines() if runs is None else runs) + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelmux.perf.summary", description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the tables in perf/README.md")
    args = parser.parse_args(argv)
    if args.write:
        print(f"{README}: {'rewritten' if rewrite() else 'already current'}")
    else:
        print(render(records.baselines()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
