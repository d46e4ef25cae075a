"""The express road: a repeated dispatch (no handle; with or without CPU sync), combine or cached dispatch as one
call from the framework layer to its plan's run.

A repeat (`ep_core.kernels.repeat`) through `EPBuffer` still walks every layer above the plan on each call:
`PreparedOps` (describe each array, build the key, compare it, build the request) -> `GpuExecutor` (the routing
copy, the allocator wrapper, the stream pairs). On a host where a Python call costs 100-200 ns that is most of a
dispatch's host time (issue 18). An express lane replaces those layers for one prepared entry, for a framework
that proves the key itself, and runs the same plan (`RepeatDispatch.run` / `RepeatCombine.run`, the one per-call
code of a repeated call):

- the key check is `match(x, topk_idx, topk_weights)`: the framework's native comparison of each array with the
  layout of the call the entry was made from (ep_torch: its host extension's `Signature.match`, one C call that
  returns the pointers or None). The caller compares the scalar arguments by identity with the recorded ones
  (`scalars`, kept on the lane by `EPBuffer.keep_lane`), so a call reaching `__call__` has the key that call had:
  the same entry, the same validated request.
- a dispatch without a handle (`ExpressDispatch`) hands the plan its allocations (`RepeatDispatch.run`'s `made`):
  the outputs, the handle's routing copy and its int32 block from one call of the allocator's `batch`
  (`allocate.batch(specs)`: a callable that makes them all; ep_torch's is one `at::empty` loop in C++); a
  CPU-sync dispatch's outputs and metadata from one more, for the rows its counts gave (one prepared call per row
  count seen, a few kept); a zero-copy dispatch's batch is the routing copy and the block alone (its outputs are
  the receive region's views). The new handle is recorded as validated with the fingerprint
  `validation.handle_fingerprint` gives it (by value the same for every no-sync handle of the entry, read from the
  first; a CPU-sync handle's counts are its own: `validation.trust_handle`).
- a combine or cached dispatch (`ExpressWithHandle`, its `op` a field) checks the handle as `PreparedOps` does (its
  key part, then `check_handle`) and calls the plan as `GpuExecutor` does.

An error before the launch gives up the call's device sequence number, as `EPBuffer.announcing` does, so that a
rank refusing a call can never be paired with its peers' next one. Anything the express lane does not cover (a
handle, events, another stream context, a changed rank state) is the caller's cue to take the ordinary road:
`__call__` returns None having done nothing.
"""

from __future__ import annotations

from typing import Any

from ep_core._env import knobs
from ep_core.handle import BLOCK_PARTS, EPHandle
from ep_core.kernels.array_block import Int32Block
from ep_core.kernels.prepared_launch import epilogue_outputs
from ep_core.kernels.repeat import RepeatCombine, RepeatDispatch, note_handle_topk_idx
from ep_core.requests import DispatchResult
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
    elif epilogue is None and (rows > 0 or plan.zero_padding or plan.cpu_sync):
        return None  # what `RepeatDispatch.run` declines
    batch = getattr(allocator, "batch", None)
    if batch is None or not is_trusted_allocator(allocator):
        return None
    return ExpressDispatch(buffer, executor, plan, x_dtype, allocator, batch, match)


