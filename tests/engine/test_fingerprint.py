"""The dispatcher's memo of validated calls (engine/fingerprint.py): a call whose arguments' metadata
were seen skips validation, and nothing validation reads can change without the call being validated
again. Every test runs on both fingerprints, the Python one and the native one (compiled once per
session here, as kernelmux warmup compiles it), and the two must tell the same calls apart."""

from __future__ import annotations

import pytest
import torch

from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import Engine, Settings
import kernelmux.engine._engine as engine_module
from kernelmux.engine import fingerprint
from kernelmux.engine.report import report as kernelmux_report
from kernelmux.errors import InvalidArgumentError
from kernelmux.platforms import simulate
from kernelmux.registry import Registry
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC


@pytest.fixture(scope="session")
def native(tmp_path_factory):
    """The native fingerprint, built once for the session (xdist workers share the folder: torch's
    build lock makes one compile it and the others load it)."""
    root = tmp_path_factory.getbasetemp().parent / "native-fingerprint"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KERNELMUX_CACHE_DIR", str(root))
        patch.setattr(fingerprint, "_loaded", None)
        state = fingerprint.build_native()
        built, _ = fingerprint.native_state()
    assert built is not None, state
    return built


@pytest.fixture(params=["python", "native"])
def fingerprint_of(request):
    return fingerprint.python_fingerprint if request.param == "python" else request.getfixturevalue("native")


def _dispatcher(*impls, fingerprint_of=fingerprint.python_fingerprint, monkeypatch=None):
    registry = Registry({s.name: s for s in ALL_SPECS})
    registry.register_plugin(FakePlugin(*impls), "fakes")
    monkeypatch.setattr(fingerprint, "active", lambda: fingerprint_of)
    engine = Engine(ALL_SPECS, Settings(), platform=simulate("x86_64"), registry=registry)
    assert engine.fingerprint is fingerprint_of
    return engine.dispatchers["grouped_topk"]


@pytest.fixture
def counted(monkeypatch, fingerprint_of):
    """A dispatcher over one fake implementation, with its validations counted."""
    counter = Counter()
    dispatcher = _dispatcher(fake_impl("fake", counter), fingerprint_of=fingerprint_of, monkeypatch=monkeypatch)
    validations = []
    validate = dispatcher._validate

    def counting(*args, **kwargs):
        validations.append(1)
        return validate(*args, **kwargs)

    monkeypatch.setattr(dispatcher, "_validate", counting)
    return dispatcher, validations, counter


def _args(**changes):
    kwargs = SPEC.case("deepseek_v3_t64").build()
    kwargs.update(changes)
    return kwargs


def test_a_repeated_call_is_validated_once(counted):
    dispatcher, validations, counter = counted
    kwargs = _args()
    for _ in range(3):
        dispatcher(**kwargs)
    dispatcher(**_args())  # new tensors, same metadata
    assert len(validations) == 1 and counter.calls == 4


def test_a_bad_argument_after_a_good_call_is_still_rejected(counted):
    dispatcher, validations, _ = counted
    dispatcher(**_args(renormalize=True))
    with pytest.raises(InvalidArgumentError, match="renormalize"):
        dispatcher(**_args(renormalize=1))  # equal to True and of equal hash, but not a bool
    with pytest.raises(InvalidArgumentError, match="topk"):
        dispatcher(**_args(topk=10_000))


@pytest.mark.parametrize("change", ["dtype", "rows", "strides", "alignment", "positional", "bool", "device"])
def test_each_thing_validation_reads_makes_a_new_fingerprint(change, fingerprint_of):
    kwargs = _args()
    logits = kwargs["gating_output"]
    if change == "dtype":
        other = dict(kwargs, gating_output=logits.to(torch.float16))
    elif change == "rows":
        other = dict(kwargs, gating_output=torch.cat((logits, logits)))
    elif change == "strides":
        wide = torch.zeros(logits.shape[0], 2 * logits.shape[1], dtype=logits.dtype)
        other = dict(kwargs, gating_output=wide[:, ::2])
    elif change == "alignment":
        flat = torch.zeros(logits.numel() + 1, dtype=logits.dtype)
        other = dict(kwargs, gating_output=flat[1:].view(logits.shape))  # 4 bytes off
    elif change == "bool":
        other = dict(kwargs, renormalize=int(kwargs["renormalize"]))  # equal, and of equal hash
    elif change == "device":
        other = dict(kwargs, gating_output=logits.to("meta"))
    else:
        positional = tuple(kwargs[name] for name in SPEC.signature.parameters)
        assert fingerprint_of(positional, {}) != fingerprint_of((), kwargs)
        return
    assert fingerprint_of((), kwargs) is not None and fingerprint_of((), other) is not None
    assert fingerprint_of((), kwargs) != fingerprint_of((), other)
    assert fingerprint_of((), kwargs) == fingerprint_of((), _args())  # new tensors, same metadata


def test_a_layout_an_implementation_declines_is_asked_again(monkeypatch, fingerprint_of):
    counter = Counter()
    picky = fake_impl("picky", counter, priority=9,
                      decline=lambda key: None if key.gating_output_layout.alignment >= 16 else "misaligned")
    other = Counter()
    dispatcher = _dispatcher(picky, fake_impl("other", other), fingerprint_of=fingerprint_of, monkeypatch=monkeypatch)
    kwargs = _args()
    dispatcher(**kwargs)
    logits = kwargs["gating_output"]
    flat = torch.zeros(logits.numel() + 1, dtype=logits.dtype)
    misaligned = flat[1:].view(logits.shape)
    misaligned.copy_(logits)
    dispatcher(**dict(kwargs, gating_output=misaligned))
    assert counter.calls == 1 and other.calls == 1


