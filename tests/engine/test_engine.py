"""Selection and dispatch proven by behaviour: counting fake implementations on faked platforms."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import kernelmux
from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import Engine, FallbackWarning, Settings
from kernelmux.platforms import PlatformKind, simulate
from kernelmux.engine.report import report
from kernelmux.errors import (ConfigurationError, ImplementationError, KernelmuxError, NoImplementationError,
                              UnknownOpError)
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC
from kernelmux.registry import PlatformRequirement, Registry

CPU = simulate("x86_64")
ALL_OPS_SPECS = {spec.name: spec for spec in ALL_SPECS}
SM90 = simulate("sm_90")


def _engine(*impls, settings=Settings(), platform=CPU) -> Engine:
    registry = Registry({s.name: s for s in ALL_SPECS}, strict=settings.strict)
    registry.register_plugin(FakePlugin(*impls), "fakes")
    return Engine(ALL_SPECS, settings, platform=platform, registry=registry)


def _call(engine: Engine, case: str = "small_sigmoid_bias"):
    kwargs = SPEC.case(case).build()
    out = engine.dispatchers["grouped_topk"](**kwargs)
    SPEC.check_close(out, SPEC.reference(**kwargs), kwargs)
    return out


def test_highest_priority_viable_implementation_runs():
    low, high = Counter(), Counter()
    engine = _engine(fake_impl("low", low, priority=1), fake_impl("high", high, priority=5))
    _call(engine)
    assert (high.calls, low.calls) == (1, 0)


def test_preference_overrides_priority_and_deny_list_removes():
    low, high = Counter(), Counter()
    impls = (fake_impl("low", low, priority=1), fake_impl("high", high, priority=5))
    _call(_engine(*impls, settings=Settings(prefer={"grouped_topk": ("low",)})))
    assert (low.calls, high.calls) == (1, 0)
    engine = _engine(*impls, settings=Settings(deny=frozenset({"grouped_topk:high"})))
    _call(engine)
    assert (low.calls, high.calls) == (2, 0)
    (denied,) = [r for impl, r in engine.tables["grouped_topk"].rejected if impl.backend == "high"]
    assert "deny list ('grouped_topk:high')" in denied
    _call(_engine(*impls, settings=Settings(deny=frozenset({"high"}), prefer={"*": ("high",)})))
    assert high.calls == 0


def test_platform_requirement_rejects_at_startup_with_reason():
    gpu = Counter()
    impl = fake_impl("gpu", gpu, requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                                                 min_capability=(10, 0)))
    on_cpu = _engine(impl)
    (reason,) = [r for i, r in on_cpu.tables["grouped_topk"].rejected if i.backend == "gpu"]
    assert reason == "needs a cuda platform, this is cpu"
    on_sm90 = _engine(impl, platform=SM90)
    (reason,) = [r for i, r in on_sm90.tables["grouped_topk"].rejected if i.backend == "gpu"]
    assert reason == "needs capability >= 10.0, this has 9.0"
    on_sm100 = _engine(impl, platform=simulate("sm_100"))
    assert [c.impl.backend for c in on_sm100.tables["grouped_topk"].candidates] == ["gpu"]


def test_supports_decision_is_cached_per_dispatch_key():
    picky, fallback = Counter(), Counter()
    engine = _engine(
        fake_impl("picky", picky, priority=5,
                  decline=lambda key: "bf16 only" if key.logits_dtype != torch.bfloat16 else None),
        fake_impl("general", fallback, priority=1),
    )
    for _ in range(3):
        _call(engine, "small_softmax")  # fp32: picky declines, general runs
    assert (picky.supports_calls, picky.calls, fallback.calls) == (1, 0, 3)
    for _ in range(2):
        _call(engine, "mixtral_8x7b_t1024")  # bf16, another key: asked once more, accepts
    assert (picky.supports_calls, picky.calls) == (2, 2)
    decisions = engine.dispatchers["grouped_topk"].decisions
    assert sorted(d.backend for d in decisions.values()) == ["general", "picky"]


def test_nothing_accepts_falls_back_to_reference_with_one_warning():
    declining = Counter()
    engine = _engine(fake_impl("never", declining, decline=lambda x: "not today"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _call(engine)
        _call(engine)
    fallback_warnings = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "never: not today" in str(fallback_warnings[0].message)
    assert declining.calls == 0
    (call,) = [o for o in report(engine)["ops"] if o["op"] == "grouped_topk"][0]["calls"]
    assert call["fallback"] and call["backend"] == "reference"


def test_strict_mode_raises_listing_every_candidate_and_reason():
    engine = _engine(
        fake_impl("a", Counter(), decline=lambda x: "too small"),
        fake_impl("gpu", Counter(), requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}))),
        settings=Settings(strict=True),
    )
    with pytest.raises(NoImplementationError) as info:
        _call(engine)
    message = str(info.value)
    assert "a: too small" in message
    assert "gpu: rejected at startup: needs a cuda platform" in message
    assert info.value.op == "grouped_topk"


def test_device_mismatch_declines_without_calling_supports():
    cuda_only = Counter()
    engine = _engine(fake_impl("cuda_only", cuda_only, devices=frozenset({"cuda"}),
                               decline=lambda x: None),
                     fake_impl("host", Counter(), devices=frozenset({"cpu"})))
    _call(engine)
    assert (cuda_only.calls, cuda_only.supports_calls) == (0, 0)
    (decision,) = engine.dispatchers["grouped_topk"].decisions.values()
    assert dict(decision.answers)["cuda_only"] == "runs on cuda tensors, the inputs are on cpu"


def test_explain_answers_for_a_simulated_device_without_running():
    """The inputs live on this machine's CPU; on a simulated sm_90 the key says cuda:0, so a
    cuda-only implementation is asked (with the simulated platform) and accepts."""
    gpu = Counter()
    seen = []
    engine = _engine(fake_impl("gpu", gpu, devices=frozenset({"cuda"}),
                               decline=lambda key: seen.append(key.device) or None), platform=SM90)
    answers = engine.explain("grouped_topk", SPEC.case("deepseek_v3_t64").build("cpu"))
    assert [(impl.backend, reason) for impl, reason in answers] == [("gpu", None)]
    assert seen == [torch.device("cuda", 0)]
    assert gpu.calls == 0


def test_resolve_returns_the_function_dispatch_would_run():
    chosen = Counter()
    engine = _engine(fake_impl("chosen", chosen, priority=3), fake_impl("other", Counter()))
    kwargs = SPEC.case("small_softmax").build()
    fn = engine.resolve("grouped_topk", **kwargs)
    fn(**kwargs)
    assert chosen.calls == 1
    with pytest.raises(UnknownOpError, match="known ops: .*grouped_topk"):
        engine.resolve("no_such_op")


def test_invalid_input_is_rejected_before_any_implementation_runs():
    counter = Counter()
    engine = _engine(fake_impl("any", counter))
    kwargs = SPEC.case("small_softmax").build()
    kwargs["topk_group"] = 99
    with pytest.raises(kernelmux.errors.InvalidArgumentError, match="topk_group"):
        engine.dispatchers["grouped_topk"](**kwargs)
    assert counter.calls == 0


def test_settings_from_env_parse_and_errors():
    settings = Settings.from_env({
        "KERNELMUX_PREFER": "grouped_topk=triton,cpu; *=cpu",
        "KERNELMUX_DENY": "triton, grouped_topk:cpu",
        "KERNELMUX_PLUGINS": "reference,cpu",
        "KERNELMUX_STRICT": "1",
        "KERNELMUX_PLATFORM": "sm_100",
    })
    assert settings.preference("grouped_topk") == ("triton", "cpu")
    assert settings.preference("other_op") == ("cpu",)
    assert settings.denial("grouped_topk", "cpu") == "grouped_topk:cpu"
    assert settings.denial("x", "triton") == "triton"
    assert settings.allow_plugins == {"reference", "cpu"} and settings.strict
    assert settings.platform == "sm_100"
    with pytest.raises(KernelmuxError, match="expected 'op=backend"):
        Settings.from_env({"KERNELMUX_PREFER": "grouped_topk"})


def test_configure_python_api_replaces_the_engine_and_rejects_unknown_backends():
    try:
        engine = kernelmux.configure(prefer={"grouped_topk": ["reference"]}, from_env=False)
        assert kernelmux.current() is engine
        assert engine.tables["grouped_topk"].candidates[0].impl.backend == "reference"
        with pytest.raises(KernelmuxError, match="unknown backend"):
            kernelmux.configure(prefer={"grouped_topk": ["no_such_backend"]}, from_env=False)
        simulated = kernelmux.configure(platform="gfx942", from_env=False)
        assert simulated.platform.arch == "gfx942" and simulated.platform.simulated
    finally:
        kernelmux.reset()


def test_report_lists_chosen_viable_and_rejected():
    engine = _engine(fake_impl("fast", Counter(), priority=5), fake_impl("slow", Counter()),
                     fake_impl("gpu", Counter(), requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}))))
    (op,) = [o for o in report(engine)["ops"] if o["op"] == "grouped_topk"]
    assert op["chosen"] == "fast"
    assert [v["backend"] for v in op["viable"]] == ["fast", "slow"]
    assert {r["backend"]: r["reason"] for r in op["rejected"]}["gpu"].startswith("needs a cuda")


# ---------------------------------------------------------------------------------------------
# supports() decides from the dispatch key and the platform alone (issue 24, item 2)


def test_supports_taking_the_calls_arguments_is_rejected_at_registration():
    """A supports() reading the call's tensors could decide on what the cached key does not hold
    (a layout, an alignment, a batch size): registration refuses it and says what to take."""
    def supports(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func="softmax",
                 routed_scaling_factor=1.0, e_score_correction_bias=None):
        return None

    impl = dataclasses.replace(fake_impl("old_style", Counter()), supports=supports)
    engine = _engine(impl)
    (rejection,) = engine.registry.rejections
    assert rejection.backend == "old_style"
    assert "it must take (key, platform)" in rejection.reason and "gating_output_layout" in rejection.reason


def test_a_layout_the_cached_choice_cannot_read_is_decided_afresh():
    """The first call (row-major logits) caches 'rows' for its key; the same values read
    column-major form another key, so 'rows' is asked again, declines, and 'general' runs."""
    rows, general = Counter(), Counter()
    engine = _engine(
        fake_impl("rows", rows, priority=5,
                  decline=lambda key: None if key.gating_output_layout.unit_stride else "row-major logits only"),
        fake_impl("general", general, priority=1),
    )
    kwargs = SPEC.case("deepseek_v3_t64").build()
    engine.dispatchers["grouped_topk"](**kwargs)
    column_major = dict(kwargs, gating_output=kwargs["gating_output"].t().contiguous().t())
    out = engine.dispatchers["grouped_topk"](**column_major)
    SPEC.check_close(out, SPEC.reference(**kwargs), kwargs)
    assert (rows.calls, general.calls, rows.supports_calls) == (1, 1, 2)


def test_supports_gets_the_platform_of_the_calls_device():
    seen = []
    engine = _engine(fake_impl("any", Counter(), decline=lambda key: seen.append(key.device) or None))
    _call(engine)
    assert seen == [torch.device("cpu")]
    assert engine.platform_for(torch.device("cpu")) is engine.platform


# ---------------------------------------------------------------------------------------------
# What an implementation raises is reported as its own failure (issue 24, item 6)


def _raising_impl(backend: str, error: BaseException, counter: Counter, priority: int = 5):
    def grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func="softmax",
                     routed_scaling_factor=1.0, e_score_correction_bias=None):
        counter.calls += 1
        raise error

    grouped_topk.__signature__ = SPEC.signature
    return dataclasses.replace(fake_impl(backend, counter, priority=priority), fn=grouped_topk)


def test_an_implementation_that_raises_is_named_in_a_typed_error():
    broken, fallback = Counter(), Counter()
    cause = IndexError("index 9 is out of bounds")
    engine = _engine(_raising_impl("broken", cause, broken), fake_impl("general", fallback, priority=1))
    with pytest.raises(ImplementationError) as info:
        _call(engine)
    error = info.value
    assert (error.op, error.backend, error.plugin) == ("grouped_topk", "broken", "fakes")
    assert error.__cause__ is cause
    assert "grouped_topk:broken (plugin 'fakes') raised IndexError: index 9 is out of bounds" in str(error)
    assert isinstance(error, RuntimeError)
    # No silent fallback: the next candidate did not run in its place.
    assert (broken.calls, fallback.calls) == (1, 0)


def test_running_out_of_memory_passes_through_with_a_note():
    memory = torch.OutOfMemoryError("CUDA out of memory")
    engine = _engine(_raising_impl("hungry", memory, Counter()))
    with pytest.raises(torch.OutOfMemoryError) as info:
        _call(engine)
    assert info.value is memory and "grouped_topk:hungry" in "".join(getattr(memory, "__notes__", []))


# ---------------------------------------------------------------------------------------------
# The report while other threads dispatch (issue 24, item 9)


def test_report_while_another_thread_dispatches_new_keys():
    engine = _engine(fake_impl("any", Counter()))
    stop = threading.Event()
    failures = []

    def dispatch():
        experts = 2
        while not stop.is_set():
            experts += 2  # every call a new key
            logits = torch.randn(1, experts)
            try:
                engine.dispatchers["grouped_topk"](logits, 1, False, 2, 1)
            except Exception as error:  # noqa: BLE001 - surfaced below
                failures.append(error)
                return

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=dispatch)
    worker.start()
    reports, deadline = 0, time.monotonic() + 3.0  # each report grows with the decisions: bounded in time
    try:
        while reports < 300 and time.monotonic() < deadline:
            report(engine)
            reports += 1
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(previous)
    assert failures == []
    assert reports >= 10 and len(engine.dispatchers["grouped_topk"].decisions) > 1


# ---------------------------------------------------------------------------------------------
# Settings name only what exists, from the environment or the API alike (issue 24, item 10)


@pytest.mark.parametrize("env, fragment", [
    ({"KERNELMUX_DENY": "tritn"}, "deny names unknown backend 'tritn'"),
    ({"KERNELMUX_DENY": "grouped_topk:cpuu"}, "deny names unknown backend 'cpuu' (in 'grouped_topk:cpuu')"),
    ({"KERNELMUX_DENY": "groupd_topk:cpu"}, "deny names unknown op 'groupd_topk'"),
    ({"KERNELMUX_PREFER": "grouped_topk=tritn"}, "prefer names unknown backend 'tritn' (for grouped_topk)"),
    ({"KERNELMUX_PREFER": "groupd_topk=cpu"}, "prefer names unknown op 'groupd_topk'"),
    ({"KERNELMUX_PLUGINS": "reference,cpuu"}, "the plugin allow-list names 'cpuu'"),
])
def test_a_typo_in_the_environment_is_an_error_listing_known_names(env, fragment):
    with pytest.raises(ConfigurationError) as info:
        Engine(ALL_SPECS, Settings.from_env(env), platform=CPU)
    message = str(info.value)
    assert fragment in message
    assert "Known ops:" in message and "grouped_topk" in message and "backends:" in message and "triton" in message


def test_a_typo_through_configure_is_the_same_error():
    try:
        with pytest.raises(ConfigurationError, match="deny names unknown backend 'tritn'"):
            kernelmux.configure(deny=["tritn"], from_env=False)
        with pytest.raises(ConfigurationError, match="prefer names unknown backend 'no_such_backend'"):
            kernelmux.configure(prefer={"grouped_topk": ["no_such_backend"]}, from_env=False)
    finally:
        kernelmux.reset()


@pytest.mark.parametrize("variable", ["KERNELMUX_STRICT", "KERNELMUX_CHECK"])
def test_boolean_variables_accept_words_and_refuse_typos(variable):
    field = variable.removeprefix("KERNELMUX_").lower()
    assert getattr(Settings.from_env({variable: "on"}), field) is True
    assert getattr(Settings.from_env({variable: "0"}), field) is False
    with pytest.raises(ConfigurationError, match=f"{variable}='ture'"):
        Settings.from_env({variable: "ture"})


# ---------------------------------------------------------------------------------------------
# A fallback is said once (issue 24, item 13)


def test_a_fallback_is_printed_once_with_logging_configured(tmp_path):
    """An integrator's process with logging set up (as servers do): the fallback reaches stderr
    once, not as a log record and a warning both."""
    script = textwrap.dedent("""
        import logging, warnings
        logging.basicConfig(level=logging.INFO)
        import kernelmux
        from kernelmux.specs.grouped_topk import SPEC
        kernelmux.configure(allow_plugins=["reference"], from_env=False)  # nothing but the fallback
        kernelmux.ops.grouped_topk(**SPEC.case("small_softmax").build())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELMUX_")}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("fell back to the reference") == 1, result.stderr


