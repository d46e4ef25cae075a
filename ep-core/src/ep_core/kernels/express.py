"""The express road: a repeated dispatch (no handle; with or without CPU sync), combine or cached dispatch as one
call from the framework layer to the launches.

A repeat (`ep_core.kernels.repeat`) still walks every layer above it on each call: `EPBuffer` -> `PreparedOps`
(describe each array, build the key, compare it, build the request) -> `GpuExecutor` (the routing copy, the
allocator wrapper, the stream pairs) -> `RepeatDispatch.run` (five allocations, the block, the handle). On a host
where a Python call costs 100-200 ns that is most of a dispatch's host time (issue 18). `ExpressDispatch` is that
road for one prepared entry, made once the entry has its repeat, with everything the layers derive per call
resolved ahead:

- the key check is `match(x, topk_idx, topk_weights)`: the framework's native comparison of each array with the
  layout of the call the entry was made from (ep_torch: its host extension's `Signature.match`, one C call that
  returns the pointers or None). The caller compares the scalar arguments by identity with the recorded ones, so
  a call reaching `__call__` has the key that call had: the same entry, the same validated request.
- the outputs, the handle's routing copy and its int32 block come from one call of the allocator's `batch`
  (`allocate.batch(specs)`: a callable that makes them all; ep_torch's is one `at::empty` loop in C++);
- the new handle is recorded as validated with the fingerprint `validation.handle_fingerprint` gives it (its
  by-value part is the same for every handle of the entry and is read from the first one);
- the rest is the repeat's own per-call work (failure guard, envelope, launches with their stream-order pairs,
  the handle's launch number, the input-error report), through the same helpers.

A CPU-sync dispatch (`ExpressDispatch` of a plan with `cpu_sync`) is the same road with the count round trip between its launches: the
dispatch kernel, the count copy and the wait (`DirectRank._copy_counts` / `_sync_counts`, the CPU timeout and the
kernels' error record included), then its outputs and the handle's metadata in one `batch` call for the rows the
counts gave (one prepared call per row count seen, a few kept), the copy epilogue, and the handle recorded with
the fingerprint `validation.trust_handle` gives it (its counts are its own).

A no-sync zero-copy dispatch (`ExpressDispatch` of a plan with `zero_copy`) is the no-sync road with nothing to allocate but the
routing copy and the handle's block: its one launch stores the outputs in the receive region (returned as its
views) and the handle's metadata.

A combine or cached dispatch (`ExpressWithHandle`, its `op` a field) keeps its repeat as it is: the lane replaces the
layers above it (the caller's match for the arrays, the handle's key part and `check_handle` as `PreparedOps`
checks them, the stream pairs) and calls `RepeatCombine.run` / `RepeatDispatch.run` as `GpuExecutor` does.

An error before the launch gives up the call's device sequence number, as `EPBuffer.announcing` does, so that a
rank refusing a call can never be paired with its peers' next one. Anything the express lane does not cover (a
handle, events, another stream context, a changed rank state) is the caller's cue to take
the ordinary road: `__call__` returns None having done nothing.
"""

from __future__ import annotations

from typing import Any

from ep_core._env import knobs
from ep_core.handle import EPHandle
from ep_core.kernels.array_block import Int32Block
from ep_core.kernels.launch_words import dispatch_words, epilogue_outputs
from ep_core.kernels.prepared_launch import record_wait
from ep_core.kernels.repeat import RepeatCombine, RepeatDispatch, note_handle_topk_idx
from ep_core.validation import (
    check_handle,
    handle_fingerprint,
    is_trusted_allocator,
    trust_fingerprint,
    trust_handle,
)

__all__ = ["ExpressDispatch", "ExpressWithHandle", "express_dispatch", "express_with_handle"]


def _same(ptr: int, _what: str) -> int:
    return ptr


# `DirectRank`'s names of a new handle's int32 arrays, in the dispatch kernel's argument order after the routing
_KERNEL_PARTS = ("dst_slot", "fwd", "psum_rank", "psum_expert", "unaligned")


