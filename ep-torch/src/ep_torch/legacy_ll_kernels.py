"""CUDA kernels of V1 low-latency mode (``include/ep_torch/ll_pack.cuh``), JIT-compiled through ep_jit like
ep-core's, and their launches on torch's current stream (capturable: fixed shapes, counts read on the GPU).

``pack`` is the dispatch epilogue (layout + row copy or FP8 cast: two launches, three when rows are ordered by key),
``gather_lanes`` builds the wide combine rows, ``weighted_sum`` the fused fp32 lane sum. Each is bit for bit the
torch composition in ``legacy_ll`` (kept as the CPU path and as the reference of the GPU tests).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from ep_core.errors import EPConfigError, EPValueError

__all__ = [
    "KERNEL_NAMES",
    "MAX_TOPK",
    "compile_ll_kernels",
    "gather_lanes",
    "get_include",
    "pack",
    "weighted_sum",
]

KERNEL_NAMES = (
    "ep_ll_order",
    "ep_ll_layout",
    "ep_ll_pack_bf16",
    "ep_ll_pack_fp8",
    "ep_ll_gather",
    "ep_ll_weighted_sum",
)
MAX_TOPK = 128  # EP_LL_MAX_TOPK: a row's lane slots are staged in shared memory
SOURCE = "#include <ep_torch/ll_pack.cuh>\n"


def get_include() -> str:
    """Directory holding ``ep_torch/ll_pack.cuh`` (inside the package, in a wheel and in a checkout)."""
    inc = Path(__file__).resolve().parent / "include"
    if not (inc / "ep_torch" / "ll_pack.cuh").is_file():
        raise EPConfigError(f"ep_torch kernel header not found under {inc}; reinstall ep-torch")
    return str(inc)


def compile_ll_kernels(arch: str | None = None) -> Any:
    """Compile (or fetch from ep_jit's cache) the low-latency kernels; returns the ep_jit Artifact. One
    configuration: sizes, the index dtype and the FP8 options are kernel arguments."""
    import ep_jit

    return ep_jit.compile(
        SOURCE,
        name="ep_torch_ll_pack",
        include_dirs=[get_include()],
        defines={"EP_LL_MAX_TOPK": MAX_TOPK},
        arch=arch,
        flags=("-std=c++17",),
    )


_kernels: dict[int, dict[str, Any]] = {}
_lock = threading.Lock()


def _k(name: str) -> Any:
    dev = torch.cuda.current_device()
    ks = _kernels.get(dev)
    if ks is None:
        import ep_jit

        with _lock:
            ks = _kernels.get(dev)
            if ks is None:
                module = ep_jit.load(compile_ll_kernels())
                ks = {n: module.function(n) for n in KERNEL_NAMES}
                _kernels[dev] = ks
    return ks[name]


def _i32(v: int) -> Any:
    import ep_jit

    return ep_jit.int32(int(v))


def _idx64(t: torch.Tensor, what: str) -> Any:
    if t.dtype not in (torch.int64, torch.int32):
        raise EPValueError(f"{what}: expected int64 or int32 expert ids, got {t.dtype}")
    return _i32(t.dtype == torch.int64)


def _vec(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _stream() -> Any:
    return torch.cuda.current_stream()


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
    stream = _stream()
    order = None
    scan_len = rows
    if by_key:  # rows grouped by region (hybrid) or in any order: scan them in (source rank, token) order
        order = torch.empty(slots, dtype=torch.int32, device=dev)
        _k("ep_ll_order").launch(
            1, 1024, [meta, _i32(meta.stride(0)), num_valid, _i32(slots), order], stream=stream
        )
        scan_len = slots
    args = [recv_idx, idx64, _i32(k), meta, _i32(meta.stride(0)), num_valid, order, _i32(rows), _i32(scan_len),
            _i32(tokens_per_rank), _i32(num_ranks), _i32(slots), lane_slot, lane_ok, src_info, recv_count,
            layout_range]  # fmt: skip
    _k("ep_ll_layout").launch(epr, 256, args, shared_mem=4 * num_ranks, stream=stream)
    if not use_fp8:
        out = torch.empty(epr, slots, h, dtype=torch.bfloat16, device=dev)
        vecs = h * 2 // 16
        if rows:
            _k("ep_ll_pack_bf16").launch(
                (rows, -(-vecs // 256)),
                256,
                [recv_x, _i32(vecs), lane_slot, lane_ok, _i32(k), num_valid, out],
                stream=stream,
            )
        return out, recv_count, src_info, layout_range, lane_slot, lane_ok
    groups = h // 128
    q = torch.empty(epr, slots, h, dtype=torch.float8_e4m3fn, device=dev)
    if use_ue8m0:
        s_store = torch.empty(epr, groups // 4, slots, dtype=torch.int32, device=dev)
    else:
        s_store = torch.empty(epr, groups, slots, dtype=torch.float32, device=dev)
    if rows:
        args = [recv_x, _i32(h), lane_slot, lane_ok, _i32(k), num_valid, q, s_store, _i32(slots),
                _i32(round_scale), _i32(use_ue8m0)]  # fmt: skip
        _k("ep_ll_pack_fp8").launch((rows, -(-groups // 8)), 256, args, stream=stream)
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
        _k("ep_ll_gather").launch(
            (rows, -(-vecs // 256)),
            256,
            [x, _i32(vecs), lane_slot, lane_ok, _i32(k), _i32(lane0), _i32(lanes), num_valid, wide],
            stream=_stream(),
        )
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
    args = [_vec(y), _i32(h), topk_idx.contiguous(), _idx64(topk_idx, "low_latency_combine: topk_idx"),
            topk_weights.contiguous(), _i32(k), _i32(lane0), _i32(lanes), acc, _i32(first), _i32(last), out]  # fmt: skip
    _k("ep_ll_weighted_sum").launch((-(-vecs // 128), t), 128, args, stream=_stream())
