"""The GPU executor of direct mode: one `DirectRank` per rank drives the three kernels of ep_core.

A dispatch is two phases so that several ranks of one process (the loopback domain) can be driven together:
`launch_dispatch` validates, allocates the handle arrays and launches the dispatch kernel (it returns at once);
`finish_dispatch` waits for the received counts when a CPU sync is asked for (stream poll with the CPU timeout),
sizes and allocates the outputs and launches the copy epilogue. A combine is one launch. A process that holds one
rank (multi-process, or a real multi-GPU job) simply calls both phases in turn.

Arrays are `DeviceArray`s allocated stream-ordered on the rank's stream, or caller arrays taken by pointer
(`as_view`). bf16 is uint16 storage; FP8 data is uint8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ep_layout
import numpy as np

from ep_core.errors import EPDeviceError, EPStateError, EPTimeoutError, EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.kernels import _cuda
from ep_core.kernels._args import FLAGS, pack_op_args
from ep_core.kernels._cuda import DeviceArray, DeviceView, PinnedBuffer, Stream, as_view
from ep_core.kernels._source import load_kernels
from ep_core.kernels.plan import (
    SCRATCH_BARRIER_EPOCH_OFFSET,
    SCRATCH_INPUT_ERROR_OFFSET,
    KernelConfig,
    RegionPlan,
    launch_geometry,
    plan_regions,
)

__all__ = ["TAG_NAMES", "CombineResult", "DirectRank", "DispatchResult", "RankResources"]

TAG_NAMES = {
    1: "grid_barrier",
    2: "dispatch.entry_barrier",
    3: "dispatch.counts",
    4: "combine.entry_barrier",
    5: "combine.exit_barrier",
}
_EK = ep_layout.ErrorKind
_ERR_OFF = ep_layout.WorkspaceLayout.ERROR_RECORD_OFFSET
_FIELD = {f.name: f for f in ep_layout.ERROR_RECORD_FIELDS}

Allocator = Callable[[tuple, Any, "tuple | None"], Any]


@dataclass
class RankResources:
    """What a rank's kernels address: its symmetric base, the device table of every rank's base, its stream."""

    rank: int
    num_ranks: int
    base: int
    data_bytes: int
    peer_table: int
    stream: Stream
    nccl_window: int = 0
    scratch_buffers: dict = field(default_factory=dict)


@dataclass(eq=False)
class DispatchResult:
    recv_x: DeviceArray | Any
    recv_sf: DeviceArray | Any | None
    recv_topk_idx: DeviceArray | Any | None
    recv_topk_weights: DeviceArray | Any | None
    handle: EPHandle

    def to_reference(self) -> Any:
        """The same result as numpy arrays, as an `ep_core.reference.DispatchOutput` (synchronizes)."""
        from ep_core.reference import DispatchOutput

        h = self.handle
        handle = EPHandle(
            h.do_expand,
            h.num_experts,
            h.expert_alignment,
            h.num_max_tokens_per_rank,
            h.num_sms,
            _np(h.topk_idx),
            h.num_recv_tokens,
            h.num_expanded_tokens,
            list(h.num_recv_tokens_per_expert_list),
            _np(h.psum_num_recv_tokens_per_scaleup_rank),
            _np(h.psum_num_recv_tokens_per_expert),
            _np(h.num_unaligned_recv_tokens_per_expert),
            _np(h.recv_src_metadata),
            _np(h.dst_buffer_slot_idx),
            num_ranks=h.num_ranks,
            rank=h.rank,
        )
        return DispatchOutput(
            _np(self.recv_x), _np(self.recv_sf), _np(self.recv_topk_idx), _np(self.recv_topk_weights), handle
        )


@dataclass(eq=False)
class CombineResult:
    combined_x: DeviceArray | Any
    combined_topk_weights: DeviceArray | Any | None

    def to_reference(self) -> Any:
        from ep_core.reference import CombineOutput

        return CombineOutput(_np(self.combined_x), _np(self.combined_topk_weights))


def _np(a: Any) -> np.ndarray | None:
    if a is None:
        return None
    if isinstance(a, DeviceArray):
        return a.numpy()
    if isinstance(a, np.ndarray):
        return a
    return np.asarray(a)


@dataclass
class _PendingDispatch:
    config: KernelConfig
    args: dict
    geometry: Any
    cached: bool
    do_cpu_sync: bool
    expand: bool
    num_tokens: int
    num_experts: int
    alignment: int
    num_sms: int
    x: DeviceView
    sf: DeviceView | None
    col_major_sf: bool
    has_weights: bool
    zero_padding: bool
    handle: EPHandle | None
    topk_idx: Any
    arrays: dict
    keep: list
    host: PinnedBuffer | None = None


def _check_2d(view: DeviceView, what: str) -> None:
    if len(view.shape) != 2:
        raise EPValueError(f"{what}: expected a 2-D array, got shape {view.shape}")


class DirectRank:
    """One rank of a direct-mode domain (ipc or nccl transport): validates, launches, reads back counts."""

    def __init__(
        self,
        resources: RankResources,
        *,
        num_max_tokens_per_rank: int,
        gpu_timeout_secs: float = 100.0,
        cpu_timeout_secs: float = 300.0,
        allocator: Allocator | None = None,
        num_warps: int | None = None,
    ) -> None:
        self.res = resources
        self.num_ranks = resources.num_ranks
        self.rank = resources.rank
        self.num_max_tokens = int(num_max_tokens_per_rank)
        self.gpu_timeout_secs = float(gpu_timeout_secs)
        self.cpu_timeout_secs = float(cpu_timeout_secs)
        self.device_sms = _cuda.num_device_sms()
        clock_khz = _cuda.device_attribute("CU_DEVICE_ATTRIBUTE_CLOCK_RATE")
        self.timeout_cycles = max(int(self.gpu_timeout_secs * clock_khz * 1000.0), 1)
        self._allocator = allocator
        self._num_warps = num_warps
        self._host = PinnedBuffer(4 * (2 * self.num_ranks + 2 * 256) + 64 + 32)

    # ------------------------------------------------------------------ helpers
    @property
    def stream(self) -> Stream:
        return self.res.stream

    def _alloc(self, shape: tuple, dtype: Any, strides: tuple | None = None) -> Any:
        if self._allocator is not None:
            return self._allocator(tuple(shape), np.dtype(dtype), strides)
        return DeviceArray(shape, dtype, self.stream, strides)

    def _config(self, hidden: int, elem: int, packs: int, topk: int) -> KernelConfig:
        kw = {} if self._num_warps is None else {"num_warps": self._num_warps}
        transport = "nccl" if self.res.nccl_window else "ipc"
        return KernelConfig(self.num_ranks, topk, hidden, elem, packs, transport=transport, **kw)

    def _regions(
        self, config: KernelConfig, num_experts: int, op: str, amr: bool | None = None
    ) -> tuple[RegionPlan, int]:
        plan = plan_regions(
            config, num_experts, self.num_max_tokens, self.res.data_bytes, op=op, allow_multiple_reduction=amr
        )
        if plan.scratch_offset >= 0:
            scratch = self.res.base + plan.scratch_offset
        else:
            buf = self.res.scratch_buffers.get(plan.scratch_bytes)
            if buf is None:
                buf = _cuda.DeviceBuffer(plan.scratch_bytes)
                self.res.scratch_buffers[plan.scratch_bytes] = buf
            scratch = buf.ptr
        previous = getattr(self, "_last_scratch", None)
        if previous is not None and previous != scratch:
            # The barrier epoch lives in the scratch but counts arrivals in the workspace, which every op shares:
            # carry it to the new scratch, or the barrier's `arrivals >= epoch * N` test would pass at once.
            off = SCRATCH_BARRIER_EPOCH_OFFSET
            _cuda.copy_device(scratch + off, previous + off, 8, self.stream)
        self._last_scratch = scratch
        return plan, scratch

    def _common(self, plan: RegionPlan, scratch: int, num_experts: int) -> dict:
        return {
            "workspace": self.res.base + plan.workspace_offset,
            "recv_region": self.res.base + plan.recv_offset,
            "scratch": scratch,
            "peer_bases": self.res.peer_table,
            "own_base": self.res.base,
            "nccl_window": self.res.nccl_window,
            "rank": self.rank,
            "num_max_tokens": self.num_max_tokens,
            "num_experts": num_experts,
            "timeout_cycles": self.timeout_cycles,
        }

    def _num_sms(self, num_sms: int, handle: EPHandle | None) -> int:
        if num_sms == 0 and handle is not None and handle.num_sms:
            num_sms = handle.num_sms
        if num_sms == 0:
            num_sms = max(1, min(16, self.device_sms // self.num_ranks))
        return int(num_sms)

    # ------------------------------------------------------------------ dispatch
    def launch_dispatch(
        self,
        x: Any,
        topk_idx: Any = None,
        topk_weights: Any = None,
        *,
        sf: Any = None,
        num_experts: int | None = None,
        expert_alignment: int | None = None,
        do_expand: bool | None = None,
        do_cpu_sync: bool | None = None,
        deterministic: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        handle: EPHandle | None = None,
        num_sms: int = 0,
        cumulative_local_expert_recv_stats: Any = None,
    ) -> _PendingDispatch:
        """Validate and launch the dispatch kernel; `finish_dispatch` completes the call."""
        keep: list = []
        if isinstance(x, tuple):
            if len(x) != 2:
                raise EPTypeError(f"x: expected an array or an FP8 tuple (data, sf), got a tuple of {len(x)}")
            x, sf = x
        xv = as_view(x, "x")
        _check_2d(xv, "x")
        num_tokens, hidden = xv.shape
        elem = xv.dtype.itemsize
        if elem not in (1, 2):
            raise EPTypeError(f"x: expected bf16 (2-byte) or FP8 (1-byte) elements, got dtype {xv.dtype}")
        if num_tokens > 0 and xv.element_strides[1] != 1:  # an empty x may carry any strides (torch: (0, 0))
            raise EPValueError(f"x: expected rows with unit element stride, got strides {xv.element_strides}")
        if num_tokens > self.num_max_tokens:
            raise EPValueError(
                f"x: expected at most num_max_tokens_per_rank={self.num_max_tokens} rows, got {num_tokens}"
            )
        sfv = None
        packs = 0
        if elem == 1:
            if sf is None:
                raise EPValueError("x: FP8 data needs its scale packs: pass x=(data, sf)")
            sfv = as_view(sf, "sf")
            _check_2d(sfv, "sf")
            if sfv.dtype.itemsize != 4 or sfv.shape[0] != num_tokens:
                raise EPValueError(
                    f"sf: expected [{num_tokens}, P] 4-byte packs, got {sfv.shape} {sfv.dtype}"
                )
            packs = sfv.shape[1]
        elif sf is not None:
            raise EPValueError("sf: scale packs are only valid with FP8 data (1-byte elements)")

        cached = handle is not None
        if cached:
            if topk_idx is not None:
                raise EPValueError(
                    "topk_idx: must be None for a cached dispatch (the handle's routing is reused)"
                )
            if do_cpu_sync:
                raise EPValueError("do_cpu_sync: cannot do a CPU sync with a cached handle")
            if cumulative_local_expert_recv_stats is not None:
                raise EPValueError("cumulative_local_expert_recv_stats: not allowed in a cached dispatch")
            topk_idx = handle.topk_idx
            num_experts = handle.num_experts
            expert_alignment = handle.expert_alignment
            do_expand = handle.do_expand
            do_cpu_sync = False
            if handle.num_tokens != num_tokens:
                raise EPValueError(f"x: the handle was made for {handle.num_tokens} tokens, got {num_tokens}")
        else:
            if topk_idx is None:
                raise EPValueError("topk_idx: required without a handle")
            if num_experts is None:
                raise EPValueError("num_experts: required without a handle")
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        expert_alignment = 1 if expert_alignment is None else int(expert_alignment)
        do_expand = bool(do_expand)
        if expert_alignment < 1:
            raise EPValueError(f"expert_alignment: expected >= 1, got {expert_alignment}")
        if do_zero_padding and not do_expand:
            raise EPValueError("do_zero_padding: only valid together with do_expand=True")
        num_experts = int(num_experts)
        if num_experts % self.num_ranks:
            raise EPValueError(
                f"num_experts: expected a multiple of num_ranks={self.num_ranks}, got {num_experts}"
            )
        iv = as_view(topk_idx, "topk_idx")
        _check_2d(iv, "topk_idx")
        if iv.shape[0] != num_tokens or not iv.is_contiguous:
            raise EPValueError(f"topk_idx: expected a contiguous [{num_tokens}, K] array, got {iv.shape}")
        if iv.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
            raise EPTypeError(f"topk_idx: expected int64 (or int32), got {iv.dtype}")
        topk = iv.shape[1]
        wv = None
        if topk_weights is not None:
            wv = as_view(topk_weights, "topk_weights")
            if wv.shape != (num_tokens, topk) or wv.dtype != np.float32 or not wv.is_contiguous:
                raise EPValueError(
                    f"topk_weights: expected a contiguous float32 [{num_tokens}, {topk}], got {wv.shape} {wv.dtype}"
                )
        cfg = self._config(hidden, elem, packs, topk)
        plan, scratch = self._regions(cfg, num_experts, "dispatch")
        num_sms = self._num_sms(num_sms, handle)
        geo = launch_geometry(cfg, num_sms, self.device_sms)
        kernels = load_kernels(cfg)
        epr = num_experts // self.num_ranks

        arrays: dict[str, Any] = {}
        if cached:
            arrays["dst_slot"] = handle.dst_buffer_slot_idx
            arrays["psum_rank"] = handle.psum_num_recv_tokens_per_scaleup_rank
            arrays["psum_expert"] = handle.psum_num_recv_tokens_per_expert
            arrays["unaligned"] = handle.num_unaligned_recv_tokens_per_expert
            arrays["src_metadata"] = handle.recv_src_metadata
        else:
            arrays["dst_slot"] = self._alloc((num_tokens, topk), np.int32)
            arrays["psum_rank"] = self._alloc((self.num_ranks,), np.int32)
            arrays["psum_expert"] = self._alloc((epr,), np.int32)
            arrays["unaligned"] = self._alloc((epr,), np.int32)
        stats_ptr = 0
        if cumulative_local_expert_recv_stats is not None:
            sv = as_view(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
            if sv.shape != (epr,) or sv.dtype != np.int32:
                raise EPValueError(
                    f"cumulative_local_expert_recv_stats: expected int32 [{epr}], got {sv.shape} {sv.dtype}"
                )
            stats_ptr = sv.ptr
        flags = 0
        if do_expand:
            flags |= FLAGS["expand"]
        if cached:
            flags |= FLAGS["cached"]
        if deterministic:
            flags |= FLAGS["deterministic"]
        if do_zero_padding:
            flags |= FLAGS["zero_padding"]
        if use_tma_aligned_col_major_sf:
            flags |= FLAGS["sf_col_major"]
        if iv.dtype == np.int32:
            flags |= FLAGS["topk_idx32"]
        args = self._common(plan, scratch, num_experts)
        args.update(
            num_tokens=num_tokens,
            expert_alignment=expert_alignment,
            flags=flags,
            x=xv.ptr,
            x_stride=xv.element_strides[0] * elem,
            sf=sfv.ptr if sfv is not None else 0,
            sf_stride0=sfv.element_strides[0] if sfv is not None else 0,
            sf_stride1=sfv.element_strides[1] if sfv is not None else 0,
            topk_idx=iv.ptr,
            topk_weights=wv.ptr if wv is not None else 0,
            dst_slot=as_view(arrays["dst_slot"], "dst_slot").ptr,
            psum_rank=as_view(arrays["psum_rank"], "psum_rank").ptr,
            psum_expert=as_view(arrays["psum_expert"], "psum_expert").ptr,
            unaligned_expert=as_view(arrays["unaligned"], "unaligned").ptr,
            cum_stats=stats_ptr,
        )
        import ep_jit

        kernels.dispatch.launch(
            geo.grid,
            geo.block,
            [ep_jit.struct(pack_op_args(**args))],
            shared_mem=geo.shared_mem,
            stream=self.stream.handle,
        )
        keep.extend([x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats])
        pending = _PendingDispatch(
            cfg,
            args,
            geo,
            cached,
            do_cpu_sync,
            do_expand,
            num_tokens,
            num_experts,
            expert_alignment,
            num_sms,
            xv,
            sfv,
            bool(use_tma_aligned_col_major_sf),
            wv is not None,
            bool(do_zero_padding),
            handle,
            topk_idx,
            arrays,
            keep,
        )
        if do_cpu_sync:
            host = self._host.array
            n = self.num_ranks
            _cuda.copy_to_host(host[: 4 * n], args["psum_rank"], self.stream)
            _cuda.copy_to_host(host[4 * n : 4 * n + 4 * epr], args["unaligned_expert"], self.stream)
            pending.host = self._host
        return pending

    def finish_dispatch(self, p: _PendingDispatch) -> DispatchResult:
        """Wait for the counts (CPU sync), allocate the outputs and launch the copy epilogue."""
        n, k, m = self.num_ranks, p.config.num_topk, self.num_max_tokens
        epr = p.num_experts // n
        a = p.alignment
        if p.do_cpu_sync:
            if not self.stream.synchronize(self.cpu_timeout_secs):
                raise EPTimeoutError(
                    self.rank,
                    "cpu.dispatch_wait",
                    "stream",
                    "not drained",
                    f"rank {self.rank}: the dispatch did not finish within the CPU timeout "
                    f"({self.cpu_timeout_secs} s)",
                )
            self.check_errors(synchronize=False)
            host = self._host.array
            psum = host[: 4 * n].view(np.int32).copy()
            counts = host[4 * n : 4 * n + 4 * epr].view(np.int32).copy()
            num_recv = int(psum[-1])
            aligned = [int((c + a - 1) // a * a) for c in counts]
            num_expanded = int(sum(aligned))
            expert_list = aligned
        elif p.cached:
            num_recv = p.handle.num_recv_tokens
            num_expanded = p.handle.num_expanded_tokens
            expert_list = list(p.handle.num_recv_tokens_per_expert_list)
        else:
            num_recv = n * m
            num_expanded = ep_layout.align(n * m * min(k, epr) + (a - 1) * epr, a)
            expert_list = []
        rows = num_expanded if p.expand else num_recv
        hidden = p.x.shape[1]
        recv_x = self._alloc((rows, hidden), p.x.dtype)
        recv_sf = None
        sf_strides = (0, 0)
        if p.sf is not None:
            packs = p.sf.shape[1]
            if p.col_major_sf:
                ld = ep_layout.align(max(rows, 1), 4)
                sf_strides = (1, ld)
                recv_sf = self._alloc((rows, packs), p.sf.dtype, sf_strides)
            else:
                sf_strides = (packs, 1)
                recv_sf = self._alloc((rows, packs), p.sf.dtype)
        recv_idx = None if p.expand else self._alloc((rows, k), np.int64)
        recv_w = None
        if p.has_weights:
            recv_w = self._alloc((rows,) if p.expand else (rows, k), np.float32)
        if p.cached:
            meta = p.arrays["src_metadata"]
        else:
            meta = self._alloc((num_recv, k + 2), np.int32)
        args = dict(p.args)
        args.update(
            src_metadata=as_view(meta, "recv_src_metadata").ptr,
            recv_x=as_view(recv_x, "recv_x").ptr,
            recv_sf=as_view(recv_sf, "recv_sf").ptr if recv_sf is not None else 0,
            sf_out_stride0=sf_strides[0],
            sf_out_stride1=sf_strides[1],
            recv_topk_idx=as_view(recv_idx, "recv_topk_idx").ptr if recv_idx is not None else 0,
            recv_topk_weights=as_view(recv_w, "recv_topk_weights").ptr if recv_w is not None else 0,
            num_out_rows=rows,
        )
        import ep_jit

        kernels = load_kernels(p.config)
        if rows > 0 or p.zero_padding:
            kernels.epilogue.launch(
                p.geometry.grid,
                p.geometry.block,
                [ep_jit.struct(pack_op_args(**args))],
                shared_mem=p.geometry.shared_mem,
                stream=self.stream.handle,
            )
        if p.cached:
            handle = p.handle
        else:
            handle = EPHandle(
                p.expand,
                p.num_experts,
                a,
                m,
                p.num_sms,
                p.topk_idx,
                num_recv,
                num_expanded,
                expert_list,
                p.arrays["psum_rank"],
                p.arrays["psum_expert"],
                p.arrays["unaligned"],
                meta,
                p.arrays["dst_slot"],
                num_ranks=n,
                rank=self.rank,
            )
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)

    def dispatch(self, *args: Any, **kwargs: Any) -> DispatchResult:
        """Both phases (one rank per process)."""
        return self.finish_dispatch(self.launch_dispatch(*args, **kwargs))

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        x: Any,
        handle: EPHandle,
        *,
        topk_weights: Any = None,
        bias: Any = None,
        allow_multiple_reduction: bool = True,
        num_sms: int = 0,
    ) -> CombineResult:
        if handle is None:
            raise EPValueError("handle: combine needs the handle of a dispatch")
        xv = as_view(x, "x")
        _check_2d(xv, "x")
        if xv.dtype.itemsize != 2 or not xv.is_contiguous:
            raise EPTypeError(
                f"x: expected contiguous bf16 rows (2-byte elements), got {xv.dtype} {xv.shape}"
            )
        hidden = xv.shape[1]
        k = handle.num_topk
        t = handle.num_tokens
        amr = bool(allow_multiple_reduction)
        if not handle.do_expand and xv.shape[0] != handle.recv_src_metadata.shape[0]:
            raise EPValueError(
                f"x: expected {handle.recv_src_metadata.shape[0]} rows (one per received token), got {xv.shape[0]}"
            )
        wv = None
        if topk_weights is not None:
            if handle.do_expand and not amr:
                raise EPValueError(
                    "topk_weights: not allowed for an expand-layout combine with allow_multiple_reduction=False"
                )
            wv = as_view(topk_weights, "topk_weights")
            want = (xv.shape[0],) if handle.do_expand else (xv.shape[0], k)
            if wv.shape != want or wv.dtype != np.float32 or not wv.is_contiguous:
                raise EPValueError(
                    f"topk_weights: expected contiguous float32 {want}, got {wv.shape} {wv.dtype}"
                )
        if bias is None:
            biases: tuple = ()
        elif isinstance(bias, tuple):
            if len(bias) != 2:
                raise EPValueError(f"bias: expected a tuple of exactly two arrays, got {len(bias)}")
            biases = tuple(b for b in bias if b is not None)
        elif isinstance(bias, list):
            raise EPTypeError("bias: expected an array or a tuple of two arrays, got a list")
        else:
            biases = (bias,)
        bias_views = []
        for i, b in enumerate(biases):
            bv = as_view(b, f"bias[{i}]")
            if bv.shape != (t, hidden) or bv.dtype.itemsize != 2 or not bv.is_contiguous:
                raise EPValueError(
                    f"bias[{i}]: expected contiguous bf16 [{t}, {hidden}], got {bv.shape} {bv.dtype}"
                )
            bias_views.append(bv)
        iv = as_view(handle.topk_idx, "handle.topk_idx")
        cfg = self._config(hidden, 2, 0, k)
        plan, scratch = self._regions(cfg, handle.num_experts, "combine", amr)
        num_sms = self._num_sms(num_sms, handle)
        geo = launch_geometry(cfg, num_sms, self.device_sms)
        kernels = load_kernels(cfg)
        combined = self._alloc((t, hidden), np.uint16)
        combined_w = self._alloc((t, k), np.float32) if wv is not None else None
        flags = 0
        if handle.do_expand:
            flags |= FLAGS["expand"]
        if amr:
            flags |= FLAGS["multiple_reduction"]
        if ep_layout.combine_uses_rank_layout(self.num_ranks, k, amr):
            flags |= FLAGS["rank_layout"]
        if iv.dtype == np.int32:
            flags |= FLAGS["topk_idx32"]
        args = self._common(plan, scratch, handle.num_experts)
        args.update(
            num_tokens=t,
            flags=flags,
            topk_idx=iv.ptr,
            psum_rank=as_view(handle.psum_num_recv_tokens_per_scaleup_rank, "psum").ptr,
            src_metadata=as_view(handle.recv_src_metadata, "recv_src_metadata").ptr,
            comb_x=xv.ptr,
            comb_weights=wv.ptr if wv is not None else 0,
            bias0=bias_views[0].ptr if len(bias_views) > 0 else 0,
            bias1=bias_views[1].ptr if len(bias_views) > 1 else 0,
            combined_x=as_view(combined, "combined_x").ptr,
            combined_weights=as_view(combined_w, "combined_w").ptr if combined_w is not None else 0,
        )
        import ep_jit

        kernels.combine.launch(
            geo.grid, geo.block, [ep_jit.struct(pack_op_args(**args))], stream=self.stream.handle
        )
        return CombineResult(combined, combined_w)

    # ------------------------------------------------------------------ errors
    def read_error(self) -> tuple[np.ndarray, np.ndarray]:
        """(error record bytes, input-error words) of this rank (synchronizes the stream)."""
        rec = np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, dtype=np.uint8)
        inp = np.zeros(4, dtype=np.int64)
        _cuda.copy_to_host(rec, self.res.base + _ERR_OFF, self.stream)
        scratch = self._any_scratch()
        if scratch:
            _cuda.copy_to_host(inp.view(np.uint8), scratch + SCRATCH_INPUT_ERROR_OFFSET, self.stream)
        self.stream.synchronize()
        return rec, inp

    def _any_scratch(self) -> int:
        """The scratch of the last operation (the workspace's reserved region unless it was too small)."""
        return getattr(self, "_last_scratch", self.res.base + ep_layout.WorkspaceLayout.RESERVED_OFFSET)

    def check_errors(self, synchronize: bool = True) -> None:
        """Raise EPTimeoutError / EPDeviceError if a kernel of this rank recorded an error."""
        if synchronize and not self.stream.synchronize(self.cpu_timeout_secs):
            raise EPTimeoutError(self.rank, "cpu.synchronize", "stream", "not drained")
        rec, inp = self.read_error()

        def get(name: str) -> int:
            f = _FIELD[name]
            dt = np.int32 if f.dtype == "int32" else np.int64
            return int(rec[f.offset : f.offset + np.dtype(dt).itemsize].view(dt)[0])

        kind = get("abort_flag")
        if kind in (int(_EK.TIMEOUT), int(_EK.PEER_ABORT)):
            tag = TAG_NAMES.get(get("tag"), str(get("tag")))
            if kind == int(_EK.PEER_ABORT):
                raise EPTimeoutError(
                    self.rank,
                    "peer_abort",
                    "abort_flag",
                    kind,
                    f"rank {self.rank}: aborted because a peer rank timed out; call reset() on the domain",
                )
            raise EPTimeoutError(
                get("rank"),
                tag,
                get("counter"),
                get("value"),
                f"rank {get('rank')} timed out in {tag} (peer {get('peer_rank')}, counter {get('counter')}, last "
                f"value {get('value')}, expected {get('expected')}); a peer rank did not arrive: check that every "
                "rank calls the same operations",
            )
        if kind != 0:
            raise EPDeviceError(f"rank {self.rank}: kernel error kind {kind}", code=kind, rank=self.rank)
        if inp[0] != 0:
            what = {
                int(_EK.INVALID_EXPERT): "an expert id >= num_experts",
                int(_EK.DUPLICATE_EXPERT): "a duplicate expert in one token",
            }.get(int(inp[0]), "bad input")
            self.clear_input_error()
            raise EPDeviceError(
                f"rank {self.rank}: topk_idx holds {what} (token {inp[1]}, lane {inp[2]}, value {inp[3]}); fix the "
                "routing",
                code=int(inp[0]),
                rank=self.rank,
                detail=int(inp[3]),
            )

    def clear_input_error(self) -> None:
        _cuda.memset(self._any_scratch() + SCRATCH_INPUT_ERROR_OFFSET, 32, self.stream)

    def reset_state(self) -> None:
        """Zero the workspace and scratch of this rank (after a timeout; every rank of the domain must reset)."""
        if self.res.base == 0:
            raise EPStateError("reset_state: the rank has no buffer")
        self.stream.synchronize()
        _cuda.memset(self.res.base, ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES, self.stream)
        for buf in self.res.scratch_buffers.values():
            _cuda.memset(buf.ptr, buf.nbytes, self.stream)
        self.stream.synchronize()
