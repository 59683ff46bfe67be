"""End to end with a real out-of-tree plugin (tests/plugin_pkg, installed with pip): discovery
through the ``kernelmux.backends`` entry-point group, quarantine of a plugin that fails to import,
priority, and every KERNELMUX_* override, each in a fresh interpreter with a controlled environment.

The plugin registers grouped_topk for backend ``example`` at priority 5 (cpu is 10) and counts its
calls; its second entry point, ``example_broken``, raises ImportError at import.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

try:
    importlib.metadata.distribution("kernelmux-example-plugin")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "the example plugin is not installed: pip install ./tests/plugin_pkg (CI does)",
        allow_module_level=True,
    )

OP = "grouped_topk"
MARKER = "KERNELMUX_TEST_JSON:"

# Runs before each test's script: `emit` prints the result on a line of its own, so whatever else
# the process prints (warnings, logs) cannot be mistaken for it.
PRELUDE = f"""
import json

def emit(data):
    print({MARKER!r} + json.dumps(data))
"""

# The report, a dispatched call on a small spec case, and the plugin's call counter.
CALL_SCRIPT = """
import warnings
import torch
import kernelmux
import kernelmux_example_plugin as plugin
from kernelmux.ops.specs.grouped_topk import SPEC

kwargs = SPEC.case("deepseek_v3_t64").build("cpu", seed=0)
actual = kernelmux.ops.grouped_topk(**kwargs)
SPEC.check_close(actual, SPEC.reference(**kwargs), kwargs)  # raises (non-zero exit) on mismatch
calls_after_small = plugin.CALLS

# bf16 logits, which the plugin's supports() declines: another dispatch key, so it is asked afresh.
big = SPEC.case("deepseek_v3_bf16_t1024").build("cpu", seed=0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    actual = kernelmux.ops.grouped_topk(**big)
SPEC.check_close(actual, SPEC.reference(**big), big)

emit({
    "report": kernelmux.report(),
    "calls_after_small": calls_after_small,
    "calls_after_big": plugin.CALLS,
    "warnings": [type(w.message).__name__ for w in caught],
})
"""

REPORT_SCRIPT = """
import kernelmux

emit({"report": kernelmux.report()})
"""

STARTUP_SCRIPT = """
import kernelmux
from kernelmux.errors import PluginLoadError

try:
    kernelmux.current()
except PluginLoadError as error:
    emit({"error": type(error).__name__, "plugin": error.plugin,
          "distribution": error.distribution, "message": str(error)})
else:
    emit({"error": None, "report": kernelmux.report()})
"""


def run_kernelmux(script: str, tmp_path, **env_vars: str) -> dict:
    """Run ``script`` in a fresh interpreter whose only KERNELMUX_* variables are ``env_vars``;
    return what it emitted. The process must exit 0."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNELMUX_") and k != "TRITON_INTERPRET"
    }
    env.update(env_vars)
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    # cwd outside the repository: the repository root is the kernelmux package's own directory.
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode} with {env_vars}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, f"expected one result line\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(lines[0][len(MARKER):])


def op_entry(report: dict, op: str = OP) -> dict:
    return next(o for o in report["ops"] if o["op"] == op)


def backends(entries: list) -> list:
    return [e["backend"] for e in entries]


def test_default_discovers_quarantines_and_ranks_below_cpu(tmp_path):
    """No overrides: the plugin is discovered with its distribution and version, the broken one is
    quarantined without failing the process, and cpu outranks the plugin, which comes next."""
    out = run_kernelmux(CALL_SCRIPT, tmp_path)
    report = out["report"]

    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["example"] == {
        "name": "example",
        "distribution": "kernelmux-example-plugin",
        "version": "0.1.0",
        "module": "kernelmux_example_plugin",
    }
    assert "example_broken" not in plugins
    quarantined = {q["name"]: q for q in report["quarantined"]}
    assert set(quarantined) == {"example_broken"}
    broken = quarantined["example_broken"]
    assert broken["distribution"] == "kernelmux-example-plugin" and broken["version"] == "0.1.0"
    assert "ImportError" in broken["reason"], broken["reason"]
    assert report["skipped_plugins"] == []
    assert report["rejected_registrations"] == []

    entry = op_entry(report)
    viable = backends(entry["viable"])
    example = entry["viable"][viable.index("example")]
    assert (example["plugin"], example["priority"], example["devices"]) == ("example", 5, ["cpu"])
    if report["platform"]["kind"] == "cpu":
        assert entry["chosen"] == "cpu"
        assert viable == ["cpu", "example"]
    else:  # a GPU host: triton may rank first statically, but cpu still precedes the plugin
        assert viable.index("example") == viable.index("cpu") + 1

    # Both calls ran on cpu: the plugin was never needed, so it never ran.
    assert out["calls_after_small"] == 0 and out["calls_after_big"] == 0
    assert [c["backend"] for c in entry["calls"]] == ["cpu", "cpu"]
    assert out["warnings"] == []


