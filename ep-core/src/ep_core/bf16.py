"""Exact bfloat16 arithmetic for numpy, which has no bfloat16 dtype: ep_core stores bf16 values as their bits in
`uint16` arrays. `float32_to_bf16` rounds to nearest even (`__float2bfloat16_rn`: the sign of zero and infinities
kept, every NaN a quiet NaN of its sign); `bf16_to_float32` is exact; `stochastic_bits` is DeepEP's stochastic
rounding (its bf16 reduce-scatter's wire format).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_bf16_bits", "bf16_to_float32", "float32_to_bf16", "is_bf16_dtype", "stochastic_bits"]


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


_HASH_IN = (0x5671D42B, 0x9995E499, 0xACE1B8A5, 0xE153538D)


def stochastic_bits(x: Any, first_quad: int = 0) -> np.ndarray:
    """DeepEP's stochastic rounding of float32 ``x`` (1-D, a multiple of 4 elements) to bf16 bits (uint16).

    Elements go in groups of 4 (a float4, numbered from ``first_quad``: its index in the whole tensor); a 32-bit
    hash of the 4 values' bits and the index gives two words of random bits, the first for elements 0-1 and the
    second for 2-3, the low 16 bits for the even element and the high 16 for the odd one. An element adds its 16
    random bits to its float32 bits and keeps the top 16 (``|v|`` rounds up with probability its distance from the
    bf16 below it, in units of the last place; a carry past the largest finite bf16 gives infinity); NaN gives the
    canonical 0x7FFF. ``include/ep_core/bucket_bf16.cuh`` computes the same bits on the GPU."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    quads = bits.reshape(-1, 4)
    u32 = np.uint32
    h = (np.arange(quads.shape[0], dtype=np.uint64) + first_quad).astype(u32)
    for k in range(4):
        h = h + quads[:, k] * u32(_HASH_IN[k])
    h ^= h >> u32(23)
    h = h * u32(0x7FEB352D)
    h ^= h >> u32(16)
    h1 = h * u32(0x846CA68B)
    h1 ^= h1 >> u32(11)
    h2 = h * u32(0xD35A2D97)
    h2 ^= h2 >> u32(11)
    mask = u32(0xFFFF)
    rnd = np.stack([h1 & mask, h1 >> u32(16), h2 & mask, h2 >> u32(16)], axis=1).reshape(-1)
    out = ((bits + rnd) >> u32(16)).astype(np.uint16)  # a non-NaN's bits + 0xFFFF stay below 2**32
    out[(bits & u32(0x7FFFFFFF)) > u32(0x7F800000)] = 0x7FFF
    return out
