"""User overrides of selection: preferences, deny list, plugin allow-list, strict mode, simulation.

Read from environment variables or given through the Python API (``kernelmux.configure``); one
frozen ``Settings`` value is what the engine is built from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kernelmux.errors import KernelmuxError

__all__ = ["ENV_VARS", "Settings"]

# The environment variables kernelmux reads, with what each holds (documented in README.md).
ENV_VARS: Mapping[str, str] = {
    "KERNELMUX_PREFER": "per-op backend preference, e.g. 'grouped_topk=triton,cpu;*=cpu'",
    "KERNELMUX_DENY": "backends or op:backend pairs never used, e.g. 'triton,grouped_topk:cpu'",
    "KERNELMUX_PLUGINS": "allow-list of plugin (entry-point) names to load, e.g. 'reference,cpu'",
    "KERNELMUX_STRICT": "1: raise instead of falling back to the reference or quarantining",
    "KERNELMUX_PLATFORM": "simulate a platform: sm_90, sm_100, gfx942, aarch64, s390x, ...",
}

_TRUE = {"1", "true", "yes", "on"}


def _split(text: str, sep: str = ",") -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(sep) if part.strip())


def _parse_prefer(text: str) -> dict[str, tuple[str, ...]]:
    prefer: dict[str, tuple[str, ...]] = {}
    for clause in _split(text, ";"):
        op, eq, backends = clause.partition("=")
        if not eq or not op.strip() or not _split(backends):
            raise KernelmuxError(
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
    """

    prefer: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    deny: frozenset[str] = frozenset()
    allow_plugins: frozenset[str] | None = None
    strict: bool = False
    platform: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        plugins = env.get("KERNELMUX_PLUGINS", "").strip()
        return cls(
            prefer=_parse_prefer(env.get("KERNELMUX_PREFER", "")),
            deny=frozenset(_split(env.get("KERNELMUX_DENY", ""))),
            allow_plugins=frozenset(_split(plugins)) if plugins else None,
            strict=env.get("KERNELMUX_STRICT", "").strip().lower() in _TRUE,
            platform=env.get("KERNELMUX_PLATFORM", "").strip() or None,
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
