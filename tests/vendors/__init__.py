"""Fake vendor libraries for the CPU, one folder per import name (``flashinfer/``, ``deep_gemm/``):
each module holds the shipped signatures, argument checks and output layouts of the functions
kernelmux calls, with the math written here independently of kernelmux. Tests install a fake as a
real distribution (plugin_installs.install) so the vendor mechanism meets it as it meets the real one."""

from __future__ import annotations

import pathlib
import sys
from typing import Mapping, Optional

from kernelmux.backends import _vendor
from plugin_installs import Distribution, install

__all__ = ["FAKES", "install_all", "install_fake", "reversed_signature", "sources"]

_ROOT = pathlib.Path(__file__).parent

# Every fake here: import name -> (distribution, the version it is installed as: the one whose
# source the fake was written against).
FAKES: dict[str, tuple[str, str]] = {
    "flashinfer": ("flashinfer-python", "0.6.14"),
    "deep_gemm": ("sgl-deep-gemm", "0.1.4.post1"),
    "aiter": ("amd-aiter", "0.1.21.dev46+ge4048607a"),  # setuptools_scm's name for ROCm/aiter e4048607
    "vllm_xpu_kernels": ("vllm-xpu-kernels", "0.1.16.2"),
}


def sources(name: str) -> dict[str, str]:
    """The fake ``name``'s files, install path (``flashinfer/fused_moe/__init__.py``) -> source text."""
    root = _ROOT / name
    if not root.is_dir():
        raise FileNotFoundError(f"no fake vendor {name!r} under {_ROOT}")
    return {path.relative_to(_ROOT).as_posix(): path.read_text()
            for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts}


def install_fake(monkeypatch, tmp_path: pathlib.Path, name: str, distribution: str, version: str,
                 files: Optional[Mapping[str, str]] = None) -> pathlib.Path:
    """The fake ``name`` (or ``files`` instead of its sources) installed as ``distribution`` at
    ``version`` on sys.path for this test, with no earlier import of it or vendor answer cached."""
    site = install(tmp_path / "site", Distribution(distribution, version, {},
                                                   files if files is not None else sources(name)))
    monkeypatch.syspath_prepend(str(site))
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(_vendor, "_problems", {})
    return site


def install_all(site: pathlib.Path) -> pathlib.Path:
    """Every fake in FAKES installed into ``site`` as its distribution (for a subprocess's PYTHONPATH:
    the dry run of every vendor backend at once)."""
    for name, (distribution, version) in FAKES.items():
        install(site, Distribution(distribution, version, {}, sources(name)))
    return site


def reversed_signature(source: str, name: str) -> str:
    """``source`` with ``def name(...)``'s parameters reversed within its required run and within its
    defaulted run (``self`` and keyword-only ones stay put): still valid, and every positional caller
    of it now passes its arguments to the wrong parameters."""
    lines = source.split("\n")
    start = lines.index(next(line for line in lines if line.strip() == f"def {name}(")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(")"))
    params = [line.strip() for line in lines[start:end]]
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    head = params[:1] if params[0] == "self," else []
    stop = params.index("*,") if "*," in params else len(params)
    middle, tail = params[len(head):stop], params[stop:]
    required = [p for p in middle if "=" not in p]
    defaulted = [p for p in middle if "=" in p]
    assert middle == required + defaulted
    reordered = head + required[::-1] + defaulted[::-1] + tail
    assert reordered != params
    return "\n".join(lines[:start] + [indent + p for p in reordered] + lines[end:])