def test_deny_cpu_dispatches_to_the_plugin_and_supports_declines(tmp_path):
    """KERNELMUX_DENY=cpu: the plugin is chosen, a call on a spec case runs it (its counter moves)
    and matches the reference; a call over its row limit is declined by its supports() and falls
    back to the reference with a FallbackWarning."""
    out = run_kernelmux(CALL_SCRIPT, tmp_path, KERNELMUX_DENY="cpu")
    report = out["report"]
    entry = op_entry(report)

    assert report["settings"]["deny"] == ["cpu"]
    if report["platform"]["kind"] == "cpu":
        assert entry["chosen"] == "example"
    assert "cpu" not in backends(entry["viable"])
    rejected = {r["backend"]: r["reason"] for r in entry["rejected"]}
    assert rejected["cpu"] == "denied by the deny list ('cpu')"

    # The small case ran on the plugin (and SPEC.check_close passed in the subprocess).
    assert out["calls_after_small"] == 1
    small, big = entry["calls"]
    assert (small["backend"], small["fallback"]) == ("example", False)
    # The big case: supports() declined, so the plugin did not run and the reference did.
    assert out["calls_after_big"] == 1
    assert (big["backend"], big["fallback"]) == ("reference", True)
    answers = {a["backend"]: a["reason"] for a in big["answers"]}
    assert answers["example"] == "example plugin takes fp32 logits only, got torch.bfloat16"
    assert out["warnings"] == ["FallbackWarning"]


def test_deny_op_backend_pair_rejects_the_plugin(tmp_path):
    """KERNELMUX_DENY=grouped_topk:example: the plugin loads but is not viable, with the reason."""
    report = run_kernelmux(REPORT_SCRIPT, tmp_path, KERNELMUX_DENY=f"{OP}:example")["report"]
    entry = op_entry(report)
    assert "example" in {p["name"] for p in report["plugins"]}
    assert "example" not in backends(entry["viable"])
    rejected = {r["backend"]: r["reason"] for r in entry["rejected"]}
    assert rejected["example"] == f"denied by the deny list ('{OP}:example')"
    assert "cpu" in backends(entry["viable"])


def test_prefer_puts_the_plugin_first(tmp_path):
    """KERNELMUX_PREFER=grouped_topk=example: the plugin is chosen over the higher-priority cpu."""
    report = run_kernelmux(REPORT_SCRIPT, tmp_path, KERNELMUX_PREFER=f"{OP}=example")["report"]
    entry = op_entry(report)
    assert report["settings"]["prefer"] == {OP: ["example"]}
    assert entry["chosen"] == "example"
    first, *rest = entry["viable"]
    assert (first["backend"], first["preferred"]) == ("example", True)
    assert "cpu" in backends(rest)
    assert not any(v["preferred"] for v in rest)


def test_plugin_allow_list_skips_the_plugin(tmp_path):
    """KERNELMUX_PLUGINS=reference,cpu: neither of the package's plugins is imported; both are
    listed as skipped, and nothing is quarantined."""
    report = run_kernelmux(REPORT_SCRIPT, tmp_path, KERNELMUX_PLUGINS="reference,cpu")["report"]
    assert {p["name"] for p in report["plugins"]} == {"reference", "cpu"}
    assert {"example", "example_broken"} <= set(report["skipped_plugins"])
    assert report["quarantined"] == []
    entry = op_entry(report)
    assert "example" not in backends(entry["viable"]) + backends(entry["rejected"])
    assert entry["chosen"] == "cpu"


def test_strict_mode_raises_on_the_broken_plugin(tmp_path):
    """KERNELMUX_STRICT=1 with the broken plugin allowed: engine startup raises PluginLoadError
    naming it, instead of quarantining it."""
    out = run_kernelmux(
        STARTUP_SCRIPT,
        tmp_path,
        KERNELMUX_STRICT="1",
        KERNELMUX_PLUGINS="reference,cpu,example,example_broken",
    )
    assert out["error"] == "PluginLoadError", out
    assert out["plugin"] == "example_broken"
    assert out["distribution"] == "kernelmux-example-plugin"
    assert "example_broken" in out["message"] and "ImportError" in out["message"]
