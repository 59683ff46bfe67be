#!/usr/bin/env bash
# Untracked: ablation of the warm start (977e8f7 + a local KERNELMUX_WARM_NO_ROWS guard).
set -o pipefail
export KERNELMUX_COMMIT=${KERNELMUX_COMMIT:?}
python3 -m pip install -q --no-deps --no-build-isolation --no-index . ./tests/plugin_pkg || exit 1
C="--cases llama3_70b_tp8_fp8_decode_b64_ctx4096 llama3_70b_tp8_fp8_decode_b8_ctx32768 --shapes 48:4096:8:1 --no-triton --repeat ${REPEAT:-2}"
for r in $(seq ${ROUNDS:-2}); do
  for v in full norows pdloff; do
    case $v in full) D="--plans auto";; norows) D="--plans auto --defines KERNELMUX_WARM_NO_ROWS";; pdloff) D="--plans auton";; esac
    echo "== $v $r"
    timeout -s KILL 200 python3 perf/diag/cuda_decode_sweep.py --out $OUT/$v$r $C $D 2>&1 | grep -E "copy|cuda "
  done
done
