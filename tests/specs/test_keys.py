"""Every spec's dispatch key holds what implementations decide on: the device, and the layout of
every tensor argument (issue 24, item 2: supports() sees only the key, so what the key lacks
cannot be decided on, and a cached decision holds for every call with that key)."""

from __future__ import annotations

import typing

import pytest
import torch

from kernelmux.specs._key import MAX_ALIGNMENT, Layout, layout, size_class
from kernelmux.specs import ALL_SPECS


def _tensor_parameters(spec) -> list[str]:
    names = []
    for name, parameter in spec.signature.parameters.items():
        annotation = parameter.annotation
        if annotation is torch.Tensor or torch.Tensor in typing.get_args(annotation):
            names.append(name)
    return names


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_key_names_the_device_and_every_tensors_layout(spec):
    fields = spec.key._fields
    assert "device" in fields
    missing = [name for name in _tensor_parameters(spec) if f"{name}_layout" not in fields]
    assert missing == [], f"{spec.name}'s key lacks the layouts of {missing}"


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_validate_returns_the_specs_key_for_every_small_case(spec):
    for case in spec.cases:
        if not {"random", "edge"} & case.tags:
            continue  # the model cases are built by the same makers, larger
        kwargs = case.build(seed=1)
        key = spec.validate(**kwargs)
        assert type(key) is spec.key, case.name
        assert key.device == torch.device("cpu")
        for name in _tensor_parameters(spec):
            assert getattr(key, f"{name}_layout") == layout(kwargs[name]), (case.name, name)
        hash(key)
        assert key == spec.validate(**kwargs)  # a float field of NaN would never equal itself


def test_layout_reads_unit_stride_and_alignment():
    rows = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert layout(rows) == Layout(True, MAX_ALIGNMENT) and layout(rows).dense_rows
    assert layout(rows.t()) == Layout(False, 2)
    assert layout(rows[:, 1:]) == Layout(True, 2)  # address 2 bytes in, rows 16 bytes apart
    assert layout(rows[:, :4]) == Layout(True, MAX_ALIGNMENT)  # a narrower view of aligned rows
    assert layout(rows[:1, 1:]) == Layout(True, 2)  # one row: its stride is never stepped
    assert layout(torch.zeros(3, 1, dtype=torch.int32).expand(3, 5)) == Layout(False, 4)
    assert layout(torch.zeros(5, dtype=torch.int32)[::2]) == Layout(False, MAX_ALIGNMENT)
    assert layout(torch.zeros((), dtype=torch.float32)) == Layout(True, MAX_ALIGNMENT)
    assert layout(None) is None


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 1), (2, 3), (3, 3), (4, 7), (65535, 65535), (65536, 131071)])
def test_size_class_decides_limits_of_the_form_two_to_the_k_minus_one_exactly(n, expected):
    assert size_class(n) == expected
    assert (size_class(n) <= 65535) == (n <= 65535)
