"""Per-call dispatch overhead on the CPU: ``kernelmux.ops.<op>`` against calling the chosen
implementation directly and against calling the function ``kernelmux.resolve`` returned (once),
plus what one ``resolve()`` call costs; and what checked mode (``KERNELMUX_CHECK=1``) adds to a
paged_attention decode call on the machine's device.

    python -m kernelmux.perf.dispatch_overhead [--json FILE]

Three dispatch measurements, all with tuning tables on: every op through a no-op implementation of
its signature on its first quick model case, with the Python and the native call fingerprint
(engine/fingerprint.py, built first if it is not); grouped_topk with a no-op implementation (the
overhead alone) and with the real chosen implementation on a DeepSeek-V3 decode step (T = 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from kernelmux import ops
from kernelmux.engine import configure, current, fingerprint, reset, resolve
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC
from kernelmux.registry import Implementation, hookimpl


class _NoopEveryOp:
    """A no-op implementation of every op, with the spec's signature: dispatch alone is timed."""

    @hookimpl
    def kernelmux_implementations(self):
        impls = []
        for spec in ALL_SPECS:
            def noop(*args: Any, **kwargs: Any) -> None:
                return None

            noop.__signature__ = spec.signature
            impls.append(Implementation(op=spec.name, backend="noop", fn=noop, spec_version=spec.version,
                                        priority=1_000_000))
        return impls


def measure_ops(calls: int, repeats: int) -> dict[str, Any]:
    """Per op, the median time a no-op call takes through ``kernelmux.ops`` with each fingerprint,
    and called directly; positional arguments, as an integration's layer code calls."""
    state = fingerprint.build_native(lambda line: print(line, file=sys.stderr))
    engines = {}
    built = fingerprint.native_state()[0] is not None
    for name in ("python", "native") if built else ("python",):
        engines[name] = configure(plugins={"noop": _NoopEveryOp()}, prefer={"*": ["noop"]}, tuning=True,
                                  native_fingerprint=name == "native", from_env=False)
    results: dict[str, Any] = {"native_state": state, "ops": {}}
    for spec in ALL_SPECS:
        case = (spec.model_cases(True, "cpu") or spec.cases)[0]
        kwargs = case.build()
        positional = tuple(kwargs[name] for name in spec.signature.parameters)
        impl = engines["python"].registry.implementations[(spec.name, "noop")]
        per_engine = {name: engine.dispatchers[spec.name] for name, engine in engines.items()}
        for dispatcher in per_engine.values():
            dispatcher(*positional)  # selected once, outside the timing
        variants = {f"{name} fingerprint": (lambda d=d: d(*positional)) for name, d in per_engine.items()}
        variants["direct"] = lambda: impl.fn(*positional)
        medians = _interleaved(variants, calls, repeats)
        tensors = sum(isinstance(v, torch.Tensor) for v in positional)
        results["ops"][spec.name] = {
            "case": case.name, "arguments": len(positional), "tensors": tensors, "median_us": medians,
            "added_us": {name: medians[f"{name} fingerprint"] - medians["direct"] for name in per_engine},
        }
    reset()
    return results


def _interleaved(variants: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each variant. The variants are interleaved, rotating which goes
    first, so drift in machine load and whatever the first block of a round pays (seen: ~10 us a
    call) hit all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name] += _per_call_ns(variants[name], calls, 1)
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def _per_call_ns(fn: Callable[[], Any], calls: int, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls)
    return samples


