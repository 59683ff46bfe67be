"""The vendor mechanism's probes (backends/_vendor.py) on fake vendors: keywords of functions and
of methods reached by a dotted path, functions whose signature cannot be read (compiled tvm-ffi
functions), and the install hint naming kernelmux's extra."""

from __future__ import annotations

from kernelmux.backends._vendor import Vendor, VendorCall
from vendors import install_fake

FAKE = {
    "fakevendor/__init__.py": "",
    "fakevendor/api.py": (
        "class Opaque:\n"
        "    __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError('ffi.Function')))\n"
        "    def __call__(self, *args):\n        return args\n"
        "compiled = Opaque()\n"
        "def gemm(a, b, *, out=None):\n    return a\n"
        "class Wrapper:\n"
        "    def plan(self, indptr, page_size, causal=False):\n        pass\n"
    ),
}


def _problem(*calls):
    return _vendor().problem_for(calls)


def _vendor(extra=""):
    return Vendor("fakevendor", "fake-vendor", ((1, 0), (2, 0)), extra=extra)


def test_keywords_are_probed_on_functions_and_on_methods_by_dotted_path(monkeypatch, tmp_path):
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    assert _problem(VendorCall("fakevendor.api", "gemm", ("a", "b", "out")),
                    VendorCall("fakevendor.api", "Wrapper.plan", ("indptr", "page_size", "causal"))) is None
    reason = _problem(VendorCall("fakevendor.api", "Wrapper.plan", ("indptr", "window_left")))
    assert reason == ("fake-vendor 1.2: fakevendor.api.Wrapper.plan takes no keyword window_left "
                      "(its parameters: self, indptr, page_size, causal)")


def test_a_function_whose_signature_cannot_be_read_is_only_checked_for_presence(monkeypatch, tmp_path):
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    assert _problem(VendorCall("fakevendor.api", "compiled", ("anything",))) is None
    missing = _problem(VendorCall("fakevendor.api", "absent", ()))
    assert missing.startswith("fake-vendor 1.2: fakevendor.api.absent: AttributeError")


def test_a_torch_op_is_probed_through_its_schema(monkeypatch, tmp_path):
    # Vendors that register torch ops (vllm-xpu-kernels' _moe_C, _xpu_C) are called by the schema's
    # argument names; a release that renames one rejects the op, as for a Python function.
    import torch

    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    library = torch.library.Library("kernelmux_vendor_probe", "DEF")
    library.define("gemm(Tensor a, Tensor b, float alpha=1.0) -> Tensor")
    try:
        assert _problem(VendorCall("torch", "ops.kernelmux_vendor_probe.gemm", ("a", "b", "alpha"))) is None
        assert _problem(VendorCall("torch", "ops.kernelmux_vendor_probe.gemm.default", ("a", "b"))) is None
        reason = _problem(VendorCall("torch", "ops.kernelmux_vendor_probe.gemm", ("a", "beta")))
        assert reason == ("fake-vendor 1.2: torch.ops.kernelmux_vendor_probe.gemm takes no keyword beta "
                          "(its parameters: a, b, alpha)")
        assert "AttributeError" in _problem(VendorCall("torch", "ops.kernelmux_vendor_probe.absent", ()))
    finally:
        library._destroy()


def test_a_call_without_a_function_probes_that_its_module_imports(monkeypatch, tmp_path):
    # A compiled extension whose import registers torch ops (vllm-xpu-kernels' _C): a failed import
    # is the op's reason, whatever it raises.
    files = {**FAKE, "fakevendor/_ext.py": "raise OSError('libsycl.so.9: cannot open shared object file')\n"}
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", files)
    assert _problem(VendorCall("fakevendor.api")) is None
    assert _problem(VendorCall("fakevendor._ext")) == (
        "fake-vendor 1.2: import fakevendor._ext failed: OSError: libsycl.so.9: cannot open shared object file")


def test_the_install_hint_names_kernelmux_extra(monkeypatch):
    monkeypatch.setattr(Vendor, "version", lambda self: None)
    assert _vendor(extra="fake").problem() == "fake-vendor is not installed (pip install 'kernelmux[fake]')"
    assert "kernelmux[fakevendor]" in _vendor().problem()


def test_a_broken_call_rejects_only_the_ops_that_make_it(monkeypatch, tmp_path):
    # One vendor API changing must not take the vendor's other ops down with it.
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    vendor = _vendor()
    broken = (VendorCall("fakevendor.api", "gemm", ("a", "alpha")),)
    fine = (VendorCall("fakevendor.api", "gemm", ("a", "b")),)
    assert vendor.problem() is None and vendor.problem_for(fine) is None
    assert "takes no keyword alpha" in vendor.problem_for(broken)
    assert vendor.static_check(broken)(None) == vendor.problem_for(broken)
