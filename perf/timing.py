"""Timers: CUDA-graph replay with rotated inputs, CUDA events per call (optionally flushing the
L2 between calls) for code a graph cannot capture, and the wall clock on CPUs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "Timing", "checked_replay_time", "event_time", "graph_replay_time", "input_bytes", "replay_trials",
    "rotated_inputs", "rotation_count", "wall_time",
]


@dataclass(frozen=True)
class Timing:
    """Per-call microseconds over the trials: median, 20th and 80th percentiles."""

    median_us: float
    p20_us: float
    p80_us: float


def _summary(per_call_us: list[float]) -> Timing:
    if len(per_call_us) < 2:
        return Timing(per_call_us[0], per_call_us[0], per_call_us[0])
    q = statistics.quantiles(per_call_us, n=5, method="inclusive")
    return Timing(statistics.median(per_call_us), q[0], q[3])


def rotation_count(bytes_per_call: int, l2_bytes: int, cap: int) -> int:
    """Input sets to rotate through so one graph's inputs span 3x the L2 (each call then reads
    from device memory, not from the cache the previous call filled), at most ``cap``."""
    return max(1, min(cap, -(-3 * l2_bytes // max(bytes_per_call, 1))))


def input_bytes(kwargs: dict[str, Any]) -> int:
    """Bytes held by the tensors among a call's arguments."""
    return sum(v.numel() * v.element_size() for v in kwargs.values() if isinstance(v, torch.Tensor))


def rotated_inputs(build: Callable[[int], dict[str, Any]], l2_bytes: int, cap: int, *,
                   first: Optional[dict[str, Any]] = None, bytes_per_call: Optional[int] = None,
                   seed: int = 0) -> list[dict[str, Any]]:
    """The input sets a timing cycles through: ``first`` (else ``build(seed)``), then ``build(seed + 1)``,
    ... up to rotation_count's number for ``bytes_per_call`` (else the first set's input_bytes)."""
    first = build(seed) if first is None else first
    count = rotation_count(input_bytes(first) if bytes_per_call is None else bytes_per_call, l2_bytes, cap)
    return [first] + [build(seed + i) for i in range(1, count)]


def replay_trials(quick: bool) -> int:
    """Graph replays per timing for the bench's rows and for the ceilings that judge them (one
    load for both: perf/ceilings.py)."""
    return 10 if quick else 30


def graph_replay_time(
    fn: Callable[..., Any],
    inputs: Sequence[dict[str, Any]],
    *,
    calls_per_graph: int = 32,
    trials: int = 30,
) -> Timing:
    """Capture ``calls_per_graph`` calls of ``fn`` (cycling through ``inputs``) in one CUDA graph,
    replay it ``trials`` times timed by CUDA events, and report per-call times. Graph replay
    removes Python and launch overhead, as a serving engine's decode graphs do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for kwargs in inputs[:3]:  # warm-up: compilation, autotuning, allocator growth
            fn(**kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fn(**inputs[i % len(inputs)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    del graph
    return _summary(per_call)


def checked_replay_time(fn: Callable[..., Any], inputs: Sequence[dict[str, Any]], expected: Any,
                        check_close: Callable[[Any, Any, dict[str, Any]], None], **replay: int) -> Timing:
    """``check_close(fn(**inputs[0]), expected, inputs[0])`` (a spec's: AssertionError when wrong),
    then graph_replay_time(fn, inputs, **replay): the sweeps' order, so no wrong variant gets a time."""
    check_close(fn(**inputs[0]), expected, inputs[0])
    return graph_replay_time(fn, inputs, **replay)


def event_time(
    fn: Callable[..., Any],
    inputs: Sequence[dict[str, Any]],
    *,
    reps: int = 50,
    budget_s: float = 1.0,
    flush_l2_bytes: int = 0,
) -> Timing:
    """Time single calls of ``fn`` (cycling through ``inputs``) with CUDA events, for code a
    graph cannot capture (host syncs, such as the references' ``.tolist()``). The times include
    launch overhead and any host work, as a caller sees it. With ``flush_l2_bytes``, a buffer
    that large is overwritten before every call, outside the timed region."""
    flush = torch.empty(flush_l2_bytes // 4, dtype=torch.float32, device="cuda") if flush_l2_bytes else None
    for kwargs in inputs[:3]:
        fn(**kwargs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call: list[float] = []
    spent = 0.0
    while len(per_call) < 3 or (len(per_call) < reps and spent < budget_s):
        if flush is not None:
            flush.fill_(len(per_call))
        start.record()
        fn(**inputs[len(per_call) % len(inputs)])
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3)
        spent += per_call[-1] / 1e6
    return _summary(per_call)


def wall_time(fn: Callable[[], Any], *, reps: int = 50, budget_s: float = 1.0, warmup: int = 2) -> Timing:
    """Time single calls with the wall clock (CPU work): ``warmup`` calls, then at least 3 and up
    to ``reps`` calls while ``budget_s`` lasts."""
    for _ in range(warmup):
        fn()
    per_call: list[float] = []
    spent = 0.0
    while len(per_call) < 3 or (len(per_call) < reps and spent < budget_s):
        start = time.perf_counter()
        fn()
        per_call.append((time.perf_counter() - start) * 1e6)
        spent += per_call[-1] / 1e6
    return _summary(per_call)
