"""The plan of one call signature and its run: a dispatch (no-sync, CPU-sync, cached, zero-copy, FP8) or a combine
as the first call of that signature resolved it, and the one per-call code of every later call (ep-core's README,
"The road of one call").

The signature is the key of a prepared-operation entry (`ep_core.prepared`), whose request passed the full
validation, so everything `RankDriver`'s full path derived from it is reused: that path (`record=True`) leaves a
`DispatchPlan` / `CombinePlan` in `RankDriver.last_repeat`, kept in the rank's plan cache (`RankDriver.plans`) under
the entry's token. `run()` does only what changes per call (guard and handle state, pointers, allocations, the
envelope's sequence number, the launches' words: `dispatch_words`, `combine_words`, `epilogue_outputs`, the new
handle, the error report). What the key does not cover (the last operation's scratch, `debug_skip_scaleout_signal`,
the handle's `topk_idx` layout, a hybrid handle's forward metadata, a missing prepared epilogue) is checked per
call: `run()` then returns None having done nothing, and the caller takes the full path.

Two callers: `EPBuffer` with a request `PreparedOps` proved (`serve`), and a framework that proves the key itself
(ep_torch: the host extension's `Signature.match`, the scalars by identity), which calls the plans
`EPBuffer.keep_lane` kept for it (`__call__`; allocations from the allocator's `batch`, `ep_core.kernels.kept_plan`).
"""

from __future__ import annotations

import contextlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import ep_layout
import numpy as np

from ep_core import device_array as _device_array
from ep_core.handle import BLOCK_PARTS, MISSING, EPHandle
from ep_core.kernels._cuda import as_view, view_ptr
from ep_core.kernels._envelope import OP_COMBINE, OP_DISPATCH
from ep_core.kernels.array_block import Int32Block
from ep_core.kernels.kept_plan import batched, output_specs
from ep_core.kernels.prepared_launch import _NO_PAIR, PreparedOp, record_wait
from ep_core.requests import CombineResult, DispatchResult
from ep_core.validation import check_handle_key, handle_fingerprint, trust_fingerprint, trust_handle

__all__ = [
    "CombinePlan",
    "DispatchPlan",
    "array_ptr",
    "combine_words",
    "dispatch_words",
    "epilogue_outputs",
    "handle_topk_idx",
    "note_handle_topk_idx",
    "run_launch",
]

_Q = struct.Struct("<q")
_I32, _I64, _F32, _U16 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.uint16)

# ------------------------------------------------------------------------------------------ the per-call words
# Each tuple of a launch's per-call words is built in one place, in the order of its slot names
# (`prepared_launch._DISPATCH_DYNAMIC` and the others), for the full path (`RankDriver`) and the plans' runs alike.


def dispatch_words(*words: int, src_metadata: int | None = None) -> tuple:
    """The dispatch launch's per-call words (x, sf, topk_idx, topk_weights, dst_slot, fwd_meta, psum_rank,
    psum_expert, unaligned_expert, cum_stats, topk_idx_copy, envelope: `_DISPATCH_DYNAMIC` order); with
    `src_metadata` (a zero-copy dispatch, whose kernel writes the handle's metadata) before the envelope
    (`_DISPATCH_ZERO_COPY_DYNAMIC`)."""
    return words if src_metadata is None else (*words[:-1], src_metadata, words[-1])


def combine_words(*words: int, dst_slot: int | None = None) -> tuple:
    """The combine launch's per-call words (topk_idx, psum_rank, src_metadata, fwd_meta, comb_x, comb_weights,
    bias0, bias1, combined_x, combined_weights, envelope: `_COMBINE_DYNAMIC` order); with `dst_slot` (a
    zero-copy combine, which reads the dispatch's slots) before the envelope (`_COMBINE_ZERO_COPY_DYNAMIC`)."""
    return words if dst_slot is None else (*words[:-1], dst_slot, words[-1])


def epilogue_outputs(
    ptr: Any,
    meta_ptr: int,
    recv_x: Any,
    recv_sf: Any,
    sf_strides: tuple,
    recv_idx: Any,
    recv_w: Any,
    rows: int,
) -> tuple:
    """The copy epilogue's own per-call words, in `_EPILOGUE_DYNAMIC` order; the envelope is 0: the epilogue meets
    no peer and is not a collective launch. `ptr` is `view_ptr` (full path), `array_ptr` (a run), or None where
    the outputs are pointers already (a kept plan's batch); `meta_ptr`: the handle's `recv_src_metadata`."""
    if ptr is not None:
        recv_x = ptr(recv_x, "recv_x")
        recv_sf = ptr(recv_sf, "recv_sf") if recv_sf is not None else 0
        recv_idx = ptr(recv_idx, "recv_topk_idx") if recv_idx is not None else 0
        recv_w = ptr(recv_w, "recv_topk_weights") if recv_w is not None else 0
    return (0, meta_ptr, recv_x, recv_sf or 0, *sf_strides, recv_idx or 0, recv_w or 0, rows)


