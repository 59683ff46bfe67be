"""The xpu backend as the engine meets it, with the fake vllm-xpu-kernels installed: registered through its entry
point, selected first on a simulated XPU for every op it serves, explaining every op and case it does
not, and quarantined (the backend, or only the ops that need the failing part) with the installed
version and the reason when the library is missing, outside the tested range, or broken."""

from __future__ import annotations

import pytest

import torch

from kernelmux.backends import _vendor
from kernelmux.backends.xpu import CALLS, DECLINED, TABLE, XPU_KERNELS
from kernelmux.engine import Engine, Settings
from kernelmux.specs import ALL_SPECS
from vendors import sources

SERVED = ("grouped_topk", "fused_moe", "paged_attention", "kv_cache_write", "scaled_mm", "fp4_mm")
GAPS = ("quantize_nvfp4", "selective_state_update", "ssd_scan")
# A spec case per served op that the adapter takes, and one it declines with (part of) its reason.
ACCEPTED = {"grouped_topk": "deepseek_v3_t64", "fused_moe": "small_silu",
            "paged_attention": "llama3_8b_chunked_prefill", "kv_cache_write": "small_fp8_scales",
            "scaled_mm": "small_block", "fp4_mm": "one_token_mxfp4_w4a4"}
DECLINED_CASES = {
    "grouped_topk": ("groups_of_one", "groups of at least 2 experts"),
    "fused_moe": ("small_fp8_block", "fp8_block: XpuFusedMoe's block-fp8 recipe"),
    "paged_attention": ("gemma2_soft_cap", "no logits soft cap"),
    "scaled_mm": ("small_block_fnuz", "float8_e4m3fn operands only"),
    "fp4_mm": ("small_nvfp4_w4a4", "MXFP4 only"),
}


