"""numpy reference of the V1 low-latency numerics that ``ep_torch.Buffer`` promises bit for bit (on CPU and GPU).

- **Masked layout** (``ll_expected_rows``): local expert e of rank r holds one row per (source rank, source token)
  whose top-k selects e, in ascending (source rank, source token) order; ``recv_count[e]`` is their number.
- **FP8 cast** (``fp8_cast_reference``), per 128 channels of a bf16 row: ``amax = max(max|x|, 1e-4)`` (fp32),
  ``scale = amax / 448`` (one correctly rounded fp32 division), with ``round_scale`` rounded up to a power of two
  by its bits (exponent + 1 when any mantissa bit is set, V1's ``log2_ceil``), ``q = e4m3(x / scale)`` (fp32
  division, round to nearest even; beyond 448 is NaN like torch's cast). ``use_ue8m0`` stores each scale's exponent
  byte, four per int32, channel group 4p + j in byte j.
- **Combine** (``ll_combine_reference``): ``combined[t] = bf16(acc)`` with ``acc = +0.0`` (fp32) and, for every lane
  k in ascending order with ``topk_idx[t, k] >= 0``: ``p = fp32(y[t, k]) * w[t, k]`` then ``acc = acc + p`` (two
  separately rounded fp32 operations, no fused multiply-add), one round-to-nearest-even to bf16 at the end.
  With ``use_logfmt`` ``fp32(y[t, k])`` is the LogFMT round trip of the expert's row (``legacy.logfmt.roundtrip``,
  float32, not rounded to bf16).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "bf16_to_f32",
    "f32_to_bf16",
    "fp8_cast_reference",
    "fp8_e4m3_bits",
    "ll_combine_reference",
    "ll_expected_rows",
]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 bit patterns, round to nearest even (NaN stays a quiet NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), rounded)


def ll_expected_rows(
    topk_idx_per_rank: list[np.ndarray], rank: int, num_experts: int
) -> list[list[tuple[int, int]]]:
    """Per local expert of ``rank``: the (source rank, source token) of its packed rows, in order."""
    n = len(topk_idx_per_rank)
    epr = num_experts // n
    rows: list[list[tuple[int, int]]] = [[] for _ in range(epr)]
    for src, idx in enumerate(topk_idx_per_rank):
        for t in range(idx.shape[0]):
            for e in sorted({int(v) - rank * epr for v in idx[t] if v >= 0 and int(v) // epr == rank}):
                rows[e].append((src, t))
    return rows


def ll_combine_reference(
    y_bits: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, use_logfmt: bool = False
) -> np.ndarray:
    """``y_bits`` [T, K, H] bf16 bits: the expert output of token t's lane k. Returns [T, H] bf16 bits."""
    if use_logfmt:
        from .logfmt import roundtrip

        y = roundtrip(y_bits)
    else:
        y = bf16_to_f32(y_bits)
    w = np.asarray(topk_weights, dtype=np.float32)
    acc = np.zeros((y.shape[0], y.shape[2]), dtype=np.float32)
    for k in range(y.shape[1]):
        p = (y[:, k] * w[:, k : k + 1]).astype(np.float32)
        acc = np.where((np.asarray(topk_idx)[:, k] >= 0)[:, None], (acc + p).astype(np.float32), acc)
    return f32_to_bf16(acc)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(127)  # positive finite codes; 127 is NaN
    exp, man = codes >> 3, codes & 7
    return np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * 2.0 ** (exp - 7))


_E4M3 = _e4m3_table()


def fp8_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 to float8_e4m3fn bit patterns (uint8), round to nearest even; |x| rounding past 448 is NaN."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = np.where(a >= 2.0**-6, 2.0 ** (exp - 3), 2.0**-9)  # exact power of two: a / quantum is exact
    q = np.round(a / quantum) * quantum  # ties to even multiple = even mantissa
    code = np.searchsorted(_E4M3, q).astype(np.int64)
    code = np.where(q > 448.0, 127, code)
    code = np.where(np.isnan(x), 127, code)
    sign = (np.signbit(x)).astype(np.int64) << 7
    return (code | sign).astype(np.uint8)


def _pow2_ceil(s: np.ndarray) -> np.ndarray:
    b = s.view(np.int32)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)
    return (e.astype(np.int32) << 23).view(np.float32)


def fp8_cast_reference(
    x_bits: np.ndarray, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``x_bits`` [R, H] bf16 bits. Returns (q [R, H] uint8 e4m3 bits, scales [R, H/128] float32, or with
    ``use_ue8m0`` [R, H/512] int32)."""
    x = bf16_to_f32(x_bits)
    r, h = x.shape
    g = x.reshape(r, h // 128, 128)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-4)).astype(np.float32)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    if round_scale:
        scale = _pow2_ceil(scale)
    q = fp8_e4m3_bits((g / scale[..., None]).astype(np.float32)).reshape(r, h)
    if not use_ue8m0:
        return q, scale
    exps = ((scale.view(np.int32) >> 23) & 0xFF).reshape(r, h // 512, 4)
    packed = exps[..., 0] | exps[..., 1] << 8 | exps[..., 2] << 16 | exps[..., 3] << 24
    return q, packed.astype(np.int32)
