"""End to end with real out-of-tree plugins, each installed as a distribution into a temporary
folder that only the test's subprocess sees (tests/plugin_installs.py): discovery through the
``kernelmux.backends`` entry-point group, priority, every KERNELMUX_* override, and quarantine of
plugins that fail to import, end the process, claim a name they do not own or register nothing.
Each scenario runs in a fresh interpreter with a controlled environment.

tests/plugin_pkg registers grouped_topk for backend ``example`` at priority 5 (cpu is 10) and
counts its calls; its second entry point, ``example_broken``, raises ImportError at import.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import plugin_installs
from plugin_installs import Distribution

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"
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
from kernelmux.specs.grouped_topk import SPEC

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
    "plugin_file": plugin.__file__,
})
"""

REPORT_SCRIPT = """
import kernelmux

emit({"report": kernelmux.report()})
"""

# The report, and which of the test plugins' modules were imported at all.
IMPORTS_SCRIPT = """
import sys
import kernelmux

report = kernelmux.report()
emit({"report": report, "modules": sorted(m for m in sys.modules if m.startswith("test_plugin_"))})
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

# Opening of every test plugin module below: `records(backend, specs)` builds valid records (the
# spec's own reference as fn, so the signature check passes) for the first spec, or for ``specs``.
RECORDS = """
import sys

from kernelmux import Implementation, hookimpl
from kernelmux.specs import ALL_SPECS


def records(backend, specs=ALL_SPECS[:1], priority=0):
    return [
        Implementation(op=spec.name, backend=backend, fn=spec.reference, spec_version=spec.version,
                       priority=priority, description=f"from {__name__}")
        for spec in specs
    ]
"""


def plugin_module(body: str) -> str:
    """A test plugin module's source: RECORDS, then ``body``."""
    return RECORDS + textwrap.dedent(body)


def hooked(expression: str) -> str:
    """A test plugin module whose decorated hook returns ``expression``."""
    return plugin_module(f"""
        @hookimpl
        def kernelmux_implementations():
            return {expression}
        """)


def _run(argv: list, site: pathlib.Path, env_vars: dict) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNELMUX_") and k != "TRITON_INTERPRET"
    }
    env["KERNELMUX_TUNING"] = "0"  # priorities: a tuning table matching this machine would reorder
    env.update(env_vars)
    # cwd outside the repository: the repository root is the kernelmux package's own directory.
    result = subprocess.run(
        argv,
        env=plugin_installs.pythonpath_env(site, env),
        cwd=site.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode} with {env_vars}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def run_kernelmux(script: str, site: pathlib.Path, **env_vars: str) -> dict:
    """Run ``script`` in a fresh interpreter that sees the distributions installed in ``site`` and
    whose only KERNELMUX_* variables are ``env_vars``; return what it emitted. It must exit 0."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    result = _run([sys.executable, "-c", code], site, env_vars)
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, f"expected one result line\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(lines[0][len(MARKER):])


def run_info(site: pathlib.Path, *options: str, **env_vars: str) -> str:
    """``kernelmux info`` in a fresh interpreter that sees ``site``; its stdout. It must exit 0."""
    return _run([sys.executable, "-m", "kernelmux", "info", *options], site, env_vars).stdout


@pytest.fixture
def site(tmp_path) -> pathlib.Path:
    """An empty install folder, seen only by the test's subprocesses."""
    path = tmp_path / "site"
    path.mkdir()
    return path


@pytest.fixture
def example_site(site) -> pathlib.Path:
    """tests/plugin_pkg installed into ``site``, as ``pip install ./tests/plugin_pkg`` would."""
    return plugin_installs.install(site, plugin_installs.from_project(PLUGIN_PKG))


def op_entry(report: dict, op: str = OP) -> dict:
    return next(o for o in report["ops"] if o["op"] == op)


def backends(entries: list) -> list:
    return [e["backend"] for e in entries]


def by_name(entries: list) -> dict:
    return {e["name"]: e for e in entries}


# -- tests/plugin_pkg ---------------------------------------------------------------------------


def test_default_discovers_quarantines_and_ranks_below_cpu(example_site):
    """No overrides: the plugin is discovered from the temporary install with its distribution,
    version and implementation count, the broken one is quarantined without failing the process,
    and cpu outranks the plugin, which comes next."""
    out = run_kernelmux(CALL_SCRIPT, example_site)
    report = out["report"]

    # Imported from the test's own install, not from one that happens to be in site-packages.
    assert pathlib.Path(out["plugin_file"]).is_relative_to(example_site), out["plugin_file"]
    plugins = by_name(report["plugins"])
    assert plugins["example"] == {
        "name": "example",
        "distribution": "kernelmux-example-plugin",
        "version": "0.1.0",
        "module": "kernelmux_example_plugin",
        "implementations": 1,
    }
    assert "example_broken" not in plugins
    quarantined = by_name(report["quarantined"])
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


