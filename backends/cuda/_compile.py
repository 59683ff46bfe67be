"""NVRTC compilation of the cuda backend's kernels to cubins, and the on-disk cubin cache that
spares a new process the compilation; plus ``diagnostics``, the one way to build them with the
KERNELMUX_DIAG_* macros (kernels/diagnostics.cuh lists them)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.cuda._toolchain import (NvrtcError, arch_name, device_headers, find_nvrtc,
                                                nvrtc_library, nvrtc_version)

__all__ = ["DIAGNOSTICS", "CacheWarning", "CompiledModule", "cache_dir", "compile_module", "compile_module_cached",
           "diagnostics", "diagnostics_in_force"]


# The kernels' compile-time diagnostics, each documented in kernels/diagnostics.cuh: a build with
# any of them times or traces the kernel, and may compute wrong results (the SKIP ones).
DIAGNOSTICS = ("KERNELMUX_DIAG_TRACE", "KERNELMUX_DIAG_SKIP_SCORES", "KERNELMUX_DIAG_SKIP_VALUES",
               "KERNELMUX_DIAG_SKIP_LOADS", "KERNELMUX_DIAG_SKIP_CONVERT", "KERNELMUX_DIAG_WATCHDOG")


def _diagnostics_problem(macros: tuple[str, ...]) -> Optional[str]:
    unknown = [m for m in macros if m not in DIAGNOSTICS]
    if unknown:
        return f"unknown macros {unknown}; known: {', '.join(DIAGNOSTICS)} (kernels/diagnostics.cuh)"
    return None


_diagnostics = ScopedSetting("diagnostics", (), _diagnostics_problem)


def diagnostics(*macros: str) -> contextlib.AbstractContextManager[tuple[str, ...]]:
    """Within the block, every kernel the backend loads is built with ``macros`` defined (each one
    of DIAGNOSTICS); the kernels' caches key on the macros, so the plain builds stay apart."""
    return _diagnostics.override(tuple(sorted(set(macros))))


def diagnostics_in_force() -> tuple[str, ...]:
    """The diagnostic macros the kernels loaded now are built with (none outside ``diagnostics``)."""
    return _diagnostics.current


@dataclass(frozen=True)
class CompiledModule:
    """A cubin, the lowered (mangled) name of each requested kernel, and NVRTC's log (ptxas's
    resource lines when compiled with ``verbose``)."""

    cubin: bytes
    names: dict
    log: str

    def registers(self, name: str) -> int:
        """Registers per thread ptxas reported for kernel ``name`` (needs ``verbose``)."""
        return self._ptxas_field(name, r"Used (\d+) registers")

    def static_shared_bytes(self, name: str) -> int:
        """Static shared memory (``__shared__`` variables) of kernel ``name`` (needs ``verbose``)."""
        return self._ptxas_field(name, r"(\d+) bytes smem")

    def spill_bytes(self, name: str) -> int:
        stores = self._ptxas_field(name, r"(\d+) bytes spill stores")
        loads = self._ptxas_field(name, r"(\d+) bytes spill loads")
        return stores + loads

    def _ptxas_field(self, name: str, pattern: str) -> int:
        lowered = self.names[name]
        blocks = self.log.split("ptxas info    : Compiling entry function")
        for block in blocks[1:]:
            if block.strip().startswith(f"'{lowered}'"):
                found = re.search(pattern, block)
                if found:
                    return int(found.group(1))
                return 0
        raise NvrtcError(f"no ptxas report for {name} ({lowered}) in the log:\n{self.log}")


def _check(lib, result: int, what: str, program=None) -> None:
    if result == 0:
        return
    message = f"{what}: {lib.nvrtcGetErrorString(result).decode()}"
    if program is not None:
        message += "\n" + _program_log(lib, program)
    raise NvrtcError(message)


def _program_log(lib, program) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    return log.value.decode(errors="replace")


# Every compilation's options beside the arch (and ptxas's report when verbose); the cache keys on
# the full list, so a change here is a new cache entry.
_BASE_OPTIONS = ("--std=c++17", "-lineinfo")


def _options(arch: tuple[int, int], arch_specific: bool, verbose: bool) -> list[str]:
    """The options NVRTC gets for this arch."""
    options = [f"--gpu-architecture={arch_name(arch, arch_specific)}", *_BASE_OPTIONS]
    if verbose:
        options.append("--ptxas-options=-v")
    return options


def _program_text(source: str, defines: Sequence[str]) -> str:
    """``source`` with each macro of ``defines`` defined to 1 before it (line numbers stay the
    file's)."""
    if not defines:
        return source
    return "".join(f"#define {name} 1\n" for name in defines) + "#line 1\n" + source


