"""perf/timing.py: how many input sets a timing rotates through, and the check before a time."""

from __future__ import annotations

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
