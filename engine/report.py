"""The selection report: one view across all ops of what was chosen, viable, rejected and why."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any, Mapping

import torch

if TYPE_CHECKING:
    from kernelmux.engine._engine import Engine
    from kernelmux.registry import Implementation

__all__ = ["explain_report", "report", "render_explain", "render_report"]


def distribution_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _impl_json(impl: "Implementation") -> dict[str, Any]:
    return {
        "backend": impl.backend,
        "plugin": impl.plugin,
        "priority": impl.priority,
        "requirement": impl.requirement.describe(),
        "devices": sorted(impl.devices),
        "description": impl.description,
    }


def report(engine: "Engine", cache_usage: bool = False) -> dict[str, Any]:
    """The report as JSON-ready data; ``cache_usage`` adds each compile cache's files and bytes."""
    from kernelmux.engine.fingerprint import native_state, python_fingerprint
    from kernelmux.engine.warm_start import warm_state

    registry = engine.registry
    ops = []
    for name, table in engine.tables.items():
        dispatcher = engine.dispatchers[name]
        ops.append({
            "op": name,
            "spec_version": table.spec.version,
            "chosen": table.candidates[0].impl.backend if table.candidates else "reference (fallback)",
            "viable": [dict(_impl_json(c.impl), preferred=c.preferred) for c in table.candidates],
            "rejected": [dict(_impl_json(impl), reason=reason) for impl, reason in table.rejected],
            "calls": [
                {
                    "key": {name: str(value) for name, value in zip(key._fields, key)},
                    "backend": decision.backend,
                    "fallback": decision.fallback,
                    "answers": [{"backend": b, "reason": r} for b, r in decision.answers],
                    "platform": decision.platform,
                    "tuned": decision.tuned,
                    "capture": decision.capture,
                }
                for key, decision in dispatcher.decisions.items()  # a snapshot: safe while others dispatch
            ],
        })
    return {
        "kernelmux": distribution_version("kernelmux"),
        "torch": torch.__version__,
        "triton": distribution_version("triton"),
        "platform": engine.platform.to_json(),
        "settings": {
            "prefer": {op: list(b) for op, b in engine.settings.prefer.items()},
            "deny": sorted(engine.settings.deny),
            "allow_plugins": sorted(engine.settings.allow_plugins) if engine.settings.allow_plugins is not None else None,
            "strict": engine.settings.strict,
            "check": engine.settings.check,
        },
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
             "implementations": p.implementations}
            for p in registry.plugins
        ],
        "quarantined": [
            {"name": q.name, "distribution": q.distribution, "version": q.version, "reason": q.reason}
            for q in registry.quarantined
        ],
        "skipped_plugins": [p.name for p in registry.skipped],
        "rejected_registrations": [
            {"plugin": r.plugin, "op": r.op, "backend": r.backend, "reason": r.reason}
            for r in registry.rejections
        ],
        "tuning": {"tables": list(engine.tuning.sources), "notes": list(engine.tuning.notes),
                   "measurements": len(engine.tuning.measurements())},
        "warm_start": warm_state(engine, cache_usage),
        "call_fingerprint": native_state()[1] if engine.fingerprint is not python_fingerprint
        else f"Python (the native one: {native_state()[1]})",
        "ops": ops,
    }


def _render_warm_start(warm: Mapping[str, Any]) -> Any:
    """What the first calls here would compile, and the compile caches."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="warm start: what a first call compiles (kernelmux warmup runs them ahead)",
                  title_justify="left", caption=escape(warm["note"] or f"warm-up record: {warm['record']}"),
                  caption_justify="left")
    for column in ("op", "implementation", "compiles with", "warmed buckets"):
        table.add_column(column)
    for op, impls in warm["ops"].items():
        for impl in impls:
            warmed = impl["warmed_buckets"]
            table.add_row(op, impl["backend"], escape(f"{impl['jit']}: {impl['variant']}"),
                          str(warmed) if warmed else "-" if not warm["record"]
                          else "[yellow]none: the first call compiles[/yellow]")
    if not any(warm["ops"].values()):
        table.add_row("-", "-", "no implementation viable here compiles at its first call", "-")
    for cache in warm["caches"]:
        state = ("empty" if not cache["exists"] else f"{cache['files']} files, {cache['bytes'] / 2**20:.1f} MiB"
                 if "files" in cache else "present")
        table.caption += escape(f"\n{cache['name']} ({', '.join(cache['backends'])}): {cache['directory']}: {state}")
    return table


def render_report(data: Mapping[str, Any]) -> Any:
    """The report as rich renderables (a group of tables)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    platform = data["platform"]
    header = Text.assemble(
        ("platform: ", "bold"),
        f"{platform['kind']} {platform['arch']} {platform['device_name']}"
        + (" [simulated]" if platform["simulated"] else ""),
        "\nfeatures: " + (", ".join(platform["features"]) or "none"),
        f"\nkernelmux {data['kernelmux']}, torch {data['torch']}, triton {data['triton'] or 'not installed'}",
    )
    plugins = Table(title="plugins", title_justify="left")
    for column in ("name", "distribution", "version", "implementations", "status"):
        plugins.add_column(column)
    for p in data["plugins"]:
        # A plugin that loaded but registered nothing is as useless as a broken one: make it stand out.
        count = str(p["implementations"]) if p["implementations"] else "[yellow]0[/yellow]"
        plugins.add_row(escape(p["name"]), p["distribution"], p["version"], count, "loaded")
    for q in data["quarantined"]:
        # escape(): a reason quoting a [pyproject.toml] table would otherwise be read as markup.
        plugins.add_row(escape(q["name"]), q["distribution"], q["version"], "-",
                        f"[red]quarantined[/red]: {escape(q['reason'])}")
    for name in data["skipped_plugins"]:
        plugins.add_row(escape(name), "", "", "-", "not in KERNELMUX_PLUGINS allow-list")
    parts: list[Any] = [header, plugins]
    tuning = data["tuning"]
    lines = [f"tuning tables: {', '.join(tuning['tables']) or 'none for this device'}"
             + (f" ({tuning['measurements']} measured buckets; each call is ordered by its bucket's ranking)"
                if tuning["tables"] else " (priorities order every call)")]
    lines += [f"  note: {note}" for note in tuning["notes"]]
    lines.append(f"call fingerprint (a call seen before skips validation): {data['call_fingerprint']}")
    parts.append(Text("\n".join(lines)))
    parts.append(_render_warm_start(data["warm_start"]))
    if data["rejected_registrations"]:
        rejected = Table(title="implementations rejected at registration", title_justify="left")
        for column in ("plugin", "implementation", "reason"):
            rejected.add_column(column)
        for r in data["rejected_registrations"]:
            rejected.add_row(escape(r["plugin"]), escape(f"{r['op']}:{r['backend']}"), escape(r["reason"]))
        parts.append(rejected)
    ops = Table(title="ops", title_justify="left")
    for column in ("op", "chosen", "other candidates (in order)", "not viable here"):
        ops.add_column(column)
    for op in data["ops"]:
        others = [v["backend"] + (" (preferred)" if v["preferred"] else "") for v in op["viable"][1:]]
        ops.add_row(
            f"{op['op']} v{op['spec_version']}",
            op["chosen"],
            ", ".join(others) or "-",
            escape("\n".join(f"{r['backend']}: {r['reason']}" for r in op["rejected"])) or "-",
        )
    parts.append(ops)
    return Group(*parts)


