"""V1 low-latency FP8 cast in torch, bit for bit ``legacy.reference.fp8_cast_reference`` on CPU and GPU.

Only correctly rounded elementwise ops: the scale is divided by a *tensor* 448 (torch's CUDA division by a Python
scalar multiplies by its reciprocal, which rounds differently), the power-of-two rounding works on the bits (a
``log2``/``ceil`` of the float can land on the wrong side of an exact power), ``amax`` is order independent.
"""

from __future__ import annotations

import torch
from ep_core.errors import EPValueError

__all__ = ["per_token_cast_to_fp8"]


def per_token_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False, col_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128 channels: ``amax = max(|x|, 1e-4)``, ``scale = amax / 448`` (rounded up to a power of two with
    ``round_scale``), ``q = fp8_e4m3(x / scale)``. Scales are float32 ``[..., H/128]``; with ``use_ue8m0`` each
    scale's exponent byte, four per int32 (little-endian), ``[..., H/512]``. ``col_major``: the last two dimensions
    of the scales are stored column-major like V1's."""
    *lead, h = x.shape
    if h % 128:
        raise EPValueError(f"per_token_cast_to_fp8: hidden={h} must be a multiple of 128")
    g = x.to(torch.float32).reshape(*lead, h // 128, 128)
    amax = g.abs().amax(-1).clamp(min=1e-4)
    scale = amax / torch.full_like(amax, 448.0)
    if round_scale:
        bits = scale.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exp << 23).view(torch.float32)
    q = (g / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(*lead, h)
    if use_ue8m0:
        if (h // 128) % 4:
            raise EPValueError(
                f"use_ue8m0: hidden={h} must be a multiple of 512 (four scale bytes per int32)"
            )
        exp = ((scale.view(torch.int32) >> 23) & 0xFF).reshape(*lead, h // 512, 4)
        scale = exp[..., 0] | (exp[..., 1] << 8) | (exp[..., 2] << 16) | (exp[..., 3] << 24)
    if col_major and scale.dim() >= 2:
        scale = scale.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, scale
