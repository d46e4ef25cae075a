"""Exact bfloat16 arithmetic for numpy, which has no bfloat16 dtype: ep_core stores bf16 values as their bits in
`uint16` arrays. `float32_to_bf16` rounds to nearest even (`__float2bfloat16_rn`: the sign of zero and infinities
kept, every NaN a quiet NaN of its sign); `bf16_to_float32` is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_bf16_bits", "bf16_to_float32", "float32_to_bf16", "is_bf16_dtype"]


def float32_to_bf16(x: Any) -> np.ndarray:
    """Round float32 values to bf16 (round to nearest, ties to even); returns the bit patterns as uint16."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_to_float32(bits: Any) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32, exactly."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        b = as_bf16_bits(b)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def is_bf16_dtype(dtype: Any) -> bool:
    """True for the dtypes ep_core treats as bf16 storage: uint16 bit patterns or a `bfloat16` extension dtype."""
    dt = np.dtype(dtype)
    return dt == np.uint16 or (dt.itemsize == 2 and dt.name == "bfloat16")


def as_bf16_bits(x: Any) -> np.ndarray:
    """View bf16 data as uint16 bit patterns.

    Accepts uint16 arrays (returned as is), arrays of a 2-byte `bfloat16` extension dtype (viewed), and float32 /
    float64 arrays (rounded with `float32_to_bf16`; pass bf16-representable values to stay exact).
    """
    a = np.asarray(x)
    if a.dtype == np.uint16:
        return a
    if a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype in (np.float32, np.float64):
        return float32_to_bf16(a.astype(np.float32))
    raise TypeError(f"expected bf16 data (uint16 bit patterns, bfloat16 or float32), got dtype {a.dtype}")
