"""Fake aiter.jit.utils.chip_info: the GPU the fake pretends to run on, from FAKE_AITER_GFX
(gfx942 by default), read when asked (aiter probes rocminfo)."""
import os

GFX_ENV = "FAKE_AITER_GFX"


def get_gfx():
    return os.environ.get(GFX_ENV, "gfx942")


get_gfx_runtime = get_gfx


def get_cu_num():
    return 304 if get_gfx() == "gfx942" else 256  # MI300X, MI355X
