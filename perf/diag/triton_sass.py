"""A triton kernel's SASS for a GPU arch, compiled on this machine with no GPU: the instructions up to its
first EXIT (the path every program takes, slow-path subroutines after it; a static count, so the few
instructions of a branch the fast path skips count too), per element when told how many elements a thread
handles, and their opcodes. For issue-bound kernels (quantize_fp8, the fp4 decoders): count what a change
saves before spending device time on it.

Triton's Linux wheel bundles ptxas and cuobjdump. The launch specializes 16-divisible integer arguments and
pointers (vector loads and stores follow from it) and arguments equal to 1 (constexpr): name those as a
launch would see them, or the SASS is another kernel's.

    python perf/diag/triton_sass.py kernelmux.backends.triton._quantize_fp8_kernel:quantize_groups_kernel \\
        --arg x_ptr='*bf16' q_ptr='*u8' scale_ptr='*fp32' cols=i32 group_size=i32 num_groups=i32 stride_xm=i32 \\
              stride_qm=i32 stride_sm=i32 \\
        --const stride_xk=1 stride_sg=1 UE8M0=False NATIVE_FP8=True FNUZ=False GROUPS=8 GROUP_PAD=128 \\
        --div16 x_ptr q_ptr scale_ptr cols group_size stride_xm stride_qm --elements 8 [--warps 4] [--sass F]
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import os
import re
import subprocess
import tempfile

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _pairs(items: list[str], parse) -> dict:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        out[name] = parse(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", help="MODULE:KERNEL, a @triton.jit function")
    parser.add_argument("--arg", nargs="*", default=[], help="NAME=TYPE for each runtime argument (*bf16, i32, ...)")
    parser.add_argument("--const", nargs="*", default=[], help="NAME=VALUE for each constexpr (a Python literal)")
    parser.add_argument("--div16", nargs="*", default=[], help="arguments the launch finds divisible by 16")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an int (90: sm_90)")
    parser.add_argument("--elements", type=int, default=0, help="elements a thread handles: prints per element")
    parser.add_argument("--sass", help="write the SASS listing here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: the interpreter compiles nothing; unset it")

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, _, kernel_name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module_name), kernel_name)
    types, constants = _pairs(args.arg, str), _pairs(args.const, ast.literal_eval)
    missing = [name for name in kernel.arg_names if name not in types and name not in constants]
    if missing:
        raise SystemExit(f"give a type (--arg) or a value (--const) for {missing}")
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in args.div16}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options={"num_warps": args.warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        listing = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    lines = [line for line in listing.splitlines() if _INSTRUCTION.match(line)]
    if args.sass:
        with open(args.sass, "w") as f:
            f.write("\n".join(lines) + "\n")
    opcodes = [_INSTRUCTION.match(line)[1] for line in lines]
    main_path = opcodes[:opcodes.index("EXIT") + 1] if "EXIT" in opcodes else opcodes
    print(f"{args.kernel} for sm_{args.arch}, {args.warps} warps: {len(opcodes)} instructions, "
          f"{len(main_path)} up to the first EXIT")
    if args.elements:
        print(f"  {len(main_path) / args.elements:.1f} per element ({args.elements} a thread) on that path")
    counts = collections.Counter(main_path)
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
