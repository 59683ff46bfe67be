"""The bench's plots (--plot): a log-log roofline of the run's rows against its measured ceilings,
and each implementation's speed-up over the fastest other one; the data each draws comes from a
function of its own (tested), then drawn with matplotlib."""

from __future__ import annotations

import os
from typing import Any

from kernelmux.errors import ConfigurationError
from kernelmux.perf.report import fmt_us
from kernelmux.perf.schema import ABOVE_CEILING, REFERENCE

__all__ = ["plot", "roofline_ceilings", "roofline_points", "speedup_path", "speedups"]

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
            label = f"{b['speedup']:.2f}x: {fmt_us(b['median_us'])} vs {b['versus']} {fmt_us(b['versus_us'])}"
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