def express_dispatch(
    buffer: Any, executor: Any, token: Any, x_dtype: str, allocator: Any, match: Any
) -> ExpressDispatch | None:
    """The express lane of the entry whose request carried `token` (`PreparedToken`; `x_dtype`: its x's dtype
    name): an `ExpressDispatch` (no-sync, CPU-sync or zero-copy as its plan is), or None where it cannot serve it: no
    repeat of a dispatch without a handle on `executor`'s rank, an allocator that is not trusted or offers no
    `batch`, an empty routing (no copy to fill: the handle aliases it), or `EPKIT_EXPRESS_LANE=0`. With FP8 scales, `match(x, topk_idx, topk_weights)` returns four pointers: x's data,
    its scales, the routing, the weights."""
    if not knobs.express_lane:
        return None
    plan = None if token is None else token.plan
    rank = getattr(executor, "rank", None)
    if type(plan) is not RepeatDispatch or plan.rank is not rank:
        return None
    if plan.cached or not plan.int32_shapes or plan.num_tokens == 0 or plan.topk == 0:
        return None
    # a CPU-sync dispatch's metadata is allocated once its rows are known (`RepeatDispatch.run`), else it is in
    # the block
    if ("src_metadata" in plan.int32_shapes) is plan.cpu_sync:
        return None
    rows = plan.num_expanded if plan.expand else plan.num_recv
    epilogue = plan.prepared.epilogue_pdl if plan.epilogue_pdl else plan.prepared.epilogue
    if plan.zero_copy:  # one launch, no epilogue; a CPU-sync zero-copy dispatch is never recorded
        if plan.cpu_sync:
            return None
        epilogue = None
    elif epilogue is None and (rows > 0 or plan.zero_padding or plan.cpu_sync):
        return None
    batch = getattr(allocator, "batch", None)
    if batch is None or not is_trusted_allocator(allocator):
        return None
    return ExpressDispatch(buffer, executor, plan, epilogue, x_dtype, allocator, batch, match)


