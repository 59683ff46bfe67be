"""perf/dispatch_overhead.py's every-op measurement: each op dispatched to a no-op of its signature,
with each fingerprint there is, against calling it directly."""

from __future__ import annotations

from kernelmux.engine import fingerprint
from kernelmux.perf import dispatch_overhead
from kernelmux.specs import ALL_SPECS


def test_every_op_is_measured_with_the_fingerprints_there_are(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_loaded", None)
    monkeypatch.setattr(fingerprint, "build_native", lambda log: fingerprint.native_state()[1])  # none built
    results = dispatch_overhead.measure_ops(calls=3, repeats=2)
    assert "kernelmux warmup builds it" in results["native_state"]
    assert list(results["ops"]) == [spec.name for spec in ALL_SPECS]
    for op, row in results["ops"].items():
        assert set(row["median_us"]) == {"python fingerprint", "direct"}, op
        assert row["tensors"] >= 1 and row["median_us"]["python fingerprint"] > 0
