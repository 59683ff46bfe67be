#!/usr/bin/env bash
# One device call: install kernelmux and the example plugin into the machine's python (no network:
# no build isolation, no dependency resolution), run the whole test suite on the GPU, then the
# grouped_topk benchmark. Outputs go to $OUT (or ./perf-out).
#   bash perf/run_gpu.sh [--sweep]
set -uo pipefail
out=${OUT:-perf-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index . ./tests/plugin_pkg 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
(cd /tmp && python3 -m pytest "$OLDPWD/tests" -q -p no:cacheprovider 2>&1) | tee "$out/pytest.txt" | tail -25
python3 -m kernelmux.perf.grouped_topk_gpu --out "$out" "$@" 2>&1 | tee "$out/bench.txt"
