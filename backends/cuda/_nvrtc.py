"""Runtime compilation and launch of the cuda backend's CUDA C++ kernels, through ctypes.

NVRTC compiles a kernel source (with the backend's own *.cuh headers, no CUDA or system headers:
the sources use inline PTX) straight to a cubin for the GPU's arch; the driver API loads it and
launches on torch's current stream, so launches order with torch's work and are captured by CUDA
graphs. A launch may ask to overlap the kernel before it (programmatic dependent launch, sm_90+:
`Kernel.__call__`'s ``overlap_previous``; the kernel then waits with common.cuh's
wait_for_previous_grid before it touches global memory). Nothing is built at install time and
no Python package beyond torch is needed: NVRTC comes with torch's CUDA wheels
(nvidia-cuda-nvrtc) or a CUDA toolkit, libcuda with the driver. On machines without NVRTC the
backend reports why it is not viable; CPU-only machines with NVRTC installed can still compile
(the tests do, for sm_90).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

__all__ = ["CacheWarning", "CompiledModule", "Kernel", "KernelSpec", "LoadedKernels", "NvrtcError",
           "cache_dir", "compile_module", "compile_module_cached", "device_headers", "find_nvrtc",
           "load_kernel"]


class NvrtcError(RuntimeError):
    """NVRTC or the driver refused: the message carries the compiler log or the CUDA error."""


def _candidate_paths() -> list[str]:
    paths = []
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels (nvidia-cuda-nvrtc among them)

        for root in nvidia.__path__:
            # CUDA 13 wheels: nvidia/cu13/lib; CUDA 12 wheels: nvidia/cuda_nvrtc/lib.
            paths += sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so*")), reverse=True)
            paths += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    # Whatever the loader finds (a library torch already loaded, LD_LIBRARY_PATH).
    paths += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    paths = [p for p in paths if "builtins" not in os.path.basename(p) and "alt" not in os.path.basename(p)]
    # The NVRTC of torch's CUDA major first: its cubins load under the driver torch runs on.
    major = _torch_cuda_major()
    return sorted(paths, key=lambda p: major is None or f".so.{major}" not in os.path.basename(p))


def _torch_cuda_major() -> Optional[int]:
    try:
        import torch
    except ImportError:
        return None
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


@functools.lru_cache(maxsize=None)
def find_nvrtc() -> Optional[ctypes.CDLL]:
    """The NVRTC library, or None when none can be loaded."""
    for path in _candidate_paths():
        # NVRTC opens its builtins library by name at the first compilation; some wheels' libnvrtc
        # (13.0.x) carries no rpath to its own folder, so that open fails unless the builtins
        # beside it are loaded first.
        # (Bare names are the loader's to resolve: no folder to look in.)
        folder = os.path.dirname(path)
        for builtins in glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*")) if folder else ():
            if ".alt." not in builtins:
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


def nvrtc_version() -> Optional[tuple[int, int]]:
    lib = find_nvrtc()
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


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


def arch_name(arch: tuple[int, int], arch_specific: bool = False) -> str:
    """``sm_90``, or ``sm_90a`` for the arch-specific features (wgmma, setmaxnreg) whose cubins
    run on that arch only."""
    return f"sm_{arch[0]}{arch[1]}" + ("a" if arch_specific else "")


@functools.cache
def device_headers() -> tuple[tuple[str, str], ...]:
    """The backend's device headers (the *.cuh files beside this module) as (include name, text):
    every compilation gets them, so a kernel source includes one by its file name."""
    folder = os.path.dirname(os.path.abspath(__file__))
    return tuple((os.path.basename(path), open(path).read())
                 for path in sorted(glob.glob(os.path.join(folder, "*.cuh"))))


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
    instantiating the kernels ``names`` (C++ name expressions, e.g. ``"merge_splits<true>"``),
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
    from kernelmux.engine.settings import env_value

    root = env_value("KERNELMUX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernelmux")
    return os.path.join(root, "cuda")


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


class _DlInfo(ctypes.Structure):
    """dladdr's answer (dlfcn.h's Dl_info)."""

    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _nvrtc_library() -> Optional[list]:
    """The NVRTC library file loaded (its real path, size and mtime): nvrtcVersion says major.minor
    only, and a patch release (a ptxas fix) may change the code generated for the same source."""
    lib = find_nvrtc()
    if lib is None:
        return None
    path = lib._name
    try:
        # The file the loader actually opened (find_nvrtc may have given it a bare name).
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if dladdr(ctypes.cast(lib.nvrtcVersion, ctypes.c_void_p), ctypes.byref(info)) and info.fname:
            path = info.fname.decode()
    except (AttributeError, OSError):
        pass
    try:
        found = os.stat(path)
    except OSError:
        return [path, None, None]
    return [os.path.realpath(path), found.st_size, found.st_mtime_ns]


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
        "nvrtc_library": _nvrtc_library(),
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


# ---------------------------------------------------------------------------------------------
# Driver API: load and launch.

_PTR, _I32, _I64, _F32 = "p", "i", "q", "f"
_CTYPES = {_PTR: ctypes.c_void_p, _I32: ctypes.c_int32, _I64: ctypes.c_int64, _F32: ctypes.c_float}
_CU_OCCUPANCY = "cuOccupancyMaxActiveBlocksPerMultiprocessor"
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def _cu_check(result: int, what: str) -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    _libcuda().cuGetErrorString(result, ctypes.byref(text))
    raise NvrtcError(f"{what}: CUDA error {result} ({text.value.decode() if text.value else 'unknown'})")


# cuLaunchKernelEx's attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class Kernel:
    """One kernel of a loaded module, launched on torch's current stream of its device.

    ``signature`` gives each argument's kind: ``p`` pointer (a tensor, or None for a null
    pointer), ``i`` int32, ``q`` int64, ``f`` float32."""

    def __init__(self, function: ctypes.c_void_p, signature: str, block: int,
                 module: ctypes.c_void_p, shared_bytes: int = 0) -> None:
        self._function = function
        self._signature = signature
        self._block = block
        self._shared_bytes = shared_bytes  # dynamic shared memory per CTA
        self._module = module  # kept alive with the function
        self._per_thread = threading.local()

    @functools.cached_property
    def blocks_per_sm(self) -> int:
        """CTAs of this kernel one SM holds at once (the driver's occupancy calculator)."""
        count = ctypes.c_int()
        _cu_check(getattr(_libcuda(), _CU_OCCUPANCY)(ctypes.byref(count), self._function, self._block,
                                                     ctypes.c_size_t(self._shared_bytes)), _CU_OCCUPANCY)
        return count.value

    def parameters(self, *args) -> ctypes.Array:
        """The kernelParams array cuLaunchKernel reads: one pointer per argument, to storage that
        holds its value. The storage is allocated once per kernel and thread and refilled per
        call (a launch copies the values out before it returns), which costs a few us where
        building ctypes objects per argument cost ~25."""
        if len(args) != len(self._signature):
            raise TypeError(f"kernel takes {len(self._signature)} arguments, got {len(args)}")
        storage = getattr(self._per_thread, "storage", None)
        if storage is None:
            values = [_CTYPES[kind]() for kind in self._signature]
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            storage = self._per_thread.storage = (values, params)
        values, params = storage
        for value, kind, arg in zip(values, self._signature, args):
            if kind == _PTR:
                value.value = arg.data_ptr() if arg is not None else None
            else:
                value.value = arg
        return params

    def __call__(self, grid: tuple[int, int, int], *args, overlap_previous: bool = False) -> None:
        """Launch on torch's current stream. ``overlap_previous``: programmatic dependent launch
        (sm_90+): the grid may be scheduled while the kernel before it on the stream finishes, so
        the kernel must wait (``griddepcontrol.wait``) before its first global read or write."""
        import torch

        params = self.parameters(*args)
        stream = torch.cuda.current_stream().cuda_stream
        if not overlap_previous:
            _cu_check(_libcuda().cuLaunchKernel(self._function, grid[0], grid[1], grid[2], self._block, 1, 1,
                                                self._shared_bytes, ctypes.c_void_p(stream), params, None),
                      "cuLaunchKernel")
            return
        config = getattr(self._per_thread, "config", None)
        if config is None:  # built once per kernel and thread, as the parameters are
            attribute = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attribute.value.flag = 1
            config = self._per_thread.config = _LaunchConfig(
                block=(ctypes.c_uint * 3)(self._block, 1, 1), shared_bytes=self._shared_bytes,
                attrs=ctypes.pointer(attribute), num_attrs=1)
        config.grid[0], config.grid[1], config.grid[2] = grid
        config.stream = stream
        _cu_check(_libcuda().cuLaunchKernelEx(ctypes.byref(config), self._function, params, None),
                  "cuLaunchKernelEx")


def load_kernel(module: CompiledModule, name: str, signature: str, block: int,
                loaded: Optional[ctypes.c_void_p] = None,
                shared_bytes: int = 0) -> tuple[Kernel, ctypes.c_void_p]:
    """Kernel ``name`` of ``module`` in the current CUDA context (torch's current device): the
    module is loaded once per context by the caller, who passes it back as ``loaded``.
    ``shared_bytes`` of dynamic shared memory go with every launch; the kernel is opted in to
    that amount here: without it a launch gets 48 KiB of static and dynamic shared memory
    together (a 4-warp decode build asking for 48 KiB beside 300 static bytes failed to launch)."""
    lib = _libcuda()
    if loaded is None:
        loaded = ctypes.c_void_p()
        _cu_check(lib.cuModuleLoadData(ctypes.byref(loaded), module.cubin), "cuModuleLoadData")
    function = ctypes.c_void_p()
    _cu_check(lib.cuModuleGetFunction(ctypes.byref(function), loaded, module.names[name].encode()),
              f"cuModuleGetFunction({name})")
    if shared_bytes > 0:
        _cu_check(lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         ctypes.c_int(shared_bytes)),
                  f"cuFuncSetAttribute({name}, {shared_bytes} B)")
    return Kernel(function, signature, block, loaded, shared_bytes), loaded