class ExpressDispatch:
    """One prepared dispatch without a handle, its whole road (module doc). Its plan's fields say which: no-sync,
    CPU-sync (`cpu_sync`: the count round trip between the dispatch kernel and the outputs) or zero-copy
    (`zero_copy`: one launch, the outputs the receive region's views, the batch only the routing copy and the
    handle's block)."""

    __slots__ = (
        "_alloc",
        "_at",
        "_batch",
        "_block_at",
        "_by_rows",
        "_by_value",
        "_epilogue",
        "_epr",
        "_executor",
        "_has_idx",
        "_has_w",
        "_plan",
        "_rows",
        "_sf_name",
        "_x_dtype",
        "allocator",
        "buffer",
        "cpu_sync",
        "match",
        "scalars",
        "zero_copy",
    )

    _KEEP = 16  # a CPU-sync dispatch's prepared output batches kept (one per row count seen; a step's counts vary)

    def __init__(
        self,
        buffer: Any,
        executor: Any,
        plan: RepeatDispatch,
        epilogue: Any,
        x_dtype: str,
        allocator: Any,
        batch: Any,
        match: Any,
    ) -> None:
        self.buffer = buffer
        self.allocator = allocator
        self.match = match
        self._executor = executor
        self._plan = plan
        self.cpu_sync = plan.cpu_sync
        self.zero_copy = plan.zero_copy
        self._epr = plan.num_experts // plan.rank.num_ranks
        self._by_rows: dict = {}
        self._epilogue = epilogue
        self._rows = plan.num_expanded if plan.expand else plan.num_recv
        self._x_dtype = x_dtype
        self._sf_name = plan._sf_name
        self._has_idx = not plan.expand
        self._has_w = plan.has_weights
        # the outputs' places in a batch (0: absent; recv_x is first): scales, recv_topk_idx, recv_topk_weights
        sf = self._sf_name is not None
        self._at = (
            1 if sf else 0,
            1 + sf if self._has_idx else 0,
            1 + sf + self._has_idx if self._has_w else 0,
        )
        # the outputs (a CPU-sync dispatch: none, they follow the counts), then the routing copy and the block
        specs = [] if plan.cpu_sync else self._output_specs(self._rows)
        specs.append(((plan.num_tokens, plan.topk), "int32" if plan.idx32 else "int64"))
        offsets, _sizes, total, _strided = Int32Block.layout(plan._int32_key)
        specs.append(((max(total, 1),), "int32"))
        self._batch = batch
        self._alloc = batch(tuple(specs))
        at = plan._part
        # byte offsets of the block's parts the dispatch kernel takes (-1: absent, a null pointer; the metadata
        # of a CPU-sync dispatch is apart)
        parts = [4 * offsets[at[name]] if name in at else -1 for name in _KERNEL_PARTS]
        self._block_at = (*parts, 4 * offsets[at["src_metadata"]] if "src_metadata" in at else -1)
        self._by_value: tuple | None = None  # the handles' fingerprint by value, read from the first

    def _output_specs(self, rows: int) -> list:
        """What `RepeatDispatch.run` allocates for `rows` received rows, in its order: recv_x, the scales (FP8;
        column-major: the storage `[packs, align(rows, 4)]`), recv_topk_idx (not expanded), recv_topk_weights;
        nothing for a zero-copy dispatch (its outputs are the region's)."""
        if self.zero_copy:
            return []
        plan = self._plan
        k = plan.topk
        specs: list = [((rows, plan.hidden), self._x_dtype)]
        if self._sf_name is not None:
            specs.append((plan.sf_layout(rows)[0], self._sf_name))
        if self._has_idx:
            specs.append(((rows, k), "int64"))
        if self._has_w:
            specs.append(((rows,) if plan.expand else (rows, k), "float32"))
        return specs

    def _received(self, arrays: tuple, aptrs: tuple, meta_ptr: int, rows: int) -> tuple:
        """`(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, the copy epilogue's words)` of a batch whose
        first arrays are the outputs of `rows` rows (`_output_specs`); the words from the batch's own pointers."""
        s, i, w = self._at
        strides = self._plan.sf_layout(rows)[1] if s else (0, 0)
        words = epilogue_outputs(
            _same,
            meta_ptr,
            aptrs[0],
            aptrs[s] if s else None,
            strides,
            aptrs[i] if i else None,
            aptrs[w] if w else None,
            rows,
        )
        return (
            arrays[0],
            arrays[s] if s else None,
            arrays[i] if i else None,
            arrays[w] if w else None,
            words,
        )

    def _start(self, x: Any, topk_idx: Any, topk_weights: Any, stream: int) -> tuple | None:
        """The per-call checks and the one allocation before the dispatch kernel: `(step, wait, signal, arrays,
        pointers, the kernel's dynamic words)`, or None (nothing done)."""
        ptrs = self.match(x, topk_idx, topk_weights)
        if ptrs is None:
            return None
        plan = self._plan
        rank = plan.rank
        if rank._last_scratch != plan.scratch or rank.debug_skip_scaleout_signal != plan.skip_signal:
            return None
        buffer = self.buffer
        if buffer._destroyed:
            return None  # the ordinary road raises the caller's own error
        step = rank._num_collective_launches
        try:
            wait, signal, _leave = self._executor._pairs(stream, False)
            rank.guard()
            arrays, aptrs = self._alloc()
        except Exception as exc:
            buffer.announce_error("dispatch", exc, step)
            raise
        if self._sf_name is None:
            x_ptr, idx_ptr, w_ptr = ptrs
            sf_ptr = 0
        else:
            x_ptr, sf_ptr, idx_ptr, w_ptr = ptrs
        base = aptrs[-1]
        at = self._block_at
        dynamic = dispatch_words(
            x_ptr,
            sf_ptr,
            idx_ptr,
            w_ptr,
            base + at[0],
            base + at[1] if at[1] >= 0 else 0,
            base + at[2],
            base + at[3],
            base + at[4],
            0,
            aptrs[-2],
            plan._envelopes.word(step + 1, -1),
            base + at[5] if plan.zero_copy else None,  # a zero-copy dispatch's kernel writes the metadata
        )
        return step, wait, signal, arrays, aptrs, dynamic

    def __call__(self, x: Any, topk_idx: Any, topk_weights: Any, stream: int) -> tuple | None:
        """`(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, handle)` of the dispatch (`recv_sf`: None without
        FP8 scales; column-major ones as their storage `[packs, align(rows, 4)]`), or None (nothing done: take the
        ordinary road). The caller has compared every other argument with the recorded call's; the outputs come
        from that call's allocator, on `stream`'s order as the ordinary road's do."""
        started = self._start(x, topk_idx, topk_weights, stream)
        if started is None:
            return None
        if self.zero_copy:
            return self._zero_copy_call(*started)
        if self.cpu_sync:
            return self._sync_call(*started)
        step, wait, signal, arrays, aptrs, dynamic = started
        plan = self._plan
        rank = plan.rank
        rows = self._rows
        copies = rows > 0 or plan.zero_padding
        try:
            rank._launch_prepared(plan.prepared.main, dynamic, False, True, wait, None if copies else signal)
        except Exception as exc:
            self.buffer.announce_error("dispatch", exc, step)
            raise
        base = aptrs[-1]
        at = self._block_at
        launch_number = rank._num_collective_launches
        recv_x, recv_sf, recv_idx, recv_w, outputs = self._received(arrays, aptrs, base + at[5], rows)
        if copies:
            rank._launch_prepared(self._epilogue, dynamic + outputs, False, False, None, signal)
        return recv_x, recv_sf, recv_idx, recv_w, self._new_handle(arrays, base, launch_number)

    def _new_handle(self, arrays: tuple, base: int, launch_number: int) -> EPHandle:
        """The call's new handle over the batch's routing copy and int32 block (`base`: its address), recorded as
        launched, unconfirmed and trusted; the kernel's input-error report read."""
        plan = self._plan
        rank = plan.rank
        copy = arrays[-2]
        block = Int32Block.adopt(arrays[-1], plan._int32_key, base)
        handle = plan._block_handle(block, copy, plan.num_recv, plan.num_expanded, [], None)
        rank._handle_launch[handle] = launch_number
        rank._unconfirmed.add(handle)
        note_handle_topk_idx(rank, handle, copy, plan.idx32)
        self._trust(handle, copy, block)
        rank._report_input_error()
        return handle

    def _trust(self, handle: EPHandle, copy: Any, block: Int32Block) -> None:
        """`validation.trust_handle` for a handle of this entry: the fingerprint by value is every handle's."""
        config = self.buffer.config
        by_value = self._by_value
        if by_value is None:
            fingerprint = handle_fingerprint(config, self._executor, handle)
            if fingerprint[1] != (copy, block, block, block, block, block):
                return  # not the block form (never for the lane's handles): validated at first use
            by_value = self._by_value = fingerprint[0]
        trust_fingerprint(handle, (by_value, (copy, block, block, block, block, block), config))

    def _zero_copy_call(
        self, step: int, wait: Any, signal: Any, arrays: tuple, aptrs: tuple, dynamic: tuple
    ) -> tuple:
        """A zero-copy dispatch's rest after `_start`: its one launch; the outputs the views of the receive region
        where the kernel stored them (`DirectRank.zero_copy_views`, relabelled with the call's dtypes as
        `GpuExecutor` does, the repeat's, kept for every call of the entry: `RepeatDispatch.zero_copy_outputs`);
        the handle's metadata written by the kernel."""
        plan = self._plan
        rank = plan.rank
        base = aptrs[-1]
        try:
            rank._launch_prepared(plan.prepared.main, dynamic, False, True, wait, signal)
        except Exception as exc:
            self.buffer.announce_error("dispatch", exc, step)
            raise
        launch_number = rank._num_collective_launches
        views = plan.zero_copy_outputs(self._rows, self._x_dtype)
        return (*views, self._new_handle(arrays, base, launch_number))

    def _outputs(self, rows: int, num_recv: int) -> tuple:
        """`(arrays, pointers)` of one call's outputs for `rows` output rows (the expanded ones, or the received
        tokens), then the handle's metadata (one row per received token), from one `batch` call."""
        key = (rows, num_recv)
        made = self._by_rows.get(key)
        if made is None:
            if len(self._by_rows) >= self._KEEP:
                self._by_rows.clear()
            specs = self._output_specs(rows)
            specs.append(((num_recv, self._plan.topk + 2), "int32"))
            made = self._by_rows[key] = self._batch(tuple(specs))
        return made()

    def _sync_call(
        self, step: int, wait: Any, signal: Any, arrays: tuple, aptrs: tuple, dynamic: tuple
    ) -> tuple:
        """A CPU-sync dispatch's rest after `_start`: the dispatch kernel, the count copy and wait, then the outputs
        and the handle's metadata in one `batch` call for the rows the counts gave, the copy epilogue; the handle
        carries its counts (and its per-expert list), and it is confirmed (drained) when this returns."""
        plan = self._plan
        rank = plan.rank
        base = aptrs[-1]
        at = self._block_at
        try:
            rank._launch_prepared(plan.prepared.main, dynamic, False, True, wait, None)
            launch_number = rank._num_collective_launches
            rank._copy_counts(base + at[2], base + at[4], self._epr, True)
            num_recv, num_expanded, expert_list = rank._sync_counts(self._epr, plan.alignment)
        except Exception as exc:
            # a launch that failed gives up its step; after it (a timeout, a kernel's error) there is none to give up
            self.buffer.announce_error("dispatch", exc, step)
            raise
        rows = num_expanded if plan.expand else num_recv
        outs, optrs = self._outputs(rows, num_recv)
        recv_x, recv_sf, recv_idx, recv_w, outputs = self._received(outs, optrs, optrs[-1], rows)
        meta = outs[-1]
        if rows > 0 or plan.zero_padding:
            rank._launch_prepared(self._epilogue, dynamic + outputs, False, False, None, signal)
        elif signal is not None:  # no rows: nothing to copy, the stream order alone
            record_wait(signal[0], rank.stream.handle, signal[1])
        copy = arrays[-2]
        block = Int32Block.adopt(arrays[-1], plan._int32_key, base)
        handle = plan._block_handle(block, copy, num_recv, num_expanded, expert_list, meta)
        rank._handle_launch[handle] = launch_number
        note_handle_topk_idx(rank, handle, copy, plan.idx32)
        trust_handle(self.buffer.config, self._executor, handle)
        rank._report_input_error()
        return recv_x, recv_sf, recv_idx, recv_w, handle


