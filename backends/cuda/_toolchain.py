"""Where the cuda backend's compiler and sources are: the NVRTC library (torch's CUDA wheels or a
toolkit), its version and file, the arch names NVRTC targets, and the kernels' headers."""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import pathlib
from typing import Optional

__all__ = ["KERNELS", "NvrtcError", "arch_name", "device_headers", "find_nvrtc", "nvrtc_library",
           "nvrtc_version"]

# The CUDA C++ sources (*.cu) and the headers every compilation gets (*.cuh).
KERNELS = pathlib.Path(__file__).with_name("kernels")


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


def arch_name(arch: tuple[int, int], arch_specific: bool = False) -> str:
    """``sm_90``, or ``sm_90a`` for the arch-specific features (wgmma, setmaxnreg) whose cubins
    run on that arch only."""
    return f"sm_{arch[0]}{arch[1]}" + ("a" if arch_specific else "")


@functools.cache
def device_headers() -> tuple[tuple[str, str], ...]:
    """The backend's device headers (kernels/*.cuh) as (include name, text): every compilation
    gets them, so a kernel source includes one by its file name."""
    return tuple((path.name, path.read_text()) for path in sorted(KERNELS.glob("*.cuh")))


class _DlInfo(ctypes.Structure):
    """dladdr's answer (dlfcn.h's Dl_info)."""

    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> Optional[list]:
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