class _Envelopes:
    """The envelope words of one plan by the handle's launch number, bit for bit `pack_envelope(kind, seq, fields
    + (launch,))`: a CRC-32 continues over appended bytes (the fields' CRC once, then each launch's 8 bytes)."""

    __slots__ = ("crc", "kind", "top")

    def __init__(self, kind: int, fields: tuple) -> None:
        self.kind = kind
        self.crc = zlib.crc32(struct.pack(f"<{len(fields)}q", *fields))
        self.top = kind << 56

    def word(self, seq: int, launch: int) -> int:
        return self.top | ((seq & 0xFFFFFF) << 32) | zlib.crc32(_Q.pack(launch), self.crc)


def array_ptr(obj: Any, what: str) -> int:
    """`view_ptr` of an array whose type and dtype are known good (the handle's arrays, validated by this call's
    `check_handle`; outputs of this call's allocator): a torch tensor's `data_ptr()` without the dtype lookup."""
    if type(obj) is _device_array._torch_tensor_type:
        return obj.data_ptr()
    return view_ptr(obj, what)


# `RankDriver`'s names of a new handle's int32 arrays -> the handle's fields
_HANDLE_FIELD = {
    "dst_slot": "dst_buffer_slot_idx",
    "psum_rank": "psum_num_recv_tokens_per_scaleup_rank",
    "fwd": "token_metadata_at_forward",
    "psum_expert": "psum_num_recv_tokens_per_expert",
    "unaligned": "num_unaligned_recv_tokens_per_expert",
    "src_metadata": "recv_src_metadata",
}
# for `object.__new__` (the name `EPHandle` may be wrapped by a benchmark's step timer)
_HANDLE_TYPE = EPHandle


def _handle_ptrs(handle: EPHandle, names: tuple) -> list[int]:
    """The pointers of a handle's array fields `names`: a field's own array where it is set, else its part of
    the handle's block (`ep_core.handle`), without making a view."""
    d = handle.__dict__
    held = d.get(BLOCK_PARTS)
    out = []
    for name in names:
        a = d.get(name, MISSING)
        if a is MISSING:
            part = None if held is None else held[1].get(name)
            if part is not None:
                out.append(held[0].ptrs[part])
                continue
            a = getattr(handle, name)  # raises AttributeError
        out.append(array_ptr(a, name))
    return out


# the handle arrays a cached dispatch / a combine reads (the forward metadata in hybrid mode only)
_DISPATCH_FIELDS = tuple(field for name, field in _HANDLE_FIELD.items() if name != "fwd")
_COMBINE_FIELDS = ("psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata")
_FWD = ("token_metadata_at_forward",)


def handle_topk_idx(rank: Any, handle: EPHandle, num_tokens: int) -> tuple[int, bool] | None:
    """`(pointer, is_int32)` of a handle's `topk_idx` when it is a contiguous int64/int32 `[num_tokens, K]` array
    (what the full path accepts), else None; the verdict kept per handle while the same array with the same shape
    is there, the pointer read every time."""
    idx = handle.topk_idx
    seen = rank._handle_idx.get(handle)
    if seen is None or seen[0] is not idx or seen[1] != idx.shape:
        iv = as_view(idx, "topk_idx")
        ok = (
            len(iv.shape) == 2 and iv.shape[0] == num_tokens and iv.is_contiguous and iv.dtype in (_I64, _I32)
        )
        seen = (idx, idx.shape, ok, iv.dtype == _I32)
        with contextlib.suppress(TypeError):  # not weak-referenceable: checked every time
            rank._handle_idx[handle] = seen
    if not seen[2]:
        return None
    return array_ptr(idx, "topk_idx"), seen[3]


def note_handle_topk_idx(rank: Any, handle: EPHandle, idx: Any, is_int32: bool) -> None:
    """Keep `handle_topk_idx`'s verdict for a new handle whose `topk_idx` is `idx`, a copy of the validated
    routing from an allocator that returns what it is asked for, so that its combine does not describe it again."""
    try:  # noqa: SIM105 (every new handle passes here: a `with` costs about half a microsecond more)
        rank._handle_idx[handle] = (idx, idx.shape, True, is_int32)
    except TypeError:  # not weak-referenceable: checked at first use
        pass


# ------------------------------------------------------------------------------- the rank's per-call steps
# Inlined here (a run calls no other module on its way to the launch): the guard's fast path, the handle's owner
# check, the prepared launch with its stream-order pairs. Their slow paths are `RankDriver`'s.


def _guard(rank: Any) -> None:
    """`RankDriver.guard`'s fast path: the host words read; a published abort raises through the guard itself."""
    abort, bad_input = rank._status.read()
    rank._input_pending = bad_input != 0
    if abort:
        rank.guard()


def _check_owner(rank: Any, handle: EPHandle) -> None:
    """`RankDriver._check_handle`'s fast path: a handle of this rank's generation, not spoilt by a failure."""
    if handle.__dict__.get("_ep_owner") is not rank.state.owner or handle in rank._failed_handles:
        rank._check_handle(handle)


