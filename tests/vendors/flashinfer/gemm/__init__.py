"""Fake flashinfer.gemm (0.6.14): the GEMMs kernelmux calls, one sibling module per family (fp8.py: the
block-scaled FP8 GEMMs; fp4.py: mm_fp4), re-exported here by name as gemm_base.py's are in the real package."""
from .fp8 import fp8_blockscale_gemm_sm90 as fp8_blockscale_gemm_sm90
from .fp8 import gemm_fp8_nt_groupwise as gemm_fp8_nt_groupwise
from .fp4 import mm_fp4 as mm_fp4

__all__ = ["fp8_blockscale_gemm_sm90", "gemm_fp8_nt_groupwise", "mm_fp4"]
