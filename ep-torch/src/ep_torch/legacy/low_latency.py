"""V1 low-latency mode on ep's direct dispatch/combine: fixed shapes, no host sync, so it can be captured in a CUDA
graph; the numerics are ``ep_torch.legacy.reference``'s, bit for bit.

Dispatch: one non-expand dispatch without CPU sync (worst-case ``N*M`` rows, true count on the GPU), then an
epilogue of fixed-shape ops scatters every (row, lane) into the packed masked layout ``[E_local, N*M, H]`` (each
slot written once; rows past ``recv_count`` are unspecified, as in V1). FP8 is cast once per received row. Positions
count rows in (source rank, source token) order: a deterministic direct-mode dispatch delivers them in that order;
hybrid rows (grouped by region) and a non-deterministic dispatch's rows are ordered by their source key.

Combine: the expert rank gathers, for each received row, the K lanes' expert outputs into one wide row ``[K*H]``
(zeros for lanes that are not its own) and runs ep's unweighted combine on the wide rows: every lane slot has exactly
one non-zero contributor, so ep's fp32 sum returns each lane's bf16 output unchanged to the source rank, which then
weights and sums in ascending lane order (the reference's order: multiply, then add, in fp32; one bf16 rounding).
The price: every (token, rank) row carries all K lane slots, mostly zeros, so the combine moves (ranks a token
reaches) times V1's bytes (V1 sends one message per (token, expert)). All K lanes travel in one combine when ep's
kernels can stage such a row, else in groups (``lanes_per_combine``): one combine per group.

On CUDA the epilogue, the wide-row gather and the weighted sum are kernels (``legacy.ll_kernels``: one pass each,
bit for bit the torch composition here, which stays the CPU path and the GPU tests' reference); ``use_kernels``
(None = on CUDA) picks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from ep_core.errors import EPValueError

from .fp8 import per_token_cast_to_fp8

__all__ = [
    "LowLatencyHandle",
    "into",
    "lanes_per_combine",
    "ll_combine",
    "ll_combine_weighted",
    "ll_dispatch",
    "weighted_lane_sum",
]


class LowLatencyHandle(tuple):
    """V1's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:
    ``src_info`` [E_local, N*M] int32 (source token of each packed row, -1 where no row was written), ``layout_range``
    [E_local, N] int64 ((offset << 32) | count of each source rank's block, V1's packing). The attributes drive
    combine: on the adapter ``ep_handle`` (ep's handle), ``lane_slot`` [N*M, K] (packed slot of each received row's
    lane, the dump slot ``E_local*N*M`` for lanes not here), ``lane_ok`` [N*M, K] bool; on the native kernels
    ``native`` = (the rank's region, the top-k lane of each packed row), ``ep_handle`` None."""

    ep_handle: Any
    lane_slot: Any
    lane_ok: Any
    num_topk: int
    num_tokens: int
    native: Any

    def __new__(
        cls,
        items: tuple,
        ep_handle: Any,
        lane_slot: Any,
        lane_ok: Any,
        *,
        native: Any = None,
        num_topk: int = 0,
        num_tokens: int = -1,
    ) -> LowLatencyHandle:
        obj = super().__new__(cls, items)
        obj.ep_handle, obj.lane_slot, obj.lane_ok = ep_handle, lane_slot, lane_ok
        obj.num_topk = int(num_topk) if lane_slot is None else int(lane_slot.shape[1])
        obj.num_tokens = int(num_tokens) if ep_handle is None else int(getattr(ep_handle, "num_tokens", -1))
        # the native kernels' state (legacy.ll_kernels): (region, lanes [E_local, N*M] int32) (ep_handle None)
        obj.native = native
        return obj


def ll_dispatch(
    inner: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    m: int,
    num_experts: int,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    use_kernels: bool | None = None,
    rows_ordered: bool = True,
    zero_copy: bool = False,
) -> tuple[Any, torch.Tensor, LowLatencyHandle]:
    """The packed masked layout of this rank's received rows (no host sync: capturable). ``use_kernels``: the
    CUDA epilogue (``legacy_ll_kernels.pack``) instead of the torch ops; None = on CUDA. ``rows_ordered``: ``inner``
    is deterministic (direct-mode rows already in V1's order); else (and in hybrid mode) rows are ordered by their
    source key (source rank, token). ``zero_copy``: ``inner``'s dispatch leaves the rows in its buffer (one NVLink
    domain; deterministic order) and the packing reads them there, before ``inner``'s next operation writes it."""
    n = inner.num_ranks
    epr = num_experts // n
    h = int(x.shape[1])
    k = int(topk_idx.shape[1])
    dev = x.device
    recv_x, recv_idx, _, ep_handle, _ = inner.dispatch(
        x, topk_idx=topk_idx, num_experts=num_experts, do_cpu_sync=False, zero_copy=bool(zero_copy)
    )
    rows_ordered = rows_ordered or bool(zero_copy)
    if _kernels(x, use_kernels, "low_latency_dispatch"):
        from . import ll_kernels as legacy_ll_kernels

        recv, recv_count, src_info, layout_range, lane_slot, lane_ok = legacy_ll_kernels.pack(
            recv_x,
            recv_idx,
            ep_handle.recv_src_metadata,
            _num_valid(ep_handle),
            num_ranks=n,
            epr=epr,
            tokens_per_rank=int(inner.num_max_tokens_per_rank),
            by_key=int(inner.num_scaleup_ranks) < n or not rows_ordered,
            use_fp8=use_fp8,
            round_scale=round_scale,
            use_ue8m0=use_ue8m0,
        )
        handle = LowLatencyHandle((src_info, layout_range, m, h, num_experts), ep_handle, lane_slot, lane_ok)
        return recv, recv_count, handle
    rows = int(recv_x.shape[0])  # N*M, fixed
    slots = n * m
    dump = epr * slots
    num_valid = ep_handle.psum_num_recv_tokens_per_scaleup_rank[-1:].to(torch.int64)
    valid_row = torch.arange(rows, device=dev) < num_valid  # [R]: rows past the true count are unspecified
    lanes = recv_idx.to(torch.int64)
    lane_ok = (lanes >= 0) & valid_row[:, None]
    lane_e = torch.where(lane_ok, lanes, torch.full_like(lanes, epr))  # epr: the dump column
    member = torch.zeros(rows, epr + 1, dtype=torch.int64, device=dev).scatter_(1, lane_e, 1)[:, :epr]
    meta = ep_handle.recv_src_metadata[:, 0].to(torch.int64)
    if int(inner.num_scaleup_ranks) < n or not rows_ordered:
        # hybrid rows are grouped by scale-up region (and non-deterministic rows are in any order): count positions
        # in (source rank, token) order, V1's packing (a fixed-shape sort, no host sync; direct mode's
        # deterministic rows are in that order already)
        key = torch.where(valid_row, meta, n * inner.num_max_tokens_per_rank + torch.arange(rows, device=dev))
        order = torch.argsort(key)
        pos = torch.empty_like(member).index_put_((order,), member[order].cumsum(0) - 1)
    else:
        pos = member.cumsum(0) - 1  # [R, epr]: row's position in expert e's packed rows
    recv_count = member.sum(0).to(torch.int32)
    lane_pos = pos.gather(1, lane_e.clamp(max=epr - 1))
    lane_slot = torch.where(lane_ok, lane_e * slots + lane_pos, torch.full_like(lanes, dump))
    src_rank = torch.where(valid_row, meta // inner.num_max_tokens_per_rank, torch.full_like(meta, n))
    src_tok = (meta % inner.num_max_tokens_per_rank).to(torch.int32)
    # src_info and layout_range (V1's handle contents)
    src_info = torch.full((dump + 1,), -1, dtype=torch.int32, device=dev)
    src_info.index_put_((lane_slot,), src_tok[:, None].expand(rows, k))
    per_src = torch.zeros(epr, n + 1, dtype=torch.int64, device=dev)
    per_src.scatter_add_(1, src_rank[None, :].expand(epr, rows), member.t().contiguous())
    per_src = per_src[:, :n]
    layout_range = ((per_src.cumsum(1) - per_src) << 32) | per_src
    handle = LowLatencyHandle(
        (src_info[:dump].view(epr, slots), layout_range, m, h, num_experts), ep_handle, lane_slot, lane_ok
    )
    if not use_fp8:
        return _scatter_rows(recv_x, lane_slot, dump).view(epr, slots, h), recv_count, handle
    q, s = per_token_cast_to_fp8(recv_x, round_scale=round_scale, use_ue8m0=use_ue8m0, col_major=False)
    packed_q = (
        _scatter_rows(q.view(torch.uint8), lane_slot, dump).view(torch.float8_e4m3fn).view(epr, slots, h)
    )
    rows_s = _scatter_rows(s, lane_slot, dump).view(epr, slots, s.shape[1])
    # V1: the scales' last two dimensions are column-major, strides (groups * slots, 1, slots) as DeepEP allocates
    # them (not .contiguous() of the transpose, which keeps the row-major strides when there is one scale column)
    packed_s = torch.empty(epr, s.shape[1], slots, dtype=s.dtype, device=s.device).transpose(1, 2)
    packed_s.copy_(rows_s)
    return (packed_q, packed_s), recv_count, handle


def _kernels(x: torch.Tensor, use_kernels: bool | None, op: str) -> bool:
    """Whether ``op`` runs ep-torch's CUDA kernels: ``use_kernels``, None = on CUDA."""
    if use_kernels is None:
        return x.is_cuda
    if use_kernels and not x.is_cuda:
        raise EPValueError(f"{op}: ll_use_kernels=True needs CUDA tensors, got x on {x.device}")
    return bool(use_kernels)


def _num_valid(ep_handle: Any) -> torch.Tensor:
    """The true received row count as a one-element int32 device tensor (read by the kernels, never the host)."""
    psum = ep_handle.psum_num_recv_tokens_per_scaleup_rank[-1:]
    return psum if psum.dtype == torch.int32 else psum.to(torch.int32)


def _scatter_rows(src: torch.Tensor, lane_slot: torch.Tensor, dump: int) -> torch.Tensor:
    """``out[lane_slot[r, j]] = src[r]`` for every lane, one scatter (``src`` broadcast over the lanes, no copy);
    every real slot is written once, lanes not here land on the dump row (dropped)."""
    out = torch.empty(dump + 1, *src.shape[1:], dtype=src.dtype, device=src.device)
    out.index_put_((lane_slot,), src.unsqueeze(1).expand(src.shape[0], lane_slot.shape[1], *src.shape[1:]))
    return out[:dump]


def lanes_per_combine(num_topk: int, hidden: int, group: int = 0) -> int:
    """Lanes carried by one wide combine: ``group`` if given, else all K in one combine when ep's kernels can stage
    a row of K lanes (one token slot per warp in shared memory), else the most that fit, at least one. Fewer,
    wider combines win although wider rows leave fewer warps per block: each ep combine has a fixed cost (its
    barriers), measured on the H200 (T=128, hidden 7168, top-8, torch-op epilogue): 1 lane per combine 476 us,
    2: 359, 4: 309, all 8: 266."""
    if group > 0:
        return min(int(group), num_topk)
    return _lanes_that_fit(int(num_topk), int(hidden))


@functools.lru_cache(maxsize=64)
def _lanes_that_fit(num_topk: int, hidden: int) -> int:
    from ep_core.errors import EPConfigError
    from ep_core.kernels.plan import KernelConfig

    for g in range(num_topk, 1, -1):
        try:  # raises when one token slot exceeds a block's shared memory (direct, and hybrid's larger slot)
            KernelConfig(1, num_topk, g * hidden)
            KernelConfig(2, num_topk, g * hidden, num_scaleup_ranks=1)
        except EPConfigError:
            continue
        return g
    return 1


def ll_combine(
    inner: Any, x: torch.Tensor, handle: LowLatencyHandle, num_tokens: int, group: int = 0, num_sms: int = 0
) -> torch.Tensor:
    """Every lane's bf16 expert output back at its source token: ``[T, K, H]`` (exact copies; 0 for -1 lanes).
    The K lanes travel in wide rows of ``lanes_per_combine`` lanes, one ep combine per group of lanes."""
    epr, slots, h = x.shape
    k = handle.num_topk
    g = lanes_per_combine(k, h, group)
    flat = x.reshape(epr * slots, h)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    slot = handle.lane_slot.clamp(max=epr * slots - 1)
    y = None if g == k else torch.empty(num_tokens, k, h, dtype=x.dtype, device=x.device)
    for g0 in range(0, k, g):
        g1 = min(k, g0 + g)
        idx = slot[:, g0:g1].reshape(-1)
        wide = torch.where(handle.lane_ok[:, g0:g1].reshape(-1, 1), flat.index_select(0, idx), zero)
        out, _, _ = inner.combine(wide.view(-1, (g1 - g0) * h), handle.ep_handle, num_sms=num_sms)
        if y is None:
            return out.view(num_tokens, k, h)
        y[:, g0:g1] = out.view(num_tokens, g1 - g0, h)
    assert y is not None
    return y


def weighted_lane_sum(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``bf16(sum_k w[t, k] * y[t, k])`` over lanes with an expert, fp32, ascending k, multiply and add as separate
    ops (the reference's order; no fused multiply-add, no reduction kernel of unspecified order). ``y`` bf16, or
    float32 (LogFMT's decoded rows)."""
    t, k, h = y.shape
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    w = topk_weights.to(torch.float32)
    valid = topk_idx >= 0
    for j in range(k):
        p = y[:, j].to(torch.float32) * w[:, j : j + 1]
        acc = torch.where(valid[:, j : j + 1], acc + p, acc)
    return acc.to(torch.bfloat16)


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or ``out`` with ``result`` copied into it when the caller gave one."""
    if out is None:
        return result
    out.copy_(result)
    return out


def ll_combine_weighted(
    inner: Any,
    x: torch.Tensor,
    handle: LowLatencyHandle,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    group: int = 0,
    out: torch.Tensor | None = None,
    use_kernels: bool | None = None,
    num_sms: int = 0,
    use_logfmt: bool = False,
) -> torch.Tensor:
    """V1's weighted combine of the packed ``x``: ``[T, H]`` bf16 (written into ``out`` when given; ``num_sms``
    goes to ep's combine, 0 = ep's choice). With
    ``use_kernels`` (None = on CUDA): per group of lanes, one gather kernel into the wide rows, ep's combine and one
    fused weighted-sum kernel (fp32 accumulator between groups, exact); else ``ll_combine`` +
    ``weighted_lane_sum``. The same bits either way. ``use_logfmt``: each lane's row is LogFMT round-tripped
    (``legacy.logfmt.roundtrip_torch``, float32) before the weighted sum, on the torch path: the adapter moves the
    bf16 rows and applies the round trip at the receiver (the numbers of V1's encoded transfer, not its bytes)."""
    t = int(topk_idx.shape[0])
    if use_logfmt or not _kernels(x, use_kernels, "low_latency_combine"):
        y = ll_combine(inner, x, handle, t, group, num_sms)
        if use_logfmt:
            from .logfmt import roundtrip_torch

            y = roundtrip_torch(y)
        return into(weighted_lane_sum(y, topk_idx, topk_weights), out)
    from . import ll_kernels as legacy_ll_kernels

    h = int(x.shape[2])
    k = handle.num_topk
    g = lanes_per_combine(k, h, group)
    num_valid = _num_valid(handle.ep_handle)
    if out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0:
        dest = out  # written in place
    else:
        dest = torch.empty(t, h, dtype=x.dtype, device=x.device)
    acc = None if g == k else torch.empty(t, h, dtype=torch.float32, device=x.device)
    for g0 in range(0, k, g):
        g1 = min(k, g0 + g)
        wide = legacy_ll_kernels.gather_lanes(x, handle.lane_slot, handle.lane_ok, num_valid, g0, g1 - g0)
        y, _, _ = inner.combine(wide, handle.ep_handle, num_sms=num_sms)
        legacy_ll_kernels.weighted_sum(y, topk_idx, topk_weights, g0, g1 - g0, acc, dest)
    return dest if dest is out else into(dest, out)