# ---------------------------------------------------------------------------------------------
# Simulated platforms answer as the real ones (issue 24, item 12)


def test_simulated_hopper_takes_the_fp8_decode_on_cuda():
    """Inputs built on this CPU, asked for a simulated sm_90: the cuda backend's fp8 decode
    kernel accepts, as it does on an H100 (it used to decline: 'tensors are on meta')."""
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    case = "llama3_8b_fp8_decode_b8_ctx4096"
    kwargs = ALL_OPS_SPECS["paged_attention"].case(case).build("cpu")
    answers = {impl.backend: reason for impl, reason in engine.explain("paged_attention", kwargs)}
    if "cuda" in {impl.backend for impl, _ in engine.tables["paged_attention"].rejected}:
        pytest.skip("the cuda backend is not viable here (no NVRTC): the test extra installs it")
    assert answers["cuda"] is None and answers["triton"] is None


@pytest.mark.parametrize("arch", ["sm_100", "sm_120"])
def test_the_hopper_only_mla_kernel_is_not_viable_on_blackwell(arch):
    engine = Engine(ALL_SPECS, Settings(platform=arch))
    (op,) = [o for o in report(engine)["ops"] if o["op"] == "mla_decode"]
    assert op["chosen"] != "cuda"
    assert {r["backend"]: r["reason"] for r in op["rejected"]}["cuda"] == f"needs arch in {{sm_90}}, this is {arch}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compares a simulated platform "
                    "with the real one it simulates; runs in the GPU suite")
