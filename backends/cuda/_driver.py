"""The cuda backend's driver calls (libcuda through ctypes): a compiled module loaded once per
device, each kernel launched on torch's current stream with its params struct, optionally as a
programmatic dependent of the kernel before it (cuLaunchKernelEx, sm_90+), and the TMA tensor maps
kernels take as parameters (cuTensorMapEncodeTiled, sm_90+)."""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

from kernelmux.backends.cuda._compile import CompiledModule
from kernelmux.backends.cuda._toolchain import NvrtcError

__all__ = ["Kernel", "KernelSpec", "LoadedKernels", "TensorMap", "load_kernel", "module_global", "tensor_map"]

_CU_OCCUPANCY = "cuOccupancyMaxActiveBlocksPerMultiprocessor"
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


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


# CUtensorMap: 128 opaque bytes (64-byte aligned where the driver writes it and on the device).
TensorMap = ctypes.c_ubyte * 128
_TENSOR_MAP_ALIGNMENT = 64
# cuTensorMapEncodeTiled's enums (cuda.h): the element type, no interleave, the 128-byte swizzle (the
# layout the kernels' wgmma descriptors read), 256-byte L2 promotion, zeros for elements out of bounds.
_CU_TENSOR_MAP_DATA_TYPE = {1: 0, 2: 1, 4: 2}  # element bytes -> UINT8, UINT16, UINT32: copies, no arithmetic
_CU_TENSOR_MAP_INTERLEAVE_NONE, _CU_TENSOR_MAP_SWIZZLE_128B = 0, 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B, _CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 3, 0


