"""perf/timing.py: how many input sets a timing rotates through, the check before a time, and the
one Method that times a bench run's rows and its ceilings."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kernelmux.perf import timing

L2 = 50 * 2**20


def test_input_bytes_counts_tensor_arguments_only():
    kwargs = {"a": torch.zeros(4, 8, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.float16),
              "n": 7, "name": "x", "none": None}
    assert timing.input_bytes(kwargs) == 4 * 8 * 4 + 3 * 2


@pytest.mark.parametrize("bytes_per_call, cap, count", [
    (L2, 8, 3),            # 3x the L2 in sets of one L2
    (L2 // 2 + 1, 8, 6),   # rounds up
    (4 * L2, 8, 1),        # one set already spans 3x
    (1024, 8, 8),          # small calls: the cap
    (0, 8, 8),
])
def test_rotation_count_spans_three_l2s_up_to_the_cap(bytes_per_call, cap, count):
    assert timing.rotation_count(bytes_per_call, L2, cap) == count


def test_rotated_inputs_builds_the_sets_after_the_first():
    seeds = []

    def build(seed):
        seeds.append(seed)
        return {"x": torch.full((L2 // 4,), float(seed))}  # one L2 a set: three sets

    first = {"x": torch.zeros(L2 // 4)}
    inputs = timing.rotated_inputs(build, L2, cap=8, first=first, seed=10)
    assert inputs[0] is first and seeds == [11, 12] and [float(s["x"][0]) for s in inputs[1:]] == [11.0, 12.0]
    # Without a first set it builds one from the seed; bytes_per_call overrides the count.
    seeds.clear()
    assert len(timing.rotated_inputs(build, L2, cap=8, bytes_per_call=1)) == 8 and seeds == list(range(8))


def test_checked_replay_time_times_only_a_right_answer(monkeypatch):
    timed = []
    monkeypatch.setattr(timing, "graph_replay_time", lambda fn, inputs, **replay: timed.append(replay) or "t")

    def check_close(actual, expected, kwargs):
        assert actual == expected, f"{actual} != {expected} for {kwargs}"

    inputs = [{"x": 2}, {"x": 3}]
    assert timing.checked_replay_time(lambda x: x * 2, inputs, 4, check_close, trials=5) == "t"
    assert timed == [{"trials": 5}]
    with pytest.raises(AssertionError, match="6 != 5"):
        timing.checked_replay_time(lambda x: x * 3, inputs, 5, check_close)
    assert len(timed) == 1


def test_wall_time_stops_at_the_budget_after_its_minimum_calls():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    result = timing.wall_time(slow, reps=50, budget_s=0.01, warmup=0, min_calls=1)
    assert len(calls) == 1 and result.samples == 1 and result.median_us >= 0.02e6
    calls.clear()
    assert timing.wall_time(slow, reps=50, budget_s=0.01, warmup=2).samples == 3 and len(calls) == 5


def test_time_calls_on_cuda_replays_a_graph_unless_told_not_to(monkeypatch):
    # No GPU needed: both CUDA timers are replaced by recorders; what is tested is which one a
    # Method picks and with what counts (the reference's: events, no warm-up, one call at least).
    used = []
    monkeypatch.setattr(timing, "graph_replay_time", lambda fn, inputs, **kw: used.append(("graph", kw)) or "g")
    monkeypatch.setattr(timing, "event_time", lambda fn, inputs, **kw: used.append(("events", kw)) or "e")
    method = timing.Method.for_run("cuda", quick=False, threads=2)
    assert timing.time_calls(method, lambda: None, [{}]) == ("g", "cuda-graph")
    assert used.pop() == ("graph", {"trials": timing.replay_trials(False)})
    no_capture = dataclasses.replace(method, capture=False, warmup=0, min_calls=1)
    assert timing.time_calls(no_capture, lambda: None, [{}]) == ("e", "cuda-events")
    assert used.pop() == ("events", {"reps": 100, "budget_s": 0.5, "flush_l2_bytes": 0, "warmup": 0,
                                     "min_calls": 1})
    flushing = timing.Method.for_run("cuda", quick=True, threads=2, flush_l2_bytes=1 << 20)
    assert timing.time_calls(flushing, lambda: None, [{}]) == ("e", "cuda-events +flush-l2")
    assert used.pop()[1]["flush_l2_bytes"] == 1 << 20 and not used


def test_time_calls_on_a_cpu_pins_the_method_threads(monkeypatch):
    threads = torch.get_num_threads()
    seen = []
    method = timing.Method.for_run("cpu", quick=True, budget_s=0.001, threads=threads)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # as an implementation changing it would
        timing_, timer = timing.time_calls(method, lambda: seen.append(torch.get_num_threads()), [{}])
    finally:
        torch.set_num_threads(threads)
    assert timer == "wall-clock" and set(seen) == {threads} and timing_.samples >= 3
