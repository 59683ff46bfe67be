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


def _vendor(*calls, extra=""):
    return Vendor("fakevendor", "fake-vendor", ((1, 0), (2, 0)), calls, extra=extra)


def test_keywords_are_probed_on_functions_and_on_methods_by_dotted_path(monkeypatch, tmp_path):
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    assert _vendor(VendorCall("fakevendor.api", "gemm", ("a", "b", "out")),
                   VendorCall("fakevendor.api", "Wrapper.plan", ("indptr", "page_size", "causal"))).problem() is None
    reason = _vendor(VendorCall("fakevendor.api", "Wrapper.plan", ("indptr", "window_left"))).problem()
    assert reason == ("fake-vendor 1.2: fakevendor.api.Wrapper.plan takes no keyword window_left "
                      "(its parameters: self, indptr, page_size, causal)")


def test_a_function_whose_signature_cannot_be_read_is_only_checked_for_presence(monkeypatch, tmp_path):
    install_fake(monkeypatch, tmp_path, "fakevendor", "fake-vendor", "1.2", FAKE)
    assert _vendor(VendorCall("fakevendor.api", "compiled", ("anything",))).problem() is None
    missing = _vendor(VendorCall("fakevendor.api", "absent", ())).problem()
    assert missing.startswith("fake-vendor 1.2: fakevendor.api.absent: AttributeError")


def test_the_install_hint_names_kernelmux_extra(monkeypatch):
    monkeypatch.setattr(Vendor, "version", lambda self: None)
    assert _vendor(extra="fake").problem() == "fake-vendor is not installed (pip install 'kernelmux[fake]')"
    assert "kernelmux[fakevendor]" in _vendor().problem()
