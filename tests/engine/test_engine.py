"""Selection and dispatch proven by behaviour: counting fake implementations on faked platforms."""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelmux
from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import Engine, FallbackWarning, PlatformKind, Settings, simulate
from kernelmux.engine.report import report
from kernelmux.errors import KernelmuxError, NoImplementationError, UnknownOpError
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.ops.specs.grouped_topk import SPEC
from kernelmux.registry import PlatformRequirement, Registry

CPU = simulate("x86_64")
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
                  decline=lambda x: "bf16 only" if x.dtype != torch.bfloat16 else None),
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
    gpu = Counter()
    engine = _engine(fake_impl("gpu", gpu, devices=frozenset({"cuda"})), platform=SM90)
    meta_kwargs = SPEC.case("deepseek_v3_t64").build("meta")
    answers = engine.explain("grouped_topk", meta_kwargs)
    assert [(impl.backend, reason) for impl, reason in answers] == [("gpu", None)]
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
