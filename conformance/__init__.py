"""The conformance kit: every implementation a backend registers, run against its spec's reference
the way kernelmux's own are tested, for plugin authors (``kernelmux check --backend NAME``,
``kernelmux.conformance.check``, and the ``kernelmux_conformance`` pytest fixture).

Per implementation and spec case (fresh random inputs; an implementation's ``supports`` may decline,
which is reported, not failed):

- ``reference``: the outputs match the reference's, with NaN left in the allocator's free blocks so
  an output element never written fails;
- ``fake``: the outputs' structure, shapes, dtypes and devices are the spec's fake's (what
  ``torch.compile`` traced);
- ``strided``: every tensor argument as a view whose last dim has stride 2, garbage between its
  elements (declined: the integer tensors alone, the index tensors kernels read by stride);
  accepted, the outputs must match the reference's;
- ``graph`` (CUDA): captured in a CUDA graph, the inputs refilled with another draw, the outputs
  poisoned, replayed: the outputs match the reference on the new inputs (declined where the
  implementation's ``capture_check`` says the call cannot be captured: the engine runs another);

and per op, on its first case the implementation accepts, through ``kernelmux.ops`` with the backend
preferred: ``compile`` (``torch.compile(fullgraph=True)``) and ``opcheck`` (torch.library.opcheck's
schema and fake-tensor tests); and ``drawn``: the ``reference`` check on shapes hypothesis draws from
the spec's ``shapes`` strategy (empty batches, odd sizes, every option), a failure shrunk to the
smallest shape that fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

import kernelmux.engine as engine_module
from kernelmux.engine import Engine, Settings, configure
from kernelmux.engine._engine import capture_problem, output_problem
from kernelmux.errors import ConfigurationError
from kernelmux.platforms import detect
from kernelmux.specs import ALL_SPECS

__all__ = ["CASE_CHECKS", "DRAWN_CHECKS", "OP_CHECKS", "Finding", "Report", "check", "poison_freed_memory"]

CASE_CHECKS = ("reference", "fake", "strided", "graph")
OP_CHECKS = ("compile", "opcheck")
DRAWN_CHECKS = ("drawn",)
PASS, FAIL, DECLINED, SKIPPED = "pass", "fail", "declined", "skipped"
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


@dataclass(frozen=True)
class Finding:
    """One check of one implementation on one case (or op)."""

    op: str
    backend: str
    case: str
    check: str
    status: str  # pass, fail, declined, skipped
    message: str = ""


@dataclass
class Report:
    """What ``check`` found for one backend on this machine."""

    backend: str
    device: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.status] = counts.get(f.status, 0) + 1
        return counts

    def summary(self) -> str:
        counts = ", ".join(f"{n} {status}" for status, n in sorted(self.counts().items()))
        return f"kernelmux check --backend {self.backend} on {self.device}: {counts or 'nothing to check'}"

    def failure_table(self) -> str:
        """The failures, one line each: op, case, check, message."""
        return "\n".join(f"  {f.op} / {f.case} / {f.check}: {f.message}" for f in self.failures)


def poison_freed_memory(device: str, nbytes: int) -> None:
    """NaN-filled blocks freed into the allocator, so outputs allocated next start as NaN."""
    blocks = [torch.full((max(nbytes // 4, 1) + extra,), float("nan"), device=device) for extra in (0, 64, 4096)]
    del blocks


def _clone(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _garbage(dtype: torch.dtype) -> Any:
    """What lies between a strided view's elements, so a reader that assumes stride 1 reads it: an
    out-of-range index for wide integers, a large value every float type (fp8 e4m3fnuz: 240) holds."""
    if dtype == torch.bool:
        return True
    if dtype in (torch.int32, torch.int64):
        return 1 << 20
    return 100 if not dtype.is_floating_point else 200.0


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """A view equal to ``tensor`` whose last dim has stride 2, garbage between the elements."""
    shape = (*tensor.shape[:-1], 2 * tensor.shape[-1])
    if tensor.dtype in _FP8:  # fill_ has no fp8 kernel everywhere: the garbage goes in through fp32
        doubled = torch.full(shape, _garbage(tensor.dtype), device=tensor.device).to(tensor.dtype)
    else:
        doubled = torch.full(shape, _garbage(tensor.dtype), dtype=tensor.dtype, device=tensor.device)
    view = doubled[..., ::2]
    view.copy_(tensor)
    return view


def _failure(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


class _Checker:
    def __init__(self, backend: str, engine: Engine, device: str, seed: int, plugins: Optional[Mapping[str, Any]],
                 max_bytes: Optional[int]) -> None:
        self.engine, self.device, self.seed = engine, device, seed
        self.plugins, self.max_bytes = plugins, max_bytes
        self.platform = detect(torch.device(device))
        self.specs = engine.specs

    def run_case(self, impl, case, checks: Sequence[str]) -> list[Finding]:
        spec = self.specs[impl.op]
        found: list[Finding] = []

        def finding(check: str, status: str, message: str = "") -> None:
            found.append(Finding(impl.op, impl.backend, case.name, check, status, message))

        kwargs = case.build(self.device, self.seed)
        if self.max_bytes is not None and spec.cost(kwargs).bytes > self.max_bytes:
            finding("reference", SKIPPED, f"moves {spec.cost(kwargs).bytes >> 20} MiB, over the size limit")
            return found
        try:
            reason = self._answer(impl, kwargs)
        except Exception as error:  # noqa: BLE001 - a supports() that raises is a defect, not a decline
            finding("reference", FAIL, f"supports() raised {_failure(error)}")
            return found
        if reason is not None:
            finding("reference", DECLINED, reason)
            return found
        try:
            raw, expected = self._against_reference(impl, kwargs)
            finding("reference", PASS)
        except Exception as error:  # noqa: BLE001 - anything an implementation raises is a finding
            finding("reference", FAIL, _failure(error))
            return found  # the other checks would repeat the failure
        if "fake" in checks:
            fake_kwargs = _clone(kwargs)
            problem = output_problem(raw, spec.fake(**fake_kwargs))
            finding("fake", FAIL if problem else PASS, problem or "")
        if "strided" in checks:
            found.append(self._strided(impl, case.name, kwargs, expected))
        if "graph" in checks:
            found.append(self._graph(impl, case, kwargs))
        return found

    def _against_reference(self, impl, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        """(the implementation's raw result, the reference's outputs) on copies of ``kwargs``, with
        NaN in the allocator's free blocks; raises when the outputs do not match."""
        spec = self.specs[impl.op]
        ref_kwargs = _clone(kwargs)
        expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
        call = _clone(kwargs)
        poison_freed_memory(self.device, sum(v.numel() * 8 for v in kwargs.values() if isinstance(v, torch.Tensor)))
        raw = impl.fn(**call)
        spec.check_close(spec.outputs(raw, call), expected, kwargs)
        return raw, expected

    def run_drawn(self, impl, examples: int) -> Finding:
        """The reference check on ``examples`` shapes drawn from the spec's ``shapes`` strategy;
        a failure is shrunk by hypothesis and reported on the smallest failing shape."""
        spec = self.specs[impl.op]

        def finding(status: str, message: str, case: str = "-") -> Finding:
            return Finding(impl.op, impl.backend, case, "drawn", status, message)

        if spec.shapes is None:
            return finding(SKIPPED, "the spec draws no shapes (no OpSpec.shapes)")
        try:
            import hypothesis
            from hypothesis import HealthCheck, given, settings
        except ImportError:
            return finding(SKIPPED, "hypothesis is not installed (pip install hypothesis)")
        agreed, declined, failing = [0], [0], [""]

        @hypothesis.seed(self.seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(spec.shapes())
        def one(case) -> None:
            kwargs = case.build(self.device, self.seed)
            try:
                if self._answer(impl, kwargs) is not None:
                    declined[0] += 1
                    return
                self._against_reference(impl, kwargs)
            except Exception:
                failing[0] = case.name  # hypothesis runs the smallest failing example last
                raise
            agreed[0] += 1

        try:
            one()
        except Exception as error:  # noqa: BLE001 - hypothesis re-raises the implementation's failure
            return finding(FAIL, _failure(error), failing[0] or "-")
        return finding(PASS if agreed[0] else DECLINED,
                       f"{agreed[0]} drawn shapes agreed with the reference, {declined[0]} were declined")

    def _answer(self, impl, kwargs) -> Optional[str]:
        if impl.supports is None:
            return None
        return impl.supports(self.specs[impl.op].validate(**kwargs), self.platform)

    def _strided(self, impl, case: str, kwargs: Mapping[str, Any], expected: Any) -> Finding:
        """Every tensor strided; if that is declined, the integer ones alone (block tables, offsets,
        lengths, slots: what kernels most often read with their own strides)."""
        spec = self.specs[impl.op]
        declined = []
        for which, wanted in (("every tensor", lambda v: True), ("the integer tensors", lambda v: not (
                v.is_floating_point() or v.dtype == torch.bool))):
            strided = {k: _strided(v) if isinstance(v, torch.Tensor) and v.dim() and v.numel() and wanted(v) else v
                       for k, v in kwargs.items()}
            if all(strided[k] is kwargs[k] for k in kwargs):
                continue  # no such tensor
            try:
                reason = self._answer(impl, strided)
            except Exception as error:  # noqa: BLE001 - the spec's validation refuses such views
                declined.append(f"{which}: the spec refuses them ({_failure(error)})")
                continue
            if reason is not None:
                declined.append(f"{which}: {reason}")
                continue
            try:
                actual = spec.outputs(impl.fn(**strided), strided)
                spec.check_close(actual, expected, kwargs)
            except Exception as error:  # noqa: BLE001
                return Finding(impl.op, impl.backend, case, "strided", FAIL, f"{which} strided: {_failure(error)}")
            return Finding(impl.op, impl.backend, case, "strided", PASS, f"{which} strided")
        return Finding(impl.op, impl.backend, case, "strided", DECLINED, "; ".join(declined) or "no tensor to stride")

    def _graph(self, impl, case, kwargs: Mapping[str, Any]) -> Finding:
        spec = self.specs[impl.op]
        why = capture_problem(impl, spec.validate(**kwargs), self.platform)
        if why is not None:  # declared: under capture the engine runs another implementation
            return Finding(impl.op, impl.backend, case.name, "graph", DECLINED, f"cannot be captured: {why}")
        if self.device != "cuda":
            return Finding(impl.op, impl.backend, case.name, "graph", SKIPPED, "CUDA graphs need a CUDA device")
        fresh = case.build(self.device, self.seed + 1)
        if any(isinstance(v, torch.Tensor) and v.shape != fresh[k].shape for k, v in kwargs.items()):
            return Finding(impl.op, impl.backend, case.name, "graph", SKIPPED, "another draw has other shapes")
        static = _clone(kwargs)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    impl.fn(**_clone(static))  # warm-up: compilation outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = impl.fn(**static)
            for name, value in fresh.items():
                if isinstance(value, torch.Tensor):
                    static[name].copy_(value)
            for out in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref_kwargs = _clone(fresh)
            expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
            spec.check_close(spec.outputs(result, static), expected, fresh)
        except Exception as error:  # noqa: BLE001
            return Finding(impl.op, impl.backend, case.name, "graph", FAIL, _failure(error))
        return Finding(impl.op, impl.backend, case.name, "graph", PASS)

    def run_op(self, impl, case, checks: Sequence[str]) -> list[Finding]:
        """compile and opcheck through kernelmux.ops with this backend preferred."""
        from kernelmux.ops import ALL_OPS

        op = ALL_OPS[impl.op]
        spec = op.spec
        names = list(spec.signature.parameters)
        found = []
        previous = engine_module.current()  # the caller's engine comes back afterwards
        configure(prefer={impl.op: [impl.backend]}, plugins=self.plugins, tuning=False)
        try:
            if "compile" in checks:
                torch._dynamo.reset()
                kwargs, ref_kwargs = case.build(self.device, self.seed), case.build(self.device, self.seed)

                def call(*args):
                    return op(*args)

                try:
                    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
                    actual = spec.outputs(compiled(*(kwargs[n] for n in names)), kwargs)
                    spec.check_close(actual, spec.outputs(spec.reference(**ref_kwargs), ref_kwargs), ref_kwargs)
                    found.append(Finding(impl.op, impl.backend, case.name, "compile", PASS))
                except Exception as error:  # noqa: BLE001
                    found.append(Finding(impl.op, impl.backend, case.name, "compile", FAIL, _failure(error)))
            if "opcheck" in checks:
                kwargs = case.build(self.device, self.seed)
                tests = ("test_schema", "test_faketensor")
                if any(isinstance(v, torch.Tensor) and v.dtype in _FP8 for v in kwargs.values()):
                    tests = ("test_faketensor",)  # torch.allclose, inside test_schema, has no fp8 kernel
                try:
                    torch.library.opcheck(op.custom_op, tuple(kwargs[n] for n in names), test_utils=tests)
                    found.append(Finding(impl.op, impl.backend, case.name, "opcheck", PASS))
                except Exception as error:  # noqa: BLE001
                    found.append(Finding(impl.op, impl.backend, case.name, "opcheck", FAIL, _failure(error)))
        finally:
            engine_module.install(previous)
        return found


def check(backend: str, ops: Optional[Iterable[str]] = None, *, cases: Optional[Iterable[str]] = None,
          checks: Sequence[str] = CASE_CHECKS + OP_CHECKS + DRAWN_CHECKS, device: Optional[str] = None,
          seed: Optional[int] = None, plugins: Optional[Mapping[str, Any]] = None, max_bytes: Optional[int] = None,
          examples: int = 20,
          progress: Callable[[Finding], None] = lambda finding: None) -> Report:
    """Check every implementation ``backend`` registers (of ``ops``, default all) that can run here
    on every spec case (or those named) on ``device`` (default: CUDA when there is one and the
    backend runs there, else the CPU), and on ``examples`` drawn shapes. ``plugins`` are plugin
    objects registered beside the installed ones. A fresh random seed unless given."""
    chosen = device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(ALL_SPECS, Settings(tuning=False), platform=detect(torch.device(chosen)), plugins=plugins)
    if device is None and chosen == "cuda":
        # A backend whose implementations all run on CPU tensors is checked there, GPU or not.
        mine = [impl for (_, name), impl in engine.registry.implementations.items() if name == backend]
        if mine and all(impl.devices and "cuda" not in impl.devices for impl in mine):
            chosen = "cpu"
            engine = Engine(ALL_SPECS, Settings(tuning=False), platform=detect(torch.device(chosen)), plugins=plugins)
    device = chosen
    known = sorted({impl.backend for impl in engine.registry.implementations.values()})
    if backend not in known:
        raise ConfigurationError(f"no backend {backend!r} is registered; backends: {', '.join(known)}")
    wanted = set(ops) if ops is not None else set(engine.specs)
    unknown = wanted - set(engine.specs)
    if unknown:
        raise ConfigurationError(f"unknown op(s) {sorted(unknown)}; ops: {', '.join(sorted(engine.specs))}")
    if "drawn" in checks and (type(examples) is not int or examples < 1):
        raise ConfigurationError(f"examples: expected a positive int (shapes drawn per implementation), "
                                 f"got {examples!r}")
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    checker = _Checker(backend, engine, device, seed, plugins, max_bytes)
    report = Report(backend, f"{device} ({checker.platform.describe()}), seed {seed}")
    named = any(c in CASE_CHECKS or c in OP_CHECKS for c in checks)  # drawn shapes alone: no named case

    def add(findings: Iterable[Finding]) -> None:
        for f in findings:
            report.findings.append(f)
            progress(f)

    for (op, name), impl in sorted(engine.registry.implementations.items()):
        if name != backend or op not in wanted:
            continue
        table = engine.tables[op]
        rejected = next((why for r, why in table.rejected if r is impl), None)
        if rejected is not None and name != "reference":
            add([Finding(op, name, "-", "platform", SKIPPED, f"not viable here: {rejected}")])
            continue
        if impl.devices and device not in impl.devices:
            add([Finding(op, name, "-", "platform", SKIPPED, f"runs on {'/'.join(sorted(impl.devices))} tensors")])
            continue
        first_accepted = None
        for case in engine.specs[op].cases if named else ():
            if cases is not None and case.name not in cases:
                continue
            if device == "cpu" and "gpu" in case.tags:
                continue  # GB-sized perf shapes: the GPU's
            findings = checker.run_case(impl, case, [c for c in checks if c in CASE_CHECKS])
            add(findings)
            if first_accepted is None and any(f.check == "reference" and f.status == PASS for f in findings):
                first_accepted = case
        op_checks = [c for c in checks if c in OP_CHECKS]
        if op_checks and first_accepted is not None:
            add(checker.run_op(impl, first_accepted, op_checks))
        if "drawn" in checks:
            add([checker.run_drawn(impl, examples)])
    return report
