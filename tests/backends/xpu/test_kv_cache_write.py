"""The xpu backend's kv_cache_write against the fake vllm-xpu-kernels (_C.reshape_and_cache_flash with the
shipped schema, cache.cpp's checks and its addressing: one run of Hkv * D elements per token and slot, V
written with K's strides): caches byte for byte against the spec's reference, in every cache layout."""

from __future__ import annotations

import logging

import pytest
import torch

from fakes import ask
from kernelmux.backends.xpu import kv_cache_write as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import kv_cache_write as spec

XPU = simulate("xpu")
FP8 = torch.float8_e4m3fn


def _copy(tensor):
    """A copy with the same strides (clone() makes views with gaps contiguous)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype).copy_(tensor)


def _copies(kwargs):
    return {k: _copy(v) if k.endswith("cache") else v for k, v in kwargs.items()}


def _run(kwargs):
    """(adapter's caches, reference's caches) from copies of the same inputs, layouts kept."""
    ours, theirs = _copies(kwargs), _copies(kwargs)
    spec.SPEC.reference(**theirs)
    adapter.kv_cache_write(**ours)
    return (ours["k_cache"], ours["v_cache"]), (theirs["k_cache"], theirs["v_cache"])


@pytest.mark.parametrize("case", [c.name for c in spec.SPEC.cases_tagged("quick")])
def test_spec_cases_are_written_byte_for_byte(vendor, case):
    kwargs = spec.SPEC.case(case).build(seed=5)
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    spec.SPEC.check_close(*_run(kwargs), kwargs)


def _small(seed, dtype=torch.bfloat16, cache_dtype=None, tokens=11, heads=3, dim=16, block=4, blocks=6):
    kwargs = spec._maker(tokens, heads, dim, block, blocks, dtype, cache_dtype, padding=0.2,
                         scales=(0.3, 0.07) if cache_dtype == FP8 else None, magnitude=8.0)(
        torch.device("cpu"), torch.Generator().manual_seed(seed))
    return kwargs


def test_views_of_a_joint_cache_take_one_launch(vendor):
    # vLLM's [num_blocks, 2, block_size, Hkv, D]: K and V share strides, the kernel's plain path.
    kwargs = _small(1, cache_dtype=FP8)
    joint = torch.stack((kwargs["k_cache"], kwargs["v_cache"]), dim=1)
    kwargs["k_cache"], kwargs["v_cache"] = joint[:, 0], joint[:, 1]
    spec.SPEC.check_close(*_run(kwargs), kwargs)
    assert [name for name, _ in vendor["_C"].CALLS] == ["reshape_and_cache_flash"]


@pytest.mark.parametrize("layout", ["padded_head_dim", "heads_outermost", "different_k_v_strides",
                                    "strided_input"])
def test_other_layouts_are_written_per_head(vendor, layout, caplog, monkeypatch):
    monkeypatch.setattr(adapter, "_announced", set())
    kwargs = _small(2, dtype=torch.float16)
    blocks, block, heads, dim = kwargs["k_cache"].shape
    if layout == "padded_head_dim":  # a head stride of D + 8: the kernel's plain path cannot read it
        for name in ("k_cache", "v_cache"):
            wide = torch.randn(blocks, block, heads, dim + 8).to(torch.float16)
            wide[..., :dim] = kwargs[name]
            kwargs[name] = wide[..., :dim]
    elif layout == "heads_outermost":  # [Hkv, num_blocks, block_size, D] storage
        for name in ("k_cache", "v_cache"):
            kwargs[name] = kwargs[name].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    elif layout == "different_k_v_strides":
        kwargs["v_cache"] = kwargs["v_cache"].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    else:  # this step's keys as a slice of a fused qkv buffer with padding between heads
        qkv = torch.randn(kwargs["key"].shape[0], heads, 2 * dim).to(torch.float16)
        qkv[..., :dim] = kwargs["key"]
        kwargs["key"] = qkv[..., :dim]
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    with caplog.at_level(logging.WARNING, logger="kernelmux.backends.xpu"):
        spec.SPEC.check_close(*_run(kwargs), kwargs)
        _run(kwargs)  # the same layout again: logged once
    launches = len(vendor["_C"].CALLS)
    per_head = layout != "strided_input"
    assert launches == (2 if not per_head else 4 * heads)
    assert [r.getMessage().split(":")[1] for r in caplog.records] == ([" xpu kv_cache_write"] if per_head else [])


def test_the_plain_path_would_write_v_with_k_strides(vendor):
    # Why caches with different K and V strides are not handed over in one launch.
    kwargs = _small(3)
    # [num_blocks, Hkv, block_size, D] storage: the same block stride as K, other page and head strides.
    kwargs["v_cache"] = kwargs["v_cache"].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert kwargs["v_cache"].stride(0) == kwargs["k_cache"].stride(0)
    ours, theirs = _copies(kwargs), _copies(kwargs)
    torch.ops._C.reshape_and_cache_flash(key=ours["key"], value=ours["value"], key_cache=ours["k_cache"],
                                         value_cache=ours["v_cache"], slot_mapping=ours["slot_mapping"],
                                         kv_cache_dtype="auto", k_scale=torch.ones(1), v_scale=torch.ones(1))
    spec.SPEC.reference(**theirs)
    with pytest.raises(AssertionError, match="v_cache"):
        spec.SPEC.check_close((ours["k_cache"], ours["v_cache"]), (theirs["k_cache"], theirs["v_cache"]), kwargs)


def test_fp8_caches_divide_and_saturate_as_the_spec(vendor):
    kwargs = _small(4, cache_dtype=FP8, tokens=20)
    assert adapter.cache_dtype_name(kwargs["k_cache"]) == "fp8_e4m3"
    spec.SPEC.check_close(*_run(kwargs), kwargs)
    [(_, call)] = vendor["_C"].CALLS
    assert call["kv_cache_dtype"] == "fp8_e4m3"


def test_a_non_unit_head_dim_stride_is_declined():
    kwargs = _small(5)
    wide = torch.zeros(*kwargs["k_cache"].shape[:3], 2 * kwargs["k_cache"].shape[3], dtype=torch.bfloat16)
    reason = ask(adapter.supports, spec.SPEC, {**kwargs, "k_cache": wide[..., ::2], "v_cache": wide[..., 1::2]}, XPU)
    assert "k_cache needs a unit stride along the head dim" in reason
