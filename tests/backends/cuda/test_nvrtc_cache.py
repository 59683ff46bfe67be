"""The cuda backend's on-disk cubin cache (_compile.compile_module_cached): keyed on every input of
the compilation, loaded only when its recorded hash matches, written owner-only and atomically,
and never used in a directory other users may write. NVRTC compiles a tiny kernel for sm_90."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest

from cuda_kernels import needs_nvrtc
from kernelmux.backends.cuda import _compile as cuda_compile

pytestmark = needs_nvrtc

SOURCE = "template <int S> __global__ void scale(float* x) { x[threadIdx.x] *= S; }\n"
NAMES = ["scale<2>"]
ARCH = (9, 0)
# Another kernel with the same name expression: a cubin that must never come back for SOURCE.
DECOY = "template <int S> __global__ void scale(float* x) { x[threadIdx.x] += S; }\n"
_compile_now, _headers, _version = cuda_compile.compile_module, cuda_compile.device_headers, cuda_compile.nvrtc_version


@pytest.fixture
def compiles(monkeypatch):
    """The calls compile_module_cached makes to NVRTC (each one compiles for real)."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return _compile_now(*args, **kwargs)

    monkeypatch.setattr(cuda_compile, "compile_module", counting)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache's folder (KERNELMUX_CACHE_DIR/cuda), not created yet."""
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path / "trusted"))
    return tmp_path / "trusted" / "cuda"


def cached(**changes):
    kwargs = dict(source=SOURCE, names=NAMES, arch=ARCH) | changes
    return cuda_compile.compile_module_cached(**kwargs)