def test_deny_cpu_dispatches_to_the_plugin_and_supports_declines(example_site):
    """KERNELMUX_DENY=cpu: the plugin is chosen, a call on a spec case runs it (its counter moves)
    and matches the reference; a call over its row limit is declined by its supports() and falls
    back to the reference with a FallbackWarning."""
    out = run_kernelmux(CALL_SCRIPT, example_site, KERNELMUX_DENY="cpu")
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


def test_deny_op_backend_pair_rejects_the_plugin(example_site):
    """KERNELMUX_DENY=grouped_topk:example: the plugin loads but is not viable, with the reason."""
    report = run_kernelmux(REPORT_SCRIPT, example_site, KERNELMUX_DENY=f"{OP}:example")["report"]
    entry = op_entry(report)
    assert "example" in {p["name"] for p in report["plugins"]}
    assert "example" not in backends(entry["viable"])
    rejected = {r["backend"]: r["reason"] for r in entry["rejected"]}
    assert rejected["example"] == f"denied by the deny list ('{OP}:example')"
    assert "cpu" in backends(entry["viable"])


def test_prefer_puts_the_plugin_first(example_site):
    """KERNELMUX_PREFER=grouped_topk=example: the plugin is chosen over the higher-priority cpu."""
    report = run_kernelmux(REPORT_SCRIPT, example_site, KERNELMUX_PREFER=f"{OP}=example")["report"]
    entry = op_entry(report)
    assert report["settings"]["prefer"] == {OP: ["example"]}
    assert entry["chosen"] == "example"
    first, *rest = entry["viable"]
    assert (first["backend"], first["preferred"]) == ("example", True)
    assert "cpu" in backends(rest)
    assert not any(v["preferred"] for v in rest)


def test_plugin_allow_list_skips_the_plugin(example_site):
    """KERNELMUX_PLUGINS=reference,cpu: neither of the package's plugins is imported; both are
    listed as skipped, and nothing is quarantined."""
    report = run_kernelmux(REPORT_SCRIPT, example_site, KERNELMUX_PLUGINS="reference,cpu")["report"]
    assert {p["name"] for p in report["plugins"]} == {"reference", "cpu"}
    assert {"example", "example_broken"} <= set(report["skipped_plugins"])
    assert report["quarantined"] == []
    entry = op_entry(report)
    assert "example" not in backends(entry["viable"]) + backends(entry["rejected"])
    assert entry["chosen"] == "cpu"


def test_strict_mode_raises_on_the_broken_plugin(example_site):
    """KERNELMUX_STRICT=1 with the broken plugin allowed: engine startup raises PluginLoadError
    naming it, instead of quarantining it."""
    out = run_kernelmux(
        STARTUP_SCRIPT,
        example_site,
        KERNELMUX_STRICT="1",
        KERNELMUX_PLUGINS="reference,cpu,example,example_broken",
    )
    assert out["error"] == "PluginLoadError", out
    assert out["plugin"] == "example_broken"
    assert out["distribution"] == "kernelmux-example-plugin"
    assert "example_broken" in out["message"] and "ImportError" in out["message"]


# -- names a plugin does not own -----------------------------------------------------------------

# Takes over every op's cpu backend at a priority above everything, if kernelmux lets it.
CPU_IMPOSTOR = Distribution(
    "cpu-turbo", "6.6.6", {"cpu": "test_plugin_cpu_turbo"},
    {"test_plugin_cpu_turbo.py": hooked("records('cpu', ALL_SPECS, priority=1000)")},
)


@pytest.mark.parametrize("allow", [None, "reference,cpu"], ids=["all-plugins", "allow-list-cpu"])
def test_an_entry_point_named_like_a_builtin_is_quarantined_not_imported(site, allow):
    """A third-party entry point named ``cpu``: quarantined, never imported, with a reason naming
    its distribution and the reserved name, with or without an allow-list naming cpu; the built-in
    cpu plugin loads and owns every cpu implementation."""
    plugin_installs.install(site, CPU_IMPOSTOR)
    env = {"KERNELMUX_PLUGINS": allow} if allow else {}
    out = run_kernelmux(IMPORTS_SCRIPT, site, **env)
    report = out["report"]

    assert out["modules"] == []
    plugins = by_name(report["plugins"])
    assert plugins["cpu"]["distribution"] == "kernelmux"
    assert plugins["cpu"]["module"] == "kernelmux.backends.cpu"
    (impostor,) = [q for q in report["quarantined"] if q["name"] == "cpu"]
    assert (impostor["distribution"], impostor["version"]) == ("cpu-turbo", "6.6.6")
    assert "reserved" in impostor["reason"] and "cpu-turbo" in impostor["reason"]
    assert "kernelmux.backends.cpu" in impostor["reason"]
    cpu_entries = [
        e for op in report["ops"] for e in op["viable"] + op["rejected"] if e["backend"] == "cpu"
    ]
    assert cpu_entries and all((e["plugin"], e["priority"]) == ("cpu", 10) for e in cpu_entries)


