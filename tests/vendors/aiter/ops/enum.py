"""Fake aiter.ops.enum: aiter builds ActivationType and QuantType from its compiled module_aiter_core
(pybind enums of csrc/include/aiter_enum.h); the same members and values here."""
import enum


class ActivationType(enum.IntEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2
    Situv2 = 3


class QuantType(enum.IntEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


class MlaVersion(enum.IntEnum):
    V32 = 0
    V40 = 1
