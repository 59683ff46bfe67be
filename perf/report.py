"""The bench's reports of a run: its rows as text (progress lines, table cells), the markdown
file, and the comparison of two runs that gates a change (--compare)."""

from __future__ import annotations

import math
from typing import Any, Callable

from kernelmux.perf.schema import ABOVE_CEILING, REFERENCE, above_ceiling, failures

__all__ = ["compare", "describe", "fmt_us", "markdown", "roofline_cell", "vs_reference_cell"]

def roofline_cell(row: dict[str, Any]) -> str:
    """The % roofline column: the percentage, or the flag with the ratio and the ceiling."""
    if row.get("flag") == ABOVE_CEILING:
        return f"{ABOVE_CEILING} ({row['ceiling_ratio']:.2f}x {row['ceiling']})"
    return f"{row['roofline_pct']:.1f}" if "roofline_pct" in row else "-"


def vs_reference_cell(row: dict[str, Any]) -> str:
    if "speedup_vs_reference" not in row:
        return "-"
    value = row["speedup_vs_reference"]
    return "not timed" if value is None else f"{value:.2f}x"


def describe(row: dict[str, Any]) -> str:
    head = f"{row['op']} {row['case']} {row['backend']}: "
    if row["status"] != "ok":
        return head + f"{row['status'].upper()} {row.get('message', '')}"
    if "median_us" not in row:
        return head + f"ok, not timed ({row.get('not_timed', '')})"
    text = (f"{fmt_us(row['median_us'])} (p20-p80 {fmt_us(row['p20_us'])}-{fmt_us(row['p80_us'])}, "
            f"n={row['samples']}), ")
    if row.get("flag") == ABOVE_CEILING:
        text += (f"ABOVE-CEILING: {row['ceiling_ratio']:.2f}x the {row['ceiling']} ceiling (a ceiling problem, "
                 f"not a result)")
    else:
        text += f"{row['roofline_pct']:.1f}% of roofline ({row['bound']})"
    if row["backend"] != REFERENCE and "speedup_vs_reference" in row:
        value = row["speedup_vs_reference"]
        text += ", reference not timed" if value is None else f", {value:.2f}x the reference"
    if "metadata_us" in row:
        text += f"; of which metadata and planning {fmt_us(row['metadata_us'])}"
    return head + text


def fmt_us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"



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
    if result.get("parts"):
        lines += ["", f"Merged from {len(result['parts'])} runs of this commit (the table's ceilings are the "
                      "first's; each row's percentage is against its own run's): " + "; ".join(
                          f"{p['timestamp']}, {p['cases']} case(s) of {', '.join(p['ops']) or 'no op'}, memory "
                          f"{p['ceilings'].get('memory_gbps') or 0:.3g} GB/s, bf16 "
                          f"{p['ceilings'].get('bf16_tflops') or 0:.3g} TFLOP/s" for p in result["parts"]) + "."]
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
            cells = [fmt_us(r["median_us"]), f"{fmt_us(r['p20_us'])}-{fmt_us(r['p80_us'])}",
                     str(r.get("samples", "-")), f"{r['tflops']:.3g}", f"{r['gbps']:.3g}", roofline_cell(r),
                     r["bound"], vs_reference_cell(r),
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
    planned = [r for r in result["rows"] if "metadata_us" in r]
    if planned:
        lines += ["", "Metadata conversion and planning, timed apart (the row's median includes it): "
                      + ", ".join(f"{r['op']}/{r['case']}/{r['backend']} {fmt_us(r['metadata_us'])}"
                                  for r in planned) + "."]
    if result.get("first_calls"):
        lines += ["", "Vendor first calls (JIT compiles, not in any row): "
                      + ", ".join(f"{c['vendor']} {c['op']} {c['variant']} {c['seconds']:.1f} s"
                                  for c in result["first_calls"]) + "."]
    line = selection_line(result)
    if line:
        lines += ["", line]
    if result.get("wall_s"):
        lines += ["", "Wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["wall_s"].items()) + "."]
    return "\n".join(lines) + "\n"



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
        out(f"  {flag:10s} {name}: {fmt_us(prior['median_us'])} -> {fmt_us(row['median_us'])} "
            f"({ratio:.3f}x time)")
    if ratios:
        logs = [math.log(r) for r in ratios]
        out(f"  {len(ratios)} rows: time ratio geomean {math.exp(sum(logs) / len(logs)):.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}; {regressions} past the threshold")
    return regressions


def selection_line(result: dict[str, Any]) -> str:
    """Chosen against fastest: how many cases the engine's choice (tuning table or priority) was the
    fastest timed row on, within 3%, and each case where it was not ("" for a run before /2 had it)."""
    selection = result.get("selection")
    if not selection:
        return ""
    missed = [s for s in selection if s["mismatch"]]
    not_run = result.get("not_run") or ()
    stopped = f"Stopped at the deadline: {len(not_run)} case(s) not run. " if not_run else ""
    text = (f"{stopped}Selection: on {len(selection) - len(missed)} of {len(selection)} cases with two or more "
            "timed rows the engine's choice was the fastest (within 3%)")
    if not missed:
        return text + "."
    return text + "; slower on " + ", ".join(
        f"{s['op']}/{s['case']} ({s['chosen']} {fmt_us(s['chosen_us'])}, {s['fastest']} {fmt_us(s['fastest_us'])}, "
        f"{s['ratio']:.2f}x)" for s in missed) + "."
