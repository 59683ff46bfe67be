"""The argument checks every spec's validate() shares (specs/_validate.py): check_choice answers
any value, hashable or not, with an InvalidArgumentError that names the argument, the allowed
values and the value given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._validate import check_choice

# The two shapes of choices the specs pass: a dict keyed by name (quantize_fp8's FP8_DTYPES,
# scaled_mm's OUT_DTYPES) and a tuple of names (GRANULARITIES, ACTIVATIONS).
CHOICES = {"dict": {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz},
           "tuple": ("e4m3fn", "e4m3fnuz")}

WRONG = {
    "list": (["e4m3fn"], "['e4m3fn']", "a list was given"),  # unhashable: TypeError against a dict
    "dict": ({"e4m3fn": 1}, "{'e4m3fn': 1}", "a dict was given"),
    "set": ({"e4m3fn"}, "{'e4m3fn'}", "a set was given"),
    "bytearray": (bytearray(b"e4m3fn"), "bytearray(b'e4m3fn')", "a bytearray was given"),
    # An array's == is elementwise: `in` against a tuple asks its truth value, which is ambiguous.
    "array": (np.array(["e4m3fn", "e4m3fnuz"]), "array(['e4m3fn', 'e4m3fnuz']", "a ndarray was given"),
    "tensor": (torch.zeros(3, 4), "tensor([[0., 0., 0., 0.], [0., 0., 0., 0.],", "a Tensor was given"),
    "dtype": (torch.float8_e4m3fn, "torch.float8_e4m3fn", "a dtype was given"),
    "none": (None, "None", "a NoneType was given"),
    "other_name": ("e5m2", "'e5m2'", None),  # a string: no hint, the list says it all
}


@pytest.mark.parametrize("choices", list(CHOICES))
@pytest.mark.parametrize("given", list(WRONG))
def test_any_wrong_value_is_an_invalid_argument_naming_what_is_allowed(choices, given):
    value, shown, hint = WRONG[given]
    with pytest.raises(InvalidArgumentError) as info:
        check_choice("quantize_fp8", "fp8_dtype", value, CHOICES[choices])
    error = info.value
    assert (error.op, error.argument) == ("quantize_fp8", "fp8_dtype")
    message = str(error)
    assert "expected one of ['e4m3fn', 'e4m3fnuz']" in message, message
    assert f"got {shown}" in message and "\n" not in message, message
    assert (hint in message) if hint else ("(" not in message.split("got ")[1]), message


def test_a_long_repr_is_cut_to_one_line():
    with pytest.raises(InvalidArgumentError) as info:
        check_choice("quantize_fp8", "fp8_dtype", list(range(1000)), ("e4m3fn",))
    got = info.value.actual
    assert len(got) == 80 and got.endswith("...") and got.startswith("[0, 1, 2")


@pytest.mark.parametrize("choices", list(CHOICES))
def test_each_allowed_value_passes(choices):
    for value in CHOICES[choices]:
        check_choice("quantize_fp8", "fp8_dtype", value, CHOICES[choices])
    check_choice("quantize_fp8", "fp8_dtype", np.str_("e4m3fn"), CHOICES[choices])  # equal and same hash


def test_an_op_called_with_a_list_for_a_name_raises_invalid_argument():
    import kernelmux

    x = torch.randn(4, 32)
    with pytest.raises(InvalidArgumentError, match="'fp8_dtype': expected one of"):
        kernelmux.ops.quantize_fp8(x, "per_tensor", 128, False, ["e4m3fn"])