def explain_report(
    engine: "Engine", op: str, kwargs: Mapping[str, Any] | None, case_name: str | None
) -> dict[str, Any]:
    """Why each implementation of ``op`` would or would not run, for one case if given."""
    data = report(engine)
    entry = next(o for o in data["ops"] if o["op"] == op)
    result: dict[str, Any] = {"platform": data["platform"], "op": op, "case": case_name,
                              "rejected": entry["rejected"], "viable": entry["viable"]}
    result["tuning"] = data["tuning"]
    if kwargs is not None:
        answers, tuned = engine.explain_tuned(op, kwargs)
        chosen = next((impl.backend for impl, reason in answers if reason is None), None)
        plans = engine.explain_plans(op, kwargs)
        result["answers"] = [{"backend": impl.backend, "reason": reason, "plan": plans.get(impl.backend)}
                             for impl, reason in answers]
        result["chosen"] = chosen or "reference (fallback)"
        result["tuned"] = tuned
        result["capture"] = engine.explain_capture(op, kwargs)
    else:
        result["chosen"] = entry["chosen"]
    return result


def _order(data: Mapping[str, Any]) -> str:
    """What ordered the candidates in an explain report: a tuning table's measurement or priority."""
    if data.get("tuned"):
        return f"tuning table {data['tuned']}"
    if not data["tuning"]["tables"]:
        return "priority (no tuning table for this device)"
    if "answers" in data:
        return "priority (no tuning table measured a bucket like this call's)"
    return "priority here; a tuning table orders each call by its bucket (pass --case)"


def render_explain(data: Mapping[str, Any]) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    platform = data["platform"]
    title = Text.assemble(
        (f"{data['op']}", "bold"),
        f" on {platform['kind']} {platform['arch']}" + (" [simulated]" if platform["simulated"] else ""),
        f", case {data['case']}" if data["case"] else " (no case: static selection only)",
        "\nchosen: ", (data["chosen"], "bold green"),
        "\nordered by: " + _order(data),
        f"\n{data['capture']}" if data.get("capture") else "",
    )
    table = Table()
    for column in ("backend", "implementation", "stage", "verdict"):
        table.add_column(column)
    viable = {v["backend"]: v for v in data["viable"]}
    rejected = {r["backend"]: r for r in data["rejected"]}
    if "answers" in data:  # in the order the call tries them
        for answer in data["answers"]:
            v = viable.get(answer["backend"]) or rejected.get(answer["backend"], {})
            reason = answer["reason"]
            verdict = "[green]accepts[/green]" if reason is None else f"declines: {escape(reason)}"
            if answer.get("plan"):
                verdict += f"; runs {escape(answer['plan'])}"
            stage = (f"candidate (priority {v['priority']})" if answer["backend"] in viable
                     else "ranked by the tuning table")
            table.add_row(escape(answer["backend"]), escape(v.get("description", "")), stage, verdict)
    else:
        for v in data["viable"]:
            table.add_row(escape(v["backend"]), escape(v.get("description", "")),
                          f"candidate (priority {v['priority']})",
                          "[green]viable[/green] (supports() is asked per call; pass --case)")
    for r in data["rejected"]:
        if any(a["backend"] == r["backend"] for a in data.get("answers", ())):
            continue  # the reference, listed above where the tuning table ranked it
        table.add_row(escape(r["backend"]), escape(r.get("description", "")), "startup",
                      f"[red]not viable[/red]: {escape(r['reason'])}")
    return Group(title, table)