def test_explain_on_the_simulated_platform_equals_the_real_machine():
    """For every op and every case: `explain --platform <this GPU's arch>` (inputs on the CPU)
    gives the same answers as plain `explain` (inputs on the GPU). The gpu-tagged cases (GB-sized
    inputs, drawn on the CPU: 230 s on the H100's host at cf8f4a1, where they passed too) come
    from the same makers as the model cases and are left out of the suite."""
    real = Engine(ALL_SPECS, Settings())
    simulated = Engine(ALL_SPECS, Settings(platform=real.platform.arch))
    differences = []
    for spec in ALL_SPECS:
        for case in spec.cases:
            if "gpu" in case.tags:
                continue
            on_cpu = case.build("cpu", seed=0)
            on_gpu = {k: v.to(real.platform.device) if isinstance(v, torch.Tensor) else v for k, v in on_cpu.items()}
            dry = [(impl.backend, reason) for impl, reason in simulated.explain(spec.name, on_cpu)]
            wet = [(impl.backend, reason) for impl, reason in real.explain(spec.name, on_gpu)]
            if dry != wet:
                differences.append((spec.name, case.name, dry, wet))
            del on_cpu, on_gpu
        torch.cuda.empty_cache()
    assert differences == []


def test_the_simulation_variable_is_read_once_by_the_engine(monkeypatch):
    monkeypatch.setenv("KERNELMUX_PLATFORM", "gfx950")
    engine = Engine(ALL_SPECS, plugins={})
    monkeypatch.setenv("KERNELMUX_PLATFORM", "sm_100")
    assert (engine.platform.arch, engine.platform.simulated) == ("gfx950", True)
    assert engine.platform_for(torch.device("cpu")).arch == "gfx950"