def test_info_text_shows_the_quarantine_reason_verbatim(site):
    """The text table prints the reason as written: the pyproject.toml table it names is not
    swallowed as rich markup."""
    plugin_installs.install(site, CPU_IMPOSTOR)
    text = run_info(site, COLUMNS="1000")  # wide enough that no reason wraps
    (row,) = [line for line in text.splitlines() if "cpu-turbo" in line]
    assert 'rename the entry point under [project.entry-points."kernelmux.backends"] in cpu-turbo' in row


def test_strict_mode_raises_on_an_entry_point_named_like_a_builtin(site):
    plugin_installs.install(site, CPU_IMPOSTOR)
    out = run_kernelmux(STARTUP_SCRIPT, site, KERNELMUX_STRICT="1")
    assert out["error"] == "PluginConflictError", out
    assert (out["plugin"], out["distribution"]) == ("cpu", "cpu-turbo")
    assert "reserved" in out["message"]


def test_records_for_a_builtin_backend_from_a_plugin_are_rejected(site):
    """A plugin named ``accel`` (loaded before ``cpu``: entry points load in name order) that
    registers backend ``cpu``: those records are rejected with a reason naming the plugin's
    distribution and the reserved name, its own backend registers, and cpu stays kernelmux's."""
    plugin_installs.install(site, Distribution(
        "accel-kernels", "1.0", {"accel": "test_plugin_accel"},
        {"test_plugin_accel.py": hooked("records('cpu', priority=1000) + records('accel')")},
    ))
    report = run_kernelmux(REPORT_SCRIPT, site)["report"]

    assert by_name(report["plugins"])["accel"]["implementations"] == 1
    (rejection,) = [r for r in report["rejected_registrations"] if r["plugin"] == "accel"]
    assert (rejection["op"], rejection["backend"]) == (OP, "cpu")
    assert "reserved" in rejection["reason"] and "accel-kernels" in rejection["reason"]
    entry = op_entry(report)
    (cpu,) = [e for e in entry["viable"] + entry["rejected"] if e["backend"] == "cpu"]
    assert (cpu["plugin"], cpu["priority"]) == ("cpu", 10)
    assert "accel" in backends(entry["viable"] + entry["rejected"])


def test_two_distributions_with_one_entry_point_name_are_both_quarantined(site):
    """Two distributions both declaring entry point ``fast``: which would load first is an accident
    of sys.path, so neither is imported; each is quarantined naming the other."""
    for dist, module in (("fast-a", "test_plugin_fast_a"), ("fast-b", "test_plugin_fast_b")):
        plugin_installs.install(site, Distribution(
            dist, "1.0", {"fast": module}, {f"{module}.py": hooked("records('fast')")}
        ))
    out = run_kernelmux(IMPORTS_SCRIPT, site)
    report = out["report"]

    assert out["modules"] == []
    assert "fast" not in by_name(report["plugins"])
    quarantined = {q["distribution"]: q["reason"] for q in report["quarantined"] if q["name"] == "fast"}
    assert set(quarantined) == {"fast-a", "fast-b"}
    assert "fast-b 1.0" in quarantined["fast-a"] and "fast-a 1.0" in quarantined["fast-b"]
    assert "fast" not in backends(op_entry(report)["viable"] + op_entry(report)["rejected"])


def test_a_backend_name_registered_by_two_plugins_keeps_its_first_owner(site):
    """Plugins ``one`` and ``two`` both use backend ``shared`` (for different ops, so no op:backend
    pair collides): the second one's record is rejected with a reason naming the owner."""
    plugin_installs.install(site, Distribution(
        "one-kernels", "1.0", {"one": "test_plugin_one"},
        {"test_plugin_one.py": hooked("records('shared', ALL_SPECS[:1])")},
    ))
    plugin_installs.install(site, Distribution(
        "two-kernels", "1.0", {"two": "test_plugin_two"},
        {"test_plugin_two.py": hooked("records('shared', ALL_SPECS[1:2])")},
    ))
    report = run_kernelmux(REPORT_SCRIPT, site)["report"]

    plugins = by_name(report["plugins"])
    assert (plugins["one"]["implementations"], plugins["two"]["implementations"]) == (1, 0)
    (rejection,) = [r for r in report["rejected_registrations"] if r["plugin"] == "two"]
    assert rejection["backend"] == "shared"
    assert "plugin 'one'" in rejection["reason"] and "one-kernels" in rejection["reason"]


