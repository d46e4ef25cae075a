"""LogFMT-10, DeepEP V1's encoding of the low-latency combine payload (``low_latency_combine(use_logfmt=True)``):
the numpy model (``encode`` / ``decode`` / ``roundtrip``, the contract) and its torch twin (``roundtrip_torch``,
what the CPU backend and the CUDA adapter run; the native kernel's ``ep_core/ll_logfmt.cuh`` does the same
arithmetic), bit for bit equal.

Format of one bf16 row of ``hidden`` channels (``hidden % 512 == 0``):

- **Groups** of 128 consecutive channels carry ``(amax, amin)``: the largest and smallest magnitude (bf16 bits,
  compared as integers, so NaN > Inf > finite). **Chunks** of ``1024`` channels (``512`` when ``hidden % 1024``)
  are encoded, or sent as plain bf16, as a whole: a chunk is encoded iff every group in it has
  ``0 < amax < 1`` and ``amin < amax`` (V1's test ``log2 amax < 0 and log2 amin < log2 amax``: all-zero,
  all-equal, >= 1, Inf and NaN groups keep their chunk in bf16, exactly).
- **Code** of an encoded value: a sign bit and a 9-bit magnitude code ``c``: 0 is zero, ``c >= 1`` is
  ``2 ** (lmin + (c - 1) * step)``, the 511 levels evenly spaced in log2 between ``lmin`` and ``lmax = log2 amax``;
  ``lmin = max(log2 amin, lmax - 32)`` (``lmax - 32`` when ``amin == 0``), ``step = (lmax - lmin) / 510``.
  Encoding rounds to the level nearest in the linear domain: ``c = floor((log2|x| - lmin) / step + rnd)`` clamped
  to [0, 511] (0 for x = 0), ``rnd = 2 - log2((1 + 2**step) / 2) / step``, taken as its expansion
  ``1.5 - step * ln2 / 8`` (the next term is below 1e-6 of a level); values far under ``lmin`` become zero.
- **Decoding** returns float32 (not rounded to bf16): the combine multiplies it by the top-k weight and adds it in
  fp32 like a bf16 output (``legacy.reference.ll_combine_reference``'s order).

Arithmetic (what makes numpy, torch and the GPU agree bitwise; DeepEP uses the GPU's approximate ``lg2``/``ex2``,
so its codes can differ from these by one level at a rounding boundary): ``log2`` of a bf16 magnitude is its
exponent plus a table of ``log2(1 + k/128)`` (float32, one add); ``step``, ``1/step`` are correctly rounded
float32 divisions; ``u = ((log2|x| - lmin) * inv) + rnd`` and ``y = lmin + (c - 1) * step`` are separately rounded
float32 operations (no fused multiply-add); ``2**y`` is ``p(f) * 2**n`` (``n = floor(y)``, ``f = y - n``, ``p`` a
degree-6 float32 Horner polynomial, relative error < 1e-7), scaled through ``2**(n + 100)`` then ``2**-100``
(one rounding, subnormals kept). Wire format of the native kernel: per slot the group words ``amax | amin << 16``
and, per chunk at its bf16 offset, either the bf16 values or 5 uint32 per 16 values (the 16 nine-bit codes as a
little-endian bit string in bits 0..143, the 16 signs in bits 144..159): 10 bits a value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from ep_core.errors import EPValueError

__all__ = [
    "GROUP",
    "LogFMTEncoded",
    "check_hidden",
    "chunk_size",
    "decode",
    "encode",
    "exp2_model",
    "log2_bf16",
    "roundtrip",
    "roundtrip_torch",
]

GROUP = 128  # channels per (amax, amin) pair
MIN_CLIP = 32.0  # lmin >= lmax - 32 (V1's kMinClip)
LEVELS = 510  # step = (lmax - lmin) / 510: codes 1..511 span [lmin, lmax]
MAX_CODE = 511
_ONE_BITS = 0x3F80  # bf16 1.0: an encoded chunk's magnitudes are all below it

# log2(1 + k / 128), k = 0..127, float32 (the bf16 mantissas); ll_logfmt.cuh holds the same table
LOG2_TABLE = np.log2(1.0 + np.arange(128) / 128.0).astype(np.float32)
# 2**f on [0, 1): coefficients of f**0 .. f**6 (float32 bits; ll_logfmt.cuh holds the same)
EXP2_POLY_BITS = (0x3F800000, 0x3F317215, 0x3E75FECD, 0x3D6342B1, 0x3C1E9275, 0x3AA3180E, 0x39637149)
_EXP2_POLY = np.array(EXP2_POLY_BITS, dtype=np.uint32).view(np.float32)
_RND_SLOPE = np.float32(np.log(2.0) / 8.0)  # rnd = 1.5 - step * ln2 / 8


def chunk_size(hidden: int) -> int:
    """Channels encoded (or not) as one: 1024 when ``hidden % 1024 == 0``, else 512 (V1's send unroll)."""
    return 1024 if hidden % 1024 == 0 else 512


def check_hidden(hidden: int, op: str = "low_latency_combine") -> None:
    """LogFMT needs ``hidden % 512 == 0`` (V1's combine: whole chunks of 512 or 1024 channels)."""
    if hidden <= 0 or hidden % 512:
        raise EPValueError(
            f"{op}: use_logfmt=True needs hidden % 512 == 0 (whole LogFMT chunks), got {hidden}"
        )


def log2_bf16(mag: np.ndarray) -> np.ndarray:
    """log2 of positive finite bf16 magnitudes (bits 1..0x7F7F, uint16/int) as float32: exponent + table."""
    b = np.asarray(mag).astype(np.int64)
    e = b >> 7
    k = b & 127
    # subnormal k * 2**-133: normalise k's leading one to bit 7 (p = floor(log2 k))
    p = np.where(k > 0, np.floor(np.log2(np.maximum(k, 1))), 0).astype(np.int64)
    idx = np.where(e > 0, k, (k << (7 - p)) & 127)
    ex = np.where(e > 0, e - 127, p - 133).astype(np.float32)
    return (ex + LOG2_TABLE[idx]).astype(np.float32)


def exp2_model(y: np.ndarray) -> np.ndarray:
    """2**y for float32 y in [-170, 0): ``p(y - floor y)`` scaled by ``2**floor(y)`` (see the module doc)."""
    y = np.asarray(y, dtype=np.float32)
    n = np.floor(y).astype(np.float32)
    f = (y - n).astype(np.float32)
    p = np.full_like(f, _EXP2_POLY[6])
    for c in _EXP2_POLY[5::-1]:
        p = ((p * f).astype(np.float32) + c).astype(np.float32)
    ni = n.astype(np.int32)
    up = ((ni + 100 + 127).astype(np.uint32) << 23).view(np.float32)
    down = np.float32(2.0**-100)
    return ((p * up).astype(np.float32) * down).astype(np.float32)


def _group_params(
    amax: np.ndarray, amin: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group: (castable, lmin, step, inv) from the magnitude bits (garbage where not castable)."""
    ok = (amax > 0) & (amax < _ONE_BITS) & (amin < amax)
    safe_max = np.where(ok, amax, 0x3F00)  # a dummy castable pair where not ok (no log2 of 0, Inf, NaN)
    safe_min = np.where(ok, amin, 0)
    lmax = log2_bf16(safe_max)
    floor_ = (lmax - np.float32(MIN_CLIP)).astype(np.float32)
    lmin = np.where(safe_min == 0, floor_, np.maximum(log2_bf16(np.maximum(safe_min, 1)), floor_))
    lmin = lmin.astype(np.float32)
    step = ((lmax - lmin).astype(np.float32) / np.float32(LEVELS)).astype(np.float32)
    inv = (np.float32(1.0) / step).astype(np.float32)
    return ok, lmin, step, inv


def _groups(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(magnitude bits [..., G, 128] int64, amax [..., G], amin [..., G])."""
    b = np.asarray(bits).astype(np.int64) & 0xFFFF
    check_hidden(b.shape[-1], "logfmt")
    mag = (b & 0x7FFF).reshape(*b.shape[:-1], b.shape[-1] // GROUP, GROUP)
    return mag, mag.max(-1), mag.min(-1)


def _chunk_cast(ok: np.ndarray, hidden: int) -> np.ndarray:
    """[..., G] castable groups -> [..., G] whether each group's chunk is encoded."""
    per = chunk_size(hidden) // GROUP
    c = ok.reshape(*ok.shape[:-1], ok.shape[-1] // per, per).all(-1)
    return np.repeat(c, per, axis=-1)


class LogFMTEncoded(NamedTuple):
    """``values`` [..., H] uint16: per channel ``sign << 9 | code`` in encoded chunks, the bf16 bits elsewhere;
    ``meta`` [..., H / 128] uint32 ``amax | amin << 16``; ``cast`` [..., H / chunk] bool (what the receiver
    derives from ``meta``)."""

    values: np.ndarray
    meta: np.ndarray
    cast: np.ndarray


def encode(bits: np.ndarray) -> LogFMTEncoded:
    """LogFMT-10 of bf16 rows ``bits`` [..., H] (uint16 bit patterns)."""
    b = np.asarray(bits).astype(np.int64) & 0xFFFF
    h = b.shape[-1]
    mag, amax, amin = _groups(b)
    ok, lmin, step, inv = _group_params(amax, amin)
    cast_g = _chunk_cast(ok, h)
    rnd = (np.float32(1.5) - (step * _RND_SLOPE).astype(np.float32)).astype(np.float32)
    lx = log2_bf16(np.maximum(mag, 1))
    u = ((lx - lmin[..., None]).astype(np.float32) * inv[..., None]).astype(np.float32)
    u = (u + rnd[..., None]).astype(np.float32)
    code = np.clip(np.floor(np.where(np.isfinite(u), u, 0)), 0, MAX_CODE).astype(np.int64)
    code = np.where(mag == 0, 0, code)
    sign = (b.reshape(mag.shape) >> 15) & 1
    enc = (sign << 9) | code
    values = np.where(cast_g[..., None], enc, b.reshape(mag.shape)).reshape(b.shape).astype(np.uint16)
    meta = (amax | (amin << 16)).astype(np.uint32)
    per = chunk_size(h) // GROUP
    return LogFMTEncoded(values, meta, cast_g[..., ::per].copy())


def decode(values: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """The float32 rows [..., H] of an encoding (the cast flags derived from ``meta``, as the receiver does)."""
    v = np.asarray(values).astype(np.int64)
    h = v.shape[-1]
    meta = np.asarray(meta).astype(np.int64)
    amax, amin = meta & 0xFFFF, (meta >> 16) & 0xFFFF
    ok, lmin, step, _ = _group_params(amax, amin)
    cast_g = _chunk_cast(ok, h)
    g = v.reshape(*v.shape[:-1], h // GROUP, GROUP)
    code = (g & 0x1FF).astype(np.float32)
    y = lmin[..., None] + ((code - np.float32(1)).astype(np.float32) * step[..., None]).astype(np.float32)
    mag = np.where((g & 0x1FF) == 0, np.float32(0), exp2_model(np.where((g & 0x1FF) == 0, -1, y)))
    dec = np.where((g >> 9) & 1, -mag, mag).astype(np.float32)
    plain = (g.astype(np.uint32) << 16).view(np.float32)
    return np.where(cast_g[..., None], dec, plain).reshape(v.shape).astype(np.float32)


def roundtrip(bits: np.ndarray) -> np.ndarray:
    """``decode(encode(bits))``: float32 [..., H], what the combine adds (times its weight) for a bf16 row."""
    enc = encode(bits)
    return decode(enc.values, enc.meta)


# --- torch twin (CPU backend and the CUDA adapter; fixed shapes, no host sync) -------------------------------------


def _t_log2(mag: Any, table: Any) -> Any:
    import torch

    e = mag >> 7
    k = mag & 127
    kk = torch.clamp(k, min=1)
    p = torch.zeros_like(k)
    for s in (4, 2, 1):  # floor(log2 k) for k < 128 by halving
        big = (kk >> (p + s)) > 0
        p = torch.where(big, p + s, p)
    idx = torch.where(e > 0, k, (k << (7 - p)) & 127)
    ex = torch.where(e > 0, e - 127, p - 133).to(torch.float32)
    return ex + table[idx]


def roundtrip_torch(x: Any) -> Any:
    """``roundtrip`` on a bf16 tensor ``x`` [..., H] (any device): float32 [..., H], the same bits."""
    import torch

    h = int(x.shape[-1])
    check_hidden(h, "logfmt")
    dev = x.device
    table = torch.from_numpy(LOG2_TABLE).to(dev)
    b = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    g = b.reshape(*b.shape[:-1], h // GROUP, GROUP)
    mag = g & 0x7FFF
    amax, amin = mag.amax(-1), mag.amin(-1)
    ok = (amax > 0) & (amax < _ONE_BITS) & (amin < amax)
    safe_max = torch.where(ok, amax, torch.full_like(amax, 0x3F00))
    safe_min = torch.where(ok, amin, torch.zeros_like(amin))
    lmax = _t_log2(safe_max, table)
    floor_ = lmax - MIN_CLIP
    lmin = torch.where(
        safe_min == 0, floor_, torch.maximum(_t_log2(torch.clamp(safe_min, min=1), table), floor_)
    )
    # tensor divisors: torch divides by a python scalar as a multiply by its reciprocal (not correctly rounded)
    step = (lmax - lmin) / torch.full_like(lmax, float(LEVELS))
    inv = torch.ones_like(step) / step
    rnd = 1.5 - step * float(_RND_SLOPE)
    per = chunk_size(h) // GROUP
    cast = ok.reshape(*ok.shape[:-1], ok.shape[-1] // per, per).all(-1).repeat_interleave(per, dim=-1)
    lx = _t_log2(torch.clamp(mag, min=1), table)
    u = (lx - lmin[..., None]) * inv[..., None]
    u = u + rnd[..., None]
    code = torch.clamp(torch.floor(torch.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0)), 0, MAX_CODE)
    code = torch.where(mag == 0, torch.zeros_like(code), code)
    y = lmin[..., None] + (code - 1.0) * step[..., None]
    y = torch.where(code == 0, torch.full_like(y, -1.0), y)
    n = torch.floor(y)
    f = y - n
    poly = torch.from_numpy(_EXP2_POLY.copy()).to(dev)
    p = torch.full_like(f, float(_EXP2_POLY[6]))
    for i in range(5, -1, -1):
        p = p * f + poly[i]
    up = ((n.to(torch.int32) + 227) << 23).view(torch.float32)
    val = (p * up) * float(np.float32(2.0**-100))
    val = torch.where(code == 0, torch.zeros_like(val), val)
    dec = torch.where(((g >> 15) & 1) == 1, -val, val)
    plain = x.reshape(g.shape).to(torch.float32)  # exact (NaN payloads kept)
    return torch.where(cast[..., None], dec, plain).reshape(x.shape)
