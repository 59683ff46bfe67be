"""The kernelmux command: info and explain, as tables and JSON, on this and simulated platforms."""

from __future__ import annotations

import json

import pytest

from kernelmux.cli import main
from vendors import install_fake


def _json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_json_lists_plugins_and_every_op(capsys):
    data = _json(capsys, "info")
    assert {p["name"] for p in data["plugins"]} >= {"reference", "cpu"}
    assert all(p["distribution"] and p["version"] for p in data["plugins"])
    (op,) = [o for o in data["ops"] if o["op"] == "grouped_topk"]
    assert op["chosen"] and op["spec_version"] >= 1


@pytest.mark.parametrize("platform, chosen", [("sm_90", "triton"), ("sm_100", "triton"),
                                              ("gfx942", "triton"), ("aarch64", "cpu"), ("s390x", "cpu")])
def test_explain_a_case_on_a_simulated_platform(capsys, platform, chosen):
    pytest.importorskip("triton", reason="the triton backend needs the triton package")
    data = _json(capsys, "explain", "grouped_topk", "--case", "deepseek_v3_t64", "--platform", platform)
    assert data["platform"]["simulated"] and data["platform"]["arch"] == platform
    assert data["chosen"] == chosen
    answers = {a["backend"]: a["reason"] for a in data["answers"]}
    if chosen == "triton":
        assert answers["cpu"] == "runs on cpu tensors, the inputs are on cuda"
    else:
        assert answers["cpu"] is None


def test_explain_says_which_launch_configuration_a_call_runs(capsys):
    pytest.importorskip("triton", reason="the triton backend needs the triton package")
    data = _json(capsys, "explain", "fused_moe", "--case", "qwen3_30b_a3b_t16_ep16", "--platform", "sm_90")
    (triton,) = [a for a in data["answers"] if a["backend"] == "triton"]
    assert triton["reason"] is None
    assert triton["plan"].startswith("at T = 31: BLOCK_M ") and "heuristic" in triton["plan"]
    assert all(a["plan"] is None for a in data["answers"] if a["backend"] != "triton")
    assert main(["explain", "fused_moe", "--case", "qwen3_30b_a3b_t16_ep16", "--platform", "sm_90"]) == 0
    out = capsys.readouterr().out  # the table wraps the plan inside its cell
    assert "runs at T =" in " ".join(out.split()) and "BLOCK_M" in out


