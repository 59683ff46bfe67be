"""A worker process started with the "spawn" method (as DataLoader workers and serving engines'
worker pools start on macOS, on Windows and with CUDA) builds the same selection from the
environment as its parent, and its dispatch computes the same results."""

import multiprocessing
import pathlib
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

import kernelmux
from kernelmux.specs.grouped_topk import SPEC

# Cases whose inputs numpy can carry across the process boundary (no bf16), of three dispatch keys.
CASES = ("deepseek_v3_t64", "small_sigmoid_bias", "small_softmax")
SEED = 7


def selection_summary(report: dict) -> dict:
    """What selection decided: loaded plugins, and per op the chosen and viable backends in order."""
    return {
        "plugins": sorted(p["name"] for p in report["plugins"]),
        "ops": {
            o["op"]: {"chosen": o["chosen"], "viable": [v["backend"] for v in o["viable"]]}
            for o in report["ops"]
        },
    }


def dispatch_cases() -> dict:
    """Each case's input and outputs as numpy arrays (picklable without torch's shared memory),
    with the backend that the current engine dispatched it to."""
    results = {}
    for name in CASES:
        kwargs = SPEC.case(name).build("cpu", seed=SEED)
        weights, ids = kernelmux.ops.grouped_topk(**kwargs)
        results[name] = {
            "gating_output": kwargs["gating_output"].numpy(),
            "weights": weights.numpy(),
            "ids": ids.numpy(),
        }
    entry = next(o for o in kernelmux.report()["ops"] if o["op"] == SPEC.name)
    return {"results": results, "backends": [call["backend"] for call in entry["calls"]]}


def worker() -> tuple[dict, dict]:
    """Runs in the spawned process: a fresh interpreter that imports kernelmux from scratch."""
    import kernelmux as fresh

    summary = selection_summary(fresh.report())
    return summary, dispatch_cases()


def _import_root() -> str:
    """The sys.path entry under which this module imports by its own ``__name__`` (pytest names it
    ``tests.engine.test_spawn_worker`` or ``test_spawn_worker`` depending on its import mode)."""
    path = pathlib.Path(__file__).resolve().parent
    for _ in range(__name__.count(".")):
        path = path.parent
    return str(path)


@pytest.fixture
def engine_from_env():
    """This process's engine rebuilt from the environment, as the spawned worker builds its own."""
    kernelmux.reset()
    yield
    kernelmux.reset()


def test_spawned_worker_selects_and_dispatches_like_the_parent(engine_from_env, monkeypatch):
    # The worker is pickled by reference (module name + function name); a spawned process gets
    # the parent's sys.path, so make sure that names this module wherever pytest ran from.
    monkeypatch.syspath_prepend(_import_root())
    parent_summary = selection_summary(kernelmux.report())
    parent = dispatch_cases()

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        child_summary, child = pool.submit(worker).result(timeout=300)

    assert child_summary == parent_summary
    assert SPEC.name in child_summary["ops"]
    assert child["backends"] == parent["backends"]
    for name in CASES:
        got, want = child["results"][name], parent["results"][name]
        np.testing.assert_array_equal(got["gating_output"], want["gating_output"])
        kwargs = SPEC.case(name).build("cpu", seed=SEED)
        # The spec's comparison: the same set of ids in each row, the same weight for each id.
        SPEC.check_close(
            (torch.from_numpy(got["weights"]), torch.from_numpy(got["ids"])),
            (torch.from_numpy(want["weights"]), torch.from_numpy(want["ids"])),
            kwargs,
        )
