"""CUDA-graph safety checks shared by the attention backends' tests: capture a call, refill its
inputs with new draws and lengths, poison the captured output, replay, compare with the
reference."""

from __future__ import annotations

import torch


def build(make, seed: int, device: str) -> dict:
    """A spec maker's kwargs drawn on the CPU with ``seed``, moved to ``device``."""
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def capture(fn, kwargs):
    """(graph, result) of ``fn(**kwargs)`` captured after two warm-up calls on a side stream
    (compilation and module loads happen outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(**kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn(**kwargs)
    return graph, result


def replay_on_new_inputs(spec_module, make, static: dict, graph, result, batch: int, max_len: int,
                         min_len: int = 1) -> None:
    """Refill the captured inputs with fresh draws and new lengths (min_len .. max_len: a new
    block table, queries and caches of the same shapes), poison the captured ``result``, replay,
    and check it against the spec's reference."""
    for seed in (1, 2):
        fresh = build(make, seed, "cuda")
        lens = torch.randint(min_len, max_len + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        fresh["seq_lens"] = lens.to(torch.int32).to("cuda")
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        for out in result if isinstance(result, tuple) else (result,):
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        spec_module.SPEC.check_close(result, spec_module.SPEC.reference(**static), static)