def measure(calls: int, repeats: int) -> dict[str, Any]:
    args = SPEC.case("deepseek_v3_t1").build()
    positional = tuple(args[name] for name in SPEC.signature.parameters)
    results = {}
    for label, plugins in (("noop", {"noop": _NoopEveryOp()}), ("chosen", None)):
        # Tuning tables on, as a server runs: the noop is preferred by name, as a table would rank an
        # implementation it never measured after the ones it did.
        engine = configure(plugins=plugins, prefer={"grouped_topk": ["noop"]} if plugins else None, tuning=True,
                           from_env=False)
        tables = list(engine.tuning.sources)
        resolved = resolve("grouped_topk", *positional)
        # What dispatch chose for these (CPU) tensors: on a GPU host, not the triton backend that
        # startup ranks first.
        (decision,) = engine.dispatchers["grouped_topk"].decisions.values()
        impl = engine.registry.implementations[("grouped_topk", decision.backend)]
        op = ops.grouped_topk
        variants = {
            "kernelmux.ops": lambda: op(*positional),
            "direct": lambda: impl.fn(*positional),
            "resolved": lambda: resolved(*positional),
            "resolve() itself": lambda: resolve("grouped_topk", *positional),
        }
        medians = _interleaved(variants, calls, repeats)
        results[label] = {
            "backend": impl.backend,
            "tuning_tables": tables,
            "resolved_is_chosen": resolved is impl.fn,
            "median_us": medians,
            "added_us_ops_vs_direct": medians["kernelmux.ops"] - medians["direct"],
            "added_us_resolved_vs_direct": medians["resolved"] - medians["direct"],
        }
    reset()
    return results


# A Llama-3-70B TP8 decode step, B 8 x 4096: the checked mode's device pass reads its 8 x 258
# block-table entries, offsets and lengths.
CHECKED_CASE = "llama3_70b_tp8_decode_b8_ctx4096"


def measure_checked(calls: int, repeats: int) -> dict[str, Any]:
    """paged_attention on the machine's device with checked mode off and on: median time per
    call, each call followed by a device synchronization (checked mode syncs inside every call;
    without the trailing one, the unchecked calls would only be queued)."""
    from kernelmux.specs import paged_attention as paged_spec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = paged_spec.SPEC.case(CHECKED_CASE).build(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {"unchecked": [], "checked": []}
    engines = {name: configure(check=name == "checked", from_env=False) for name in samples}
    for name, engine in engines.items():
        engine.dispatchers["paged_attention"](**kwargs)  # compile and select outside the timing
    sync()
    for round_index in range(repeats):
        for name in (("unchecked", "checked") if round_index % 2 == 0 else ("checked", "unchecked")):
            dispatcher = engines[name].dispatchers["paged_attention"]

            def call() -> None:
                dispatcher(**kwargs)
                sync()

            samples[name] += _per_call_ns(call, calls, 1)
    reset()
    medians = {name: statistics.median(s) / 1e3 for name, s in samples.items()}
    backend = engines["unchecked"].dispatchers["paged_attention"].decisions.popitem()[1].backend
    return {"device": device, "case": CHECKED_CASE, "backend": backend, "median_us": medians,
            "added_us": medians["checked"] - medians["unchecked"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    results = measure(args.calls, args.repeats)
    results["every_op"] = measure_ops(args.calls, args.repeats)
    results["checked"] = measure_checked(max(args.calls // 20, 10), args.repeats)
    results["environment"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "machine": platform.machine(), "cpu": current().platform.device_name}
    reset()
    for label in ("noop", "chosen"):
        r = results[label]
        times = ", ".join(f"{k} {v:.2f} us" for k, v in r["median_us"].items())
        print(f"{label:6s} ({r['backend']}, tuning tables: {', '.join(r['tuning_tables']) or 'none here'}): "
              f"{times}; added by kernelmux.ops "
              f"{r['added_us_ops_vs_direct']:.2f} us, by the resolved function "
              f"{r['added_us_resolved_vs_direct']:.2f} us")
    every = results["every_op"]
    print(f"every op through a no-op implementation (native fingerprint: {every['native_state']}):")
    for op, r in every["ops"].items():
        print(f"  {op:24s} {r['tensors']:2d} tensors of {r['arguments']:2d} arguments: added "
              + ", ".join(f"{name} fingerprint {us:.2f} us" for name, us in r["added_us"].items()))
    checked = results["checked"]
    print(f"checked mode ({checked['device']}, paged_attention {checked['case']} on {checked['backend']}): "
          f"{checked['median_us']['unchecked']:.1f} us a call unchecked, {checked['median_us']['checked']:.1f} us "
          f"checked (+{checked['added_us']:.1f} us; each call followed by a sync)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
