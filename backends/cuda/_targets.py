"""The GPU capabilities the cuda backend's kernels are built for, without importing torch: the
registration table's requirements and the hosts' per-call checks read them here."""

from __future__ import annotations

__all__ = ["DECODE_MIN_CAPABILITY", "HOPPER", "PDL_CAPABILITY"]

DECODE_MIN_CAPABILITY = (8, 9)  # the fp8 decode's cvt.rn.f16x2.e4m3x2 (sm_89+); movmatrix and mma are older
PDL_CAPABILITY = (9, 0)  # programmatic dependent launch (griddepcontrol)
HOPPER = (9, 0)  # wgmma and setmaxnreg: the prefill and MLA kernels' sm_90a cubins run on sm_90 only
