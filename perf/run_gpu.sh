#!/usr/bin/env bash
# The GPU suite, for one device call per group of steps. Installs kernelmux from a copy of the tree
# into the machine's python (no network: no build isolation, no dependency resolution), then runs
# the named steps, writing to $OUT (default: a new folder under /tmp) and nothing into the tree.
# Record a bench here afterwards: kernelmux bench --load $OUT/bench.json --record (perf/README.md).
#   tests-core   pytest on everything but the slow tests below         -> pytest_core.txt
#   tests-slow   opcheck/compile tests and Triton launch configs
#                (tests/test_torch_integration.py, tests/backends/triton) -> pytest_slow.txt
#   bench        kernelmux bench over every op's model cases, or $BENCH_OPS's ($BENCH_BUDGET s per row if set,
#                $BENCH_TIMEOUT s in all, default 300; no case started after 3/4 of it) -> bench.json, bench.md,
#                bench.log. The full bench outgrew one call (124 cases took ~580 s on the H200 at 0.25 s a row):
#                run it in parts by $BENCH_OPS, one call each, and merge them where you record:
#                kernelmux bench --load part1.json --load part2.json --record
#   tune         the tuning table of the bench before it, into the user's tables -> tuning.json
#   bench-attention  the same for paged_attention, mla_decode and kv_cache_write only (0.25 s
#                budget per row)                                     -> bench.json, bench.md, bench.log
#   kit          kernelmux check --backend B --max-mib 256 --verbose [$KIT_OPS] for each B in $KIT_BACKENDS
#                (default: triton cuda flashinfer deepgemm torch), $KIT_TIMEOUT s each (default 240); every
#                finding is printed as found, so a run cut off by the timeout still says how far it got
#                                                                    -> check_<backend>.txt
#   warm-start   kernelmux warmup --quick, then kernelmux info (what is cached, what a first call compiles)
#                                                                     -> warmup.txt, info.txt
#   compare      perf/diag/compare_demo.py on triton grouped_topk     -> compare.txt, compare_demo_*.json
#   sweep        grouped_topk launch-configuration sweep              -> grouped_topk_gpu.{json,md}
#   tests-attention  the triton and cuda backends' tests and conformance for paged_attention,
#                mla_decode and kv_cache_write (selected by -k, so renamed files stay in)
#                                                                     -> pytest_attention.txt
#   tests-vendor  conformance of the vendor backends (flashinfer, deepgemm, torch) and their own tests,
#                selected by -k "$VENDOR_K" (default: those three names), $VENDOR_TIMEOUT s (default 540);
#                the first calls JIT-compile the vendors' kernels    -> pytest_vendor.txt
#   jit-vendor-moe  starts the build of FlashInfer's sm_90 CUTLASS MoE module (15-25 min) in a process of its
#                own session that outlives the call; jit-vendor-moe-wait waits up to $MOE_WAIT_S s (500) for it
#                (in a later call on the same warm machine)                 -> flashinfer_moe_jit.log
#   warm-vendor  one bench case per vendor JIT module the bench needs, all at once (parallel nvcc), so a
#                bench after it in the same call finds them compiled     -> warm_vendor.log
#   profile-attention  Nsight Compute over one call per case of perf/diag/attention_profile.py
#                ($PROFILE_CASES, default its list): speed of light, occupancy, warp states,
#                memory and compute workload, launch stats      -> attention_profile.txt
#   sweep-attention  perf/diag/attention_sweep.py over $SWEEP_KINDS (decode prefill mla) and
#                $SWEEP_CASES (default all), starting no case after $SWEEP_BUDGET_S seconds;
#                $SWEEP_PLANS (BMxBNxWxS[p][:SPLITS] ...; p: table prefetch) replaces the plan lists
#                                                                     -> attention_sweep_*.json, .txt
#   hotspots-attention  Nsight Compute's stall samples per SASS instruction of the attention kernel
#                on $HOTSPOT_CASE (default the 70B TP8 fp8 decode), $HOTSPOT_PLAN (BMxBNxWxS[p][:SPLITS])
#                instead of the table's plan if set                   -> hotspots.txt, hotspots_sass.csv
#   timeline-attention  perf/diag/attention_timeline.py over $TIMELINE_CASES (default its list) with
#                $TIMELINE_BACKEND (triton or cuda; default triton): kernel durations and idle gaps per call
#                in CUDA-graph replay                                -> attention_timeline.json
#   sweep-cuda-decode  perf/diag/cuda_decode_sweep.py: the cuda backend's fp8 decode plans (splits
#                $CUDA_SWEEP_SPLITS, read-ahead, 8 warps) and the triton kernel -> cuda_decode_sweep.{json,txt}
#   ablation-cuda-mla  perf/diag/cuda_mla_ablation.py: the cuda backend's Hopper MLA kernel as built and with
#                its score MMAs, value MMAs or loads left out, over $ABLATION_CASES -> cuda_mla_ablation.json
#   sweep-cuda-prefill  perf/diag/cuda_prefill_sweep.py: the cuda backend's Hopper prefill plans (stages,
#                overlap), the triton kernel and dense SDPA on the prefill cases -> cuda_prefill_sweep.json
#   trace-cuda-decode  perf/diag/cuda_decode_trace.py: per-CTA %globaltimer marks of the cuda fp8 decode
#                kernel over $TRACE_CASES (default its list), $TRACE_SPLITS splits if set
#                                                                     -> cuda_decode_trace.{json,txt}
# A device command may run 10 minutes: tests-core + bench fit one call, tests-slow + compare
# another. Set KERNELMUX_COMMIT (the tree travels without .git).
#   bash perf/run_gpu.sh tests-core bench
# Vendor backends: wheels in .whl/ (ignored by git; the device tool's `carry`), e.g. flashinfer-python
# 0.6.14 and apache-tvm-ffi 0.1.11 for cp312 (perf/README.md), are installed to /tmp/site first and put
# on PYTHONPATH, with their JIT caches under /tmp; without .whl/ the vendor backends say "not installed".
set -uo pipefail
out=${OUT:-$(mktemp -d /tmp/kernelmux-perf.XXXXXX)}
mkdir -p "$out"
echo "outputs in $out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
repo=$(pwd)
if compgen -G "$repo/.whl/*.whl" > /dev/null; then
    # Installed once per machine: a reinstall gives FlashInfer's headers new mtimes and ninja then rebuilds its JIT
    # modules in the next call (the prefill module alone took 75 s), so a warm machine keeps the first install.
    stamp=$(cd "$repo/.whl" && sha1sum ./*.whl | sha1sum | cut -c1-16)
    if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$repo"/.whl/*.whl || exit 1
        echo "$stamp" > /tmp/site/.wheels
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer
fi
# pip builds in the source folder (build/, *.egg-info): build from a copy so the tree stays as it came.
src=$(mktemp -d /tmp/kernelmux-src.XXXXXX)
cp -a "$repo/." "$src/"
python3 -m pip install -q --no-deps --no-build-isolation --no-index "$src" 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
slow=(tests/test_torch_integration.py tests/backends/triton)
for step in "$@"; do
    echo "== $step ($(date -u +%T))"
    case "$step" in
    tests-core)
        # Eight workers, as tests-attention: run one at a time, these two took over 420 s each on
        # the H100 (5ef64b7); on eight, tests-core 383-430 s (d132626, 559f2f3), hence 540. The
        # GB-sized cases keep to one worker (their xdist group).
        (cd /tmp && timeout 540 python3 -m pytest "$repo/tests" -q -n 8 --dist loadgroup -p no:cacheprovider -rfE \
            --durations=15 "${slow[@]/#/--ignore=$repo/}" 2>&1) | tee "$out/pytest_core.txt" | tail -25 ;;
    tests-slow)
        (cd /tmp && timeout 420 python3 -m pytest "${slow[@]/#/$repo/}" -q -n 8 --dist loadgroup -p no:cacheprovider \
            -rfE --durations=15 2>&1) | tee "$out/pytest_slow.txt" | tail -25 ;;
    bench)
        # The deadline (3/4 of the timeout) starts no case late, so the run is written, cut short or not.
        timeout "${BENCH_TIMEOUT:-300}" python3 -m kernelmux bench ${BENCH_OPS:-} \
            ${BENCH_BUDGET:+--budget $BENCH_BUDGET} --deadline $(( ${BENCH_TIMEOUT:-300} * 3 / 4 )) \
            --json "$out/bench.json" --md "$out/bench.md" 2> "$out/bench.log" | tail -5 ;;
    tune)
        # The tuning table of this call's bench, into the user's tables (so a later bench on this machine
        # orders by it) and $out/tuning.json (for kernelmux tune --load or --ship here).
        python3 -m kernelmux tune --load "$out/bench.json" --out "$out/tuning.json" 2>&1 | tail -3
        mkdir -p "${KERNELMUX_CACHE_DIR:-$HOME/.cache/kernelmux}/tuning"
        cp "$out/tuning.json" "${KERNELMUX_CACHE_DIR:-$HOME/.cache/kernelmux}/tuning/" ;;
    bench-attention)
        timeout 400 python3 -m kernelmux bench paged_attention mla_decode kv_cache_write --budget 0.25 \
            --json "$out/bench.json" --md "$out/bench.md" 2> "$out/bench.log" | tail -5 ;;
    kit)
        for backend in ${KIT_BACKENDS:-triton cuda flashinfer deepgemm torch}; do
            (cd /tmp && timeout "${KIT_TIMEOUT:-240}" python3 -m kernelmux check --backend "$backend" --max-mib 256 --verbose ${KIT_OPS:-} 2>&1) \
                > "$out/check_$backend.txt"
            rc=$?
            echo "$backend: exit $rc ($(grep -c '^pass' "$out/check_$backend.txt") passed, $(grep -c '^fail' "$out/check_$backend.txt") failed): $(tail -1 "$out/check_$backend.txt")"
        done ;;
    warm-start)
        (cd /tmp && timeout 300 python3 -m kernelmux warmup --quick 2>&1) > "$out/warmup.txt"; tail -1 "$out/warmup.txt"
        (cd /tmp && python3 -m kernelmux info 2>&1) > "$out/info.txt"; grep -A30 "warm start" "$out/info.txt" | head -40 ;;
    compare)
        timeout 200 python3 perf/diag/compare_demo.py --backend triton --delay-us 2 --out "$out" 2>&1 \
            | tee "$out/compare.txt" | tail -8 ;;
    sweep)
        python3 -m kernelmux.perf.grouped_topk_gpu --out "$out" --sweep 2>&1 | tail -5 ;;
    tests-attention)
        # Eight workers: the time goes to Triton compilations (one per constexpr set), on the CPU;
        # the GB-sized conformance cases run in one of them (their xdist group), one at a time.
        # -v names every test as it finishes, so a run cut off by the timeout still says which failed.
        (cd /tmp && timeout 400 python3 -m pytest "$repo/tests/backends/triton" "$repo/tests/backends/cuda" \
            "$repo/tests/backends/test_conformance.py" \
            -k "attention or mla or kv_cache" -n 8 --dist loadgroup -v -p no:cacheprovider -rfE --durations=10 2>&1) \
            > "$out/pytest_attention.txt"; grep -E "FAILED|ERROR|passed|failed" "$out/pytest_attention.txt" | tail -40 ;;
    tests-vendor)
        vendor_tests=()
        for path in tests/backends/test_conformance.py tests/backends/{flashinfer,deepgemm,torch}; do
            [ -e "$repo/$path" ] && vendor_tests+=("$repo/$path")
        done
        (cd /tmp && timeout "${VENDOR_TIMEOUT:-540}" python3 -m pytest "${vendor_tests[@]}" \
            -k "${VENDOR_K:-flashinfer or deepgemm or torch}" -n 8 --dist loadgroup -v -p no:cacheprovider -rfE \
            --durations=15 2>&1) > "$out/pytest_vendor.txt"; grep -E "FAILED|ERROR|passed|failed" "$out/pytest_vendor.txt" | tail -60 ;;
    jit-vendor-moe)
        # FlashInfer's CUTLASS MoE module for sm_90 is ~180 CUTLASS sources (15-25 min on 16 cores), longer
        # than one device call: built by a process in its own session, which outlives this call (the
        # machine stays while calls follow each other within 30 s). jit-vendor-moe-wait waits for it.
        (cd /tmp && setsid nohup env MAX_JOBS=16 python3 -c "import time; t = time.time(); \
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module; get_cutlass_fused_moe_module('90'); \
print(f'built in {time.time() - t:.0f} s')" > /tmp/flashinfer_moe_jit.log 2>&1 < /dev/null &)
        echo "building FlashInfer's sm_90 CUTLASS MoE in the background: /tmp/flashinfer_moe_jit.log" ;;
    jit-vendor-moe-wait)
        waited=0
        until grep -qE "built in|Error" /tmp/flashinfer_moe_jit.log 2>/dev/null || [ "$waited" -ge "${MOE_WAIT_S:-500}" ]; do
            sleep 10; waited=$((waited + 10))
        done
        cp /tmp/flashinfer_moe_jit.log "$out/" 2>/dev/null; tail -3 /tmp/flashinfer_moe_jit.log ;;
    warm-vendor)
        start=$SECONDS
        for op_case in "paged_attention llama3_8b_prefill_t1024" "paged_attention gemma2_soft_cap" \
                "paged_attention llama3_8b_decode_b8_ctx4096" "paged_attention llama3_70b_tp8_decode_b8_ctx4096" \
                "paged_attention gpt_oss_120b_tp8_window_sinks_decode" "mla_decode deepseek_v3_h128_decode_b1_ctx512" \
                "mla_decode deepseek_v3_h16_decode_b1_ctx512" "scaled_mm deepseek_v3_m1_n7168_k2048" \
                "selective_state_update mamba2_2.7b_b1" "selective_state_update mamba2_2.7b_b8_bf16_state" \
                "grouped_topk deepseek_v3_t64"; do
            read -r op case <<< "$op_case"
            # 450 s: at 300 the two FlashInfer prefill builds, among eleven at once, were cut off (then 180 s
            # in the bench after it, ab86f22).
            timeout 450 python3 -m kernelmux bench "$op" --case "$case" --backend flashinfer --backend deepgemm \
                --budget 0.01 > /dev/null 2>> "$out/warm_vendor.log" &
        done
        wait; echo "warm-vendor: $((SECONDS - start)) s"; grep -h "took" "$out/warm_vendor.log" | sort -u ;;
    profile-attention)
        timeout 400 ncu --profile-from-start off --clock-control none --nvtx --print-nvtx-rename kernel \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
            --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor_op_.*cycles_active\.avg\.pct_of_peak_sustained_active" \
            python3 perf/diag/attention_profile.py ${PROFILE_CASES:+--cases $PROFILE_CASES} \
            > "$out/attention_profile.txt" 2>&1; tail -5 "$out/attention_profile.txt" ;;
    sweep-attention)
        kinds=${SWEEP_KINDS:-decode prefill mla}
        python3 perf/diag/attention_sweep.py --out "$out" --kinds $kinds --budget-s "${SWEEP_BUDGET_S:-400}" \
            --cases ${SWEEP_CASES:-} --plans ${SWEEP_PLANS:-} 2>&1 \
            | tee "$out/attention_sweep_${kinds// /_}.txt" ;;
    hotspots-attention)
        # One case ($HOTSPOT_CASE), the attention kernel only: stall samples per SASS instruction.
        timeout 300 ncu --profile-from-start off --clock-control none --section SourceCounters \
            -k regex:paged_attention_kernel -f -o "$out/hotspots" \
            python3 perf/diag/attention_profile.py --cases "${HOTSPOT_CASE:-llama3_70b_tp8_fp8_decode_b64_ctx4096}" \
            ${HOTSPOT_PLAN:+--plan $HOTSPOT_PLAN} \
            > "$out/hotspots_ncu.log" 2>&1
        ncu -i "$out/hotspots.ncu-rep" --page source --print-source sass --csv > "$out/hotspots_sass.csv" 2>&1
        { echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); commit ${KERNELMUX_COMMIT:-unknown};" \
               "case ${HOTSPOT_CASE:-llama3_70b_tp8_fp8_decode_b64_ctx4096}, plan ${HOTSPOT_PLAN:-from the table}"
          python3 perf/diag/sass_hotspots.py "$out/hotspots_sass.csv" 2>&1; } | tee "$out/hotspots.txt" | head -45 ;;
    sweep-cuda-decode)
        timeout 300 python3 perf/diag/cuda_decode_sweep.py --out "$out" --splits ${CUDA_SWEEP_SPLITS:-4 8 16 32 64} 2>&1 \
            | tee "$out/cuda_decode_sweep.txt" ;;
    sweep-cuda-prefill)
        timeout 300 python3 perf/diag/cuda_prefill_sweep.py --out "$out" 2>&1 | tee "$out/cuda_prefill_sweep.txt" ;;
    trace-cuda-decode)
        timeout 200 python3 perf/diag/cuda_decode_trace.py --out "$out" ${TRACE_CASES:+--cases $TRACE_CASES} \
            ${TRACE_SPLITS:+--splits $TRACE_SPLITS} 2>&1 | tee "$out/cuda_decode_trace.log" | tail -60 ;;
    ablation-cuda-mla)
        timeout 300 python3 perf/diag/cuda_mla_ablation.py --out "$out" ${ABLATION_CASES:+--cases $ABLATION_CASES} 2>&1 \
            | tee "$out/cuda_mla_ablation.txt" | tail -20 ;;
    timeline-attention)
        timeout 300 python3 perf/diag/attention_timeline.py --out "$out" ${TIMELINE_CASES:+--cases $TIMELINE_CASES} \
            --backend "${TIMELINE_BACKEND:-triton}" 2>&1 \
            | tee "$out/attention_timeline.txt" | tail -12 ;;
    *)
        echo "unknown step $step" >&2; exit 2 ;;
    esac
done
