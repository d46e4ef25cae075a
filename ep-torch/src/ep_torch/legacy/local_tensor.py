"""V1's ``Buffer.get_local_buffer_tensor``: a tensor over this rank's own symmetric memory (issue 42).

DeepEP V1 returns ``from_blob(base + offset, num_bytes // itemsize)[:size.numel()].view(size)`` over its NVLink or
RDMA buffer, ``offset`` in bytes (its docstring says elements), and the count ignores the offset, so its view runs
``offset`` bytes past the region. Here:

- ``use_rdma_buffer=False``: the data region of the normal-mode inner buffer, only when sized up front
  (``num_max_tokens_per_rank`` and ``hidden``: built in the constructor, never rebuilt under a view);
- ``use_rdma_buffer=True``: the low-latency inner buffer's data region, built by the first ``low_latency_dispatch``;
- ``offset``: bytes, a multiple of ``dtype``'s item size, at most the region's size; the view holds
  ``(num_bytes - offset) // itemsize`` elements (never past the region);
- the memory is the GPU's or, on the CPU backend, the reference executor's host storage, shared with the buffer.
  Valid until ``destroy()``, or ``reset()`` after a failure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ep_core.errors import EPStateError, EPTypeError, EPValueError

__all__ = ["local_buffer_tensor"]


def local_buffer_tensor(
    buf: Any, dtype: torch.dtype, size: Any = None, offset: int = 0, use_rdma_buffer: bool = False
) -> torch.Tensor:
    """``Buffer.get_local_buffer_tensor`` of V1's ``buf`` (module doc)."""
    op = f"get_local_buffer_tensor (rank {buf.rank})"
    if not isinstance(dtype, torch.dtype):
        raise EPTypeError(f"{op}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise EPTypeError(f"{op}: offset must be an int (bytes), got {type(offset).__name__}")
    if buf._destroyed:
        raise EPStateError(f"{op}: the buffer was destroyed")
    region = _region(buf, op, bool(use_rdma_buffer))
    whole = _as_tensor(region)
    item = torch.empty((), dtype=dtype).element_size()
    total = int(whole.numel())
    if offset < 0 or offset > total or offset % item:
        raise EPValueError(
            f"{op}: offset must be a byte offset in [0, {total}] (the region's size) and a multiple of {item} "
            f"({dtype}'s item size), got {offset}"
        )
    count = (total - offset) // item
    flat = whole[offset : offset + count * item].view(dtype)
    if size is None:
        return flat
    try:
        shape = torch.Size(size)
    except (TypeError, ValueError) as exc:
        raise EPTypeError(f"{op}: size must be a torch.Size (or ints), got {size!r}") from exc
    if any(d < 0 for d in shape):
        raise EPValueError(f"{op}: size must have no negative dimension, got {tuple(shape)}")
    if shape.numel() > count:
        raise EPValueError(
            f"{op}: size {tuple(shape)} needs {shape.numel()} elements of {dtype}; the region holds {count} past "
            f"offset {offset} ({total} bytes)"
        )
    return flat[: shape.numel()].view(shape)


def _region(buf: Any, op: str, rdma: bool) -> Any:
    """The ep-core byte array (``BufferBase.data``) of the inner buffer this call names (module doc)."""
    if rdma:
        inner = buf._ll_inner
        if not buf.low_latency_mode and inner is None:
            raise EPValueError(
                f"{op}: use_rdma_buffer=True: this buffer has no RDMA buffer (low_latency_mode=False; ep's normal "
                "mode keeps NVLink and RDMA traffic in one region): pass use_rdma_buffer=False"
            )
        if inner is None or inner.runtime is None or inner.runtime.destroyed:
            raise EPStateError(
                f"{op}: use_rdma_buffer=True: the low-latency buffer is built by the first low_latency_dispatch "
                "(its sizes come with that call); call it after that dispatch"
            )
        return inner.runtime.data
    inner = buf._inner
    if not buf._user_sized:
        raise EPValueError(
            f"{op}: use_rdma_buffer=False: ep builds the normal-mode buffer at the first dispatch and rebuilds it "
            "for larger ones (freeing the memory under a view); construct Buffer(..., num_max_tokens_per_rank=..., "
            "hidden=...) to build it up front, once"
            + ("; or, in low-latency mode, pass use_rdma_buffer=True" if buf.low_latency_mode else "")
        )
    if inner is None or inner.runtime is None or inner.runtime.destroyed:
        raise EPStateError(
            f"{op}: the normal-mode buffer was released (reset() after a failure); dispatch again"
        )
    return inner.runtime.data


def _as_tensor(arr: Any) -> torch.Tensor:
    """An ep-core uint8 ``DeviceArray`` as a tensor over the same memory (host: through numpy; CUDA: through the CUDA
    array interface, which keeps ``arr`` and so the storage object alive)."""
    if arr.device == "cpu":
        return torch.from_numpy(np.asarray(arr))
    return torch.as_tensor(arr, device=torch.device("cuda", int(arr.device_id)))
