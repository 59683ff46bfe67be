"""Call fingerprints: what a spec's validation reads of a call, as one hashable value, so the
dispatcher validates a call only the first time its arguments' metadata are seen (``Dispatcher``).

Two implementations with the same meaning: ``python_fingerprint``, always there, and a native one
(``native/fingerprint.cpp``, a CPython extension over libtorch) that reads tensors' metadata in C++,
about ten times faster on a call of ten tensors. The native one is compiled by ``build_native``
(``kernelmux warmup`` runs it; about 25 s once per torch and Python version, into
``$KERNELMUX_CACHE_DIR/native``) and only loaded afterwards, never compiled on a call's path: a
process where it was never built, or cannot be loaded, uses the Python one and ``kernelmux info``
says why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from kernelmux.engine.settings import cache_root
from kernelmux.specs._key import MAX_ALIGNMENT

__all__ = ["Fingerprint", "active", "build_native", "native_state", "python_fingerprint"]

# (args, kwargs) -> a hashable value, or None where an argument is neither a tensor nor a plain value.
Fingerprint = Callable[[tuple, dict], Any]

_ALIGNMENT_BITS = MAX_ALIGNMENT - 1
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype})
# The classes the native fingerprint reads directly; a subclass (a tensor wrapper whose shape is its
# own) is validated every time there, as an argument the Python one cannot hold would be.
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
SOURCE = Path(__file__).parent / "native" / "fingerprint.cpp"


def python_fingerprint(args: tuple, kwargs: dict, _tensor: type = torch.Tensor,
                       _plain: frozenset = _PLAIN) -> tuple | None:
    """What a spec's validate reads of a call: per tensor its dtype, shape, strides, device and
    address modulo the largest alignment a Layout holds; per other argument its type and value (so
    True and 1 differ). Validation reads metadata, never data, so calls with equal fingerprints have
    equal dispatch keys and are equally valid. None where an argument is neither a tensor nor a plain
    value (a list, an object): such a call is validated every time, and no tensor is ever held.
    On every call's path: the globals are bound as defaults, plain values tested first."""
    parts: list = []
    append = parts.append
    for value in (*args, *kwargs.values()) if kwargs else args:
        kind = type(value)
        if kind in _plain:
            append(kind)
            append(value)
        elif isinstance(value, _tensor):
            append((value.dtype, value.shape, value.stride(), value.device, value.data_ptr() & _ALIGNMENT_BITS))
        else:
            return None
    if kwargs:
        append(tuple(kwargs))  # the keywords' names, in order: f(x, y) and f(x, b=y) stay apart
    return tuple(parts)


def _tag() -> str:
    """What the compiled module depends on: its source, torch's build and the Python ABI."""
    digest = hashlib.sha1(SOURCE.read_bytes())
    for part in (torch.__version__, torch.version.git_version, sys.implementation.cache_tag,
                 str(torch.compiled_with_cxx11_abi())):
        digest.update(part.encode())
    return digest.hexdigest()[:12]


def _module_name() -> str:
    return f"kernelmux_fingerprint_{_tag()}"


def native_dir() -> Path:
    """Where the native fingerprint of this torch and Python is built: $KERNELMUX_CACHE_DIR/native/<tag>."""
    return Path(cache_root()) / "native" / _tag()


def _configured(module: Any) -> Fingerprint:
    module.configure(_TENSOR_TYPES, _ALIGNMENT_BITS)
    return module.fingerprint


_lock = threading.Lock()
_loaded: Optional[tuple[Optional[Fingerprint], str]] = None  # (native fingerprint or None, why), once loaded


def _load() -> tuple[Optional[Fingerprint], str]:
    name = _module_name()
    path = native_dir() / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"  # torch.utils.cpp_extension's name
    if not path.is_file():
        return None, f"not built for this torch and Python ({path} is missing; kernelmux warmup builds it)"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return _configured(module), f"native ({path})"
    except Exception as error:  # noqa: BLE001 - a module that does not load leaves the Python fingerprint
        return None, f"{path} did not load: {type(error).__name__}: {error}"


def native_state() -> tuple[Optional[Fingerprint], str]:
    """The native fingerprint (None where there is none) and a line saying which one calls use, or why
    not the native one; loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def active() -> Fingerprint:
    """The fingerprint a new dispatcher uses: the native one where it is built, else the Python one."""
    native, _ = native_state()
    return native if native is not None else python_fingerprint


def build_native(log: Callable[[str], None] = lambda line: None) -> str:
    """Compile the native fingerprint for this torch and Python (torch.utils.cpp_extension: a C++
    compiler and ninja), unless it is built already; dispatchers made afterwards in this process use
    it. Returns the line ``native_state`` gives; a failed build is said there, never raised."""
    global _loaded
    native, state = native_state()
    if native is not None:
        return state
    log(f"compiling kernelmux's native call fingerprint into {native_dir()} (C++, about 25 s, once per torch "
        "and Python version)")
    try:
        from torch.utils.cpp_extension import load

        native_dir().mkdir(parents=True, exist_ok=True)
        module = load(name=_module_name(), sources=[str(SOURCE)], build_directory=str(native_dir()),
                      extra_cflags=["-O2"], verbose=False)
        result = (_configured(module), f"native ({native_dir()})")
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, no headers: the Python fingerprint stays
        lines = str(error).strip().splitlines()
        result = (None, f"the build failed ({type(error).__name__}: {lines[-1][:300] if lines else ''})")
    with _lock:
        _loaded = result
    log(f"  call fingerprint: {result[1]}")
    return result[1]
