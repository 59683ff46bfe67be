"""Issue 31's goal shapes on the GPU, Mamba2-2.7B (Hh 80, P 64, N 128, G 1, bf16 activations):
selective_state_update at B in {1, 8, 64, 256} (fp32 state, a cache of B + 8 slots addressed by index; B 64 with
a bf16 state too) against the copy bandwidth, and ssd_scan on 1 x 8192, 8 x 2048 and 64 x 256 tokens in tokens/s.
Each implementation the engine finds viable is checked against the reference, then timed by CUDA-graph replay (the
references sync, so they are not timed); --ssu-tiles (s: with streaming cache hints) and --scan-tiles time the
triton kernels with other tiles, --profile lists
ssd_scan's kernels' times from the torch profiler.

    python perf/diag/mamba_goals.py --out DIR [--ssu-batches 1 8 64 256] [--scan-batches 1x8192 8x2048 64x256]
        [--ssu-tiles HEADSxBLOCK_PxWARPS[s] ...] [--scan-tiles NAME=VALUE,... ...] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from unittest import mock

import torch

from kernelmux import engine as engines
from kernelmux.backends.triton import selective_state_update as triton_ssu
from kernelmux.backends.triton import ssd_scan as triton_scan
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import sized_replay_time
from kernelmux.specs import selective_state_update, ssd_scan

INPUTS = 2


def _on_cuda(make, seed: int) -> list[dict]:
    """INPUTS calls of a spec maker, drawn on the CPU from seeds ``seed``, ``seed + 1``, ..., moved to the GPU."""
    return [{k: v.to("cuda") if isinstance(v, torch.Tensor) else v
             for k, v in make(torch.device("cpu"), torch.Generator().manual_seed(seed + i)).items()}
            for i in range(INPUTS)]


def _ssu_inputs(batch: int, state_dtype: torch.dtype) -> list[dict]:
    return _on_cuda(selective_state_update._mamba2_2p7b(batch, state_dtype=state_dtype), batch)


def _scan_inputs(seqs: int, length: int) -> list[dict]:
    return _on_cuda(ssd_scan._mamba2_2p7b((length,) * seqs, with_initial_states=False), seqs)


def _time(fn, inputs: list[dict], check) -> float:
    """check(fn, inputs[0]) (AssertionError when wrong), then the graph-replay time of fn over the inputs."""
    check(fn, inputs[0])
    return sized_replay_time(fn, inputs, max_calls=32)


def _check_ssu(fn, kwargs: dict) -> None:
    spec = selective_state_update.SPEC
    reference_kwargs = dict(kwargs, state=kwargs["state"].clone())
    actual_kwargs = dict(kwargs, state=kwargs["state"].clone())
    expected = spec.reference(**reference_kwargs)
    spec.check_close((fn(**actual_kwargs), actual_kwargs["state"]), (expected, reference_kwargs["state"]), kwargs)


def _check_scan(fn, kwargs: dict) -> None:
    ssd_scan.SPEC.check_close(fn(**kwargs), ssd_scan.SPEC.reference(**kwargs), kwargs)


def _profile(fn, kwargs: dict) -> dict[str, float]:
    """us per call of each kernel, over 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    fn(**kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn(**kwargs)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0):
            total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            if total:
                times[event.key[:60]] = round(total / 5, 2)
    return times


def _scan_tiles(text: str) -> triton_scan.Tiles:
    base = triton_scan.tiles_for(256, 64, 128)
    return dataclasses.replace(base, **{k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ssu-batches", nargs="*", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--scan-batches", nargs="*", default=["1x8192", "8x2048", "64x256"])
    parser.add_argument("--ssu-tiles", nargs="*", default=[], metavar="HEADSxBLOCK_PxWARPS")
    parser.add_argument("--scan-tiles", nargs="*", default=[], metavar="NAME=VALUE,...")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps",))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    engine = engines.current()
    rows = []

    def record(row: dict, work) -> None:
        try:
            row.update(work())
        except Exception as error:  # noqa: BLE001 - a failing implementation is a finding
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "mamba_goals.json"), "w") as f:
            json.dump(dict(ceilings=ceilings, rows=rows), f, indent=1)

    spec = selective_state_update.SPEC
    for state_dtype, batches in ((torch.float32, args.ssu_batches), (torch.bfloat16, [64])):
        for batch in batches:
            inputs = _ssu_inputs(batch, state_dtype)
            cost = spec.cost(inputs[0])
            impls = {impl.backend: impl.fn for impl, reason in engine.explain(spec.name, inputs[0])
                     if reason is None and impl.backend != "reference"}
            timed = [(name, fn, None) for name, fn in impls.items()]
            timed += [("triton", impls["triton"], tile) for tile in args.ssu_tiles if "triton" in impls]
            for name, fn, tile in timed:
                def work(fn=fn, tile=tile):
                    with contextlib.ExitStack() as stack:
                        if tile:
                            heads, block_p, warps = (int(v) for v in tile.rstrip("s").split("x"))
                            stack.enter_context(mock.patch.object(
                                triton_ssu, "tile_for", lambda *_: triton_ssu.Tile(heads, block_p, warps)))
                            stack.enter_context(mock.patch.object(triton_ssu, "STREAM_HINTS", tile.endswith("s")))
                        us = _time(fn, inputs, _check_ssu)
                    return dict(us=round(us, 2), copy_pct=round(100 * cost.bytes / (us * 1e-6)
                                                                / (ceilings["memory_gbps"] * 1e9), 1))
                record(dict(op=spec.name, batch=batch, state=str(state_dtype)[6:], impl=name,
                            tiles=tile or "default"), work)

    spec = ssd_scan.SPEC
    for shape in args.scan_batches:
        seqs, length = (int(v) for v in shape.split("x"))
        inputs = _scan_inputs(seqs, length)
        impls = {impl.backend: impl.fn for impl, reason in engine.explain(spec.name, inputs[0])
                 if reason is None and impl.backend != "reference"}
        timed = [(name, fn, None) for name, fn in impls.items()]
        timed += [("triton", impls["triton"], tile) for tile in args.scan_tiles if "triton" in impls]
        for name, fn, tile in timed:
            def work(fn=fn, tile=tile):
                with contextlib.ExitStack() as stack:
                    if tile:
                        tiles = _scan_tiles(tile)
                        stack.enter_context(mock.patch.object(triton_scan, "tiles_for", lambda *_: tiles))
                    us = _time(fn, inputs, _check_scan)
                    result = dict(us=round(us, 2), tokens_per_s=f"{seqs * length / (us * 1e-6):.3g}")
                    if args.profile and name == "triton":
                        result["kernels_us"] = _profile(fn, inputs[0])
                return result
            record(dict(op=spec.name, seqs=seqs, length=length, impl=name, tiles=tile or "default"), work)


if __name__ == "__main__":
    main()