def compile_module(source: str, names: Sequence[str], arch: tuple[int, int], filename: str = "kernel.cu",
                   verbose: bool = False, arch_specific: bool = False,
                   defines: Sequence[str] = ()) -> CompiledModule:
    """Compile ``source`` for ``sm_<major><minor>`` (``...a`` when ``arch_specific``),
    instantiating the kernels ``names`` (C++ name expressions, e.g. ``"merge_splits<128, 2, true>"``),
    with each macro of ``defines`` defined to 1 (diagnostic builds; line numbers stay the file's)."""
    source = _program_text(source, defines)
    lib = find_nvrtc()
    if lib is None:
        raise NvrtcError("NVRTC not found: install nvidia-cuda-nvrtc (torch's CUDA wheels bring it) or a "
                         "CUDA toolkit")
    program = ctypes.c_void_p()
    headers = device_headers()
    texts = (ctypes.c_char_p * len(headers))(*[text.encode() for _, text in headers])
    includes = (ctypes.c_char_p * len(headers))(*[name.encode() for name, _ in headers])
    created = lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), filename.encode(), len(headers),
                                     texts, includes)
    _check(lib, created,
           "nvrtcCreateProgram")
    try:
        for name in names:
            _check(lib, lib.nvrtcAddNameExpression(program, name.encode()), f"nvrtcAddNameExpression({name})")
        target = arch_name(arch, arch_specific)
        options = _options(arch, arch_specific, verbose)
        option_array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        _check(lib, lib.nvrtcCompileProgram(program, len(options), option_array),
               f"compiling {filename} for {target}", program)
        log = _program_log(lib, program)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for name in names:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(out)),
                   f"nvrtcGetLoweredName({name})")
            lowered[name] = out.value.decode()
        return CompiledModule(cubin=cubin.raw, names=lowered, log=log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


# ---------------------------------------------------------------------------------------------
# On-disk cache of compiled modules.
#
# One file per entry, ``<key>.cubin`` in cache_dir(): the line _ENTRY_MAGIC, one line of JSON (the
# manifest: the key, the key material, the lowered names, the cubin's length and sha256), then the
# cubin. The key is the sha256 of the key material: everything the cubin depends on (the program
# text after the defines, the file name (line info), the kernel names, NVRTC's full option list,
# the headers' contents, NVRTC's version and library file). A read recomputes the material and the
# cubin's hash and loads only on an exact match; anything else (another format, a truncated or
# altered file, an entry copied to another key's name) is compiled again and overwritten.
# The hash guards against corruption and stale or misplaced files, not against someone who may
# write the directory: that is why a directory anyone but its owner (this user) may write is not
# used at all, as ssh refuses such a ~/.ssh. A same-user attacker could edit this module instead.

_ENTRY_MAGIC = b"kernelmux cubin cache entry, format 1\n"
_DIRECTORY_MODE = 0o700
_FILE_MODE = 0o600


class CacheWarning(UserWarning):
    """The cubin cache was not used (an untrusted or unusable directory) or held a bad entry."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(subject: str, message: str) -> None:
    """Warn about ``subject`` (a directory, an entry) once per process: a refused directory is
    asked again at every compilation."""
    with _warned_lock:
        if subject in _warned:
            return
        _warned.add(subject)
    warnings.warn(f"kernelmux: {message}", CacheWarning, stacklevel=3)


def cache_dir() -> str:
    """Where compiled cubins are kept between processes: $KERNELMUX_CACHE_DIR/cuda, else
    ~/.cache/kernelmux/cuda. Created owner-only (0700); not used when another user owns it or it
    is group- or world-writable."""
    from kernelmux.engine.settings import cache_root

    return os.path.join(cache_root(), "cuda")


def _open_cache_dir() -> Optional[int]:
    """A descriptor of cache_dir() (created 0700 if missing), or None, with a warning once, when
    it cannot be created or must not be trusted. Entries are then opened and renamed relative to
    this descriptor, so a directory swapped in after the check is never used."""
    path = cache_dir()
    try:
        os.makedirs(path, mode=_DIRECTORY_MODE, exist_ok=True)
        handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        _warn_once(path, f"not caching compiled cubins in {path}: cannot open it ({error}); every "
                         "process compiles its kernels again. Set KERNELMUX_CACHE_DIR to a writable folder.")
        return None
    info = os.fstat(handle)
    user = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    problem = None
    if info.st_uid != user:
        problem = f"it is owned by uid {info.st_uid}, not by this user (uid {user})"
    elif mode & 0o022:
        problem = f"it is group- or world-writable (mode {mode:04o}), so others could plant cubins in it"
    if problem is not None:
        os.close(handle)
        _warn_once(path, f"not using the cubin cache {path}: {problem}; compiling without the disk "
                         f"cache. Fix: remove it (kernelmux recreates it with mode 0700) or point "
                         f"KERNELMUX_CACHE_DIR to a folder of your own.")
        return None
    if mode != _DIRECTORY_MODE:
        # Ours and writable by us only (e.g. 0755 from an older kernelmux): nobody else can have
        # written it, so tightening it is safe.
        try:
            os.fchmod(handle, _DIRECTORY_MODE)
        except OSError:
            pass
    return handle


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _key_material(source: str, names: Sequence[str], arch: tuple[int, int], filename: str,
                  arch_specific: bool, defines: Sequence[str]) -> dict:
    """Everything the cubin of compile_module(...) depends on, as JSON values. Texts enter by their
    sha256; the rest verbatim, so a manifest shows what it was built from."""
    version = nvrtc_version()
    return {
        "format": _ENTRY_MAGIC.decode().strip(),
        "program_sha256": _sha256(_program_text(source, defines).encode()),
        "filename": filename,
        "defines": list(defines),
        "names": list(names),
        "options": _options(arch, arch_specific, verbose=False),
        "headers": [[name, _sha256(text.encode())] for name, text in device_headers()],
        "nvrtc_version": list(version) if version is not None else None,
        "nvrtc_library": nvrtc_library(),
    }


def _cache_key(material: dict) -> str:
    return _sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode())


def _entry_bytes(key: str, material: dict, module: CompiledModule) -> bytes:
    manifest = {"key": key, "material": material, "names": module.names,
                "cubin_bytes": len(module.cubin), "cubin_sha256": _sha256(module.cubin)}
    return _ENTRY_MAGIC + json.dumps(manifest, sort_keys=True).encode() + b"\n" + module.cubin


def _read_entry(directory: int, entry: str, key: str, material: dict) -> tuple[Optional[CompiledModule], str]:
    """The module in ``entry`` if it is one this cache wrote for exactly ``material``; else None
    and why not ("" when there is no entry)."""
    try:
        # O_NOFOLLOW: a symbolic link planted at the entry's name is refused, not followed.
        handle = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
    except FileNotFoundError:
        return None, ""
    except OSError as error:
        return None, f"cannot open it ({error})"
    with os.fdopen(handle, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return None, f"owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o}"
        data = f.read()
    if not data.startswith(_ENTRY_MAGIC):
        return None, "not a kernelmux cache entry (or another format)"
    header, newline, cubin = data[len(_ENTRY_MAGIC):].partition(b"\n")
    try:
        manifest = json.loads(header) if newline else None
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        return None, "its manifest is truncated or unreadable"
    if manifest.get("key") != key or manifest.get("material") != material:
        return None, "its manifest records other key material (an entry stored under another key's name)"
    if manifest.get("cubin_bytes") != len(cubin) or manifest.get("cubin_sha256") != _sha256(cubin):
        return None, (f"the cubin does not match the hash recorded at compile time ({len(cubin)} bytes, "
                      f"{manifest.get('cubin_bytes')} recorded): truncated or altered")
    lowered = manifest.get("names")
    # As a set: the manifest is written with sorted keys, the names are asked in any order.
    if (not isinstance(lowered, dict) or set(lowered) != set(material["names"])
            or not all(isinstance(v, str) for v in lowered.values())):
        return None, "its lowered kernel names do not match the kernels asked for"
    return CompiledModule(cubin=cubin, names=lowered, log=""), ""


def _write_entry(directory: int, entry: str, data: bytes) -> None:
    """Write ``entry`` whole or not at all: a temporary file (0600) renamed over it, so a
    concurrent reader sees the old entry, no entry or the new one, never a part."""
    temporary = f".{entry}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, _FILE_MODE,
                     dir_fd=directory)
    try:
        with os.fdopen(handle, "wb") as f:
            os.fchmod(f.fileno(), _FILE_MODE)  # exactly 0600, whatever the umask
            f.write(data)
        os.replace(temporary, entry, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=directory)
        except OSError:
            pass
        raise


def compile_module_cached(source: str, names: Sequence[str], arch: tuple[int, int],
                          filename: str = "kernel.cu", arch_specific: bool = False,
                          defines: Sequence[str] = ()) -> CompiledModule:
    """compile_module through the on-disk cache (see above), so a new process loads a cubin
    instead of compiling (0.3-1 s a template set). An entry is loaded only when its manifest
    matches this call's key material and its cubin the recorded sha256; a bad entry is compiled
    again and overwritten (with a warning), an untrusted or unusable directory is not used (with
    a warning, once), and a failed write only costs the next process a compilation."""
    def compile_now() -> CompiledModule:
        return compile_module(source, names, arch, filename, arch_specific=arch_specific, defines=defines)

    if find_nvrtc() is None:
        return compile_now()  # raises NvrtcError, saying what to install: no key without a compiler
    material = _key_material(source, names, arch, filename, arch_specific, defines)
    key = _cache_key(material)
    entry = f"{key}.cubin"
    directory = _open_cache_dir()
    if directory is None:
        return compile_now()
    try:
        module, problem = _read_entry(directory, entry, key, material)
        if module is not None:
            return module
        if problem:
            _warn_once(os.path.join(cache_dir(), entry),
                       f"discarded the cached cubin {os.path.join(cache_dir(), entry)}: {problem}; "
                       "compiling it again")
        module = compile_now()
        try:
            _write_entry(directory, entry, _entry_bytes(key, material, module))
        except OSError:
            pass  # a full disk or a read-only mount: the next process compiles again
        return module
    finally:
        os.close(directory)
