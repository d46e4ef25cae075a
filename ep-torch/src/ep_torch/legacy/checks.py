"""V1 ``Buffer``'s argument checks shared by normal and low-latency mode."""

from __future__ import annotations

from typing import Any

import torch
from ep_core.errors import EPValueError

__all__ = ["_check_topk"]


def _check_topk(topk_idx: Any, num_experts: int, num_ranks: int, rank: int, host_read: bool = True) -> None:
    """Shapes and dtypes; the expert-id range too when ``host_read`` (a device-to-host read: never while capturing
    a CUDA graph; ep-core checks the ids on the device anyway and raises at the next sync)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise EPValueError(f"topk_idx (rank {rank}): must be a 2-D tensor [num_tokens, num_topk]")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise EPValueError(f"topk_idx (rank {rank}): dtype must be int64 or int32, got {topk_idx.dtype}")
    if num_experts <= 0 or num_experts % num_ranks:
        raise EPValueError(
            f"num_experts (rank {rank}): {num_experts} must be a positive multiple of {num_ranks} ranks"
        )
    if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
        host_read = False
    if host_read and topk_idx.numel() and int(topk_idx.max()) >= num_experts:
        raise EPValueError(
            f"topk_idx (rank {rank}): expert id {int(topk_idx.max())} >= num_experts={num_experts}"
        )