@dataclass(frozen=True)
class KernelSpec:
    """How to load and launch one kernel of a module: its C++ name expression, argument kinds
    (Kernel's signature), threads per CTA and dynamic shared memory."""

    name: str
    signature: str
    block: int
    shared_bytes: int = 0


class LoadedKernels:
    """A backend's kernels, loaded once per (device, key) and kept: ``get`` builds the module on
    the first call for a key (``build`` returns the compiled module and the specs of the kernels to
    load from it, in order) and loads it on that device; later calls return the same Kernels.
    Thread-safe: concurrent first calls build once."""

    def __init__(self) -> None:
        self._loaded: dict = {}
        self._lock = threading.Lock()

    def get(self, device, key: Hashable,
            build: Callable[[], tuple[CompiledModule, Sequence[KernelSpec]]]) -> tuple[Kernel, ...]:
        kernels = self._loaded.get((device, key))
        if kernels is None:
            with self._lock:
                kernels = self._loaded.get((device, key))  # another thread may have loaded them
                if kernels is None:
                    module, specs = build()
                    handle, loaded = None, []
                    for spec in specs:
                        kernel, handle = load_kernel(module, spec.name, spec.signature, spec.block,
                                                     loaded=handle, shared_bytes=spec.shared_bytes)
                        loaded.append(kernel)
                    kernels = self._loaded[(device, key)] = tuple(loaded)
        return kernels

    def loaded(self) -> list[tuple[Kernel, ...]]:
        """Every key's kernels, in the order they were loaded (diagnostics)."""
        return list(self._loaded.values())

    def clear(self) -> None:
        with self._lock:
            self._loaded.clear()