# -- plugins that end the process or register nothing -------------------------------------------


def test_plugins_that_exit_or_raise_base_exceptions_are_quarantined(site):
    """sys.exit() at import, sys.exit() in the hook and a BaseException subclass from the hook:
    ``kernelmux info --json`` still exits 0, and reports each plugin quarantined with the cause."""
    plugin_installs.install(site, Distribution(
        "exiting-plugins", "0.1",
        {
            "exits_at_import": "test_plugin_exit_at_import",
            "exits_in_hook": "test_plugin_exit_in_hook",
            "raises_base_exception": "test_plugin_base_exception",
        },
        {
            "test_plugin_exit_at_import.py": "import sys\n\nsys.exit(3)\n",
            "test_plugin_exit_in_hook.py": hooked("sys.exit(4)"),
            "test_plugin_base_exception.py": plugin_module("""
                class PluginOutcome(BaseException):
                    pass


                @hookimpl
                def kernelmux_implementations():
                    raise PluginOutcome("not for kernelmux to catch, thought the plugin")
                """),
        },
    ))
    report = json.loads(run_info(site, "--json"))

    quarantined = by_name(report["quarantined"])
    assert quarantined["exits_at_import"]["distribution"] == "exiting-plugins"
    assert "import failed: SystemExit: 3" in quarantined["exits_at_import"]["reason"]
    assert "registration failed: SystemExit: 4" in quarantined["exits_in_hook"]["reason"]
    assert "registration failed: PluginOutcome" in quarantined["raises_base_exception"]["reason"]
    assert {"reference", "cpu"} <= set(by_name(report["plugins"]))


def test_an_undecorated_hook_is_quarantined_and_an_empty_plugin_shows_zero(site):
    """A module defining kernelmux_implementations without @hookimpl is quarantined saying so; a
    decorated hook returning nothing loads and shows 0 implementations, in JSON and as text."""
    plugin_installs.install(site, Distribution(
        "lazy-plugins", "0.1",
        {"undecorated": "test_plugin_undecorated", "empty": "test_plugin_empty"},
        {
            "test_plugin_undecorated.py": plugin_module("""
                def kernelmux_implementations():
                    return records("undecorated")
                """),
            "test_plugin_empty.py": hooked("[]"),
        },
    ))
    report = json.loads(run_info(site, "--json"))

    plugins = by_name(report["plugins"])
    assert "undecorated" not in plugins
    reason = by_name(report["quarantined"])["undecorated"]["reason"]
    assert "defines kernelmux_implementations without @kernelmux.hookimpl" in reason
    assert "nothing was registered" in reason
    assert plugins["empty"]["implementations"] == 0
    assert plugins["cpu"]["implementations"] == sum(
        e["plugin"] == "cpu" for op in report["ops"] for e in op["viable"] + op["rejected"]
    ) > 0

    text = run_info(site, COLUMNS="1000")  # wide enough that no row wraps
    (empty_row,) = [line for line in text.splitlines() if re.search(r"\bempty\b.*lazy-plugins", line)]
    assert re.search(r"\b0\b.*loaded", empty_row), empty_row
    assert "implementations" in text


# -- the test suite installs nothing ------------------------------------------------------------


def test_the_documented_test_command_does_not_install_the_test_plugins():
    """The README's test command, which .ci/run copies, installs kernelmux with its test extras
    only: the test plugins are built by the tests, never installed into the user's environment."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)
    (command,) = [line for block in blocks for line in block.splitlines() if "pytest" in line]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f"README's test command {command!r} is not in .ci/run"
    installs = [line for line in ci + [command] if "pip install" in line and not line.startswith("#")]
    assert installs and not any("plugin_pkg" in line for line in installs), installs


def test_the_conformance_kit_passes_the_example_plugin(example_site):
    """A plugin author's check: `kernelmux check --backend example` over the plugin's one op exits 0,
    its fp16/bf16 cases declined by its supports(), never failed."""
    result = _run([sys.executable, "-m", "kernelmux", "check", "--backend", "example", "--seed", "3", "-v"],
                  example_site, {})
    assert "0 fail" not in result.stdout and " fail " not in result.stdout, result.stdout
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("kernelmux check --backend example on cpu"), summary
    assert "pass" in summary and "declined" in summary and "fail" not in summary, summary
    assert "pass     grouped_topk / deepseek_v3_t64 / strided" in result.stdout, result.stdout
