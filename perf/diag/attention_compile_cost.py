"""First-call cost of the triton backend's attention: Triton compiles paged_attention_kernel once
per constexpr set (dtypes, head geometry, cache block size, options, plan), then keeps the binary
in its on-disk cache (~/.triton/cache) for later processes. This times those compilations for
sm_90 without a GPU (Triton's compiler and its bundled ptxas run on any Linux host).

    python perf/diag/attention_compile_cost.py
"""
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelmux.backends.triton import _attention_kernel as K

target = GPUTarget("cuda", 90, 32)
fn = K.paged_attention_kernel


def sig_for(dtype, kdtype):
    """Argument types of paged_attention_kernel for query/cache element types."""
    names = list(fn.arg_names)
    ptr_types = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{kdtype}", "v_ptr": f"*{kdtype}", "out_ptr": f"*{dtype}",
        "lse_ptr": "*fp32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "cu_q_ptr": "*i32",
        "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "sinks_ptr": "*fp32", "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
    }
    sig = {}
    for n in names:
        if n in ptr_types:
            sig[n] = ptr_types[n]
        elif n in ("scale", "soft_cap"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig


def run(label, dtype, kdtype, consts, warps, stages):
    sig = sig_for(dtype, kdtype)
    for c in consts:
        sig[c] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    t = time.time()
    triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    print(f"{label}: {time.time() - t:.2f} s", flush=True)


def main() -> None:
    # The shipped plans (attention._TABLE) for Llama-3-8B decode and prefill and DeepSeek-V3 MLA.
    base = dict(
        NUM_Q_HEADS=32, GROUP=4, HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=128, D_MAIN=128, D_ROPE=0,
        BLOCK_D=128, BLOCK_R=1, BLOCK_SIZE=16, ONE_QUERY_PER_SEQ=True, CAUSAL=True, WINDOW=False,
        SOFT_CAP=False, HAS_SINKS=False, HAS_K_SCALE=False, HAS_V_SCALE=False, V_FROM_K=False,
        RETURN_LSE=False, SPLIT_KV=False, DOT_FP32=False, DOT_FP16=False, PREFETCH_PAGES=False,
    )
    run("decode bf16 (Llama-3-8B)", "bf16", "bf16", base, 4, 2)
    run("prefill bf16", "bf16", "bf16",
        dict(base, BLOCK_M=128, BLOCK_N=128, ONE_QUERY_PER_SEQ=False, PREFETCH_PAGES=True), 8, 3)
    mla = dict(
        base, NUM_Q_HEADS=128, GROUP=128, HEADS_PER_TILE=64, BLOCK_M=64, BLOCK_N=64, D_MAIN=512, D_ROPE=64,
        BLOCK_D=512, BLOCK_R=64, BLOCK_SIZE=64, V_FROM_K=True, RETURN_LSE=True, SPLIT_KV=True,
    )
    run("mla bf16, split", "bf16", "bf16", mla, 8, 2)


if __name__ == "__main__":
    main()