def test_arguments_that_are_not_plain_values_are_never_remembered(fingerprint_of):
    kwargs = _args()
    assert fingerprint_of((), dict(kwargs, topk=[8])) is None
    assert fingerprint_of((), dict(kwargs, topk=(8,))) is None
    seen = fingerprint_of((), kwargs)
    assert not any(isinstance(part, torch.Tensor) for part in seen)  # no tensor is kept alive


class _Wrapper(torch.Tensor):
    """A tensor subclass, as a wrapper whose shape is its own would be."""


def test_the_native_fingerprint_validates_what_it_cannot_read_every_time(native):
    kwargs = _args()
    assert native((), dict(kwargs, gating_output=kwargs["gating_output"].as_subclass(_Wrapper))) is None
    assert native((), dict(kwargs, topk=1 << 70)) is None  # past int64
    assert native((), dict(kwargs, gating_output=torch.nn.Parameter(kwargs["gating_output"]))) == native((), kwargs)


def test_both_fingerprints_tell_the_same_calls_apart_on_every_spec_case(native):
    # Every case of every op, positional and by keyword, with each tensor also strided and sliced:
    # two calls get equal native fingerprints exactly where their Python fingerprints are equal.
    calls = []
    for spec in ALL_SPECS:
        for case in [c for c in spec.cases if "model" not in c.tags][:6]:  # small ones: metadata is what counts
            kwargs = case.build()
            calls.append(((), kwargs))
            calls.append((tuple(kwargs[name] for name in spec.signature.parameters), {}))
            for name, value in kwargs.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.numel():
                    doubled = torch.zeros(*value.shape[:-1], 2 * value.shape[-1], dtype=value.dtype)
                    calls.append(((), dict(kwargs, **{name: doubled[..., ::2]})))
                    calls.append(((), dict(kwargs, **{name: value[:1]})))
    python = [fingerprint.python_fingerprint(a, k) for a, k in calls]
    native_ = [native(a, k) for a, k in calls]
    assert all(f is not None for f in native_) and all(f is not None for f in python)
    python_ids = {f: i for i, f in enumerate(python)}
    native_ids = {f: i for i, f in enumerate(native_)}
    assert [python_ids[f] for f in python] == [native_ids[f] for f in native_]


def test_a_native_fingerprint_never_built_leaves_the_python_one(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_loaded", None)
    assert fingerprint.active() is fingerprint.python_fingerprint
    assert "kernelmux warmup builds it" in fingerprint.native_state()[1]
    engine = Engine(ALL_SPECS, Settings(), platform=simulate("x86_64"))
    assert engine.fingerprint is fingerprint.python_fingerprint
    assert kernelmux_report(engine)["call_fingerprint"].startswith("Python (the native one: not built")


def test_a_failed_build_is_said_never_raised(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_loaded", None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    lines = []
    state = fingerprint.build_native(lines.append)
    assert state == "the build failed (RuntimeError: Ninja is required to load C++ extensions)"
    assert lines[0].startswith("compiling kernelmux's native call fingerprint") and state in lines[1]
    assert fingerprint.active() is fingerprint.python_fingerprint


def test_a_native_module_that_does_not_load_is_said(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_loaded", None)
    fingerprint.native_dir().mkdir(parents=True)
    (fingerprint.native_dir() / f"{fingerprint._module_name()}.so").write_bytes(b"not a shared object")
    native, state = fingerprint.native_state()
    assert native is None and "did not load: ImportError" in state
    assert fingerprint.active() is fingerprint.python_fingerprint


def test_the_report_names_the_native_fingerprint_in_use(native, monkeypatch):
    monkeypatch.setattr(fingerprint, "active", lambda: native)
    monkeypatch.setattr(fingerprint, "_loaded", (native, "native (/somewhere)"))
    engine = Engine(ALL_SPECS, Settings(), platform=simulate("x86_64"))
    assert all(d._fingerprint is native for d in engine.dispatchers.values())
    assert kernelmux_report(engine)["call_fingerprint"] == "native (/somewhere)"


def test_the_memo_is_bounded(counted, monkeypatch):
    dispatcher, validations, _ = counted
    monkeypatch.setattr(engine_module, "_FINGERPRINTS", 2)
    logits = _args()["gating_output"]
    for rows in (1, 2, 3, 4):
        dispatcher(**_args(gating_output=logits[:rows]))
    assert len(dispatcher._known) <= 2 and len(validations) == 4


def test_the_python_fingerprint_can_be_asked_for_where_the_native_one_is_built(native, monkeypatch):
    monkeypatch.setattr(fingerprint, "active", lambda: native)
    assert Engine(ALL_SPECS, Settings(), platform=simulate("x86_64")).fingerprint is native
    off = Settings.from_env({"KERNELMUX_NATIVE_FINGERPRINT": "0"})
    assert off.native_fingerprint is False and Settings.from_env({}).native_fingerprint is True
    engine = Engine(ALL_SPECS, off, platform=simulate("x86_64"))
    assert all(d._fingerprint is fingerprint.python_fingerprint for d in engine.dispatchers.values())
