"""A rank's combine (`CombineLaunch`, a part of `RankDriver`: direct, hybrid and cross-node mode alike): one
launch (two for a split combine: the reduce follows; a deferred one launches its reduce when its `finish()` is
called), and the zero-copy combine's buffer and checks. The rank's state, guard and launches: `rank_driver`."""

from __future__ import annotations

from typing import Any

import ep_layout
import numpy as np

from ep_core.device_array import DeviceArray as CoreArray
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.kernels._args import FLAGS
from ep_core.kernels._cuda import as_view, view_ptr
from ep_core.kernels._envelope import OP_COMBINE
from ep_core.kernels.dispatch_launch import _check_2d
from ep_core.kernels.op_plan import CombinePlan, combine_words
from ep_core.kernels.plan import launch_geometry
from ep_core.kernels.prepared_launch import _COMBINE_DYNAMIC, _COMBINE_ZERO_COPY_DYNAMIC, PreparedOp
from ep_core.requests import CombineResult
from ep_core.validation import check_zero_copy_args


class CombineLaunch:
    """The combine side of `RankDriver` (module doc)."""

    def check_zero_copy(self, x: Any, handle: EPHandle, topk_weights: Any = None) -> None:
        """What `combine(x, handle, topk_weights=..., zero_copy=True)` checks of its arguments, without launching
        (the loopback domain checks every rank before the first launches)."""
        check_zero_copy_args(handle, topk_weights)
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 2:
            raise EPValueError(f"x: expected rank {self.rank}'s 2-D combine buffer, got shape {shape}")
        ptr, rows = self._combine_buffer_place(handle, int(shape[1]))
        if shape == (rows, shape[1]) and rows == 0:
            return  # no rows: nothing is read, any address will do
        try:
            where = f"{as_view(x, 'x').ptr:#x}"
        except TypeError:  # host memory, or no array at all
            where = f"a {type(x).__name__}"
        if where != f"{ptr:#x}" or shape[0] != rows:
            raise EPValueError(
                f"x: a zero-copy combine reads rank {self.rank}'s combine buffer in place; pass "
                f"combine_buffer(handle, hidden) ({(rows, shape[1])} at {ptr:#x}) with the expert outputs written "
                f"into it, got {shape} at {where}"
            )

    def combine_buffer(self, handle: EPHandle, hidden: int) -> CoreArray:
        """Where a zero-copy combine (`combine(..., zero_copy=True)`) reads this rank's rows: bf16 [received rows,
        hidden] at the start of the receive region, one row per row of the dispatch's `recv_x`, in its order. The
        caller writes its expert outputs there instead of into an array of its own. Valid from the end of the
        dispatch's copy epilogue (the region held the received tokens until then) until the next dispatch or combine
        on this buffer, which writes the region; direct mode within one NVLink domain, non-expanded handles."""
        ptr, rows = self._combine_buffer_place(handle, hidden)
        return CoreArray(ptr, (rows, hidden), "bfloat16", device_id=self.device_id, owner=self)

    def _combine_buffer_place(self, handle: EPHandle, hidden: int) -> tuple[int, int]:
        """(address, rows) of the combine buffer, after the checks of `combine_buffer`."""
        self._check_handle(handle)
        check_zero_copy_args(handle, hidden=hidden)
        cfg = self._config(hidden, 2, 0, handle.num_topk)
        self._check_one_domain(cfg, "combine")
        rows = int(handle.recv_src_metadata.shape[0])
        if rows * hidden * 2 > self.res.data_bytes:
            raise EPValueError(
                f"zero_copy: {rows} rows of {hidden} bf16 need {rows * hidden * 2} bytes, rank {self.rank}'s receive "
                f"region has {self.res.data_bytes}; allocate the buffer with get_buffer_size_hint()"
            )
        # the receive region's start, where a zero-copy dispatch's recv_x lies too (the rows need only the bytes
        # checked above, not the ordinary combine's receive slots of both layouts)
        return self._zero_copy_places(cfg, handle.num_experts)[0], rows

    def combine(
        self,
        x: Any,
        handle: EPHandle,
        *,
        topk_weights: Any = None,
        bias: Any = None,
        allow_multiple_reduction: bool = True,
        num_sms: int = 0,
        report_input_error: bool = True,
        record: bool = False,
        zero_copy: bool = False,
        defer: bool = False,
    ) -> Any:
        """Launch the combine kernel; returns the `CombineResult`. `report_input_error=False` leaves
        `_report_input_error` to a caller that launches several ranks (the loopback domain). `record`: leave the
        call's `CombinePlan` in `last_repeat`. `zero_copy`: `x` is this rank's `combine_buffer(handle, hidden)`, read
        in place by every rank's kernel (every rank of the call passes it alike: the envelope checks).

        `defer` (DeepEP 2.5's `defer_epilogue`; records no plan): returns `finish()` instead, which allocates the
        outputs, launches the reduce and returns the `CombineResult`. A direct combine is then always split
        (`combine_split`): the call launches the send-only kernel (the collective part), `finish` the reduce-only one
        with the same words: the ordinary combine's bits. Until `finish` the rank starts no other operation and `x`
        stays unchanged (the reduce reads this rank's own rows in place). Hybrid, cross-node and zero-copy combines
        run whole at the call and `finish` hands their outputs over."""
        self.last_repeat = None
        self.guard()
        if handle is None:
            raise EPValueError("handle: combine needs the handle of a dispatch")
        self._check_handle(handle)
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
        zero_copy = bool(zero_copy)
        if zero_copy:
            self.check_zero_copy(xv, handle, topk_weights)
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
        if cfg.is_hybrid and handle.token_metadata_at_forward is None:
            raise EPValueError("handle: not made by a hybrid dispatch (no token_metadata_at_forward)")
        plan, scratch = self._regions(cfg, handle.num_experts, "combine", amr)
        num_sms = self._num_sms(num_sms, handle, handle.num_experts, k)
        flags = 0
        if handle.do_expand:
            flags |= FLAGS["expand"]
        if amr:
            flags |= FLAGS["multiple_reduction"]
        if wv is not None:
            flags |= FLAGS["combine_weights"]
        if ep_layout.combine_uses_rank_layout(self.num_ranks, k, amr):
            flags |= FLAGS["rank_layout"]
        if iv.dtype == np.int32:
            flags |= FLAGS["topk_idx32"]
        if zero_copy:
            flags |= FLAGS["combine_zero_copy"]
        # a deferred direct combine: always the two launches, the reduce at `finish` (its own launch entry)
        deferred = bool(defer) and not zero_copy and not (cfg.is_hybrid or cfg.is_direct_xnode)
        shape = self._shape_key(plan, scratch, num_sms)
        key = ("combine", cfg, handle.num_experts, t, flags, shape, deferred)
        prepared = self.plans.get(key)
        if prepared is None:
            geo = launch_geometry(cfg, num_sms, self.device_sms)
            kernels = self._kernels(cfg)
        if deferred:  # allocated at `finish`, as DeepEP's at its wait (the send part writes none)
            combined = combined_w = None
        else:
            combined = self._alloc((t, hidden), np.uint16)
            combined_w = self._alloc((t, k), np.float32) if wv is not None else None
        # ranks that differ in zero_copy would read buffers nobody filled, or fill slots nobody reads
        env_mask = (
            FLAGS["expand"] | FLAGS["multiple_reduction"] | FLAGS["rank_layout"] | FLAGS["combine_zero_copy"]
        )
        env_fields = (hidden, k, handle.num_experts, self.num_max_tokens, flags & env_mask)
        dynamic = combine_words(
            iv.ptr,
            view_ptr(handle.psum_num_recv_tokens_per_scaleup_rank, "psum"),
            view_ptr(handle.recv_src_metadata, "recv_src_metadata"),
            view_ptr(handle.token_metadata_at_forward, "token_metadata_at_forward") if cfg.is_hybrid else 0,
            xv.ptr,
            wv.ptr if wv is not None else 0,
            bias_views[0].ptr if len(bias_views) > 0 else 0,
            bias_views[1].ptr if len(bias_views) > 1 else 0,
            view_ptr(combined, "combined_x") if combined is not None else 0,
            view_ptr(combined_w, "combined_w") if combined_w is not None else 0,
            self._envelope(OP_COMBINE, (*env_fields, self._handle_launch.get(handle, -1))),
            # a zero-copy combine reads the dispatch's slots
            dst_slot=view_ptr(handle.dst_buffer_slot_idx, "dst_buffer_slot_idx") if zero_copy else None,
        )
        names = _COMBINE_ZERO_COPY_DYNAMIC if zero_copy else _COMBINE_DYNAMIC
        if prepared is None:  # a new launch shape: every field packed afresh (pack_op_args), then kept
            args = self._common(plan, scratch, handle.num_experts)
            # zero-copy: one launch (nothing is sent, the reduce is the whole kernel)
            split = deferred or (not zero_copy and self.combine_split(cfg, geo, t))
            args.update(num_tokens=t, flags=flags | (FLAGS["combine_send_only"] if split else 0))
            args.update(zip(names, dynamic))
            main = self._prepare(
                kernels.combine_zero_copy if zero_copy else kernels.combine,
                "ep_combine_zero_copy_impl" if zero_copy else "ep_combine_impl",
                geo,
                self._combine_smem(cfg),
                self.cooperative,
                args,
                names,
            )
            reduce = None
            if split:  # the reduce on the wider grid: the same words, its flag, no envelope (not collective)
                args.update(flags=flags | FLAGS["combine_reduce_only"], envelope=0)
                reduce = self._prepare(
                    kernels.combine,
                    "ep_combine_impl",
                    self.epilogue_geometry(geo),
                    self._combine_smem(cfg),
                    False,
                    args,
                    names,
                )
            prepared = PreparedOp(geo, kernels, main)
            prepared.epilogue = reduce
            prepared = self.plans.put(key, prepared)
            fresh = True
        else:
            fresh = False
        self._launch_prepared(prepared.main, dynamic, fresh, bool(dynamic[-1]))
        if deferred:
            if report_input_error:
                self._report_input_error()
            return self._reduce_later(prepared.epilogue, dynamic, t, hidden, k, wv is not None)
        if prepared.epilogue is not None:
            self._launch_prepared(prepared.epilogue, (*dynamic[:-1], 0), fresh, False)
        if record and not defer:
            self.last_repeat = CombinePlan(
                rank=self,
                prepared=prepared,
                scratch=scratch,
                hybrid=cfg.is_hybrid,
                idx32=bool(flags & FLAGS["topk_idx32"]),
                num_tokens=t,
                hidden=hidden,
                topk=k,
                has_weights=wv is not None,
                env_fields=env_fields,
                zero_copy=zero_copy,
                buffer_ptr=xv.ptr if zero_copy else 0,
            )
        if report_input_error:
            self._report_input_error()
        res = CombineResult(combined, combined_w)
        return (lambda: res) if defer else res  # (hybrid, cross-node: handed over at `finish`)

    def _reduce_later(self, reduce: Any, dynamic: tuple, t: int, hidden: int, k: int, weights: bool) -> Any:
        """A deferred combine's `finish()` (`combine(defer=True)`): its outputs from the rank's allocator of that
        moment, then the reduce launch with the call's words, the outputs set and no envelope (not collective), as
        a split combine launches it right after the send part."""

        def finish() -> CombineResult:
            combined = self._alloc((t, hidden), np.uint16)
            combined_w = self._alloc((t, k), np.float32) if weights else None
            outputs = (
                view_ptr(combined, "combined_x"),
                view_ptr(combined_w, "combined_w") if combined_w is not None else 0,
            )
            # (`_COMBINE_DYNAMIC` order: the outputs after the eight inputs, the envelope last)
            self._launch_prepared(reduce, (*dynamic[:8], *outputs, *dynamic[10:-1], 0), False, False)
            return CombineResult(combined, combined_w)

        return finish

    # ------------------------------------------------------------------ errors
