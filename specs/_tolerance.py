"""The tolerance tables more than one spec uses, each justified once here: a matmul's output
against its accumulation's magnitude, and attention's output. An op's own tables stay in its spec."""

from __future__ import annotations

import torch

from kernelmux.specs._spec import Tolerance

__all__ = ["ATTENTION_OUTPUT", "GEMM_OUTPUT"]

# Matmuls over quantized operands (scaled_mm, fp4_mm, int4_mm): |actual - expected| <= atol * mag +
# rtol * |expected|, where mag[m, n] = sum_k |A_mk| |B_nk| over the dequantized operands (+ |bias_n|)
# is the accumulation's own scale; ``atol`` is relative to mag, so one number holds for every K.
# - atol 2^-12 (every dtype): the dequantized products are exact or nearly so in every sane kernel
#   (fp8 x fp8 and e2m1 x e4m3 products are exact in fp32; a W4A4 kernel's alpha 1/(gs_a gs_b) is
#   ~2^-23 relative from the reference's per-element division). What differs is the summation:
#   another order, split-K, and tensor-core accumulators that keep fewer than 24 bits (FP8 on
#   Hopper ~14 bits, DeepSeek-V3 report 3.3.2; Blackwell's block-scaled MMAs between scale
#   blocks). Promoting to fp32 every 128 K does not keep that under 2^-14 mag: on the H100 three
#   independent kernels that do (cuBLASLt through torch with use_fast_accum=False, DeepGEMM
#   0.1.4's fp8_gemm_nt, FlashInfer 0.6.14's fp8_blockscale_gemm_sm90) put 8-10 of the 7.3M
#   outputs of DeepSeek-V3's 1024 x 7168 x 2048 between 1.4 and 3.8 x 2^-14 mag, and cuBLASLt's
#   per-tensor fp32-output GEMM 30 of 512 at 3.7 x 2^-14; 2^-12 covers them with room. For random
#   data mag / |out| ~ 0.6 sqrt(K): at K = 7168 2^-12 mag is ~1.2% of a typical output, far below
#   an indexing bug, a wrong scale (an e8m0 code off by one doubles a block) or a swapped nibble.
# - rtol: the single output rounding: values that differ by the accumulation error may round one
#   output ulp apart: bf16 1 ulp <= 2^-7 |x|, take 1e-2; fp16 <= 2^-10 |x|, take 2e-3; fp32 output
#   rounding (2^-23) is negligible beside the accumulation term, take 1e-6.
# - int4_mm: A is the int8-quantized activations (W4A8) or a (W4A16), and mag adds 2^-6 recip |zp|
#   sum_k |W| (specs/int4_mm.py ZERO_POINT_WEIGHT): W4A8 kernels sum q * w and subtract zp * sum(w),
#   terms that cancel in fp32. Measured on int4_mm's random, edge and M = 1 model cases, 5 seeds
#   each: torch 2.13's _dyn_quant_matmul_4bit (x86: its reference path), fp32 in and out as the
#   torch backend calls it, is bit-identical to the reference (its own bf16 path truncates its
#   output: one ulp, inside rtol); the KleidiAI formulation emulated in fp32 (q * w per group, zp * row sums apart,
#   groups summed forward and backward) stays within 0.12 of the bound (a bf16 output one ulp
#   away), and needs 2^-25.6 of recip |zp| sum |W| on rows whose only non-zero q - zp meets a zero
#   weight (2^-18 allowed). Bugs land far outside: a W4A16 result for a W4A8 call >= 4.2x the
#   bound, one group's scale doubled >= 5.6x, a weight code off by one >= 19x, the neighbouring
#   group's scales >= 62x, the neighbouring channel's >= 102x, swapped nibbles >= 312x. The real
#   KleidiAI kernels (aarch64) are not measured here.
GEMM_OUTPUT = {
    torch.bfloat16: Tolerance(atol=2.0**-12, rtol=1e-2),
    torch.float16: Tolerance(atol=2.0**-12, rtol=2e-3),
    torch.float32: Tolerance(atol=2.0**-12, rtol=1e-6),
}

# Attention outputs (paged_attention, mla_decode): expected values are the fp32 result rounded once
# to the query dtype (unit roundoff u = 2^-8 bf16, 2^-11 fp16). A conforming kernel differs by (a)
# its own output rounding, up to 1 ulp = 2u relative away from ours, and (b) FlashAttention-style
# P @ V with P rounded to the query dtype: |delta o| <= u * sum_j p_j |v_j|. When attention is
# concentrated that is about u |o| (rtol = 4u covers a + b); when it is spread the per-term errors
# have random signs and shrink like u max|v| / sqrt(n_eff) (atol covers it; max|v| ~ 4.5 for the
# cases' N(0, 1) values). Online-softmax rescaling and another summation order are fp32, far below
# both; so is MLA's 576-wide QK^T (16-bit products are exact in fp32). A soft cap with
# tanh.approx.f32 (rel. error ~2^-11) moves logits by ~cap 2^-11: the soft-cap cases are bf16 with
# cap <= 30. fp8 caches use the same table: dequantization is one fp32 multiply (exact in bf16 for
# power-of-two scales). Kernels that also quantize Q or P to fp8 (FA3's fp8 path, FlashMLA's fp8
# path with a q descale: each score moves by ~2^-4 |s|) do not implement this contract.
ATTENTION_OUTPUT = {
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
}
