"""Launches of V1 low-latency mode's CUDA kernels (``ep_core.ll_pack``, ``include/ep_core/ll_pack.cuh``; ep-core
compiles them through ep_jit like its other kernels) on torch's current stream with the tensors' addresses
(capturable: fixed shapes, counts read on the GPU).

``pack`` is the dispatch epilogue (layout + row copy or FP8 cast: two launches, three when rows are ordered by key),
``gather_lanes`` builds the wide combine rows, ``weighted_sum`` the fused fp32 lane sum. Each is bit for bit the
torch composition in ``legacy.low_latency`` (kept as the CPU path and as the reference of the GPU tests).
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core import ll_pack
from ep_core.errors import EPValueError
from ep_core.ll_pack import KERNEL_NAMES, MAX_TOPK, compile_ll_kernels

__all__ = [
    "KERNEL_NAMES",
    "MAX_TOPK",
    "compile_ll_kernels",
    "gather_lanes",
    "get_include",
    "pack",
    "preload",
    "weighted_sum",
]


def get_include() -> str:
    """Directory holding ``ep_core/ll_pack.cuh`` (ep-core's kernel headers)."""
    from ep_core.kernels._source import get_include as core_include

    return core_include()


def preload() -> None:
    """Compile and load the kernels on the current device now (``ep_core.ll_pack.load``)."""
    ll_pack.load(torch.cuda.current_device())


class _Launch:
    """``ll_pack.launch`` on torch's current stream and device; tensors are passed as their addresses (kept alive
    by the caller until the launch returns: the kernel is stream-ordered before any reuse of their memory)."""

    __slots__ = ("device", "stream")

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self.stream = torch.cuda.current_stream().cuda_stream

    def __call__(self, name: str, grid: Any, block: int, args: list, shared_mem: int = 0) -> None:
        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        ll_pack.launch(
            name, grid, block, values, device=self.device, stream=self.stream, shared_mem=shared_mem
        )


def _idx64(t: torch.Tensor, what: str) -> int:
    if t.dtype not in (torch.int64, torch.int32):
        raise EPValueError(f"{what}: expected int64 or int32 expert ids, got {t.dtype}")
    return int(t.dtype == torch.int64)


def _vec(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def pack(
    recv_x: torch.Tensor,
    recv_idx: torch.Tensor,
    meta: torch.Tensor,
    num_valid: torch.Tensor,
    *,
    num_ranks: int,
    epr: int,
    tokens_per_rank: int,
    by_key: bool,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked layout of ep's dispatch output: ``(recv (bf16 [epr, N*M, H] or (fp8, scales column-major)),
    recv_count [epr] int32, src_info [epr, N*M] int32, layout_range [epr, N] int64, lane_slot [R, K] int64,
    lane_ok [R, K] bool)``. ``meta`` is ``recv_src_metadata`` ([R, *] int32, column 0 = src_rank*M + token),
    ``num_valid`` a one-element int32 device tensor (the true row count). ``by_key``: the rows are not in V1's
    order (hybrid regions, a non-deterministic dispatch); the layout scans them through their source keys."""
    rows, h = int(recv_x.shape[0]), int(recv_x.shape[1])
    k = int(recv_idx.shape[1])
    if k > MAX_TOPK:
        raise EPValueError(f"low_latency_dispatch: num_topk={k} > {MAX_TOPK} (the kernels' lane limit)")
    dev = recv_x.device
    slots = num_ranks * tokens_per_rank
    recv_x = _vec(recv_x)
    recv_idx = recv_idx.contiguous()
    if meta.stride(1) != 1 or meta.dtype != torch.int32:
        meta = meta.to(torch.int32).contiguous()
    idx64 = _idx64(recv_idx, "low_latency_dispatch: recv_topk_idx")
    lane_slot = torch.empty(rows, k, dtype=torch.int64, device=dev)
    lane_ok = torch.empty(rows, k, dtype=torch.bool, device=dev)
    src_info = torch.empty(epr, slots, dtype=torch.int32, device=dev)
    recv_count = torch.empty(epr, dtype=torch.int32, device=dev)
    layout_range = torch.empty(epr, num_ranks, dtype=torch.int64, device=dev)
    run = _Launch()
    order = None
    scan_len = rows
    if by_key:  # rows grouped by region (hybrid) or in any order: scan them in (source rank, token) order
        order = torch.empty(slots, dtype=torch.int32, device=dev)
        run("ep_ll_order", 1, 1024, [meta, meta.stride(0), num_valid, slots, order])
        scan_len = slots
    args = [recv_idx, idx64, k, meta, meta.stride(0), num_valid, order, rows, scan_len, tokens_per_rank,
            num_ranks, slots, lane_slot, lane_ok, src_info, recv_count, layout_range]  # fmt: skip
    run("ep_ll_layout", epr, 256, args, shared_mem=4 * num_ranks)
    if not use_fp8:
        out = torch.empty(epr, slots, h, dtype=torch.bfloat16, device=dev)
        vecs = h * 2 // 16
        if rows:
            args = [recv_x, vecs, lane_slot, lane_ok, k, num_valid, out]
            run("ep_ll_pack_bf16", (rows, -(-vecs // 256)), 256, args)
        return out, recv_count, src_info, layout_range, lane_slot, lane_ok
    groups = h // 128
    q = torch.empty(epr, slots, h, dtype=torch.float8_e4m3fn, device=dev)
    if use_ue8m0:
        s_store = torch.empty(epr, groups // 4, slots, dtype=torch.int32, device=dev)
    else:
        s_store = torch.empty(epr, groups, slots, dtype=torch.float32, device=dev)
    if rows:
        args = [
            recv_x,
            h,
            lane_slot,
            lane_ok,
            k,
            num_valid,
            q,
            s_store,
            slots,
            int(round_scale),
            int(use_ue8m0),
        ]
        run("ep_ll_pack_fp8", (rows, -(-groups // 8)), 256, args)
    # V1: the scales' last two dimensions are column-major
    return (q, s_store.transpose(1, 2)), recv_count, src_info, layout_range, lane_slot, lane_ok


def gather_lanes(
    x: torch.Tensor,
    lane_slot: torch.Tensor,
    lane_ok: torch.Tensor,
    num_valid: torch.Tensor,
    lane0: int,
    lanes: int,
) -> torch.Tensor:
    """Wide combine rows ``[R, lanes * H]``: row r's lanes ``lane0 ..`` from the packed ``x [epr, N*M, H]`` (zeros
    where the lane is not here); rows past ``num_valid`` are left unwritten (ep's combine does not read them)."""
    h = int(x.shape[-1])
    rows, k = int(lane_slot.shape[0]), int(lane_slot.shape[1])
    x = _vec(x)
    wide = torch.empty(rows, lanes * h, dtype=x.dtype, device=x.device)
    vecs = h * 2 // 16
    if rows:
        args = [x, vecs, lane_slot, lane_ok, k, lane0, lanes, num_valid, wide]
        _Launch()("ep_ll_gather", (rows, -(-vecs // 256)), 256, args)
    return wide


def weighted_sum(
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    lane0: int,
    lanes: int,
    acc: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """One group of lanes of the combine's weighted sum: ``y [T, lanes * H]`` bf16 (an ep combine's output).
    ``acc`` (fp32 [T, H]) carries the sum between groups: read unless ``lane0 == 0``, written unless this group
    ends at K, where ``out`` ([T, H] bf16, contiguous) receives the one bf16 rounding."""
    t, k = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    h = int(y.shape[-1]) // lanes
    first, last = lane0 == 0, lane0 + lanes == k
    if t == 0:
        return
    vecs = h // 8
    args = [_vec(y), h, topk_idx.contiguous(), _idx64(topk_idx, "low_latency_combine: topk_idx"),
            topk_weights.contiguous(), k, lane0, lanes, acc, int(first), int(last), out]  # fmt: skip
    _Launch()("ep_ll_weighted_sum", (-(-vecs // 128), t), 128, args)