def run_launch(rank: Any, launch: Any, values: tuple, collective: bool, wait: Any, signal: Any) -> None:
    """`launch` with the per-call `values` patched in, natively when ep_launch is usable (else, or when the native
    launch failed, the Python path, which raises the driver's error), on the rank's stream, with the stream-order
    pairs `wait` / `signal` (one native call); the one per-call launch of a plan's run and of the full path."""
    stream = rank.res.stream.handle
    native = launch.native
    if native is None:
        code = 1
    elif wait is None and signal is None:
        code = native(stream, values)
    else:
        w_ev, w_on = wait if wait is not None else _NO_PAIR
        s_ev, s_to = signal if signal is not None else _NO_PAIR
        code = native(stream, values, w_ev.handle, w_on, s_ev.handle, s_to)
    if code > 0:  # no native path, or nothing launched: the Python path, which raises the driver's error
        launch.run(values, stream, wait, signal)
    elif code < 0:  # launched; the signal pair failed: the Python pair raises the driver's error
        record_wait(signal[0], stream, signal[1])
    if collective:
        rank._num_collective_launches += 1


@dataclass(eq=False)
class DispatchPlan:
    """A dispatch (cached or not, with or without CPU sync, zero-copy or not) as its first call resolved it
    (module doc)."""

    rank: Any  # the RankDriver
    prepared: PreparedOp
    scratch: int
    skip_signal: bool
    cached: bool
    expand: bool
    hybrid: bool
    idx32: bool
    num_tokens: int
    hidden: int
    topk: int
    x_dtype: np.dtype
    sf_dtype: np.dtype | None
    packs: int
    col_major_sf: bool
    has_weights: bool
    zero_padding: bool
    num_experts: int
    alignment: int
    num_sms: int
    int32_shapes: dict | None  # a new handle's int32 arrays (None: cached, they are the handle's)
    num_recv: int  # rows and counts of a new handle (a cached dispatch reads its handle's)
    num_expanded: int
    env_fields: tuple  # the envelope's fields but the handle's launch number
    # the copy epilogue as a programmatic dependent launch (`RankDriver._epilogue_pdl`)
    epilogue_pdl: bool = False
    cpu_sync: bool = False  # rows from the counts, read after the dispatch kernel (`RankDriver._sync_counts`)
    # the outputs are views of the receive region (`RankDriver.zero_copy_views`), stored by the dispatch kernel,
    # which also writes the handle's metadata: no epilogue (a no-sync call: `RankDriver.finish_dispatch`)
    zero_copy: bool = False
    config: Any = None  # the kernel configuration (zero-copy: where the views lie)

    op = "dispatch"
    handle_copy = True  # kept calls' handles hold a routing copy, else the caller's (`EPBuffer.keep_lane`)
    _KEEP = 16  # a kept plan's output batches by row count (a CPU-sync or cached dispatch's counts vary)

    def __post_init__(self) -> None:
        self._envelopes = _Envelopes(OP_DISPATCH, self.env_fields)
        # a no-sync zero-copy dispatch's outputs: the same views of the region on every call (its rows are the
        # worst case), made at the first
        self._zero_copy_views: tuple | None = None
        self._sf_name = None if self.sf_dtype is None else self.sf_dtype.name
        # a new handle's int32 shapes as one tuple of tuples: the key of an allocator's `int32_block` layout
        shapes = self.int32_shapes or {}
        self._int32_names = tuple(shapes)
        self._int32_key = tuple([tuple(s) for s in shapes.values()])
        self._part = {name: i for i, name in enumerate(self._int32_names)}
        self._fields = {_HANDLE_FIELD[name]: i for i, name in enumerate(self._int32_names)}
        # the block's shapes in `validation.handle_fingerprint`'s order after topk_idx, and whether the metadata
        # is apart (a CPU-sync dispatch allocates it once its rows are known)
        order = ("psum_rank", "psum_expert", "unaligned", "src_metadata", "dst_slot")
        self._shapes_in_block = (
            tuple([tuple(shapes[name]) for name in order if name in shapes]),
            "src_metadata" not in shapes,
        )
        rank = self.rank
        # the fields every new handle of this plan has (`_block_handle`)
        self._fixed = {
            "do_expand": self.expand,
            "num_experts": self.num_experts,
            "expert_alignment": self.alignment,
            "num_max_tokens_per_rank": rank.num_max_tokens,
            "num_sms": self.num_sms,
            "channel_linked_list": None,
            "num_ranks": rank.num_ranks,
            "rank": rank.rank,
            "cached_recv_src_metadata_before_sort": None,
        }
        if not self.hybrid:
            self._fixed["token_metadata_at_forward"] = None
        # kept by a framework (`keep`): None until then
        self.buffer: Any = None
        self.match: Any = None
        self.scalars: tuple | None = None
        self.siblings: list = []  # the plans kept beside this one (`_sibling`)
        # (the allocator whose calls `batched` answered, its answer): read by `serve` on every call
        self.batching: tuple = (None, False)
        self._wrapped: tuple = (None, None)  # (allocator, `GpuExecutor`'s wrapper of it): `_served`

    # ------------------------------------------------------------------------------ kept by a framework
    def _kept_outputs(self, rows: int, num_recv: int, meta_ptr: int | None) -> tuple:
        """A kept plan's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, metadata, epilogue words)`: a
        no-sync dispatch's from this call's batch (the metadata in the block: None); a CPU-sync dispatch's with its
        metadata (`meta_ptr` None) or a cached dispatch's from one batch per row count (a few kept)."""
        meta = None
        if self._made is not None:
            arrays, aptrs = self._made
        else:
            key = (rows, num_recv if meta_ptr is None else -1)
            made = self._by_rows.get(key)
            if made is None:
                if len(self._by_rows) >= self._KEEP:
                    self._by_rows.clear()
                specs = output_specs(self, rows, self._x_name)
                if meta_ptr is None:
                    specs.append(((num_recv, self.topk + 2), "int32"))
                made = self._by_rows[key] = self._batch(tuple(specs))
            arrays, aptrs = made()
            if meta_ptr is None:
                meta, meta_ptr = arrays[-1], aptrs[-1]
        s, i, w = self._at
        words = epilogue_outputs(
            None,
            meta_ptr,
            aptrs[0],
            aptrs[s] if s else None,
            self.sf_layout(rows)[1] if s else (0, 0),
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

    def __call__(self, x: Any, b: Any, w: Any, stream: int, stats: Any = None) -> DispatchResult | None:
        """The kept plan's call (module doc): `b` the routing or (cached) the handle, `stats` a plan's kept with stats
        (`match` compares them too); the caller compared the rest with `scalars`. Returns the `DispatchResult`
        (`recv_sf`: None without FP8 scales; column-major as storage; no event), or None (take the ordinary road)."""
        if self.cached:  # (never one of FP8 scales, `keep`)
            ptrs = self.match(x, w)
        elif self._sf_name is None:
            ptrs = self.match(x, b, w) if stats is None else self.match(x, b, w, stats)
        elif type(x) is tuple and len(x) == 2:
            ptrs = self.match(x[0], x[1], b, w) if stats is None else self.match(x[0], x[1], b, w, stats)
        else:
            ptrs = None  # (a plan of FP8 scales, a call without: a sibling's)
        buffer = self.buffer
        if ptrs is None:
            return _sibling(self, x, b, w, stream, stats)
        if buffer._destroyed:
            return None  # the ordinary road raises the caller's own error
        rank = self.rank
        step = rank._num_collective_launches
        try:
            if self.cached:
                # a handle of another layout: a sibling's (whose error is announced once)
                ok = not self.siblings or _idx_shape(b) == self._handle_key[1]
                if not (ok and check_handle_key(buffer.config, self._executor, b, self._handle_key)):
                    return _sibling(self, x, b, w, stream, stats)
                wait, signal = _kept_pairs(self, stream)
                return self.run(
                    ptrs[0], 0, 0, ptrs[1], 0, b, None, None, self._x_name, wait, signal, None, True
                )
            x_ptr, sf_ptr, idx_ptr, w_ptr = ptrs[:4] if self._sf_name else (ptrs[0], 0, ptrs[1], ptrs[2])
            s_ptr = 0 if stats is None else ptrs[-1]
            wait, signal = _kept_pairs(self, stream)
            res = self.run(
                x_ptr, sf_ptr, idx_ptr, w_ptr, s_ptr, None, b, None, self._x_name, wait, signal, None, True
            )
        except Exception as exc:
            # a call that launched nothing gives up its step; after a launch (a timeout, a kernel's error) there
            # is none to give up
            buffer.announce_error("dispatch", exc, step)
            raise
        finally:
            self._made = None  # the outputs are the caller's alone
        if res is not None:
            handle = res.handle
            copy = handle.topk_idx  # (no copy: the caller's routing, of the layout `match` compared)
            note_handle_topk_idx(rank, handle, copy, self.idx32)
            if self.cpu_sync:  # its counts are its own
                trust_handle(buffer.config, self._executor, handle)
            else:
                self._trust(handle, copy, handle.__dict__[BLOCK_PARTS][0])
        return res

    def _trust(self, handle: EPHandle, copy: Any, block: Int32Block) -> None:
        """`validation.trust_handle` for a new handle of this plan: the fingerprint by value is every handle's."""
        config = self.buffer.config
        by_value = self._by_value
        if by_value is None:
            fingerprint = handle_fingerprint(config, self._executor, handle)
            if fingerprint[1] != (copy, block, block, block, block, block):
                return  # not the block form (never for a kept plan's handles): validated at first use
            by_value = self._by_value = fingerprint[0]
        trust_fingerprint(handle, (by_value, (copy, block, block, block, block, block), config))

    # ------------------------------------------------------------------------------------------ the run
    def zero_copy_outputs(self, rows: int, x_name: str = "") -> tuple:
        """A zero-copy dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: views of the receive
        region (`RankDriver.zero_copy_views`), named `x_name` and the scales' dtype where given; a no-sync call's
        (the worst-case rows) made once and kept."""
        views = self._zero_copy_views
        if views is None:
            views = self.rank.zero_copy_views(
                self.config, self.num_experts, rows, self.x_dtype, self.sf_dtype, self.packs, self.has_weights
            )
            if x_name:
                views[0].dtype = x_name
                if views[1] is not None:
                    views[1].dtype = self._sf_name
            if not self.cpu_sync:  # a CPU-sync call's rows are its counts'
                self._zero_copy_views = views
        return views

    def sf_layout(self, rows: int) -> tuple:
        """The received FP8 scales of `rows` rows: `(storage shape, element strides)`: column-major as the storage
        `[packs, align(rows, 4)]` (what a request's allocator is asked for, as GpuExecutor's wrapper asks), else
        `[rows, packs]` row-major."""
        packs = self.packs
        if self.col_major_sf:
            ld = ep_layout.align(max(rows, 1), 4)
            return (packs, ld), (1, ld)
        return (rows, packs), (packs, 1)

    def _block_handle(
        self, block: Any, topk_idx: Any, num_recv: int, num_expanded: int, expert_list: list, meta: Any
    ) -> EPHandle:
        """The new handle, its int32 arrays left in their block (`ep_core.handle`): the fields are set directly,
        the block's are viewed (`ep_core.handle._InBlock`) when the caller reads them."""
        handle = object.__new__(_HANDLE_TYPE)
        d = handle.__dict__
        d.update(self._fixed)
        d["topk_idx"] = topk_idx
        d["num_recv_tokens"] = num_recv
        d["num_expanded_tokens"] = num_expanded
        d["num_recv_tokens_per_expert_list"] = expert_list
        d["_ep_owner"] = self.rank.state.owner  # ep_core.rank_state.check_owner (a reset makes a new tuple)
        if meta is not None:  # a CPU-sync dispatch's, allocated once its rows were known
            d["recv_src_metadata"] = meta
        d[BLOCK_PARTS] = (block, self._fields, len(d) + 1, self._shapes_in_block)
        return handle

    def serve(self, ex: Any, req: Any) -> DispatchResult | None:
        """A request of this plan's prepared entry, from `EPBuffer` (no executor module on the road): the routing
        copy (from the allocator's batch where it has one), the run. None: nothing done but the copy (full path)."""
        rank, idx, x_name = self.rank, req.topk_idx, req.x.dtype
        if rank is not ex.rank:
            return None
        alloc, wait, signal, ev = _served(self, ex, req, x_name)
        want_copy = req.do_handle_copy and idx is not None and 0 not in idx.shape
        known = self.batching  # (the plan's answer for a known allocator, read as a field)
        by_batch = (
            alloc.batch is not None
            and want_copy is not self.cached
            and (known[1] if known[0] is req.allocator else batched(self, req.allocator, x_name, alloc.batch))
        )
        copy = req.allocator(idx.shape, idx.dtype) if want_copy and not by_batch else None
        sf, w, stats = req.sf, req.topk_weights, req.cumulative_local_expert_recv_stats
        rank._allocator = alloc
        try:
            res = self.run(
                req.x.ptr,
                0 if sf is None else sf.ptr,
                0 if idx is None else idx.ptr,
                0 if w is None else w.ptr,
                0 if stats is None else stats.ptr,
                req.handle,
                None if idx is None else idx.obj,
                req.allocator,
                x_name,
                wait,
                signal,
                copy,
                by_batch,
                want_copy and alloc.trusted,
            )
        finally:
            rank._allocator = None
            if by_batch:
                self._made = None  # the outputs are the caller's alone
        return None if res is None else dispatch_result(res, req, ev)

    def run(
        self,
        x_ptr: int,
        sf_ptr: int,
        idx_ptr: int,
        w_ptr: int,
        stats_ptr: int,
        handle: EPHandle | None,
        topk_idx: Any,
        allocate: Any = None,
        x_name: str = "",
        wait: Any = None,
        signal: Any = None,
        copy: Any = None,
        kept: bool = False,
        trusted: bool = False,
    ) -> DispatchResult | None:
        """The dispatch, or None (nothing done: the caller takes the full path). `idx_ptr` / `topk_idx`: the
        caller's routing (a cached dispatch reads its handle's). `allocate(shape, dtype_name)`: the request's
        allocator, called as `GpuExecutor`'s wrapper calls it (`x_name`: x's dtype name); None: the rank's (numpy
        dtypes). `wait` / `signal`: the stream-order pairs, issued with the first and the last launch. `copy`: the
        new handle's routing copy (its `topk_idx`), which the kernel fills (None: none; `trusted`: from a marked
        allocator, its verdict kept, `note_handle_topk_idx`). `kept`: a kept plan's call (`__call__`): the
        allocations from its batches (`_made`, `_kept_outputs`) instead of `allocate`'s."""
        rank = self.rank
        if rank._last_scratch != self.scratch or rank.debug_skip_scaleout_signal != self.skip_signal:
            return None
        _guard(rank)
        cached = self.cached
        if cached:
            _check_owner(rank, handle)
            seen = handle_topk_idx(rank, handle, self.num_tokens)
            if seen is None or seen[1] != self.idx32:
                return None
            idx_ptr = seen[0]
            topk_idx = handle.topk_idx
            num_recv = handle.num_recv_tokens
            num_expanded = handle.num_expanded_tokens
            if self.hybrid and handle.__dict__.get("token_metadata_at_forward", MISSING) is None:
                return None
        else:
            num_recv, num_expanded = self.num_recv, self.num_expanded
        rows = num_expanded if self.expand else num_recv
        # a lone rank's cached dispatch is its epilogue alone, never a dependent launch (`RankDriver.epilogue_only`)
        alone = cached and rank.num_ranks == 1 and (rows > 0 or self.zero_padding)
        epilogue = self.prepared.epilogue_pdl if self.epilogue_pdl and not alone else self.prepared.epilogue
        zero_copy = self.zero_copy
        if not zero_copy and epilogue is None and (rows > 0 or self.zero_padding or self.cpu_sync):
            return None
        new_block = None  # a new handle's block, its arrays not viewed (`ep_core.handle`)
        meta = None
        if cached:
            names = _DISPATCH_FIELDS + _FWD if self.hybrid else _DISPATCH_FIELDS
            ptrs = _handle_ptrs(handle, names)
            dst_ptr, psum_rank_ptr, psum_expert_ptr, unaligned_ptr, meta_ptr = ptrs[:5]
            fwd_ptr = ptrs[5] if self.hybrid else 0
            launch = rank._handle_launch.get(handle, -1)
        else:
            copy_ptr = 0
            if copy is not None:  # the handle's routing is the copy the kernel fills
                topk_idx, copy_ptr = copy, array_ptr(copy, "handle.topk_idx")
            if kept:  # this call's one batch, after the guard: (the outputs,) the routing copy, the block
                arrays, aptrs = self._made = self._alloc()
                block = Int32Block.adopt(arrays[-1], self._int32_key, aptrs[-1])
                topk_idx, copy_ptr = (arrays[-2], aptrs[-2]) if self.handle_copy else (topk_idx, 0)
                if self.cpu_sync:
                    self._made = None  # its outputs follow the counts (`_kept_outputs`)
            else:
                carve = getattr(rank._allocator, "handle_block", None)
                block = None if carve is None else carve(self._int32_key)
            if block is not None and block.ptrs is not None:
                # one allocation, no view: the handle keeps the block (`ep_core.handle`)
                new_block = block
                ptrs, at = block.ptrs, self._part
                dst_ptr, psum_rank_ptr = ptrs[at["dst_slot"]], ptrs[at["psum_rank"]]
                psum_expert_ptr, unaligned_ptr = ptrs[at["psum_expert"]], ptrs[at["unaligned"]]
                fwd_ptr = ptrs[at["fwd"]] if self.hybrid else 0
                meta_ptr = ptrs[at["src_metadata"]] if "src_metadata" in at else None
            else:
                if block is not None:  # a block type without pointers of its own: its views
                    arrays = dict(zip(self._int32_names, map(block.view, range(len(block.shapes)))))
                else:
                    arrays = rank.plan_int32(self._int32_names, self._int32_key, self.int32_shapes, allocate)
                dst_slot, psum_rank = arrays["dst_slot"], arrays["psum_rank"]
                psum_expert, unaligned = arrays["psum_expert"], arrays["unaligned"]
                fwd = arrays.get("fwd")
                meta = arrays.get("src_metadata")
                dst_ptr, psum_rank_ptr = array_ptr(dst_slot, "dst_slot"), array_ptr(psum_rank, "psum_rank")
                psum_expert_ptr = array_ptr(psum_expert, "psum_expert")
                unaligned_ptr = array_ptr(unaligned, "unaligned")
                fwd_ptr = array_ptr(fwd, "token_metadata_at_forward") if self.hybrid else 0
                meta_ptr = None if meta is None else array_ptr(meta, "recv_src_metadata")
            launch = -1
        dynamic = dispatch_words(
            x_ptr,
            sf_ptr,
            idx_ptr,
            w_ptr,
            dst_ptr,
            fwd_ptr,
            psum_rank_ptr,
            psum_expert_ptr,
            unaligned_ptr,
            stats_ptr,
            0 if cached else copy_ptr,
            self._envelopes.word(rank._num_collective_launches + 1, launch),
            src_metadata=meta_ptr if zero_copy else None,  # a zero-copy dispatch's kernel writes it
        )
        # the epilogue follows (CPU sync: if rows); a zero-copy dispatch is its one launch
        copies = not zero_copy and (self.cpu_sync or rows > 0 or self.zero_padding)
        if alone:  # counted as launched, as the full path does; the epilogue takes the stream-order wait
            rank._num_collective_launches += 1
        else:
            run_launch(rank, self.prepared.main, dynamic, True, wait, None if copies else signal)
            wait = None
        launch_number = rank._num_collective_launches
        expert_list: list = []
        if self.cpu_sync:
            epr = self.num_experts // rank.num_ranks
            num_recv, num_expanded, expert_list = rank.count_round_trip(
                psum_rank_ptr, unaligned_ptr, epr, new_block is not None, self.alignment
            )
            rows = num_expanded if self.expand else num_recv
        if zero_copy:  # the kernel's outputs where it stored them (the handle below)
            recv_x, recv_sf, recv_idx, recv_w = self.zero_copy_outputs(rows, x_name)
        elif kept:
            # (`meta`: a CPU-sync dispatch's metadata, made with its outputs; else None, the block holds it)
            recv_x, recv_sf, recv_idx, recv_w, meta, outputs = self._kept_outputs(rows, num_recv, meta_ptr)
        else:
            # the outputs, exactly as `finish_dispatch` allocates them
            # (the request's allocator is called directly: no wrapper per call)
            if allocate is None:
                alloc, x_dt, sf_dt, i64, f32, i32 = rank._alloc, self.x_dtype, self.sf_dtype, _I64, _F32, _I32
            else:
                alloc, x_dt, sf_dt = allocate, x_name, self._sf_name
                i64, f32, i32 = "int64", "float32", "int32"
            recv_x = alloc((rows, self.hidden), x_dt)
            recv_sf = None
            sf_strides = (0, 0)
            if self.sf_dtype is not None:
                storage, sf_strides = self.sf_layout(rows)
                if allocate is not None:  # column-major scales: the storage [P, ld] (EPBuffer's contract)
                    recv_sf = allocate(storage, sf_dt)
                elif self.col_major_sf:
                    recv_sf = alloc((rows, self.packs), sf_dt, sf_strides)
                else:
                    recv_sf = alloc(storage, sf_dt)
            k = self.topk
            recv_idx = None if self.expand else alloc((rows, k), i64)
            recv_w = None
            if self.has_weights:
                recv_w = alloc((rows,) if self.expand else (rows, k), f32)
            if meta_ptr is None:  # a new handle of a CPU-sync dispatch: its rows are known now
                meta = alloc((num_recv, k + 2), i32)
                meta_ptr = array_ptr(meta, "recv_src_metadata")
            if rows > 0 or self.zero_padding:
                outputs = epilogue_outputs(
                    array_ptr, meta_ptr, recv_x, recv_sf, sf_strides, recv_idx, recv_w, rows
                )
        if not zero_copy and (rows > 0 or self.zero_padding):
            run_launch(rank, epilogue, dynamic + outputs, False, wait, signal)
        elif copies and signal is not None:  # a CPU-sync dispatch that received no rows
            record_wait(signal[0], rank.res.stream.handle, signal[1])
        if new_block is not None:
            handle = self._block_handle(new_block, topk_idx, num_recv, num_expanded, expert_list, meta)
            rank._handle_launch[handle] = launch_number
            if not self.cpu_sync:
                rank._unconfirmed.add(handle)
        elif not cached:
            handle = EPHandle(
                self.expand,
                self.num_experts,
                self.alignment,
                rank.num_max_tokens,
                self.num_sms,
                topk_idx,
                num_recv,
                num_expanded,
                expert_list,
                psum_rank,
                psum_expert,
                unaligned,
                meta,
                dst_slot,
                token_metadata_at_forward=fwd,
                num_ranks=rank.num_ranks,
                rank=rank.rank,
            )
            handle._ep_owner = rank.state.owner  # ep_core.rank_state.check_owner
            rank._handle_launch[handle] = launch_number
            if not self.cpu_sync:
                rank._unconfirmed.add(handle)
        if trusted:  # the routing copy (`copy`, or the batch's)
            note_handle_topk_idx(rank, handle, topk_idx, self.idx32)
        if rank._input_pending:
            rank._report_input_error()
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)


