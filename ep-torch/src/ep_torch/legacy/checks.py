"""V1 ``Buffer``'s argument checks shared by normal and low-latency mode."""

from __future__ import annotations

from typing import Any

import torch
from ep_core.errors import EPValueError

__all__ = ["LL_MAX_EXPERTS_PER_RANK", "LL_MAX_TOPK", "_check_ll_limits", "_check_topk"]

# V1 low-latency mode's limits, the same on every road (CPU backend, adapter, native kernels). DeepEP V1 takes at most
# 11 top-k lanes (kNumMaxTopK of its low-latency kernels) and bounds the experts by its SMs (32 warp groups each) and
# its QPs (num_qps_per_rank >= experts per rank; its own test runs 288 experts on one rank); ep takes more top-k lanes
# (the native kernels stage a token's lanes in shared memory: ep_core.ll_native.MAX_TOPK) and up to DeepEP V1's
# bound on local experts (LEGACY_NUM_MAX_LOCAL_EXPERTS).
LL_MAX_TOPK = 128
LL_MAX_EXPERTS_PER_RANK = 1024


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


def _check_ll_limits(op: str, rank: int, num_ranks: int, num_experts: int, num_topk: int) -> None:
    """Low-latency mode's limits (``LL_MAX_TOPK``, ``LL_MAX_EXPERTS_PER_RANK``), before anything runs."""
    if num_topk > LL_MAX_TOPK:
        raise EPValueError(
            f"{op} (rank {rank}): num_topk={num_topk} (topk_idx.shape[1]) > {LL_MAX_TOPK}, "
            "low-latency mode's top-k limit (DeepEP V1 takes at most 11)"
        )
    epr = num_experts // num_ranks
    if epr > LL_MAX_EXPERTS_PER_RANK:
        raise EPValueError(
            f"{op} (rank {rank}): num_experts={num_experts} over {num_ranks} ranks is {epr} experts per rank > "
            f"{LL_MAX_EXPERTS_PER_RANK}, low-latency mode's limit per rank (DeepEP V1's local-expert bound)"
        )
