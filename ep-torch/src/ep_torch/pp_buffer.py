"""``PPBuffer``: V2.5's buffer for pipeline-parallel send/recv alone (DeepEP's ``deep_ep.PPBuffer`` surface).

Its own symmetric storage, sized for ``num_max_tensor_bytes`` x ``num_max_inflight_tensors`` (``get_pp_buffer_size_hint``)
and configured once; ``send`` / ``recv`` are ``ElasticBuffer.pp_send`` / ``pp_recv`` (ring neighbours only, at most
``num_max_inflight_tensors`` unreceived tensors per direction). The storage and its lifecycle (bootstrap, barrier,
destroy) are an ``ElasticBuffer``'s, i.e. ep-core's ``BufferBase`` under it; transports as ``ElasticBuffer``'s
(``reference`` for CPU tensors on gloo, ``ipc`` on the GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .buffer import ElasticBuffer
from .buffer_base import ElasticBacked

__all__ = ["PPBuffer"]


class PPBuffer(ElasticBacked):
    """Symmetric storage for pipeline-parallel send/recv over ``group``'s ring (a collective to build)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_max_tensor_bytes: int,
        num_max_inflight_tensors: int,
        sl_idx: int | None = None,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str | None = None,
        num_cpu_timeout_secs: int = 300,
    ) -> None:
        num_bytes = ElasticBuffer.get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)
        self._buffer: ElasticBuffer | None = ElasticBuffer(
            group,
            num_bytes=num_bytes,
            sl_idx=3 if sl_idx is None else sl_idx,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            explicitly_destroy=explicitly_destroy,
            transport=transport,
        )
        self._buffer.pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)
        # DeepEP's attribute: the symmetric storage (the PP slots), a uint8 tensor over the data region
        self.storage: torch.Tensor | None = self._buffer._elastic().backend.region()
        self.group = self._buffer.group
        self.rank_idx, self.num_ranks = self._buffer.rank_idx, self._buffer.num_ranks
        self.num_bytes = num_bytes
        self.explicitly_destroy = bool(explicitly_destroy)

    @property
    def nccl_comm_handle(self) -> Any:
        """The NCCL communicator underneath (None on the reference and ipc transports and after ``destroy()``)."""
        return None if self._buffer is None else self._buffer.nccl_comm_handle

    def send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int | None = None) -> None:
        """Send ``x`` (contiguous, at most ``num_max_tensor_bytes``) to the prev or next rank of the ring."""
        self._buf().pp_send(x, dst_rank_idx, 0 if num_sms is None else num_sms)

    def recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int | None = None) -> None:
        """Receive the next tensor from the prev or next rank into ``x`` (the sent tensor's size)."""
        self._buf().pp_recv(x, src_rank_idx, 0 if num_sms is None else num_sms)

    def barrier(self) -> None:
        self._buf().barrier()

    def print_memory_usage(self) -> None:
        """This rank's storage bytes (DeepEP's BufferBase method)."""
        self._buf()
        print(f"PPBuffer rank {self.rank_idx}: storage {self.num_bytes} bytes")

    def destroy(self) -> None:
        """Release the storage (a collective; needs ``explicitly_destroy=True``, like DeepEP)."""
        self._buf().destroy()
        self._buffer = None
        self.storage = None