@functools.lru_cache(maxsize=256)
def _encoded_map(address: int, element_bytes: int, dims: tuple[int, ...], strides: tuple[int, ...],
                 box: tuple[int, ...]) -> bytes:
    rank = len(dims)
    storage = ctypes.create_string_buffer(ctypes.sizeof(TensorMap) + _TENSOR_MAP_ALIGNMENT)
    aligned = -ctypes.addressof(storage) % _TENSOR_MAP_ALIGNMENT
    dims_array = (ctypes.c_uint64 * rank)(*dims)
    strides_array = (ctypes.c_uint64 * max(rank - 1, 1))(*strides)
    box_array = (ctypes.c_uint32 * rank)(*box)
    element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    _cu_check(_libcuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(ctypes.addressof(storage) + aligned), _CU_TENSOR_MAP_DATA_TYPE[element_bytes],
        ctypes.c_uint32(rank), ctypes.c_void_p(address), dims_array, strides_array, box_array, element_strides,
        _CU_TENSOR_MAP_INTERLEAVE_NONE, _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        _CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled(dims {dims}, byte strides {strides}, box {box})")
    return storage.raw[aligned:aligned + ctypes.sizeof(TensorMap)]


def tensor_map(tensor, box: Sequence[int]) -> TensorMap:
    """A TMA map of ``tensor`` (unit stride along its last dim; 16-byte aligned data and strides) for
    loads of ``box`` elements per dim, innermost first (the tensor's dims reversed), in the 128-byte
    swizzle; elements out of bounds load as zeros. Maps are encoded once per (address, shape, strides,
    box) and copied into each launch's parameters."""
    dims = tuple(reversed(tensor.shape))
    strides = tuple(stride * tensor.element_size() for stride in reversed(tensor.stride()[:-1]))
    encoded = _encoded_map(tensor.data_ptr(), tensor.element_size(), dims, strides, tuple(box))
    return TensorMap.from_buffer_copy(encoded)


class Kernel:
    """One kernel of a loaded module, launched on torch's current stream of its device. Its
    parameters are the fields of a params struct whose host mirror is ``params`` (a
    ctypes.Structure of _params.py); a launch names every field."""

    def __init__(self, function: ctypes.c_void_p, params: type[ctypes.Structure], block: int,
                 module: ctypes.c_void_p, shared_bytes: int = 0) -> None:
        self._function = function
        self._params = params
        self._fields = frozenset(name for name, _ in params._fields_)
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

    def parameters(self, **fields) -> ctypes.Array:
        """The ``kernelParams`` array cuLaunchKernel reads: a pointer to each field of the params
        struct, in order, filled from ``fields`` (a tensor or None for a pointer field: its data or
        null). The driver copies each parameter to the offset the cubin gives it, which for a TMA map
        (64-byte aligned in the constant bank) is not the struct's. The struct is allocated once per
        kernel and thread and refilled per call (a launch copies it out before it returns); every
        field must be named, so none keeps a previous call's value."""
        if len(fields) != len(self._fields) or not self._fields.issuperset(fields):
            missing = sorted(self._fields - set(fields))
            unknown = sorted(set(fields) - self._fields)
            raise TypeError(f"{self._params.__name__}: missing fields {missing}, unknown fields {unknown}")
        storage = getattr(self._per_thread, "storage", None)
        if storage is None:
            struct = self._params()
            pointers = (ctypes.c_void_p * len(self._params._fields_))(
                *[ctypes.addressof(struct) + getattr(self._params, name).offset for name, _ in self._params._fields_])
            storage = self._per_thread.storage = (struct, pointers)
        struct, pointers = storage
        for name, value in fields.items():
            if value is not None and hasattr(value, "data_ptr"):
                value = value.data_ptr()
            setattr(struct, name, value)
        return pointers

    def __call__(self, grid: tuple[int, int, int], *, overlap_previous: bool = False, **fields) -> None:
        """Launch on torch's current stream with the params struct filled from ``fields``.
        ``overlap_previous``: programmatic dependent launch (sm_90+): the grid may be scheduled
        while the kernel before it on the stream finishes, so the kernel must wait
        (``griddepcontrol.wait``) before its first global read or write."""
        import torch

        pointers = self.parameters(**fields)
        stream = torch.cuda.current_stream().cuda_stream
        if not overlap_previous:
            _cu_check(_libcuda().cuLaunchKernel(self._function, grid[0], grid[1], grid[2], self._block, 1, 1,
                                                self._shared_bytes, ctypes.c_void_p(stream), pointers, None),
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
        _cu_check(_libcuda().cuLaunchKernelEx(ctypes.byref(config), self._function, pointers, None),
                  "cuLaunchKernelEx")


def load_kernel(module: CompiledModule, name: str, params: type[ctypes.Structure], block: int,
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
    return Kernel(function, params, block, loaded, shared_bytes), loaded


def module_global(kernel: Kernel, name: str) -> tuple[int, int]:
    """(device address, bytes) of the ``extern "C" __device__`` variable ``name`` of the module
    ``kernel`` was loaded from (diagnostics: the decode kernel's trace buffer)."""
    pointer, size = ctypes.c_uint64(), ctypes.c_size_t()
    _cu_check(_libcuda().cuModuleGetGlobal_v2(ctypes.byref(pointer), ctypes.byref(size), kernel._module,
                                              name.encode()), f"cuModuleGetGlobal({name})")
    return pointer.value, size.value


def copy_to_host(address: int, host: ctypes.c_void_p, size: int) -> None:
    """``size`` bytes from device ``address`` into ``host`` (diagnostics)."""
    _cu_check(_libcuda().cuMemcpyDtoH_v2(host, ctypes.c_uint64(address), ctypes.c_size_t(size)), "cuMemcpyDtoH")


def clear_device(address: int, size: int) -> None:
    """Zero ``size`` bytes at device ``address`` (diagnostics)."""
    _cu_check(_libcuda().cuMemsetD8_v2(ctypes.c_uint64(address), 0, ctypes.c_size_t(size)), "cuMemsetD8")


@dataclass(frozen=True)
class KernelSpec:
    """How to load and launch one kernel of a module: its C++ name expression, the host mirror of
    its params struct, threads per CTA and dynamic shared memory."""

    name: str
    params: type
    block: int
    shared_bytes: int = 0


class LoadedKernels:
    """A kernel family's kernels, loaded once per (device, key) and kept: ``get`` builds the
    module on the first call for a key (``build`` returns the compiled module and the specs of the
    kernels to load from it, in order) and loads it on that device; later calls return the same
    Kernels. Thread-safe: concurrent first calls build once."""

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
                        kernel, handle = load_kernel(module, spec.name, spec.params, spec.block,
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