class ExpressWithHandle:
    """A prepared op that reads a handle, its road without the layers: a combine (`op="combine"`, no bias) or a
    cached dispatch (`op="dispatch"`, the handle's routing). The caller matched its arrays and scalars; the
    handle is checked here as `PreparedOps` checks it (its key part, then `check_handle`, which compares a
    trusted handle's fingerprint), and the repeat (`RepeatCombine.run` / `RepeatDispatch.run`) does the rest,
    called as `GpuExecutor` calls it."""

    __slots__ = (
        "_executor",
        "_handle_key",
        "_plan",
        "allocator",
        "buffer",
        "match",
        "op",
        "scalars",
        "x_dtype",
    )

    def __init__(
        self, op: str, buffer: Any, executor: Any, plan: Any, allocator: Any, match: Any, x_dtype: str
    ) -> None:
        self.op = op
        self.x_dtype = x_dtype
        self.buffer = buffer
        self.allocator = allocator
        self.match = match
        self._executor = executor
        self._plan = plan
        self._handle_key: tuple | None = None  # the handle's part of the entry's key, from the recorded call

    def record_handle(self, handle: EPHandle) -> bool:
        """Take the handle part of the key from the recorded call's handle; False for a handle that has none."""
        try:
            fp = handle_fingerprint(self.buffer.config, self._executor, handle)
            self._handle_key = (fp[0][1], fp[0][2][0])
        except Exception:
            return False
        return self._handle_key[1] is not None

    def _checked(self, handle: Any) -> bool:
        """Whether `handle` has the entry's key part; raises what `check_handle` raises for a bad one."""
        if type(handle) is not EPHandle:
            return False
        config = self.buffer.config
        fp = handle_fingerprint(config, self._executor, handle)
        if fp[0][1] != self._handle_key[0] or fp[0][2][0] != self._handle_key[1]:
            return False
        check_handle(config, self._executor, handle, fp)
        return True

    def __call__(self, x: Any, handle: Any, weights: Any, stream: int) -> Any:
        """The repeat's result (`CombineResult` / `DispatchResult`), or None (nothing done: the ordinary road)."""
        ptrs = self.match(x, weights)
        buffer = self.buffer
        if ptrs is None or buffer._destroyed:
            return None
        rank = self._plan.rank
        step = rank._num_collective_launches
        try:
            if not self._checked(handle):
                return None
            wait, signal, _leave = self._executor._pairs(stream, False)
            return self._run(ptrs, handle, wait, signal)
        except Exception as exc:
            buffer.announce_error(self.op, exc, step)
            raise

    def _run(self, ptrs: tuple, handle: EPHandle, wait: Any, signal: Any) -> Any:
        if self.op == "combine":
            return self._plan.run(ptrs[0], ptrs[1], 0, 0, handle, self.allocator, wait, signal)
        return self._plan.run(
            ptrs[0], 0, 0, ptrs[1], 0, handle, None, self.allocator, self.x_dtype, wait, signal
        )


def express_with_handle(
    op: str, buffer: Any, executor: Any, token: Any, x_dtype: str, allocator: Any, match: Any, handle: Any
) -> ExpressWithHandle | None:
    """The lane of a combine (`op="combine"`) or cached dispatch (`"dispatch"`) whose request carried `token`
    and `handle`, or None (no repeat of that op yet, CPU sync, FP8 scales, an untrusted allocator, the knob)."""
    if not knobs.express_lane or not is_trusted_allocator(allocator):
        return None
    plan = None if token is None else token.plan
    rank = getattr(executor, "rank", None)
    if plan is None or plan.rank is not rank:
        return None
    if op == "combine":
        if type(plan) is not RepeatCombine:
            return None
    elif type(plan) is not RepeatDispatch or not plan.cached or plan.cpu_sync or plan.sf_dtype is not None:
        return None
    lane = ExpressWithHandle(op, buffer, executor, plan, allocator, match, x_dtype)
    return lane if lane.record_handle(handle) else None
