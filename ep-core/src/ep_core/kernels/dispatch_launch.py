"""A rank's dispatch (`DispatchLaunch`, a part of `RankDriver`: direct, hybrid and cross-node mode alike): the two
phases `launch_dispatch` / `finish_dispatch` (`ep_core.kernels.rank_driver`'s module doc). A zero-copy dispatch
leaves its outputs where the kernel stored them (`RegionView`s of the receive region).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ep_layout
import numpy as np

from ep_core.device_array import DeviceArray as CoreArray
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.kernels import _cuda
from ep_core.kernels._args import FLAGS, OP_ARGS_FIELDS
from ep_core.kernels._cuda import DeviceView, PinnedBuffer, Stream, as_view, view_ptr
from ep_core.kernels._envelope import OP_DISPATCH
from ep_core.kernels.op_plan import DispatchPlan, dispatch_words, epilogue_outputs
from ep_core.kernels.plan import KernelConfig, launch_geometry, plan_regions
from ep_core.kernels.prepared_launch import (
    _DISPATCH_DYNAMIC,
    _DISPATCH_ZERO_COPY_DYNAMIC,
    _EPILOGUE_DYNAMIC,
    _EPILOGUE_DYNAMIC_ALL,
    PreparedOp,
)
from ep_core.kernels.zero_copy_rows import ZeroCopyRows
from ep_core.requests import DispatchResult
from ep_core.validation import check_zero_copy_dispatch_args, validate_rank_routing


@dataclass
class _PendingDispatch:
    config: KernelConfig
    args: dict | None  # the full argument dict when this call prepared its launch shape (a miss), else None
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
    # this rank's collective launch count after the dispatch kernel: the identity of its handle in envelopes
    launch_number: int = 0
    prepared: PreparedOp | None = None
    dynamic: tuple = ()  # the dispatch launch's per-call words (the epilogue's start with them, then its outputs)
    repeat: dict | None = None  # what a `DispatchPlan` needs beyond these fields (`record=True`)
    # a lone rank's cached dispatch: no dispatch kernel, the copy epilogue does it all (`RankDriver.epilogue_only`)
    epilogue_only: bool = False
    # the outputs are views of the receive region, written by the dispatch kernel (`zero_copy=True`): no epilogue
    zero_copy: bool = False


_INT64, _INT32, _FLOAT32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)
_DTYPE_NAMES: dict[np.dtype, str] = {}  # numpy's `dtype.name` is slow to compute: once per dtype


class RegionView(CoreArray):
    """A zero-copy dispatch's output: a view of its rank's receive region (no allocation of its own) that copies
    itself to the host like the rank's allocations do (`numpy()`, on the rank's stream, synchronizing)."""

    __slots__ = ("stream",)

    def __init__(
        self, ptr: int, shape: tuple, dtype: Any, stream: Stream, owner: Any, device_id: int
    ) -> None:
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        super().__init__(ptr, shape, name, device_id=device_id, owner=owner)
        self.stream = stream

    def numpy(self) -> np.ndarray:
        host = np.empty(self.shape, np.dtype(self.dtype))
        if host.nbytes:
            _cuda.copy_to_host(host, self.ptr, self.stream)
            self.stream.synchronize()
        return host


def _check_2d(view: DeviceView, what: str) -> None:
    if len(view.shape) != 2:
        raise EPValueError(f"{what}: expected a 2-D array, got shape {view.shape}")


class DispatchLaunch:
    """The dispatch side of `RankDriver` (module doc)."""

    # `ProcessRank`, `NcclRank`: the routing checked here first (rule D7); the others' callers check it before
    check_routing = False
    # set by ep_torch's `borrow_recv` road just before a `finish_dispatch`, which clears it: that finish lends the
    # receive region (`lends_region`) instead of copying the rows out, where the call allows it
    borrow_recv_next = False

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
        record: bool = False,
        topk_idx_copy: Any = None,
        zero_copy: bool = False,
    ) -> _PendingDispatch:
        """Check and launch the dispatch kernel (the routing, rule D7, is the validator's: `validate_dispatch` or,
        for the kernel layer's own entry points, `ep_core.validation.validate_rank_routing`); `finish_dispatch`
        completes the call. `record`: leave the call's `DispatchPlan` in `last_repeat` (ep_core.kernels.op_plan).
        `topk_idx_copy`: a contiguous array of topk_idx's shape and dtype that the kernel fills with the routing
        as it reads it (the new handle's copy, `do_handle_copy`; not with a handle). `zero_copy`: the kernel
        stores the outputs in their final form in this rank's receive region and `recv_x`, its scales, ids and
        weights are views of it (no copy epilogue; rows in deterministic order; `zero_copy_rows`); every rank of
        the call passes it alike (the envelope checks)."""
        if self.check_routing:
            validate_rank_routing(x, topk_idx, handle)
        self.last_repeat = None
        self.guard()
        self._check_handle(handle)
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
        # the routing (rule D7) is validated before this layer (ep_core.validation.validate_routing)
        if cached:
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
        iv = as_view(topk_idx, "topk_idx")  # [num_tokens, K] int64 / int32, contiguous (validate_routing)
        topk = iv.shape[1]
        copy_ptr = 0
        if topk_idx_copy is not None:
            if cached:
                raise EPValueError(
                    "topk_idx_copy: a cached dispatch makes no new handle to copy the routing into"
                )
            cv = as_view(topk_idx_copy, "topk_idx_copy")
            if cv.shape != iv.shape or cv.dtype != iv.dtype or not cv.is_contiguous:
                raise EPValueError(
                    f"topk_idx_copy: expected a contiguous {iv.dtype} {iv.shape} array, got {cv.shape} {cv.dtype}"
                )
            copy_ptr = cv.ptr
        wv = None
        if topk_weights is not None:
            wv = as_view(topk_weights, "topk_weights")
            if wv.shape != (num_tokens, topk) or wv.dtype != np.float32 or not wv.is_contiguous:
                raise EPValueError(
                    f"topk_weights: expected a contiguous float32 [{num_tokens}, {topk}], got {wv.shape} {wv.dtype}"
                )
        cfg = self._config(hidden, elem, packs, topk)
        zero_copy = bool(zero_copy)
        if zero_copy:
            self.check_zero_copy_dispatch(cfg, cached, do_expand, bool(use_tma_aligned_col_major_sf))
        plan, scratch = self._regions(cfg, num_experts, "dispatch")
        num_sms = self._num_sms(num_sms, handle, num_experts, topk)
        flags = 0
        if zero_copy:
            flags |= FLAGS["dispatch_zero_copy"] | FLAGS["deterministic"]
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
        if self.debug_skip_scaleout_signal:
            flags |= FLAGS["skip_scaleout_signal"]
        x_stride = xv.element_strides[0] * elem
        sf_strides = (sfv.element_strides[0], sfv.element_strides[1]) if sfv is not None else (0, 0)
        # everything that shapes the launch (ep_core.kernels.prepared_launch); the pointers are patched per call
        key = (
            "dispatch",
            cfg,
            num_experts,
            num_tokens,
            expert_alignment,
            flags,
            x_stride,
            sf_strides,
            self._shape_key(plan, scratch, num_sms),
        )
        prepared = self.plans.get(key)
        if prepared is None:
            geo = launch_geometry(cfg, num_sms, self.device_sms)
            kernels = self._kernels(cfg)
        else:
            geo, kernels = prepared.geometry, prepared.kernels
        epr = num_experts // self.num_ranks

        arrays: dict[str, Any] = {}
        if cached:
            arrays["dst_slot"] = handle.dst_buffer_slot_idx
            arrays["psum_rank"] = handle.psum_num_recv_tokens_per_scaleup_rank
            arrays["psum_expert"] = handle.psum_num_recv_tokens_per_expert
            arrays["unaligned"] = handle.num_unaligned_recv_tokens_per_expert
            arrays["src_metadata"] = handle.recv_src_metadata
            arrays["fwd"] = handle.token_metadata_at_forward
        else:
            shapes = {"dst_slot": (num_tokens, topk), "psum_rank": (self.num_scaleup_ranks,)}
            # hybrid: per source node [count, ...] then per forwarded message (source id, K expert ids)
            if cfg.is_hybrid:
                shapes["fwd"] = (cfg.num_nodes, self.num_max_tokens + 1, topk + 1)
            shapes["psum_expert"] = (epr,)
            shapes["unaligned"] = (epr,)
            # its rows are known now (one per slot): in the same block. A zero-copy dispatch's kernel writes it: at
            # its largest (a CPU sync's handle keeps the first rows)
            if not do_cpu_sync or zero_copy:
                shapes["src_metadata"] = (self.num_ranks * self.num_max_tokens, topk + 2)
            arrays.update(self._alloc_int32(shapes))
            arrays.setdefault("fwd", None)
        stats_ptr = 0
        if cumulative_local_expert_recv_stats is not None:
            sv = as_view(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
            if sv.shape != (epr,) or sv.dtype != np.int32:
                raise EPValueError(
                    f"cumulative_local_expert_recv_stats: expected int32 [{epr}], got {sv.shape} {sv.dtype}"
                )
            stats_ptr = sv.ptr
        if cfg.is_hybrid and arrays["fwd"] is None:
            raise EPValueError("handle: not made by a hybrid dispatch (no token_metadata_at_forward)")
        psum_rank_ptr = view_ptr(arrays["psum_rank"], "psum_rank")
        unaligned_ptr = view_ptr(arrays["unaligned"], "unaligned")
        env_fields = (
            hidden * elem,
            cfg.num_sf_packs,
            cfg.num_topk,
            num_experts,
            self.num_max_tokens,
            expert_alignment,
            flags
            & (FLAGS["expand"] | FLAGS["cached"] | FLAGS["deterministic"] | FLAGS["dispatch_zero_copy"]),
        )
        dynamic = dispatch_words(
            xv.ptr,
            sfv.ptr if sfv is not None else 0,
            iv.ptr,
            wv.ptr if wv is not None else 0,
            view_ptr(arrays["dst_slot"], "dst_slot"),
            view_ptr(arrays["fwd"], "token_metadata_at_forward") if cfg.is_hybrid else 0,
            psum_rank_ptr,
            view_ptr(arrays["psum_expert"], "psum_expert"),
            unaligned_ptr,
            stats_ptr,
            copy_ptr,
            self._envelope(OP_DISPATCH, (*env_fields, self._handle_launch.get(handle, -1) if cached else -1)),
            src_metadata=view_ptr(arrays["src_metadata"], "src_metadata") if zero_copy else None,
        )
        fields = _DISPATCH_ZERO_COPY_DYNAMIC if zero_copy else _DISPATCH_DYNAMIC
        args = None
        if prepared is None:  # a new launch shape: every field packed afresh (pack_op_args), then kept
            args = self._common(plan, scratch, num_experts)
            args.update(
                num_tokens=num_tokens,
                expert_alignment=expert_alignment,
                flags=flags,
                x_stride=x_stride,
                sf_stride0=sf_strides[0],
                sf_stride1=sf_strides[1],
            )
            args.update(zip(fields, dynamic))
            main = self._prepare(
                kernels.dispatch_zero_copy if zero_copy else kernels.dispatch,
                "ep_dispatch_zero_copy_impl" if zero_copy else "ep_dispatch_impl",
                geo,
                geo.shared_mem,
                self.cooperative,
                args,
                fields,
            )
            # the combine of this configuration may come first inside a CUDA graph capture: query its occupancy now
            self._occupancy(kernels.combine, geo.block, self._combine_smem(cfg))
            prepared = self.plans.put(key, PreparedOp(geo, kernels, main))
        rows = (handle.num_expanded_tokens if do_expand else handle.num_recv_tokens) if cached else 0
        epilogue_only = self.epilogue_only(cached, rows, bool(do_zero_padding))
        if epilogue_only:  # prepared (its words start the epilogue's) but not launched; counted as launched
            self._num_collective_launches += bool(dynamic[-1])
        else:
            self._launch_prepared(prepared.main, dynamic, args is not None, bool(dynamic[-1]))
        keep.extend([x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, topk_idx_copy])
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
            launch_number=self._num_collective_launches,
            prepared=prepared,
            dynamic=dynamic,
            epilogue_only=epilogue_only,
            zero_copy=zero_copy,
        )
        if record:
            pending.repeat = {
                "scratch": scratch,
                "skip_signal": self.debug_skip_scaleout_signal,
                "hybrid": cfg.is_hybrid,
                "idx32": bool(flags & FLAGS["topk_idx32"]),
                "topk": topk,
                "int32_shapes": None if cached else shapes,
                "env_fields": env_fields,
            }
        if do_cpu_sync:
            self._copy_counts(psum_rank_ptr, unaligned_ptr, epr)
            pending.host = self._host
        return pending

    def finish_dispatch(self, p: _PendingDispatch) -> DispatchResult:
        """Wait for the counts (CPU sync), allocate the outputs and launch the copy epilogue."""
        n, k, m = self.num_ranks, p.config.num_topk, self.num_max_tokens
        epr = p.num_experts // n
        a = p.alignment
        if p.do_cpu_sync:
            num_recv, num_expanded, expert_list = self._sync_counts(epr, a)
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
        lend = False
        if self.borrow_recv_next:  # (read only: the calls that do not borrow write nothing)
            self.borrow_recv_next = False
            lend = self.lends_region(p)
        if p.zero_copy:
            recv_x, recv_sf, recv_idx, recv_w, meta = self._zero_copy_outputs(p, num_recv)
            pdl = False
        else:
            recv_x, recv_sf, recv_idx, recv_w, meta, pdl = self._copy_epilogue(p, rows, num_recv, lend)
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
                token_metadata_at_forward=p.arrays["fwd"],
                num_ranks=n,
                rank=self.rank,
            )
            handle._ep_owner = self.state.owner  # ep_core.rank_state.check_owner
        if not p.cached:
            self._handle_launch[handle] = p.launch_number
        if not p.cached and not p.do_cpu_sync:
            self._unconfirmed.add(handle)
        kept = p.prepared.epilogue_pdl if pdl else p.prepared.epilogue
        # a CPU-sync repeat learns its rows after launching: it needs the epilogue kept already. A zero-copy
        # dispatch has no epilogue; its repeat serves the no-sync call (a CPU sync's handle keeps a slice of the
        # metadata, which the repeat's handle block does not make)
        if p.zero_copy:
            repeatable = not p.do_cpu_sync
        elif lend:  # (never replayed: a kept plan would copy)
            repeatable = False
        else:
            repeatable = kept is not None or not (rows > 0 or p.zero_padding or p.do_cpu_sync)
        if p.repeat is not None and repeatable:
            self.last_repeat = DispatchPlan(
                rank=self,
                prepared=p.prepared,
                cached=p.cached,
                expand=p.expand,
                num_tokens=p.num_tokens,
                hidden=hidden,
                x_dtype=p.x.dtype,
                sf_dtype=None if p.sf is None else p.sf.dtype,
                packs=0 if p.sf is None else p.sf.shape[1],
                col_major_sf=p.col_major_sf,
                has_weights=p.has_weights,
                zero_padding=p.zero_padding,
                num_experts=p.num_experts,
                alignment=a,
                num_sms=p.num_sms,
                num_recv=num_recv,
                num_expanded=num_expanded,
                epilogue_pdl=pdl,
                cpu_sync=p.do_cpu_sync,
                zero_copy=p.zero_copy,
                config=p.config,
                **p.repeat,
            )
        self._report_input_error()
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)

    def lends_region(self, p: _PendingDispatch) -> bool:
        """Whether `p`'s finish can lend its receive region (`borrow_recv_next`): a new handle's non-expanded bf16
        rows without scales after a CPU sync, in direct mode within one NVLink domain, where every received row
        lies whole in the region once the epilogue has put this rank's own rows' hidden part there."""
        cfg = p.config
        return not (
            p.zero_copy or p.cached or p.expand or p.sf is not None or not p.do_cpu_sync
            or cfg.is_hybrid or cfg.is_direct_xnode or np.dtype(p.x.dtype).itemsize != 2
        )  # fmt: skip

    def region_rows(self, p: _PendingDispatch) -> RegionView:
        """This rank's dispatch receive region as `[N * M, token bytes]` uint8 (row `s * M + slot`: the token rank `s`
        put in `slot`; its hidden part first): what a lending finish returns as `recv_x`."""
        cfg, m = p.config, self.num_max_tokens
        plan = plan_regions(cfg, p.num_experts, m, self.res.data_bytes, op="dispatch")
        shape = (self.num_ranks * m, cfg.dispatch_token.get_num_bytes())
        return RegionView(
            self.res.base + plan.recv_offset, shape, np.dtype(np.uint8), self.stream, self, self.device_id
        )

    def _copy_epilogue(self, p: _PendingDispatch, rows: int, num_recv: int, lend: bool = False) -> tuple:
        """`finish_dispatch`'s outputs, allocated, and the copy epilogue that fills them: `(recv_x, recv_sf,
        recv_topk_idx, recv_topk_weights, recv_src_metadata, whether the epilogue was a programmatic dependent)`.
        `lend` (`lends_region`): no `recv_x` allocated, the epilogue told so by a null pointer (it copies no row and
        puts this rank's own rows whole into the region: dispatch_epilogue.cuh), `region_rows` returned for it."""
        hidden, k = p.x.shape[1], p.config.num_topk
        recv_x = self.region_rows(p) if lend else self._alloc((rows, hidden), p.x.dtype)
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
        # the handle's (cached), or allocated with the slots (no CPU sync)
        meta = p.arrays.get("src_metadata")
        if meta is None:
            meta = self._alloc((num_recv, k + 2), np.int32)
        outputs = epilogue_outputs(
            view_ptr, view_ptr(meta, "recv_src_metadata"), recv_x, recv_sf, sf_strides, recv_idx, recv_w, rows
        )
        if lend:
            outputs = (*outputs[:2], 0, *outputs[3:])  # recv_x null (`epilogue_outputs`' order)
        pdl = self._epilogue_pdl(p)
        if rows > 0 or p.zero_padding:
            # no grid barrier in the epilogue: a plain launch (or a programmatic dependent one)
            epilogue = p.prepared.epilogue_pdl if pdl else p.prepared.epilogue
            fresh = epilogue is None or p.args is not None  # its first use, or a new shape: a fresh pack
            if fresh:
                if p.args is not None:
                    args = dict(p.args)
                else:
                    args = dict(zip(OP_ARGS_FIELDS, p.prepared.main.patch(p.dynamic)))
                args.update(zip(_EPILOGUE_DYNAMIC, outputs))
                epilogue = self._prepare(
                    p.prepared.kernels.epilogue,
                    "ep_dispatch_copy_epilogue_impl",
                    self.epilogue_geometry(p.geometry),
                    p.geometry.shared_mem,
                    False,
                    args,
                    _EPILOGUE_DYNAMIC_ALL,
                    pdl,
                )
                if pdl:
                    p.prepared.epilogue_pdl = epilogue
                else:
                    p.prepared.epilogue = epilogue
            # its words are the dispatch's (this call's pointers) with the epilogue's outputs, envelope 0
            self._launch_prepared(epilogue, p.dynamic + outputs, fresh, False)
        return recv_x, recv_sf, recv_idx, recv_w, meta, pdl

    def _zero_copy_outputs(self, p: _PendingDispatch, num_recv: int) -> tuple:
        """`finish_dispatch`'s outputs of a zero-copy dispatch: views of this rank's receive region, where the kernel
        stored them (`ZeroCopyRows`), `num_recv` rows each (exact after a CPU sync, N * M without, as the ordinary
        dispatch's); the handle's metadata is the first `num_recv` rows of the array the kernel filled."""
        k = p.config.num_topk
        sf_dtype, packs = (None, 0) if p.sf is None else (p.sf.dtype, p.sf.shape[1])
        recv_x, recv_sf, recv_idx, recv_w = self.zero_copy_views(
            p.config, p.num_experts, num_recv, p.x.dtype, sf_dtype, packs, p.has_weights
        )
        dev, stream = self.device_id, self.stream
        meta = p.arrays["src_metadata"]
        # a CPU sync's rows: the first of the kernel's array, of the allocator's type
        if meta.shape[0] != num_recv:
            if hasattr(meta, "__getitem__"):  # torch, numpy-like
                meta = meta[:num_recv]
            else:
                ptr = view_ptr(meta, "recv_src_metadata")
                meta = RegionView(ptr, (num_recv, k + 2), _INT32, stream, meta, dev)
        return recv_x, recv_sf, recv_idx, recv_w, meta

    def zero_copy_views(
        self,
        cfg: KernelConfig,
        num_experts: int,
        rows: int,
        x_dtype: Any,
        sf_dtype: Any,
        packs: int,
        has_weights: bool,
    ) -> tuple:
        """A zero-copy dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: `RegionView`s of `rows`
        rows where the kernel stored them (`finish_dispatch`, and its repeat `DispatchPlan.run`)."""
        base, sf_at, idx_at, w_at = self._zero_copy_places(cfg, num_experts)
        dev, stream, k = self.device_id, self.stream, cfg.num_topk
        recv_x = RegionView(base, (rows, cfg.hidden), x_dtype, stream, self, dev)
        recv_sf = None if sf_dtype is None else RegionView(sf_at, (rows, packs), sf_dtype, stream, self, dev)
        recv_idx = RegionView(idx_at, (rows, k), _INT64, stream, self, dev)
        recv_w = RegionView(w_at, (rows, k), _FLOAT32, stream, self, dev) if has_weights else None
        return recv_x, recv_sf, recv_idx, recv_w

    def _zero_copy_places(self, cfg: KernelConfig, num_experts: int) -> tuple[int, int, int, int]:
        """The addresses of a zero-copy dispatch's `recv_x`, scales, ids and weights in this rank's receive region
        (`ZeroCopyRows`), kept per configuration: a call computes no offsets."""
        places = self.__dict__.setdefault("_zc_places", {})
        key = (cfg, num_experts)
        at = places.get(key)
        if at is None:
            z = self.zero_copy_rows(cfg)
            plan = plan_regions(cfg, num_experts, self.num_max_tokens, self.res.data_bytes, op="dispatch")
            base = self.res.base + plan.recv_offset
            at = places[key] = (base, base + z.sf_offset, base + z.topk_idx_offset, base + z.weights_offset)
        return at

    def zero_copy_rows(self, cfg: KernelConfig) -> ZeroCopyRows:
        """Where a zero-copy dispatch of `cfg` leaves its outputs in the receive region (zero_copy_rows.cuh)."""
        return ZeroCopyRows(
            self.num_ranks * self.num_max_tokens, cfg.hidden * cfg.elem_size, cfg.num_sf_packs, cfg.num_topk
        )

    def check_zero_copy_dispatch(
        self, cfg: KernelConfig, cached: bool, expand: bool, col_major_sf: bool
    ) -> None:
        """What `dispatch(..., zero_copy=True)` asks of its call and of this buffer; raises before any launch (the
        same on every rank of a call: nothing here depends on the rank's own tokens): the arguments as validation
        rule D18 says, then this buffer's mode and room."""
        check_zero_copy_dispatch_args(cached, expand, col_major_sf, self.rank)
        self._check_one_domain(cfg, "dispatch")
        where = f"rank {self.rank}"
        need = self.zero_copy_rows(cfg).num_bytes
        if need > self.res.data_bytes:
            raise EPValueError(
                f"zero_copy: the outputs of {self.num_ranks} x {self.num_max_tokens} rows need {need} bytes, {where}'s "
                f"receive region has {self.res.data_bytes}; allocate the buffer with get_buffer_size_hint()"
            )

    def _check_one_domain(self, cfg: KernelConfig, op: str) -> None:
        """The zero-copy ops' mode: direct, within one NVLink domain (their kernels store and load peers' regions)."""
        if cfg.is_hybrid or cfg.is_direct_xnode:
            raise EPValueError(
                f"zero_copy: direct mode within one NVLink domain only; this buffer's {self.num_ranks} ranks span "
                f"nodes of {self.num_nvlink_ranks} (rank {self.rank}; {op} without zero_copy)"
            )

    def dispatch(self, *args: Any, **kwargs: Any) -> DispatchResult:
        """Both phases (one rank per process)."""
        return self.finish_dispatch(self.launch_dispatch(*args, **kwargs))
