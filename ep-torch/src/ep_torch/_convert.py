"""Bit-exact conversion between torch tensors and the numpy arrays ep-core works on.

numpy has neither bfloat16 nor float8, so ep-core stores them as raw bits: bf16 as ``uint16``, FP8 e4m3 as
``uint8``. The conversions here are views (no rounding, no copy when the tensor is contiguous on the CPU).
"""

from __future__ import annotations

import numpy as np
import torch

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

_BITS_VIEW: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {
    torch.bfloat16: (torch.int16, np.dtype(np.uint16)),
    torch.float16: (torch.int16, np.dtype(np.float16)),
    **{dt: (torch.uint8, np.dtype(np.uint8)) for dt in _FP8_DTYPES},
}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array with the tensor's bits: bf16 -> uint16, fp8 -> uint8, other dtypes as themselves."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view = _BITS_VIEW.get(t.dtype)
    if view is None:
        return t.numpy()
    torch_bits, np_dtype = view
    return t.view(torch_bits).numpy().view(np_dtype)


def from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The inverse of :func:`to_numpy`: ``dtype`` is the torch dtype that the bits represent."""
    a = np.ascontiguousarray(a)
    view = _BITS_VIEW.get(dtype)
    if view is None:
        out = torch.from_numpy(a.astype(torch_to_numpy_dtype(dtype), copy=False))
    else:
        torch_bits, np_dtype = view
        if a.dtype != np_dtype:
            if a.dtype.itemsize != np_dtype.itemsize:
                raise TypeError(f"from_numpy: cannot reinterpret {a.dtype} as {dtype}: item sizes differ")
            a = a.view(np_dtype)
        bits_np = np.dtype(np.int16) if torch_bits is torch.int16 else np.dtype(np.uint8)
        out = torch.from_numpy(a.view(bits_np)).view(dtype)
    return out.to(device) if torch.device(device).type != "cpu" else out


_NP_OF_TORCH = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def torch_to_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype holding values (not bits) of ``dtype``."""
    try:
        return np.dtype(_NP_OF_TORCH[dtype])
    except KeyError:
        raise TypeError(f"no numpy value dtype for {dtype}; use to_numpy/from_numpy for raw bits") from None