def _fresh(kwargs):
    """kwargs whose tensors the call may write (kv_cache_write's caches) are copies."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _engine(platform="xpu"):
    return Engine(ALL_SPECS, Settings(platform=platform))


def _rejected(engine, op):
    return {impl.backend: reason for impl, reason in engine.tables[op].rejected}


def test_the_table_covers_the_served_ops_the_declined_and_the_gaps():
    rows = {row.op for row in TABLE}
    assert rows == set(SERVED) | set(DECLINED) | set(GAPS)
    assert set(CALLS) == set(SERVED) | set(DECLINED)
    assert all("dry-run only" in row.description for row in TABLE if hasattr(row, "description"))


def test_on_a_simulated_xpu_it_is_selected_first_for_every_op_it_serves(vendor):
    engine = _engine()
    for op in SERVED:
        [first, *_] = engine.tables[op].candidates
        assert first.impl.backend == "xpu", (op, [c.impl.backend for c in engine.tables[op].candidates])
        assert first.impl.description.startswith("vllm-xpu-kernels 0.1.16.2: ")
    triton = [c.impl for c in engine.tables["paged_attention"].candidates if c.impl.backend == "triton"]
    assert triton and triton[0].priority < 25  # above the triton backend's XPU target
    assert engine.distribution("xpu").startswith("kernelmux ")


@pytest.mark.parametrize("op", SERVED)
def test_explain_accepts_a_case_and_says_why_it_declines_another(vendor, op):
    engine = _engine()
    spec = engine.dispatcher(op).table.spec
    answers = engine.explain(op, spec.case(ACCEPTED[op]).build(seed=1))
    assert (answers[0][0].backend, answers[0][1]) == ("xpu", None)
    if op in DECLINED_CASES:
        case, reason = DECLINED_CASES[op]
        answers = {impl.backend: why for impl, why in engine.explain(op, spec.case(case).build(seed=1))}
        assert reason in answers["xpu"]


def test_declined_ops_and_gaps_are_rejected_with_their_reasons(vendor):
    engine = _engine()
    from kernelmux.backends.xpu import quantize_fp8, quantize_mxfp4

    assert _rejected(engine, "quantize_fp8")["xpu"] == quantize_fp8.DECLINED
    assert _rejected(engine, "quantize_mxfp4")["xpu"] == quantize_mxfp4.DECLINED
    for op in GAPS:
        assert _rejected(engine, op)["xpu"].startswith(f"no kernel for {op}: vllm-xpu-kernels 0.1.16.2 has no")


@pytest.mark.parametrize("platform", ["x86_64", "sm_90", "gfx942"])
def test_elsewhere_it_needs_an_xpu(vendor, platform):
    assert "needs a xpu platform" in _rejected(_engine(platform), "paged_attention")["xpu"]


def test_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_vendor, "_problems", {})
    monkeypatch.setattr(type(XPU_KERNELS), "version", lambda self: None)
    assert XPU_KERNELS.problem() == "vllm-xpu-kernels is not installed (pip install 'kernelmux[xpu]')"
    assert "is not installed" in _rejected(_engine(), "grouped_topk")["xpu"]


def _broken(module, raising):
    fake = sources("vllm_xpu_kernels")
    return {**fake, f"vllm_xpu_kernels/{module}.py": f"{raising}\n" + fake[f"vllm_xpu_kernels/{module}.py"]}


@pytest.mark.parametrize("version, files, broken, reason", [
    ("0.1.17", None, SERVED,
     "vllm-xpu-kernels 0.1.17 is outside the tested range >=0.1.16,<0.1.17 (pip install 'kernelmux[xpu]')"),
    ("0.1.16.2", _broken("__init__", "raise RuntimeError('PyTorch XPU is not available')"), SERVED,
     "vllm-xpu-kernels 0.1.16.2: import vllm_xpu_kernels failed: RuntimeError: PyTorch XPU is not available"),
    # A missing libsycl in one extension: only the ops that need it go (the others keep serving).
    ("0.1.16.2", _broken("_moe_C", "raise OSError('libsycl.so.9: cannot open shared object file')"),
     ("grouped_topk", "fused_moe"),
     "vllm-xpu-kernels 0.1.16.2: import vllm_xpu_kernels._moe_C failed: OSError: libsycl.so.9: cannot open"),
    # The package imports without its flash-attention extension (flash_attn_interface catches the
    # ImportError): the probe still names it.
    ("0.1.16.2", _broken("_vllm_fa2_C", "raise ImportError('undefined symbol: _ZN3c104cuda')"), ("paged_attention",),
     "import vllm_xpu_kernels._vllm_fa2_C failed: ImportError: undefined symbol"),
])
def test_a_broken_vendor_is_quarantined_with_its_version_and_reason(install_xpu, version, files, broken, reason):
    install_xpu(version, files)
    engine = _engine()
    for op in SERVED:
        rejected = _rejected(engine, op)
        if op in broken:
            assert reason in rejected["xpu"], op
        else:
            assert "xpu" not in rejected and engine.tables[op].candidates[0].impl.backend == "xpu", op


@pytest.mark.parametrize("module, old, new, op, reason", [
    # A release renaming a schema argument: the op that passes it by keyword is rejected, not misled.
    ("_moe_C", "float routed_scaling_factor, Tensor bias, int scoring_func",
     "float routed_scaling_factor, Tensor correction_bias, int scoring_func", "grouped_topk",
     "torch.ops._moe_C.grouped_topk takes no keyword bias"),
    ("_C", "str kv_cache_dtype, Tensor k_scale, Tensor v_scale", "str kv_cache_dtype, Tensor k_scales, Tensor v_scale",
     "kv_cache_write", "torch.ops._C.reshape_and_cache_flash takes no keyword k_scale"),
    ("_xpu_C", "Tensor? A_scale_, Tensor? B_scale_, Tensor? \"\n                 \"bias_) -> Tensor\", fp8_gemm",
     "Tensor? A_scale, Tensor? B_scale_, Tensor? \"\n                 \"bias_) -> Tensor\", fp8_gemm", "scaled_mm",
     "torch.ops._xpu_C.fp8_gemm takes no keyword A_scale_"),
    # And a Python wrapper renaming a parameter.
    ("flash_attn_interface", "    s_aux: Optional[torch.Tensor] = None,", "    sinks: Optional[torch.Tensor] = None,",
     "paged_attention", "vllm_xpu_kernels.flash_attn_varlen_func takes no keyword s_aux"),
    ("fused_moe_interface", "        n_experts_per_token,\n", "        topk,\n", "fused_moe",
     "XpuFusedMoe takes no keyword n_experts_per_token"),
])
def test_a_renamed_argument_rejects_the_op_that_passes_it(install_xpu, module, old, new, op, reason):
    fake = sources("vllm_xpu_kernels")
    path = f"vllm_xpu_kernels/{module}.py"
    assert old in fake[path]
    install_xpu(files={**fake, path: fake[path].replace(old, new)})
    engine = _engine()
    assert f"vllm-xpu-kernels 0.1.16.2: " in _rejected(engine, op)["xpu"]
    assert reason in _rejected(engine, op)["xpu"]
    others = [o for o in SERVED if o != op]
    assert all(engine.tables[o].candidates[0].impl.backend == "xpu" for o in others)


def test_every_torch_op_is_called_by_keyword(install_xpu):
    # A release registering the ops the adapters call with their arguments reversed changes nothing.
    fake = sources("vllm_xpu_kernels")
    library = fake["vllm_xpu_kernels/_library.py"]
    called = {"grouped_topk", "reshape_and_cache_flash", "fp8_gemm", "fp4_gemm", "dynamic_scaled_fp8_quant",
              "dynamic_per_token_scaled_fp8_quant", "per_token_group_fp8_quant", "per_token_group_quant_mxfp4"}
    reversed_library = library.replace("REVERSED: frozenset = frozenset()", f"REVERSED = frozenset({called!r})")
    assert reversed_library != library
    install_xpu(files={**fake, "vllm_xpu_kernels/_library.py": reversed_library})
    engine = _engine()
    assert all(engine.tables[op].candidates[0].impl.backend == "xpu" for op in SERVED)
    import vllm_xpu_kernels._moe_C  # noqa: F401

    assert torch.ops._moe_C.grouped_topk.default._schema.arguments[0].name == "scoring_func"
    for op in SERVED:
        spec = engine.dispatcher(op).table.spec
        kwargs = spec.case(ACCEPTED[op]).build(seed=2)
        fn = next(c.impl.fn for c in engine.tables[op].candidates if c.impl.backend == "xpu")
        expected = _fresh(kwargs)
        spec.check_close(spec.outputs(fn(**kwargs), kwargs), spec.outputs(spec.reference(**expected), expected),
                         kwargs)
    # The declined quantizers' wiring too (their results differ from the spec's by design).
    from kernelmux.backends.xpu import quantize_fp8, quantize_mxfp4

    x = torch.randn(4, 256)
    for granularity in ("per_tensor", "per_token", "per_group"):
        q, scale = quantize_fp8.quantize_fp8(x, granularity)
        assert q.dtype == torch.float8_e4m3fn and torch.isfinite(scale).all()
    q, codes = quantize_mxfp4.quantize_mxfp4(x)
    assert q.shape == (4, 128) and codes.shape == (4, 8)
