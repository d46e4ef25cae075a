"""V1 ``Buffer``'s low-latency mode (``low_latency_dispatch`` / ``low_latency_combine`` and their buffers), a base
class of ``Buffer``: the adapter on V2's kernels (``low_latency``) or the native kernels (``ll_kernels.native_*``),
as ``Buffer``'s docstring describes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPStateError, EPTypeError, EPValueError

from .. import _env
from ..buffer import ElasticBuffer
from ..event import EventHandle, EventOverlap
from .checks import _check_ll_limits, _check_topk
from .guard import _guarded, _ll_target
from .low_latency import LowLatencyHandle, into, ll_combine_weighted, ll_dispatch

__all__ = ["LowLatencyMode"]


class LowLatencyMode:
    """The low-latency methods of V1's ``Buffer`` (its state is ``Buffer.__init__``'s ``_ll_*`` fields)."""

    # The native kernels' envelope (issue 41): "change" (default) takes a host step only when this rank's sizes change
    # (``_agree_native``: a new region's layout; the hot path pays a tuple compare) and leaves the rest to the kernels:
    # each flag carries the call's signature word, a rank that refuses a call posts an abort word instead of its
    # kernels (``guard._guarded``), and every rank raises naming the rank (``ll_kernels.raise_record``) with no host
    # step; "call" takes a host step every call (raised there, before any launch, at one host exchange per call).
    ll_native_agree: str = "change"
    _ll_native_on_cpu = False  # the native road on CPU tensors: the CPU tests' stand-in of the kernels only

    def _ensure_ll(
        self, m: int, hidden: int, num_topk: int, num_experts: int = 0, cuda: bool = False
    ) -> ElasticBuffer:
        """The low-latency inner buffer. Native kernels (``ll_native=True``, on CUDA where the storage maps the
        peers): a buffer whose symmetric data region holds the low-latency region (``ep_core.ll_native``), else the
        adapter's: M tokens, combine rows of K*hidden (see ``legacy.low_latency``). V1's contract (M, hidden, K,
        experts equal on every rank) makes a rebuild collective without a collective to agree first."""
        if self._destroyed:
            raise EPStateError("Buffer: used after destroy(); create a new buffer")
        native = bool(cuda) and bool(self.ll_native)
        if native:
            key = ("native", m, hidden, num_topk, num_experts)
            if self._ll_inner is None or self._ll_key != key:
                self._build_native(m, hidden, num_topk, num_experts, key)
            if self._ll_region is not None:
                return self._ll_inner  # type: ignore[return-value]
            # this transport does not map the peers' memory (the same on every rank): the adapter from now on
        key = (m, hidden, num_topk, self.ll_deterministic)
        if self._ll_inner is None or self._ll_key != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise EPStateError(
                    f"low_latency_dispatch (rank {self.rank}): the first call with num_max_dispatch_tokens_per_rank="
                    f"{m}, hidden={hidden}, num_topk={num_topk} builds the buffer (a collective): run it once before "
                    "CUDA-graph capture"
                )
            if self._ll_inner is not None:
                old, self._ll_inner = self._ll_inner, None
                old.destroy()
            self._builds += 1
            self._ll_build = self._builds
            self._ll_inner = self._new_inner(
                num_max_tokens_per_rank=m,
                hidden=num_topk * hidden,
                num_topk=num_topk,
                # deterministic: rows in (source rank, source token) order, V1's packed order; without, the packing
                # orders rows by their source key (legacy.low_latency)
                deterministic=self.ll_deterministic,
                explicitly_destroy=True,
            )
            self._ll_key = key
            self._ll_region = None
        return self._ll_inner

    def _agree_native(self, op: str, names: tuple[str, ...], sig: tuple, cuda: bool, key: Any = None) -> None:
        """The native road's host envelope (issue 41). ``sig``: what every rank must agree on for ``op``. With
        ``ll_native_agree="change"`` (default) the callers pass only the dispatch's sizes (a new region's layout, whose
        build is a collective) and the step is taken once per change, cached; the rest (FP8 / LogFMT, the combine's
        handle, a call one rank refuses) is the kernels' signature words' (``ll_kernels.dispatch_sig``), raised on
        every rank with no host step. With ``"call"`` the whole signature is agreed every call. The step: this
        buffer's ``Channel``, so ranks that disagree all raise ``EPMismatchError`` before any build or launch; ``key``
        (default ``op``) keys the cache (the combine's is per handle age, so that two batches in flight, combined in
        turn, take no step). Under CUDA-graph capture no step is taken (a replay runs no Python): a signature agreed
        before is accepted, a new one refused. Not covered: one rank alone changing its sizes takes the step alone
        (its host wait expires, bounded, and its abort word ends its peers' call; then every rank refuses until
        ``reset()``). No step with rank masking (a masked rank sits out) or on a loopback group (no host channel)."""
        key = op if key is None else key
        memo = self.__dict__.get(
            "_ll_agreed"
        )  # (generation, {key: signature last agreed}, {(op, signature)})
        if (
            memo is not None
            and memo[1].get(key) == sig
            and memo[0] == self._channel.state.generation
            and self.ll_native_agree != "call"
        ):
            return  # the hot path: nothing changed since the ranks last agreed
        channel = self._channel
        if channel is None or self._shrink is not None:
            return
        gen = channel.state.generation
        if memo is None or memo[0] != gen:  # reset() resynchronised the ranks: agree again
            memo = self._ll_agreed = (gen, {}, set())
        if memo[1].get(key) == sig and self.ll_native_agree != "call":
            return
        if cuda and torch.cuda.is_current_stream_capturing():
            if (op, sig) in memo[2]:
                memo[1][key] = sig
                return
            raise EPStateError(
                f"{op} (rank {self.rank}): these arguments ({dict(zip(names, sig))}) were never agreed with the peers "
                "(a host step): run the call once before CUDA-graph capture"
            )
        channel.exchange(op + ".native", dict(zip(names, sig)))
        memo[1][key] = sig
        memo[2].add((op, sig))

    def _check_at_call(self, reg: Any, op: str, token: int) -> None:
        """Raise what the kernels recorded, right after the receive of the call of record ``token`` was issued
        (``NativeRegion.check``: on the CPU stand-in that receive has run; on the GPU the record is usually raised at
        the next call instead). Also from a hook, outside the call's guard: a step-breaking error is recorded in the
        rank state there too."""
        try:
            reg.check(op, at_call=token)
        except Exception as exc:
            state = getattr(self, "_state", None)
            if state is not None:
                state.record(op, exc)
            raise

    def _build_native(self, m: int, hidden: int, num_topk: int, num_experts: int, key: tuple) -> None:
        """A new inner buffer sized for the native low-latency region (a collective), and the region over it."""
        from ep_core import ll_native

        from . import ll_kernels

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise EPStateError(
                f"low_latency_dispatch (rank {self.rank}): the first call with num_max_dispatch_tokens_per_rank="
                f"{m}, hidden={hidden}, num_topk={num_topk} builds the buffer (a collective): run it once before "
                "CUDA-graph capture"
            )
        n = self.group_size
        # num_topk and the experts per rank: checked by low_latency_dispatch (checks._check_ll_limits)
        if 8 * m > 48 * 1024:
            raise EPValueError(
                f"low_latency_dispatch (rank {self.rank}): num_max_dispatch_tokens_per_rank={m} > 6144 (the native "
                "send kernel lists a block's tokens in shared memory)"
            )
        lay = ll_native.region_layout(num_experts // n, n, num_experts, m, num_topk, hidden)
        num_bytes = -(-lay.total_bytes // (2 << 20)) * (2 << 20)
        if self._ll_inner is not None:
            self._ll_inner.destroy()
            self._ll_inner = None
        ll_kernels.preload()
        self._builds += 1
        self._ll_build = self._builds  # handles of the previous inner buffer are refused (_check_handle)
        self._ll_inner = self._new_inner(num_bytes=num_bytes, explicitly_destroy=True)
        self._ll_key = key
        refusal = ll_kernels.native_refusal(self._ll_inner)
        if not refusal:
            self._ll_region = ll_kernels.NativeRegion(
                self._ll_inner, self.rank, n, num_experts, m, num_topk, hidden
            )
        else:
            self._ll_region = None
            self._ll_inner.destroy()
            self._ll_inner, self._ll_key = None, None
            # no silent fallback: the reason is the same on every rank, so every rank raises
            if self.ll_native is True:
                raise EPValueError(
                    f"Buffer(ll_native=True) (rank {self.rank}): the native low-latency kernels cannot run here: "
                    f"{refusal}; pass ll_native=None (the adapter where they cannot run) or False"
                )
            if self._shrink is not None:  # no silent fallback: the adapter takes no mask
                from .ll_shrink import shrink_unsupported

                raise shrink_unsupported(
                    "low_latency_dispatch",
                    "a transport that does not map the peers' memory (the native kernels')",
                )
            self.ll_native = False  # this transport: the adapter from now on

    def _on_comm(
        self, cuda: bool, async_finish: bool, return_recv_hook: bool, inputs: tuple, fn: Any
    ) -> tuple[Any, EventOverlap, Any]:
        """Run ``fn`` and return ``(result, event, hook)`` with V1's stream semantics.

        Without ``async_finish``/``return_recv_hook`` the work runs on the caller's stream. With either, it is issued
        at once on the communication stream (which first waits for the caller's stream) and the caller's stream does
        not wait: ``hook()`` (or ``event.current_stream_wait()``) makes the then-current stream wait for it. The host
        never blocks. What overlaps: the caller's stream runs its own work meanwhile; ep's kernels still hold their
        SMs until the peers' data has arrived (there is no separate receive kernel to launch later)."""
        if not cuda or not (async_finish or return_recv_hook):
            out = fn()
            event = (
                EventOverlap(EventHandle(device="cuda" if cuda else "cpu"))
                if async_finish
                else EventOverlap(None)
            )
            return out, event, (_data_complete if return_recv_hook else None)
        compute = torch.cuda.current_stream()
        comm = self.get_comm_stream()
        assert comm is not None
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            out = fn()
            done = EventHandle(comm)
        if not torch.cuda.is_current_stream_capturing() and not _env.avoid_record_stream():
            for t in _tensors(inputs):
                t.record_stream(comm)  # the caller may drop its inputs before the comm stream has read them
            for t in _tensors(out):
                t.record_stream(compute)  # results live on the comm stream's pool, used on the caller's
        hook = done.current_stream_wait if return_recv_hook else None
        return out, (EventOverlap(done) if async_finish else EventOverlap(None)), hook

    @_guarded("low_latency_dispatch", _ll_target)
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Any]:
        """V1 low-latency dispatch into the packed masked layout: ``(recv_x [E_local, N*M, H] (bf16, or (fp8, scales
        [E_local, N*M, H/128] float32 | [E_local, N*M, H/512] int32 with use_ue8m0, column-major)), recv_count
        [E_local] int32, handle, event, hook)``. ``recv_x[e, :recv_count[e]]`` are expert e's rows, source rank then
        source token; rows past ``recv_count[e]`` are unspecified. Fixed shapes and no host sync: capturable in a
        CUDA graph (after one call outside capture with the same sizes). Each call returns fresh tensors (V1's limit
        of two results held at once does not apply)."""
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "low_latency_dispatch: dispatch_wait_recv_cost_stats (no per-rank wait timers)"
            )
        if use_ue8m0 and not round_scale:
            raise EPValueError("low_latency_dispatch: use_ue8m0=True requires round_scale=True (V1's rule)")
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise EPValueError(f"low_latency_dispatch (rank {self.rank}): x must be [T, hidden] bfloat16")
        m = int(num_max_dispatch_tokens_per_rank)
        t, h = int(x.shape[0]), int(x.shape[1])
        if t > m:
            raise EPValueError(
                f"low_latency_dispatch (rank {self.rank}): {t} tokens > num_max_dispatch_tokens_per_rank={m}"
            )
        if use_fp8 and h % (512 if use_ue8m0 else 128):
            raise EPValueError(
                f"low_latency_dispatch: hidden={h} must be a multiple of {512 if use_ue8m0 else 128} with use_fp8=True"
                + (" and use_ue8m0=True" if use_ue8m0 else "")
            )
        # no host read on CUDA: low-latency mode never syncs the host (the hook's point, and CUDA graphs)
        _check_topk(topk_idx, num_experts, self.group_size, self.rank, host_read=not topk_idx.is_cuda)
        _check_ll_limits(
            "low_latency_dispatch", self.rank, self.group_size, int(num_experts), int(topk_idx.shape[1])
        )
        if cumulative_local_expert_recv_stats is not None and (
            cumulative_local_expert_recv_stats.shape != (num_experts // self.group_size,)
        ):
            raise EPValueError(
                f"cumulative_local_expert_recv_stats (rank {self.rank}): must be [{num_experts // self.group_size}]"
            )
        # the call as the roads below take it (`_shrink_dispatch`, `_native_dispatch`)
        call = (
            x, topk_idx, m, int(num_experts), cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
            async_finish, return_recv_hook,
        )  # fmt: skip
        if self._shrink is not None and not self._native_shrink(x, "low_latency_dispatch"):
            return self._shrink_dispatch(*call)
        native = bool(self.ll_native) and (x.is_cuda or self._ll_native_on_cpu)
        if not native and self._cpu_road(x, int(num_experts), int(topk_idx.shape[1])):
            return self._shrink_dispatch(*call, self._ll_cpu)
        # agreed before the build: ranks that disagree on the sizes never build regions of different layouts
        if native:
            reg = self._ll_region
            # what the kernels recorded, before a new signature rebuilds the region
            if reg is not None and reg.inner is self._ll_inner:
                reg.check("low_latency_dispatch")
            k = int(topk_idx.shape[1])
            sig = (m, int(num_experts), h, k, bool(use_fp8), bool(round_scale), bool(use_ue8m0))
            if self.ll_native_agree == "call":
                self._agree_native("low_latency_dispatch", _DISPATCH_FIELDS, sig, x.is_cuda)
            else:  # the sizes (a new region's layout); the flags are the kernels' signature words'
                self._agree_native("low_latency_dispatch", _DISPATCH_FIELDS[:4], sig[:4], x.is_cuda)
        inner = self._ensure_ll(m, h, int(topk_idx.shape[1]), int(num_experts), native)
        if self._ll_region is not None:
            return self._native_dispatch(*call)

        zero_copy = self.ll_zero_copy
        if zero_copy is None:  # where the inner buffer offers it: its rows are read before its next operation
            zero_copy = x.is_cuda and inner.get_physical_domain_size()[0] == 1

        def run() -> tuple:
            recv, count, handle = ll_dispatch(
                inner, x, topk_idx, m, num_experts, use_fp8, round_scale, use_ue8m0, self.ll_use_kernels,
                rows_ordered=self._ll_key is not None and self._ll_key[3], zero_copy=zero_copy,
            )  # fmt: skip
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(count.to(cumulative_local_expert_recv_stats.dtype))
            return recv, count, handle

        (recv, count, handle), event, hook = self._on_comm(
            x.is_cuda, async_finish, return_recv_hook, (x, topk_idx, cumulative_local_expert_recv_stats), run
        )
        return recv, count, self._stamp(handle, self._ll_build), event, hook

    @_guarded("low_latency_combine", _ll_target)
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Any]:
        """V1 low-latency combine from the packed ``x [E_local, N*M, H]`` bf16: ``combined_x[t] = bf16(sum over lanes
        k ascending with topk_idx[t, k] >= 0 of fp32(expert output) * topk_weights[t, k])``, multiply then add in
        fp32 (``legacy.reference.ll_combine_reference``, bitwise); returns ``(combined_x, event, hook)``.
        ``use_logfmt``: each expert output row travels LogFMT-10 encoded (``legacy.logfmt``: the sum adds its
        float32 decoding; hidden % 512 == 0)."""
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "low_latency_combine: combine_wait_recv_cost_stats (no per-rank wait timers)"
            )
        if not isinstance(handle, LowLatencyHandle):
            raise EPTypeError(
                f"low_latency_combine: handle must come from low_latency_dispatch, got {type(handle).__name__}"
            )
        self._check_handle("low_latency_combine", handle, self._ll_build)
        inner = self._ll_inner
        stale = (
            handle.native[0] is not self._ll_region if handle.native is not None else handle.ep_handle is None
        )
        shrink = getattr(handle, "shrink", None) is not None  # a masked dispatch's (legacy.ll_shrink)
        if not shrink and (inner is None or stale or self._destroyed):
            raise EPStateError("low_latency_combine: the buffer was destroyed or rebuilt since this dispatch")
        if zero_copy and x is None:
            x = self._ll_combine_buffers[self._ll_idx]
        src_info, _, _, hidden, _ = handle
        epr, slots = src_info.shape
        if x.dim() != 3 or tuple(x.shape) != (epr, slots, hidden) or x.dtype != torch.bfloat16:
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): x must be [{epr}, {slots}, hidden={hidden}] bfloat16, "
                f"got {tuple(x.shape)} {x.dtype}"
            )
        if use_logfmt:
            from .logfmt import check_hidden

            check_hidden(hidden)  # before any communication: every rank raises alike
        if topk_idx.dim() != 2 or topk_idx.shape[1] != handle.num_topk:
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): topk_idx must be [T, {handle.num_topk}] (the dispatch's K)"
            )
        if topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32:
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): topk_weights must be float32 of topk_idx's shape "
                f"{tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)} {topk_weights.dtype}"
            )
        t = int(topk_idx.shape[0])
        if t != handle.num_tokens:
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): topk_idx has {t} tokens, the dispatch had "
                f"{handle.num_tokens}"
            )
        if out is not None and (tuple(out.shape) != (t, hidden) or out.dtype != torch.bfloat16):
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): out must be [{t}, {hidden}] bfloat16"
            )
        if shrink:
            masked = getattr(handle, "ll_cpu", None) or self._shrink_step("low_latency_combine", x)

            def run_masked() -> torch.Tensor:
                return into(masked.combine(x, topk_idx, topk_weights, handle, bool(use_logfmt)), out)

            return self._on_comm(False, async_finish, return_recv_hook, (), run_masked)
        if handle.native is not None:
            reg = handle.native[0]
            lag = self.__dict__.get("_ll_dispatches", 0) - getattr(handle, "ll_call", 0)
            sig = (reg.m, reg.num_experts, hidden, handle.num_topk, bool(use_logfmt), lag)
            if self.ll_native_agree == "call":  # "change": all of it in the kernels' signature words
                self._agree_native("low_latency_combine", _COMBINE_FIELDS, sig, x.is_cuda, ("combine", lag))
            return self._native_combine(
                x, topk_idx, topk_weights, handle, out, async_finish, return_recv_hook, bool(use_logfmt)
            )

        def run() -> torch.Tensor:
            with _logfmt_envelope(inner, bool(use_logfmt)):
                return ll_combine_weighted(
                    inner, x, handle, topk_idx, topk_weights, self.ll_lanes_per_combine, out, self.ll_use_kernels,
                    self.ll_combine_num_sms, bool(use_logfmt),
                )  # fmt: skip

        return self._on_comm(x.is_cuda, async_finish, return_recv_hook, (x, topk_idx, topk_weights, out), run)

    def _native_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        m: int,
        num_experts: int,
        stats: torch.Tensor | None,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Any]:
        """The native kernels (``legacy.ll_kernels.native_dispatch``): the send now; the receive now too, or, with
        ``return_recv_hook``, when ``hook()`` is called (on the then-current stream: V1's split)."""
        from . import ll_kernels

        reg = self._ll_region
        reg.check("low_latency_dispatch")
        mask, gen = self._native_mask(reg, "low_latency_dispatch")
        h = int(x.shape[1])

        local_direct = not return_recv_hook and ll_kernels.local_direct_enabled()
        calls = self._ll_dispatches = self.__dict__.get("_ll_dispatches", 0) + 1

        sig = ll_kernels.dispatch_sig(reg, use_fp8, round_scale, use_ue8m0)

        def send() -> tuple:
            recv, count, src_info, layout_range, lanes, lane_pos, issue = ll_kernels.native_dispatch(
                reg, x, topk_idx, use_fp8, round_scale, use_ue8m0, stats, local_direct, mask, sig
            )
            token = reg.token

            def receive() -> None:
                issue()
                self._check_at_call(reg, "low_latency_dispatch", token)

            handle = LowLatencyHandle(
                (src_info, layout_range, m, h, num_experts), None, None, None,
                native=(reg, lanes, lane_pos), num_topk=int(topk_idx.shape[1]), num_tokens=int(x.shape[0]),
            )  # fmt: skip
            handle.mask_gen = gen  # a clean restarts the epochs: this dispatch's combine must come before it
            handle.ll_call = calls  # the combine's envelope: how many dispatches ago it ran (_agree_native)
            # the kernels' envelope: which dispatch of the region (its count, equal on every rank)
            handle.ll_dispatch = reg.dispatches
            return (recv, count, self._stamp(handle, self._ll_build)), receive

        if return_recv_hook:
            (recv, count, handle), receive = send()
            event = EventOverlap(EventHandle()) if async_finish else EventOverlap(None)
            return recv, count, handle, event, receive

        def run() -> tuple:
            out, receive = send()
            receive()
            return out

        (recv, count, handle), event, _ = self._on_comm(
            x.is_cuda, async_finish, False, (x, topk_idx, stats), run
        )
        return recv, count, handle, event, None

    def _native_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        out: torch.Tensor | None,
        async_finish: bool,
        return_recv_hook: bool,
        use_logfmt: bool = False,
    ) -> tuple[torch.Tensor, EventOverlap, Any]:
        from . import ll_kernels

        reg, lanes, lane_pos = handle.native
        reg.check("low_latency_combine")
        mask, gen = self._native_mask(reg, "low_latency_combine")
        if getattr(handle, "mask_gen", None) != gen:
            raise EPStateError(
                f"low_latency_combine (rank {self.rank}): the handle's dispatch ran before "
                "low_latency_clean_mask_buffer(), which restarted the kernels' epochs; dispatch again"
            )
        src_info, layout_range = handle[0], handle[1]
        # without a hook the receive follows the send at once: this rank's own rows are read in x (one pass);
        # LogFMT sends every row through the buffer (the receive decodes what the send encoded)
        local_direct = not return_recv_hook and not use_logfmt and ll_kernels.local_direct_enabled()

        sig = ll_kernels.combine_sig(reg, use_logfmt, getattr(handle, "ll_dispatch", 0))

        def send() -> tuple:
            combined, issue = ll_kernels.native_combine(
                reg, x, src_info, lanes, layout_range, topk_idx, topk_weights, out, lane_pos, local_direct,
                use_logfmt, mask, sig,
            )  # fmt: skip
            token = reg.token

            def receive() -> None:
                issue()
                self._check_at_call(reg, "low_latency_combine", token)

            return combined, receive

        if return_recv_hook:
            combined, receive = send()
            event = EventOverlap(EventHandle()) if async_finish else EventOverlap(None)
            return combined, event, receive

        def run() -> torch.Tensor:
            combined, receive = send()
            receive()
            return combined

        combined, event, _ = self._on_comm(
            x.is_cuda, async_finish, False, (x, topk_idx, topk_weights, out), run
        )
        return combined, event, None

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A combine input of the packed shape, one per buffer half like V1: the half the next low-latency call
        uses (native kernels; the adapter alternates). The native combine's send reads its input where it lies and
        writes each row straight to its token's rank, so ``zero_copy`` saves nothing more than any input does."""
        src_info, _, _, h, _ = handle
        epr, slots = src_info.shape
        if self._ll_region is not None:
            self._ll_idx = self._ll_region.next_half
        else:
            self._ll_idx ^= 1
        buf = self._ll_combine_buffers[self._ll_idx]
        if buf is None or tuple(buf.shape) != (epr, slots, h):
            buf = torch.zeros(epr, slots, h, dtype=torch.bfloat16, device=src_info.device)
            self._ll_combine_buffers[self._ll_idx] = buf
        return buf

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """ep's workspace is zero between operations (nothing to clean when switching modes), and the native
        kernels' flags carry the epoch of the call that wrote them (never cleaned); the zero-copy buffers are
        cleared."""
        for b in self._ll_combine_buffers:
            if b is not None:
                b.zero_()

    # ----------------------------------------------------------------------------------------------------------------
    # rank masking (enable_shrink=True; legacy.ll_shrink, ep_core.rank_mask)

    def _make_shrink(self, transport: str | None, check_only: bool = False, ll_native: Any = None) -> Any:
        """The rank mask: on the CPU backend (gloo groups) with its masked exchange (``ShrinkLowLatency``); on CUDA
        with the native kernels (``ll_native=True``; ipc or a loopback group) the device mask (``NativeShrink``);
        anything else is refused by name (``check_only``: the transport alone, before the group is bound)."""
        from .ll_shrink import NativeShrink, ShrinkLowLatency, shrink_unsupported

        native = bool(ll_native)
        forced = transport or _env.transport()
        if forced == "nccl" or (forced == "ipc" and not native):
            raise shrink_unsupported(
                "Buffer", f"transport {forced} (CUDA)" + ("" if native else " without ll_native=True")
            )
        if check_only:
            return None
        if self._channel is None:
            loop = getattr(self, "_loopback", None)
            if native and loop is not None and loop.device.type == "cuda":
                return NativeShrink(self.rank, self.group_size)
            raise shrink_unsupported(
                "Buffer", "a loopback group" + ("" if native else " without ll_native=True")
            )
        boot = self._channel.bootstrap
        # CUDA tensors: a CUDA group, or a gloo group over ipc
        if boot.device.type != "cpu" or (native and forced == "ipc"):
            if native:
                return NativeShrink(self.rank, self.group_size)
            raise shrink_unsupported(
                "Buffer", f"a {dist.get_backend(self.group)} group (CUDA) without ll_native=True"
            )
        return ShrinkLowLatency(self.rank, self.group_size, boot, self.num_cpu_timeout_secs)

    def _native_shrink(self, x: torch.Tensor, op: str) -> bool:
        """Whether this buffer's masking runs in the native kernels (``NativeShrink``, CUDA tensors only)."""
        from .ll_shrink import NativeShrink, shrink_unsupported

        if not isinstance(self._shrink, NativeShrink):
            return False
        if not x.is_cuda:
            raise shrink_unsupported(op, "CPU tensors on a CUDA group")
        return True

    def _native_mask(self, reg: Any, op: str) -> tuple[torch.Tensor | None, int]:
        """The device mask for this native call (None without masking) and its generation; takes the ranks that
        kernels masked after a timeout into the host mask first (a warning naming each)."""
        from .ll_shrink import NativeShrink

        shrink = self._shrink
        if not isinstance(shrink, NativeShrink):
            return None, 0
        shrink.merge(reg, op)
        shrink.calls += 1
        return shrink.device(), shrink.gen

    def _shrink_step(self, op: str, x: torch.Tensor) -> Any:
        if x.is_cuda:
            from .ll_shrink import shrink_unsupported

            raise shrink_unsupported(
                op, "CUDA tensors on a CPU group (on CUDA: transport='ipc', ll_native=True)"
            )
        return self._shrink

    def _shrink_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        m: int,
        num_experts: int,
        stats: torch.Tensor | None,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
        unmasked: Any = None,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Any]:
        """The CPU exchange's dispatch (``legacy.ll_shrink``): the buffer's rank mask, or ``unmasked`` (the CPU road
        past V2's sizes, ``_cpu_road``)."""
        shrink = unmasked if unmasked is not None else self._shrink_step("low_latency_dispatch", x)

        def run() -> tuple:
            recv, count, handle = shrink.dispatch(
                x, topk_idx, m, num_experts, use_fp8, round_scale, use_ue8m0
            )
            if stats is not None:
                stats.add_(count.to(stats.dtype))
            return recv, count, handle

        (recv, count, handle), event, hook = self._on_comm(False, async_finish, return_recv_hook, (), run)
        if unmasked is not None:
            handle.ll_cpu = unmasked  # its combine takes the same road
        return recv, count, self._stamp(handle, self._ll_build), event, hook

    def _cpu_road(self, x: torch.Tensor, num_experts: int, num_topk: int) -> bool:
        """Whether this CPU call runs on the buffer's own host exchange (``ShrinkLowLatency.over_channel``, no mask)
        instead of the adapter: V2's inner buffer takes at most 256 experts per rank and 32 top-k lanes (its rules D9
        and num_topk), low-latency mode up to ``checks.LL_MAX_*`` (DeepEP V1's 288 experts on one rank among them).
        The same numerics either way (``legacy.reference``)."""
        from ep_core.topology import MAX_EXPERTS_PER_RANK, MAX_TOPK

        if x.is_cuda or (num_experts // self.group_size <= MAX_EXPERTS_PER_RANK and num_topk <= MAX_TOPK):
            return False
        if self._channel is None:  # loopback ranks have no host channel to exchange on
            raise EPValueError(
                f"low_latency_dispatch (rank {self.rank}): num_experts={num_experts} ({num_experts // self.group_size} "
                f"per rank) with num_topk={num_topk} on CPU tensors of a loopback group: past {MAX_EXPERTS_PER_RANK} "
                f"experts per rank or {MAX_TOPK} top-k lanes the CPU backend needs a process group (gloo)"
            )
        if self.__dict__.get("_ll_cpu") is None:
            from .ll_shrink import ShrinkLowLatency

            self._ll_cpu = ShrinkLowLatency.over_channel(self.rank, self.group_size, self._channel)
        return True

    def _mask_of(self, op: str) -> Any:
        shrink = getattr(self, "_shrink", None)
        if shrink is None:
            raise EPStateError(
                f"{op}: needs a Buffer built with enable_shrink=True (rank masking); without it a peer that does not "
                "arrive fails the operation instead of being masked"
            )
        return shrink.mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask`` on this rank: a masked rank is neither sent to nor waited
        for in the low-latency operations, its experts' tokens are dropped (V1's semantics; local, no collective).
        On CUDA (native kernels) a rank masked while calls ran is unmasked by ``low_latency_clean_mask_buffer``."""
        from .ll_shrink import NativeShrink

        rank_mask = self._mask_of("low_latency_update_mask_buffer")
        if isinstance(self._shrink, NativeShrink):
            self._shrink.update(rank_to_mask, bool(mask))
        else:
            rank_mask.update(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write this rank's mask into ``mask_status`` ``[num_ranks]`` int32: 1 = masked (by the user or after a
        timeout), 0 = not."""
        rank_mask = self._mask_of("low_latency_query_mask_buffer")
        n = rank_mask.num_ranks
        if (
            not isinstance(mask_status, torch.Tensor)
            or tuple(mask_status.shape) != (n,)
            or (mask_status.dtype != torch.int32)
        ):
            raise EPValueError(
                f"low_latency_query_mask_buffer (rank {self.rank}): mask_status must be a [{n}] torch.int32 tensor, "
                f"got {getattr(mask_status, 'shape', type(mask_status).__name__)} {getattr(mask_status, 'dtype', '')}"
            )
        from .ll_shrink import NativeShrink

        if isinstance(self._shrink, NativeShrink):  # the device mask (kernels mask after a timeout)
            self._shrink.query(self._ll_region, mask_status, "low_latency_query_mask_buffer")
            return
        mask_status.copy_(torch.from_numpy(rank_mask.flags.copy()))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank on this rank. On CUDA (native kernels) a collective: every rank calls it between the same
        two operations (the ones that sat out while masked included), after the results of its earlier calls were
        waited for; it restarts the kernels' epochs (``ep_lln_clean``) so that every rank rejoins, and handles from
        before it are refused. A rank that does not take part within the GPU timeout stays masked."""
        from .ll_shrink import NativeShrink

        rank_mask = self._mask_of("low_latency_clean_mask_buffer")
        if isinstance(self._shrink, NativeShrink):
            region = self._ll_region
            self._shrink.clean(region, None if region is None else self.get_comm_stream())
            return
        rank_mask.clean()


# what the native road's ranks must agree on (``_agree_native``). Not in them: return_recv_hook, zero_copy, async_finish
# and EPKIT_LL_LOCAL_DIRECT change only how a rank reads its own rows or when, never what crosses to a peer.
_DISPATCH_FIELDS = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "num_topk", "use_fp8", "round_scale",
                    "use_ue8m0")  # fmt: skip
_COMBINE_FIELDS = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "num_topk", "use_logfmt",
                   "dispatches_since_handle")  # fmt: skip


def _logfmt_envelope(inner: Any, use_logfmt: bool) -> contextlib.AbstractContextManager:
    """A LogFMT combine's steps carry ``use_logfmt`` in their envelope (issue 41; ``Channel.tagged``): a rank that
    combines with LogFMT while its peers do not meets them in a step whose configurations differ, so every rank raises
    ``EPMismatchError`` instead of summing rows of another format. The plain combine's envelope stays as it was; a
    backend without a host channel (the GPU executor) has no step to tag."""
    rt = getattr(inner, "runtime", None)
    channel = getattr(getattr(rt, "_executor", None), "channel", None)
    if not use_logfmt or channel is None:
        return contextlib.nullcontext()
    return channel.tagged(use_logfmt=True)


def _data_complete() -> None:
    """The hook of a call that ran on the caller's stream (CPU, or neither async_finish nor a hook on the GPU
    before): the data is complete already."""


def _tensors(obj: Any) -> list[torch.Tensor]:
    """CUDA tensors in ``obj``: tensors, tuples/lists of them, and the tensor fields of handles (one level)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.is_cuda:
                found.append(o)
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
            stack.extend(v for v in getattr(o, "__dict__", {}).values() if not isinstance(v, (tuple, list)))
            if hasattr(o, "ep_handle"):  # its tensors, the unviewed block of a repeated dispatch's included
                stack.extend(v for v in o.ep_handle.held() if isinstance(v, torch.Tensor))
    return found
