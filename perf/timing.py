"""Timers (CUDA-graph replay with rotated inputs, CUDA events per call, the wall clock on CPUs) and
``Method``, the one way a bench run times both its rows and the ceilings that judge them."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "Method", "Timing", "checked_replay_time", "default_budget_s", "event_time", "graph_replay_time",
    "input_bytes", "replay_trials", "rotated_inputs", "rotation_count", "time_calls", "wall_time",
]


@dataclass(frozen=True)
class Timing:
    """Per-call microseconds over the trials: median, 20th and 80th percentiles, and how many
    trials (timed calls; graph replays for graph_replay_time) they summarize."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: int


def _summary(per_call_us: list[float]) -> Timing:
    if len(per_call_us) < 2:
        return Timing(per_call_us[0], per_call_us[0], per_call_us[0], len(per_call_us))
    q = statistics.quantiles(per_call_us, n=5, method="inclusive")
    return Timing(statistics.median(per_call_us), q[0], q[3], len(per_call_us))


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


def default_budget_s(quick: bool) -> float:
    """Seconds of timed calls per row (``kernelmux bench --budget``'s default)."""
    return 0.05 if quick else 0.5


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


def sized_replay_time(fn: Callable[..., Any], inputs: Sequence[dict[str, Any]], *, budget_us: float = 200_000,
                      max_calls: int = 32, trials: int = 10) -> float:
    """The median per-call time (us) of graph_replay_time with as many calls per graph as fit ``budget_us``
    by one eager call's time (at least one per input set, at most ``max_calls``): the diag scripts'
    timing of variants whose times differ by 1000x."""
    fn(**inputs[0])
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(**inputs[0])
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) * 1e6
    calls = max(len(inputs), min(max_calls, int(budget_us / max(eager_us, 1.0))))
    return graph_replay_time(fn, inputs, calls_per_graph=calls, trials=trials).median_us


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
    warmup: int = 3,
    min_calls: int = 3,
) -> Timing:
    """Time single calls of ``fn`` (cycling through ``inputs``) with CUDA events, for code a
    graph cannot capture (host syncs, such as the references' ``.tolist()``). The times include
    launch overhead and any host work, as a caller sees it. With ``flush_l2_bytes``, a buffer
    that large is overwritten before every call, outside the timed region. ``warmup`` untimed
    calls, then at least ``min_calls`` and up to ``reps`` while ``budget_s`` lasts."""
    flush = torch.empty(flush_l2_bytes // 4, dtype=torch.float32, device="cuda") if flush_l2_bytes else None
    for i in range(warmup):
        fn(**inputs[i % len(inputs)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call: list[float] = []
    spent = 0.0
    while len(per_call) < min_calls or (len(per_call) < reps and spent < budget_s):
        if flush is not None:
            flush.fill_(len(per_call))
        start.record()
        fn(**inputs[len(per_call) % len(inputs)])
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3)
        spent += per_call[-1] / 1e6
    return _summary(per_call)


def wall_time(fn: Callable[[], Any], *, reps: int = 50, budget_s: float = 1.0, warmup: int = 2,
              min_calls: int = 3) -> Timing:
    """Time single calls with the wall clock (CPU work): ``warmup`` calls, then at least
    ``min_calls`` and up to ``reps`` calls while ``budget_s`` lasts."""
    for _ in range(warmup):
        fn()
    per_call: list[float] = []
    spent = 0.0
    while len(per_call) < min_calls or (len(per_call) < reps and spent < budget_s):
        start = time.perf_counter()
        fn()
        per_call.append((time.perf_counter() - start) * 1e6)
        spent += per_call[-1] / 1e6
    return _summary(per_call)


@dataclass(frozen=True)
class Method:
    """How one bench run times its rows and the ceilings that judge them (perf/ceilings.py takes
    the run's Method too: a ceiling timed another way judges rows by a rate they never had).

    CPU: ``threads`` intra-op threads (set before every timing), ``warmup`` untimed calls, then
    at least ``min_calls`` and up to ``max_calls`` timed by the wall clock while ``budget_s``
    lasts. CUDA: ``trials`` replays of a 32-call graph (``capture``), else, for code a graph
    cannot capture or with ``flush_l2_bytes``, per-call events with the same ``warmup``,
    ``min_calls``, ``max_calls`` and ``budget_s``. The statistic is always the median, with the
    20th and 80th percentiles beside it.
    """

    device: str
    quick: bool
    budget_s: float
    threads: int
    trials: int
    warmup: int
    min_calls: int
    max_calls: int
    capture: bool = True
    flush_l2_bytes: int = 0

    @classmethod
    def for_run(cls, device: str, quick: bool, budget_s: Optional[float] = None, *,
                threads: Optional[int] = None, flush_l2_bytes: int = 0) -> "Method":
        """The bench's method for a run on ``device`` (None: the defaults of ``--quick`` or not,
        and torch's current thread count)."""
        cuda = device == "cuda"
        return cls(
            device=device, quick=quick, budget_s=default_budget_s(quick) if budget_s is None else budget_s,
            threads=torch.get_num_threads() if threads is None else threads, trials=replay_trials(quick),
            # Events warm up on three input sets (compilation, autotuning, allocator growth); the
            # wall clock on two calls.
            warmup=3 if cuda else 2, min_calls=3, max_calls=(20 if quick else 100) if cuda else 200,
            flush_l2_bytes=flush_l2_bytes,
        )

    def describe(self) -> dict[str, Any]:
        """The method as a record (the bench's JSON ``method.timing``)."""
        return {"device": self.device, "threads": self.threads, "budget_s": self.budget_s,
                "warmup": self.warmup, "min_calls": self.min_calls, "max_calls": self.max_calls,
                "graph_replays": self.trials if self.device == "cuda" and self.capture else None,
                "flush_l2_bytes": self.flush_l2_bytes, "statistic": "median, p20, p80"}


def time_calls(method: Method, fn: Callable[..., Any], inputs: Sequence[dict[str, Any]]) -> tuple[Timing, str]:
    """Time ``fn`` on ``inputs`` by ``method``; returns the timing and the timer's name
    (``cuda-graph``, ``cuda-events`` [``+flush-l2``] or ``wall-clock``)."""
    if method.device == "cuda":
        if method.capture and not method.flush_l2_bytes:
            try:
                return graph_replay_time(fn, inputs, trials=method.trials), "cuda-graph"
            except Exception:  # noqa: BLE001 - any capture failure means: time it another way
                torch.cuda.synchronize()
        timing = event_time(fn, inputs, reps=method.max_calls, budget_s=method.budget_s,
                            flush_l2_bytes=method.flush_l2_bytes, warmup=method.warmup,
                            min_calls=method.min_calls)
        return timing, "cuda-events" + (" +flush-l2" if method.flush_l2_bytes else "")
    # Pinned each time: an implementation that changes torch's thread count must not leave the
    # rows after it (or the ceilings) timed with other threads than the rest.
    if torch.get_num_threads() != method.threads:
        torch.set_num_threads(method.threads)
    kwargs = inputs[0]
    return wall_time(lambda: fn(**kwargs), reps=method.max_calls, budget_s=method.budget_s,
                     warmup=method.warmup, min_calls=method.min_calls), "wall-clock"