def _served(plan: Any, ex: Any, req: Any, dtype: str) -> tuple:
    """The executor's part of a served call, `(allocator wrapper, wait, signal, leave event)`: its wrapper and stream
    events kept on the plan per allocator, a kept plan's pairs (`_kept_pairs`; async: `stream_pairs`, new event)."""
    if plan._wrapped[0] is not req.allocator:
        plan._wrapped = (req.allocator, ex._allocator(req, dtype))
        plan._comm, plan._events = ex.stream.handle, ex.stream_events()
    if req.async_with_compute_stream or ex._destroyed:
        return (plan._wrapped[1], *ex.stream_pairs(req.stream, req.async_with_compute_stream))
    return (plan._wrapped[1], *_kept_pairs(plan, req.stream), None)


def dispatch_result(res: DispatchResult, req: Any, ev: Any) -> DispatchResult:
    """A dispatch's result: a zero-copy request's views named with its dtypes (the rank's name numpy's, bf16 reads
    as uint16; so that recv_x passes rule C1 of a combine), an async call's leave event."""
    if req.zero_copy:
        res.recv_x.dtype = req.x.dtype
        if res.recv_sf is not None:
            res.recv_sf.dtype = req.sf.dtype
    res.event = ev if req.async_with_compute_stream else None  # this call's own result object
    return res