# An implementation that declares some calls cannot be captured in a CUDA graph (capture_check)


def _capture(monkeypatch, capturing: bool = True):
    """The current stream capturing a CUDA graph, as far as the engine can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)


def _planned(counter: Counter, priority: int = 5, why: str = "plans on the host at every call"):
    """An implementation whose calls cannot be captured (as FlashInfer's planned wrappers)."""
    return dataclasses.replace(fake_impl("planned", counter, priority=priority), capture_check=lambda key, platform: why)


def test_under_capture_the_next_capturable_candidate_runs(monkeypatch):
    planned, graphable = Counter(), Counter()
    engine = _engine(_planned(planned), fake_impl("graphable", graphable, priority=1))
    _call(engine)
    assert (planned.calls, graphable.calls) == (1, 0)
    _capture(monkeypatch, capturing=False)
    _call(engine)
    assert (planned.calls, graphable.calls) == (2, 0)
    _capture(monkeypatch)
    _call(engine)  # the same key, cached: the capture check happens per call
    assert (planned.calls, graphable.calls) == (2, 1)
    kwargs = SPEC.case("small_sigmoid_bias").build()
    engine.resolve("grouped_topk", **kwargs)(**kwargs)  # resolved during capture: the capturable one
    assert graphable.calls == 2
    [decision] = engine.dispatchers["grouped_topk"].decisions.values()
    assert decision.backend == "planned"
    assert decision.capture == "under CUDA-graph capture graphable (planned cannot be captured: " \
                               "plans on the host at every call)"
    assert engine.explain_capture("grouped_topk", kwargs) == decision.capture
    assert report(engine)["ops"][0]["calls"][0]["capture"] == decision.capture


def test_with_no_capturable_candidate_the_chosen_one_runs_and_says_so(monkeypatch):
    planned = Counter()
    engine = _engine(_planned(planned))
    _capture(monkeypatch)
    _call(engine)
    assert planned.calls == 1  # its own refusal, if any, is what the caller sees
    [decision] = engine.dispatchers["grouped_topk"].decisions.values()
    assert decision.capture.startswith("under CUDA-graph capture still planned (planned cannot be captured")


def test_a_capture_check_that_raises_counts_as_cannot_capture(monkeypatch):
    def broken(key, platform):
        raise KeyError("width")

    planned, graphable = Counter(), Counter()
    engine = _engine(dataclasses.replace(fake_impl("planned", planned, priority=5), capture_check=broken),
                     fake_impl("graphable", graphable, priority=1))
    _capture(monkeypatch)
    _call(engine)
    assert (planned.calls, graphable.calls) == (0, 1)
    [decision] = engine.dispatchers["grouped_topk"].decisions.values()
    assert "capture_check() raised KeyError" in decision.capture


def test_a_capturable_choice_never_asks_whether_the_stream_captures(monkeypatch):
    def asked():
        raise AssertionError("the engine asked whether the stream captures")

    engine = _engine(fake_impl("plain", Counter()))
    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", asked)
    _call(engine)
    _call(engine)
