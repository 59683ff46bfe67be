"""The engine: settings, startup selection, per-call dispatch, overrides and the report.

The process has one current engine, built on first use from the environment (``Settings``) and
replaced as a whole by ``configure``; nothing rebinds at import time.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from kernelmux.engine.settings import ENV_VARS, Settings
from kernelmux.engine._engine import (
    CheckedDispatcher,
    Decision,
    Dispatcher,
    Engine,
    FallbackWarning,
    OpTable,
)
from kernelmux.engine.report import report as _report_data
from kernelmux.platforms import Platform
from kernelmux.specs import ALL_SPECS

__all__ = [
    "ENV_VARS",
    "CheckedDispatcher",
    "Decision",
    "Dispatcher",
    "Engine",
    "FallbackWarning",
    "OpTable",
    "Settings",
    "configure",
    "current",
    "install",
    "report",
    "reset",
    "resolve",
    "warmup",
]

_lock = threading.Lock()
_current: Engine | None = None  # not _engine: that name is the submodule's


def current() -> Engine:
    """The process's engine, built at first use."""
    engine = _current
    if engine is None:
        with _lock:
            engine = _current
            if engine is None:
                engine = _install(Engine(ALL_SPECS))
    return engine


def _install(engine: Engine) -> Engine:
    global _current
    _current = engine
    return engine


def install(engine: Engine) -> Engine:
    """Make ``engine`` the current one (one that ``current()`` or ``configure`` returned earlier)."""
    with _lock:
        return _install(engine)


def configure(
    *,
    prefer: Mapping[str, Iterable[str]] | None = None,
    deny: Iterable[str] | None = None,
    allow_plugins: Iterable[str] | None = None,
    strict: bool | None = None,
    check: bool | None = None,
    platform: str | Platform | None = None,
    plugins: Mapping[str, Any] | None = None,
    tuning: bool | None = None,
    native_fingerprint: bool | None = None,
    from_env: bool = True,
) -> Engine:
    """Rebuild the engine with overrides on top of the environment's settings (or on top of the
    defaults with ``from_env=False``), install it as current and return it. ``plugins`` maps
    names to plugin objects registered in addition to the installed entry points. ``check``:
    checked mode (see ``CheckedDispatcher``), the way to debug an integration. ``tuning=False``:
    priorities alone order the candidates (no tuning tables). ``native_fingerprint=False``: the
    Python call fingerprint even where the native one is built. Unknown names in
    ``prefer``, ``deny`` or ``allow_plugins`` raise ``ConfigurationError``."""
    simulated = platform if isinstance(platform, str) else None
    base = Settings.from_env() if from_env else Settings()
    settings = base.with_changes(
        prefer=prefer, deny=deny, allow_plugins=allow_plugins, strict=strict, check=check, platform=simulated,
        tuning=tuning, native_fingerprint=native_fingerprint,
    )
    engine = Engine(
        ALL_SPECS,
        settings,
        platform=platform if isinstance(platform, Platform) else None,
        plugins=plugins,
    )
    with _lock:
        return _install(engine)


def reset() -> None:
    """Forget the current engine; the next call builds one from the environment again."""
    global _current
    with _lock:
        _current = None


def resolve(op: str, *args: Any, **kwargs: Any):
    """The implementation function that ``kernelmux.ops.<op>(*args, **kwargs)`` would run, for
    callers that validate once and then call it directly with no dispatch cost."""
    return current().resolve(op, *args, **kwargs)


def report() -> dict[str, Any]:
    """The current engine's selection report as JSON-ready data."""
    return _report_data(current())


def warmup(ops: Iterable[str] | None = None, *, cases: Iterable[str] | None = None, quick: bool = False,
           log: Any = None) -> list:
    """Run what the current engine selects on each op's model cases (or ``cases``), so compilations
    are done before serving (``kernelmux warmup``; engine/warm_start.py says how)."""
    from kernelmux.engine.warm_start import warmup as run

    return run(current(), ops, cases=cases, quick=quick, log=log or (lambda line: None))