def _sibling(plan: Any, *call: Any) -> Any:
    """The call of the first of `plan.siblings` (kept before it for the same scalars, other arrays or handle:
    `EPBuffer.keep_lane`) that serves it, or None: a caller alternating between shapes keeps a plan for each."""
    for other in plan.siblings:
        got = other(*call)
        if got is not None:
            return got
    return None


def _idx_shape(handle: Any) -> Any:
    """The shape of a handle's `topk_idx` (a handle-keyed plan's key part, which picks among its siblings)."""
    return getattr(getattr(handle, "topk_idx", None), "shape", None)


def _kept_pairs(plan: Any, stream: int) -> tuple:
    """A plan's `(wait, signal)`: `GpuExecutor.stream_pairs(stream, False)` over the events taken at `keep` (`_served`)."""
    if stream == plan._comm:
        return None, None
    enter, leave = plan._events
    return (enter, stream), (leave, stream)


@dataclass(eq=False)
class CombinePlan:
    """A combine as its first call resolved it (module doc)."""

    rank: Any  # the RankDriver
    prepared: PreparedOp
    scratch: int
    hybrid: bool
    idx32: bool
    num_tokens: int
    hidden: int
    topk: int
    has_weights: bool
    env_fields: tuple  # the envelope's fields but the handle's launch number
    # the zero-copy combine: `x` must be the rank's combine buffer (at `buffer_ptr`, else the full path names the
    # error), the handle's slots travel among the words
    zero_copy: bool = False
    buffer_ptr: int = 0
    op = "combine"

    def __post_init__(self) -> None:
        self._envelopes = _Envelopes(OP_COMBINE, self.env_fields)
        self.batching: tuple = (None, False)  # `DispatchPlan.batching`
        self.buffer: Any = None
        self.match: Any = None
        self.scalars: tuple | None = None
        self.siblings: list = []  # `DispatchPlan.siblings`
        self._wrapped: tuple = (None, None)  # `DispatchPlan._wrapped`

    def serve(self, ex: Any, req: Any) -> CombineResult | None:
        """`DispatchPlan.serve` of a combine: its outputs from the allocator's `batch` where it has one."""
        rank = self.rank
        if rank is not ex.rank:
            return None
        alloc, wait, signal, ev = _served(self, ex, req, "bfloat16")
        w = 0 if req.topk_weights is None else req.topk_weights.ptr
        bias = [b.ptr for b in req.bias if b is not None] + [0, 0]
        known = self.batching
        by_batch = alloc.batch is not None and (
            known[1] if known[0] is req.allocator else batched(self, req.allocator, "bfloat16", alloc.batch)
        )
        rank._allocator = alloc
        try:
            res = self.run(req.x.ptr, w, bias[0], bias[1], req.handle, req.allocator, wait, signal, by_batch)
        finally:
            rank._allocator = None
        if res is not None:
            res.event = ev if req.async_with_compute_stream else None
        return res

    def __call__(self, x: Any, handle: Any, weights: Any, stream: int) -> CombineResult | None:
        """The kept plan's call: the `CombineResult`, or None (nothing done: the ordinary road)."""
        ptrs = self.match(x, weights)
        buffer = self.buffer
        if ptrs is None or (self.siblings and _idx_shape(handle) != self._handle_key[1]):
            return _sibling(self, x, handle, weights, stream)
        if buffer._destroyed:
            return None
        step = self.rank._num_collective_launches
        try:
            if not check_handle_key(buffer.config, self._executor, handle, self._handle_key):
                return _sibling(self, x, handle, weights, stream)
            wait, signal = _kept_pairs(self, stream)
            return self.run(ptrs[0], ptrs[1], 0, 0, handle, None, wait, signal, True)
        except Exception as exc:
            buffer.announce_error("combine", exc, step)
            raise

    def run(
        self,
        x_ptr: int,
        w_ptr: int,
        bias0: int,
        bias1: int,
        handle: EPHandle,
        allocate: Any = None,
        wait: Any = None,
        signal: Any = None,
        kept: bool = False,
    ) -> CombineResult | None:
        """The combine, or None (nothing done: the caller takes the full path). `allocate(shape, dtype_name)`:
        the request's allocator (None: the rank's, numpy dtypes); `kept`: the outputs from the kept batch."""
        rank = self.rank
        if rank._last_scratch != self.scratch or (self.zero_copy and x_ptr != self.buffer_ptr):
            return None
        _guard(rank)
        _check_owner(rank, handle)
        seen = handle_topk_idx(rank, handle, self.num_tokens)
        if seen is None or seen[1] != self.idx32:
            return None
        if self.hybrid and handle.__dict__.get("token_metadata_at_forward", MISSING) is None:
            return None
        ptrs = _handle_ptrs(handle, _COMBINE_FIELDS + _FWD if self.hybrid else _COMBINE_FIELDS)
        psum_ptr, meta_ptr = ptrs[:2]
        fwd_ptr = ptrs[2] if self.hybrid else 0
        t, hidden, k = self.num_tokens, self.hidden, self.topk
        if kept:
            arrays, aptrs = self._alloc()
            combined, combined_w = arrays[0], arrays[1] if self.has_weights else None
            out_ptr, out_w_ptr = aptrs[0], aptrs[1] if self.has_weights else 0
        else:
            if allocate is None:
                combined = rank._alloc((t, hidden), _U16)
                combined_w = rank._alloc((t, k), _F32) if self.has_weights else None
            else:
                combined = allocate((t, hidden), "bfloat16")
                combined_w = allocate((t, k), "float32") if self.has_weights else None
            out_ptr = array_ptr(combined, "combined_x")
            out_w_ptr = array_ptr(combined_w, "combined_w") if combined_w is not None else 0
        dynamic = combine_words(
            seen[0],
            psum_ptr,
            meta_ptr,
            fwd_ptr,
            x_ptr,
            w_ptr,
            bias0,
            bias1,
            out_ptr,
            out_w_ptr,
            self._envelopes.word(rank._num_collective_launches + 1, rank._handle_launch.get(handle, -1)),
            # a zero-copy combine reads the dispatch's slots
            dst_slot=array_ptr(handle.dst_buffer_slot_idx, "dst_buffer_slot_idx") if self.zero_copy else None,
        )
        reduce = self.prepared.epilogue  # a split combine's reduce launch (RankDriver.combine_split), or None
        run_launch(rank, self.prepared.main, dynamic, True, wait, signal if reduce is None else None)
        if reduce is not None:
            run_launch(rank, reduce, (*dynamic[:-1], 0), False, None, signal)
        if rank._input_pending:
            rank._report_input_error()
        return CombineResult(combined, combined_w)
