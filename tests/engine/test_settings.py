"""Every KERNELMUX_* environment variable is declared once, in engine/settings.py, and read there."""

from __future__ import annotations

import pathlib
import re

import pytest

from kernelmux.engine.settings import ENV_VARS, env_value
from kernelmux.errors import ConfigurationError

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SOURCES = [p for p in ROOT.rglob("*.py") if "tests" not in p.relative_to(ROOT).parts]


def test_every_variable_named_in_the_code_is_declared():
    # KERNELMUX_DIAG_* are compile-time macros of the cuda kernels (backends/cuda/kernels), not variables.
    named = {name for path in _SOURCES for name in re.findall(r"\bKERNELMUX_(?!DIAG_)[A-Z_]+\b", path.read_text())}
    assert named and named <= set(ENV_VARS), sorted(named - set(ENV_VARS))


def test_only_settings_reads_the_environment_for_them():
    settings = ROOT / "engine" / "settings.py"
    readers = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in _SOURCES if path != settings
               for line in path.read_text().splitlines() if re.search(r"(environ|getenv).*KERNELMUX_", line)]
    assert not readers, readers


def test_env_value_reads_at_call_time_and_refuses_undeclared_names(monkeypatch):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", " /tmp/a ")
    assert env_value("KERNELMUX_CACHE_DIR") == "/tmp/a"
    monkeypatch.delenv("KERNELMUX_CACHE_DIR")
    assert env_value("KERNELMUX_CACHE_DIR") == ""
    with pytest.raises(ConfigurationError, match="KERNELMUX_CAHCE_DIR is not a kernelmux setting"):
        env_value("KERNELMUX_CAHCE_DIR")