def cached_warning(**changes):
    """cached(...) and the messages of the CacheWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = cached(**changes)
    return module, [str(w.message) for w in caught if w.category.__name__ == "CacheWarning"]


def entries(folder):
    return sorted(p for p in folder.iterdir())


@pytest.mark.parametrize("names", [NAMES, ["scale<3>", "scale<2>"]], ids=["one_kernel", "unsorted_names"])
def test_a_second_call_loads_the_entry_without_compiling(cache, compiles, names):
    # Unsorted names, as the backend's modules ask them (the decode kernel, then its merge): the
    # manifest must not compare them in another order (a miss at every call, seen on the H100).
    first = cached(names=names)
    assert first.cubin == _compile_now(SOURCE, names, ARCH).cubin and len(compiles) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = cached(names=names)
    assert len(compiles) == 1 and second.cubin == first.cubin and second.names == first.names


def test_a_planted_file_at_the_entry_path_is_not_loaded(tmp_path, cache, compiles, monkeypatch):
    # Learn the entry's file names from a first compilation, then plant files under those names
    # in a fresh owner-only cache: another kernel's cubin, and beside it whatever metadata file
    # the cache keeps (a names record the format of kernelmux <= 0.1.0 accepted).
    real = cached()
    decoy = _compile_now(DECOY, NAMES, ARCH).cubin
    assert decoy != real.cubin
    planted = tmp_path / "planted" / "cuda"
    planted.mkdir(parents=True, mode=0o700)
    for path in entries(cache):
        data = json.dumps({"names": real.names}).encode() if path.suffix == ".json" else decoy
        (planted / path.name).write_bytes(data)
        (planted / path.name).chmod(0o600)
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(planted.parent))
    loaded, warned = cached_warning()
    assert loaded.cubin == real.cubin and len(compiles) == 2
    assert len(warned) == 1 and "discarded the cached cubin" in warned[0], warned


def test_an_entry_stored_under_another_keys_name_is_not_loaded(cache, compiles):
    # A whole, well-formed entry of the decoy kernel, renamed to the real kernel's entry: its
    # manifest records other key material.
    real = cached(source=SOURCE)
    real_files = entries(cache)
    cached(source=DECOY)
    decoy_files = [p for p in entries(cache) if p not in real_files]
    by_suffix = {p.suffix: p for p in decoy_files}
    for path in real_files:
        path.write_bytes(by_suffix[path.suffix].read_bytes())
    loaded, warned = cached_warning(source=SOURCE)
    assert loaded.cubin == real.cubin and len(compiles) == 3
    assert len(warned) == 1 and "other key material" in warned[0], warned


@pytest.mark.parametrize("damage", ["flip_last_byte", "flip_middle_byte", "truncate_half", "empty"])
def test_an_altered_or_truncated_entry_is_compiled_again_and_rewritten(cache, compiles, damage):
    real = cached()
    # The cubin's bytes are in the entry's largest file (whatever else the cache keeps beside it).
    path = max(entries(cache), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    if damage == "flip_last_byte":  # in the cubin's last section
        data[-1] ^= 0x01
    elif damage == "flip_middle_byte":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate_half":  # a write cut short
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    again, warned = cached_warning()
    assert again.cubin == real.cubin and again.names == real.names and len(compiles) == 2
    assert len(warned) == 1 and "discarded the cached cubin" in warned[0], warned
    # The damaged entry was overwritten with a good one: the next call loads it, silently.
    assert cached_warning()[1] == [] and len(compiles) == 2


def test_folder_and_entries_are_owner_only(cache, compiles):
    # An existing folder of ours that others may read (an older kernelmux made it 0755) is
    # tightened; entries are written 0600 whatever the umask, no temporary file stays behind.
    cache.mkdir(parents=True)
    cache.chmod(0o755)
    cached()
    cached(defines=("KERNELMUX_TEST_FLAG",))
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    files = entries(cache)
    assert len(files) == 2 and not [p for p in files if p.name.startswith(".")]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [
        (p.name, oct(p.stat().st_mode)) for p in files]


def test_a_new_folder_is_created_owner_only(cache, compiles):
    cached()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_failed_write_leaves_neither_a_partial_entry_nor_a_temporary_file(cache, compiles, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    assert cached().cubin == _compile_now(SOURCE, NAMES, ARCH).cubin
    assert entries(cache) == []


# Each change alters what NVRTC is given (or which NVRTC), so it must be a new entry: the
# unchanged entry's cubin would be another program's.
KEY_CHANGES = {
    "source": lambda monkeypatch: dict(source=SOURCE + "// edited\n"),
    "define": lambda monkeypatch: dict(defines=("KERNELMUX_TEST_FLAG",)),
    "names": lambda monkeypatch: dict(names=["scale<2>", "scale<3>"]),
    "arch": lambda monkeypatch: dict(arch=(8, 9)),
    "arch_specific": lambda monkeypatch: dict(arch_specific=True),
    "filename": lambda monkeypatch: dict(filename="renamed.cu"),  # the cubin's line info names it
    "header": lambda monkeypatch: monkeypatch.setattr(
        cuda_compile, "device_headers", lambda: tuple((n, t + "// edited\n") for n, t in _headers())),
    "nvrtc_version": lambda monkeypatch: monkeypatch.setattr(
        cuda_compile, "nvrtc_version", lambda: (_version()[0], _version()[1] + 1)),
    # Same major.minor, another library file (a patch release: its ptxas may generate other code).
    # (raising=False: were these renamed, the change would not reach the key and the test fails.)
    "nvrtc_library": lambda monkeypatch: monkeypatch.setattr(
        cuda_compile, "nvrtc_library", lambda: ["/elsewhere/libnvrtc.so.13.0.99", 1, 2], raising=False),
    "nvrtc_option": lambda monkeypatch: monkeypatch.setattr(
        cuda_compile, "_BASE_OPTIONS", (*getattr(cuda_compile, "_BASE_OPTIONS", ()), "--device-int128"), raising=False),
}


@pytest.mark.parametrize("change", list(KEY_CHANGES))
def test_every_input_of_the_compilation_is_in_the_key(cache, compiles, monkeypatch, change):
    cached()
    before = entries(cache)
    changes = KEY_CHANGES[change](monkeypatch) or {}
    cached(**changes)
    assert len(compiles) == 2, f"{change}: the entry compiled without it was loaded"
    assert set(entries(cache)) > set(before), f"{change}: the new entry replaced the old one"
    cached(**changes)  # and the new entry is found again
    assert len(compiles) == 2


def _plant_valid_entry(tmp_path, folder, monkeypatch):
    """An entry this cache wrote for SOURCE (elsewhere), copied into ``folder``."""
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path / "elsewhere"))
    cached()
    for path in entries(tmp_path / "elsewhere" / "cuda"):
        (folder / path.name).write_bytes(path.read_bytes())
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(folder.parent))


@pytest.mark.parametrize("problem", ["world_writable", "group_writable", "other_owner"])
def test_a_folder_other_users_may_write_is_not_used(tmp_path, compiles, monkeypatch, problem):
    folder = tmp_path / "shared" / "cuda"
    folder.mkdir(parents=True)
    folder.chmod({"world_writable": 0o777, "group_writable": 0o770, "other_owner": 0o700}[problem])
    _plant_valid_entry(tmp_path, folder, monkeypatch)
    planted = entries(folder)
    assert len(compiles) == 1
    if problem == "other_owner":  # the folder is ours; pretend we are someone else
        user = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: user + 1)
    expected = {"world_writable": "group- or world-writable (mode 0777)",
                "group_writable": "group- or world-writable (mode 0770)",
                "other_owner": "owned by uid"}[problem]
    first, warned = cached_warning()
    assert first.cubin == _compile_now(SOURCE, NAMES, ARCH).cubin
    again, warned_again = cached_warning()
    # Neither call loaded the planted entry or wrote there; the reason was given once.
    assert len(compiles) == 3
    assert entries(folder) == planted
    assert len(warned) == 1 and expected in warned[0] and str(folder) in warned[0], warned
    assert warned_again == []


def test_an_unusable_folder_costs_only_the_compilation(tmp_path, compiles, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path / "a_file"))
    module, warned = cached_warning()
    assert module.cubin == _compile_now(SOURCE, NAMES, ARCH).cubin and len(compiles) == 1
    assert len(warned) == 1 and "cannot open it" in warned[0], warned
