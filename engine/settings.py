"""Every ``KERNELMUX_*`` environment variable, declared once (``ENV_VARS``), and the user's overrides
of selection: preferences, deny list, plugin allow-list, strict mode, checked mode, simulation.

Those are read from the environment or given through the Python API (``kernelmux.configure``); one
frozen ``Settings`` value is what the engine is built from. The rest (a backend's cache folder, a
record's commit) are read where they are used, through ``env_value``, so every name is declared here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kernelmux.errors import ConfigurationError

__all__ = ["ENV_VARS", "Settings", "cache_root", "env_value"]

# The environment variables kernelmux reads, with what each holds (documented in README.md).
ENV_VARS: Mapping[str, str] = {
    "KERNELMUX_PREFER": "per-op backend preference, e.g. 'grouped_topk=triton,cpu;*=cpu'",
    "KERNELMUX_DENY": "backends or op:backend pairs never used, e.g. 'triton,grouped_topk:cpu'",
    "KERNELMUX_PLUGINS": "allow-list of plugin (entry-point) names to load, e.g. 'reference,cpu'",
    "KERNELMUX_STRICT": "1: raise instead of falling back to the reference or quarantining",
    "KERNELMUX_CHECK": "1: checked mode, for debugging an integration: index tensors' contents are "
    "validated before each call (one device pass and a host sync) and outputs checked against the spec",
    "KERNELMUX_PLATFORM": "simulate a platform: sm_90, sm_100, gfx942, aarch64, s390x, ...",
    "KERNELMUX_CACHE_DIR": "where compiled kernels, the user's tuning tables and the warm-up record are kept "
                           "(default ~/.cache/kernelmux)",
    "KERNELMUX_TUNING": "0: no tuning tables, priorities alone order each call's candidates (default 1: this device's tables)",
    "KERNELMUX_NATIVE_FINGERPRINT": "0: the Python call fingerprint even where the native one is built (default 1)",
    "KERNELMUX_COMMIT": "the commit a perf record names, where the tree has no .git (the GPU machines)",
}


def cache_root() -> str:
    """Where kernelmux keeps files between processes: $KERNELMUX_CACHE_DIR, else ~/.cache/kernelmux."""
    return env_value("KERNELMUX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernelmux")


def env_value(name: str) -> str:
    """The current value of the declared variable ``name`` ("" when unset), stripped."""
    if name not in ENV_VARS:
        raise ConfigurationError(f"{name} is not a kernelmux setting; declared: {', '.join(ENV_VARS)}")
    return os.environ.get(name, "").strip()

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(env: Mapping[str, str], name: str) -> bool:
    text = env.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(f"{name}={env[name]!r}: expected one of 1, true, yes, on (or 0, false, no, off)")


def _split(text: str, sep: str = ",") -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(sep) if part.strip())


def _parse_prefer(text: str) -> dict[str, tuple[str, ...]]:
    prefer: dict[str, tuple[str, ...]] = {}
    for clause in _split(text, ";"):
        op, eq, backends = clause.partition("=")
        if not eq or not op.strip() or not _split(backends):
            raise ConfigurationError(
                f"KERNELMUX_PREFER: cannot parse {clause!r}; expected 'op=backend[,backend...]' "
                "clauses separated by ';' (op '*' means every op)"
            )
        prefer[op.strip()] = _split(backends)
    return prefer


@dataclass(frozen=True)
class Settings:
    """Selection overrides.

    - ``prefer``: op -> backends tried first, in order (op ``"*"``: every op without its own entry).
    - ``deny``: entries ``backend`` (every op) or ``op:backend``.
    - ``allow_plugins``: load only these plugins (None: all discovered).
    - ``strict``: a call no implementation accepts raises instead of using the reference, and a
      broken plugin or rejected implementation raises instead of being quarantined.
    - ``platform``: simulate this platform instead of detecting one.
    - ``check``: checked mode (``CheckedDispatcher``): every call's index data and outputs are
      checked, at the cost of a host sync per call.
    - ``tuning``: order each call's candidates by this device's tuning tables (engine/tuning.py);
      off, priorities alone order them.
    - ``native_fingerprint``: the native call fingerprint where it is built (engine/fingerprint.py);
      off, the Python one (same meaning, slower).

    Names in ``prefer``, ``deny`` and ``allow_plugins`` are checked against what is installed
    when an engine is built from them (``Engine``), whichever way they were given.
    """

    prefer: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    deny: frozenset[str] = frozenset()
    allow_plugins: frozenset[str] | None = None
    strict: bool = False
    platform: str | None = None
    check: bool = False
    tuning: bool = True
    native_fingerprint: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        plugins = env.get("KERNELMUX_PLUGINS", "").strip()
        return cls(
            prefer=_parse_prefer(env.get("KERNELMUX_PREFER", "")),
            deny=frozenset(_split(env.get("KERNELMUX_DENY", ""))),
            allow_plugins=frozenset(_split(plugins)) if plugins else None,
            strict=_flag(env, "KERNELMUX_STRICT"),
            check=_flag(env, "KERNELMUX_CHECK"),
            platform=env.get("KERNELMUX_PLATFORM", "").strip() or None,
            tuning=_flag(env, "KERNELMUX_TUNING") if env.get("KERNELMUX_TUNING", "").strip() else True,
            native_fingerprint=(_flag(env, "KERNELMUX_NATIVE_FINGERPRINT")
                                if env.get("KERNELMUX_NATIVE_FINGERPRINT", "").strip() else True),
        )

    def with_changes(self, **changes: Any) -> "Settings":
        """A copy with the given fields replaced; iterables are normalized to the field types."""
        if changes.get("prefer") is not None:
            changes["prefer"] = {op: tuple(b) for op, b in dict(changes["prefer"]).items()}
        if changes.get("deny") is not None:
            changes["deny"] = frozenset(changes["deny"])
        if changes.get("allow_plugins") is not None:
            changes["allow_plugins"] = frozenset(changes["allow_plugins"])
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def preference(self, op: str) -> tuple[str, ...]:
        return self.prefer.get(op, self.prefer.get("*", ()))

    def denial(self, op: str, backend: str) -> str | None:
        """The deny-list entry that excludes ``op:backend``, if any."""
        for entry in (backend, f"{op}:{backend}"):
            if entry in self.deny:
                return entry
        return None
