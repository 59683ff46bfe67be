"""The kernelmux command: info and explain, as tables and JSON, on this and simulated platforms."""

from __future__ import annotations

import json

import pytest

from kernelmux.cli import main


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