class ExpressDispatch:
    """One prepared dispatch without a handle, its whole road (module doc): the key proven (`match`), the stream
    pairs, then its plan's `RepeatDispatch.run` with this lane's allocations (`start`, `outputs`: one `batch` call
    each), the new handle trusted. Its plan's fields say which dispatch: no-sync, CPU-sync (`cpu_sync`: the outputs
    follow the counts) or zero-copy (`zero_copy`: the outputs the receive region's views, the batch only the routing
    copy and the handle's block)."""

    __slots__ = (
        "_alloc",
        "_at",
        "_batch",
        "_by_rows",
        "_by_value",
        "_executor",
        "_has_idx",
        "_has_w",
        "_made",
        "_plan",
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
        self._by_rows: dict = {}
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
        specs = (
            [] if plan.cpu_sync else self._output_specs(plan.num_expanded if plan.expand else plan.num_recv)
        )
        specs.append(((plan.num_tokens, plan.topk), "int32" if plan.idx32 else "int64"))
        specs.append(((max(Int32Block.layout(plan._int32_key)[2], 1),), "int32"))
        self._batch = batch
        self._alloc = batch(tuple(specs))
        self._made: tuple | None = None  # this call's batch, between `start` and `outputs`
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

    def start(self) -> tuple:
        """`RepeatDispatch.run`'s `made.start()`, after its guard: this call's one batch (a no-sync dispatch's
        outputs, the routing copy, the handle's int32 block) as `(the block, the copy, the copy's pointer)`."""
        arrays, aptrs = self._made = self._alloc()
        return Int32Block.adopt(arrays[-1], self._plan._int32_key, aptrs[-1]), arrays[-2], aptrs[-2]

    def outputs(self, rows: int, num_recv: int, meta_ptr: int | None) -> tuple:
        """`RepeatDispatch.run`'s `made.outputs(...)`: `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, the
        metadata, the copy epilogue's words)`: a no-sync dispatch's from `start`'s batch (the metadata in the block:
        None here); a CPU-sync dispatch's, and its metadata (one row per received token), from one `batch` call for
        the rows its counts gave (one prepared call per row count seen, a few kept)."""
        if meta_ptr is None:
            key = (rows, num_recv)
            made = self._by_rows.get(key)
            if made is None:
                if len(self._by_rows) >= self._KEEP:
                    self._by_rows.clear()
                specs = self._output_specs(rows)
                specs.append(((num_recv, self._plan.topk + 2), "int32"))
                made = self._by_rows[key] = self._batch(tuple(specs))
            arrays, aptrs = made()
            meta, meta_ptr = arrays[-1], aptrs[-1]
        else:
            arrays, aptrs = self._made
            meta = None
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
            meta,
            words,
        )

    def __call__(self, x: Any, topk_idx: Any, topk_weights: Any, stream: int) -> DispatchResult | None:
        """The dispatch's `DispatchResult` (`recv_sf`: None without FP8 scales; column-major ones as their storage
        `[packs, align(rows, 4)]`; no event), or None (nothing done: take the ordinary road). The caller has
        compared every other argument with the recorded call's; the outputs come from that call's allocator, on
        `stream`'s order as the ordinary road's do."""
        ptrs = self.match(x, topk_idx, topk_weights)
        if ptrs is None:
            return None
        buffer = self.buffer
        if buffer._destroyed:
            return None  # the ordinary road raises the caller's own error
        plan = self._plan
        rank = plan.rank
        if self._sf_name is None:
            x_ptr, idx_ptr, w_ptr = ptrs
            sf_ptr = 0
        else:
            x_ptr, sf_ptr, idx_ptr, w_ptr = ptrs
        step = rank._num_collective_launches
        try:
            wait, signal, _leave = self._executor._pairs(stream, False)
            res = plan.run(
                x_ptr, sf_ptr, idx_ptr, w_ptr, 0, None, None, None, self._x_dtype, wait, signal, 0, self
            )
        except Exception as exc:
            # a call that launched nothing gives up its step; after a launch (a timeout, a kernel's error) there
            # is none to give up
            buffer.announce_error("dispatch", exc, step)
            raise
        finally:
            self._made = None  # the outputs are the caller's alone
        if res is None:
            return None
        handle = res.handle
        copy = handle.topk_idx
        note_handle_topk_idx(rank, handle, copy, plan.idx32)
        if self.cpu_sync:  # its counts are its own
            trust_handle(buffer.config, self._executor, handle)
        else:
            self._trust(handle, copy, handle.__dict__[BLOCK_PARTS][0])
        return res

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
