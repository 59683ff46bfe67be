"""Diagnostic: run every launch config of the Triton grouped_topk kernel on the GPU against the
reference; a crash kills the CUDA context, so a driver restarts a worker process after the config
that crashed.  python perf/diag/sweep_check.py"""

import subprocess
import sys

CONFIGS = [(t, bt, w) for t in (64, 1024, 16384) for bt in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)]


def worker(start: int) -> None:
    import torch

    from kernelmux.backends.triton import grouped_topk as tm
    from kernelmux.specs.grouped_topk import SPEC

    cache = {}
    for index in range(start, len(CONFIGS)):
        tokens, bt, w = CONFIGS[index]
        if tokens not in cache:
            kw = SPEC.case(f"deepseek_v3_t{tokens}").build("cuda", 0)
            cache[tokens] = (kw, SPEC.reference(**kw))
        kw, ref = cache[tokens]
        print(f"START {index}", flush=True)
        with tm.override_launch_config(tm.LaunchConfig(bt, w)):
            out = tm.grouped_topk(**kw)
        torch.cuda.synchronize()
        try:
            SPEC.check_close(out, ref, kw)
            status = "ok"
        except AssertionError as error:
            status = "WRONG " + str(error)[:200]
        print(f"DONE {index} {status}", flush=True)


def main() -> None:
    start, results = 0, {}
    while start < len(CONFIGS):
        proc = subprocess.run([sys.executable, __file__, "--worker", str(start)],
                              capture_output=True, text=True)
        last = None
        for line in proc.stdout.splitlines():
            if line.startswith("START"):
                last = int(line.split()[1])
            elif line.startswith("DONE"):
                _, i, status = line.split(" ", 2)
                results[int(i)] = status
        if proc.returncode == 0:
            break
        if last is None:
            print(proc.stderr[-2000:])
            return
        results[last] = "CRASH " + (proc.stderr.strip().splitlines() or ["?"])[-1][:150]
        start = last + 1
    for i, cfg in enumerate(CONFIGS):
        status = results.get(i, "not run")
        if status != "ok":
            print(cfg, status)
    print(f"{sum(s == 'ok' for s in results.values())} of {len(CONFIGS)} ok")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