def test_info_text_renders_tables(capsys):
    assert main(["info", "--platform", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "platform: cuda sm_90" in out and "grouped_topk v1" in out and "wgmma" in out


def test_explain_errors_name_what_exists(capsys):
    assert main(["explain", "no_such_op"]) == 2
    assert "grouped_topk" in capsys.readouterr().err
    assert main(["explain", "grouped_topk", "--case", "nope"]) == 2
    assert "deepseek_v3_t64" in capsys.readouterr().err
    assert main(["info", "--platform", "sm90"]) == 2
    assert "expected sm_XY" in capsys.readouterr().err


def test_version_names_the_installed_distribution_and_torch(capsys):
    import importlib.metadata

    import torch

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"kernelmux {importlib.metadata.version('kernelmux')}, torch {torch.__version__}"


# Every usage error of every command: exit 2, one `kernelmux: ...` line on stderr, no traceback
# (main returns or argparse exits; nothing else escapes). (argv, environment, what the line says)
USAGE_ERRORS = {
    "info_platform_without_minor": (["info", "--platform", "sm_9"], {}, "'sm_9' is not a CUDA arch"),
    "info_platform_leading_zero": (["info", "--platform", "sm_090"], {}, "'sm_090' is not a CUDA arch"),
    "info_platform_unknown": (["info", "--platform", "tpu"], {}, "cannot simulate platform 'tpu'"),
    "info_platform_from_env": (["info"], {"KERNELMUX_PLATFORM": "sm_9"}, "'sm_9' is not a CUDA arch"),
    "info_bad_setting": (["info"], {"KERNELMUX_PREFER": "junk"}, "KERNELMUX_PREFER: cannot parse 'junk'"),
    "explain_unknown_op": (["explain", "no_such_op"], {}, "unknown op 'no_such_op'"),
    "explain_unknown_case": (["explain", "grouped_topk", "--case", "nope"], {}, "no case 'nope'"),
    "explain_platform": (["explain", "grouped_topk", "--platform", "sm_9"], {}, "'sm_9' is not a CUDA arch"),
    "explain_missing_op": (["explain"], {}, "explain: the following arguments are required: op"),
    "bench_unknown_op": (["bench", "no_such_op"], {}, "unknown op 'no_such_op'; known ops: "),
    "bench_unknown_case": (["bench", "grouped_topk", "--case", "nope"], {},
                           "unknown case(s) 'nope' for grouped_topk; cases: deepseek_v3_t1"),
    "bench_unknown_case_any_op": (["bench", "--case", "nope"], {}, "no op has a case 'nope'"),
    "bench_platform_from_env": (["bench", "grouped_topk"], {"KERNELMUX_PLATFORM": "sm_9"},
                                "'sm_9' is not a CUDA arch"),
    "bench_bad_setting": (["bench", "grouped_topk"], {"KERNELMUX_PREFER": "junk"}, "KERNELMUX_PREFER"),
    "bench_unknown_backend": (["bench", "grouped_topk", "--backend", "tritn"], {},
                              "--backend names unknown backend(s) ['tritn']"),
    "bench_load_missing": (["bench", "--load", "no_such_run.json"], {}, "cannot read the bench run no_such_run.json"),
    "unknown_command": (["frobnicate"], {}, "invalid choice: 'frobnicate'"),
}


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
def test_usage_errors_exit_2_with_one_line(capsys, monkeypatch, name):
    from kernelmux import engine
    from kernelmux.perf import ceilings

    argv, env, says = USAGE_ERRORS[name]
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(engine, "_current", None)  # as in a new process: built from this environment

    def started(*args, **kwargs):
        raise AssertionError("the benchmark started instead of refusing its arguments")

    monkeypatch.setattr(ceilings, "measure", started)
    monkeypatch.setattr(ceilings, "measure_run", started)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors exit here
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("kernelmux: ") and err.count("\n") == 1, err
    assert says in err, err


@pytest.mark.parametrize("platform, viable, declined", [
    # sm_100 and sm_120 (FP4 MMA): FlashInfer's FP4 GEMM and quantizers are wired there.
    ("sm_100", {"fp4_mm", "quantize_mxfp4", "quantize_nvfp4", "paged_attention", "scaled_mm"}, set()),
    ("sm_120", {"fp4_mm", "quantize_mxfp4", "quantize_nvfp4", "paged_attention", "scaled_mm"}, set()),
    # sm_90 has no FP4 MMA: those are rejected at startup with the feature named.
    ("sm_90", {"paged_attention", "scaled_mm"}, {"fp4_mm", "quantize_mxfp4", "quantize_nvfp4"}),
])
def test_explain_lists_the_wired_vendor_implementations_of_a_simulated_platform(
        capsys, monkeypatch, tmp_path, platform, viable, declined):
    install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", "0.6.14")
    for op in viable | declined:
        data = _json(capsys, "explain", op, "--platform", platform)
        candidates = {v["backend"]: v for v in data["viable"]}
        rejected = {r["backend"]: r["reason"] for r in data["rejected"]}
        if op in viable:
            assert "flashinfer" in candidates, (op, rejected.get("flashinfer"))
            assert candidates["flashinfer"]["description"].startswith("flashinfer-python 0.6.14: ")
        else:
            assert "needs features fp4-mma" in rejected["flashinfer"], rejected["flashinfer"]
    assert main(["explain", "fp4_mm", "--platform", platform]) == 0
    assert "flashinfer" in capsys.readouterr().out
