"""Tensors over a buffer's own GPU memory: the outputs of a zero-copy dispatch and the combine buffer. They lie at
the same few places with only the row count changing, and a tensor through the CUDA array interface costs tens of
microseconds, so each place becomes a tensor once (with the most rows seen) and each call gets a new tensor object
over its rows (no autograd state carried from one call's tensor to the next).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ZeroCopyTensors"]


class ZeroCopyTensors:
    """Per buffer: the tensor of each place of its memory, by `(address, row shape, dtype)`. Cleared when the buffer
    is destroyed (the memory is released with it)."""

    __slots__ = ("_device", "_tensors")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._tensors: dict[tuple, torch.Tensor] = {}

    def tensor(self, arr: Any, dtype: torch.dtype) -> torch.Tensor | None:
        """`arr` (an ep-core array of the buffer's own GPU memory, rows first, contiguous) as a tensor of `dtype`
        (the same item size: bf16 / FP8 bits arrive as uint16 / uint8) over the same memory."""
        if arr is None:
            return None
        shape = arr.shape
        rows = shape[0]
        key = (arr.ptr, shape[1:], dtype)
        whole = self._tensors.get(key)
        if whole is None or whole.shape[0] < rows:
            whole = self._tensors[key] = self._whole(arr, dtype)
        # a new tensor object over the same memory: an alias of all rows (the no-sync calls' worst case, a third of
        # a slice's host time) or a slice
        return whole.detach() if whole.shape[0] == rows else whole[:rows]

    def outputs(
        self, recv_x: Any, x_dtype: torch.dtype, recv_sf: Any, sf_dtype: Any, recv_idx: Any, recv_w: Any
    ) -> tuple:
        """A zero-copy dispatch's outputs as tensors (`tensor` of each), in one call: `(recv_x, recv_topk_idx,
        recv_topk_weights)`, `recv_x` a `(data, scales)` tuple iff `sf_dtype` is given."""
        tensor = self.tensor
        rx = tensor(recv_x, x_dtype)
        if sf_dtype is not None:
            rx = (rx, tensor(recv_sf, sf_dtype))
        return rx, tensor(recv_idx, torch.int64), tensor(recv_w, torch.float32)

    def _whole(self, arr: Any, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of all of `arr`, once per place (through the CUDA array interface)."""
        whole = torch.as_tensor(arr, device=self._device)
        return whole if whole.dtype == dtype else whole.view(dtype)

    def clear(self) -> None:
        self._tensors.clear()
