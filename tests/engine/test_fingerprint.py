"""The dispatcher's memo of validated calls (engine/_engine.py ``_fingerprint``): a call whose
arguments' metadata were seen skips validation, and nothing validation reads can change without
the call being validated again."""

from __future__ import annotations

import pytest
import torch

from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import Engine, Settings
import kernelmux.engine._engine as engine_module
from kernelmux.errors import InvalidArgumentError
from kernelmux.platforms import simulate
from kernelmux.registry import Registry
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC


def _dispatcher(*impls):
    registry = Registry({s.name: s for s in ALL_SPECS})
    registry.register_plugin(FakePlugin(*impls), "fakes")
    engine = Engine(ALL_SPECS, Settings(), platform=simulate("x86_64"), registry=registry)
    return engine.dispatchers["grouped_topk"]


@pytest.fixture
def counted(monkeypatch):
    """A dispatcher over one fake implementation, with its validations counted."""
    counter = Counter()
    dispatcher = _dispatcher(fake_impl("fake", counter))
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


@pytest.mark.parametrize("change", ["dtype", "rows", "strides", "alignment", "positional"])
def test_each_thing_validation_reads_makes_a_new_fingerprint(change):
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
    else:
        positional = tuple(kwargs[name] for name in SPEC.signature.parameters)
        assert engine_module._fingerprint(positional, {}) != engine_module._fingerprint((), kwargs)
        return
    assert engine_module._fingerprint((), kwargs) != engine_module._fingerprint((), other)


def test_a_layout_an_implementation_declines_is_asked_again():
    counter = Counter()
    picky = fake_impl("picky", counter, priority=9,
                      decline=lambda key: None if key.gating_output_layout.alignment >= 16 else "misaligned")
    other = Counter()
    dispatcher = _dispatcher(picky, fake_impl("other", other))
    kwargs = _args()
    dispatcher(**kwargs)
    logits = kwargs["gating_output"]
    flat = torch.zeros(logits.numel() + 1, dtype=logits.dtype)
    misaligned = flat[1:].view(logits.shape)
    misaligned.copy_(logits)
    dispatcher(**dict(kwargs, gating_output=misaligned))
    assert counter.calls == 1 and other.calls == 1


def test_arguments_that_are_not_plain_values_are_never_remembered():
    kwargs = _args()
    assert engine_module._fingerprint((), dict(kwargs, topk=[8])) is None
    assert engine_module._fingerprint((), dict(kwargs, topk=(8,))) is None
    fingerprint = engine_module._fingerprint((), kwargs)
    assert not any(isinstance(part, torch.Tensor) for part in fingerprint)  # no tensor is kept alive


def test_the_memo_is_bounded(counted, monkeypatch):
    dispatcher, validations, _ = counted
    monkeypatch.setattr(engine_module, "_FINGERPRINTS", 2)
    logits = _args()["gating_output"]
    for rows in (1, 2, 3, 4):
        dispatcher(**_args(gating_output=logits[:rows]))
    assert len(dispatcher._known) <= 2 and len(validations) == 4
