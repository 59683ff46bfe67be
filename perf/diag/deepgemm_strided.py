"""Diagnostic: which condition breaks the deepgemm backend's calls in the conformance kit's strided
check (an H200 at a8915f2: scaled_mm outputs near 1e38, fused_moe NaN rows, on every tensor strided).
Per case it runs the adapter on the plain inputs, then with one tensor strided at a time, then on
plain inputs whose weights and weight scales are fresh copies made just after NaN-filled blocks were
freed (the strided run's allocation pattern without any stride): a stride-only failure points at a
layout the vendor misreads, a fresh-copy failure at a read past a buffer's end.

    python perf/diag/deepgemm_strided.py  (on an sm_90 GPU with sgl-deep-gemm installed; elsewhere it runs
    on the CPU against whatever deep_gemm imports, e.g. the tests' fake on PYTHONPATH=tests/vendors)"""

import torch

from kernelmux.backends.deepgemm import fused_moe as moe_adapter
from kernelmux.backends.deepgemm import scaled_mm as mm_adapter
from kernelmux.conformance import _strided, poison_freed_memory
from kernelmux.specs import fused_moe, scaled_mm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = ((scaled_mm.SPEC, mm_adapter.scaled_mm, ("one_token_block", "small_block"), ("b", "scale_b")),
         (fused_moe.SPEC, moe_adapter.fused_moe, ("small_fp8_block", "top1_weight_on_input_fp8_block"),
          ("w1", "w2", "w1_scale", "w2_scale")))


def verdict(spec, fn, kwargs, expected, plain) -> str:
    try:
        spec.check_close(spec.outputs(fn(**kwargs), kwargs), expected, plain)
        return "ok"
    except Exception as error:  # noqa: BLE001 - the first line of the failure is the finding
        return f"FAIL {str(error).splitlines()[0][:160]}"


def main() -> None:
    for spec, fn, names, weights in CASES:
        for name in names:
            plain = spec.case(name).build(DEVICE, 0)
            expected = spec.outputs(spec.reference(**plain), plain)
            print(f"{spec.name} {name}: plain {verdict(spec, fn, plain, expected, plain)}", flush=True)
            for arg, value in plain.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.numel():
                    one = dict(plain, **{arg: _strided(value)})
                    print(f"  {arg} strided: {verdict(spec, fn, one, expected, plain)}", flush=True)
            every = {k: _strided(v) if isinstance(v, torch.Tensor) and v.dim() and v.numel() else v
                     for k, v in plain.items()}
            print(f"  every tensor strided (the kit): {verdict(spec, fn, every, expected, plain)}", flush=True)
            poison_freed_memory(DEVICE, 1 << 28)
            fresh = dict(plain, **{w: plain[w].clone() for w in weights if plain.get(w) is not None})
            print(f"  fresh weight copies next to NaN: {verdict(spec, fn, fresh, expected, plain)}", flush=True)


if __name__ == "__main__":
    main()
