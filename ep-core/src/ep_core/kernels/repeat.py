"""The straight road of a repeated call: a dispatch (with or without CPU sync), a cached dispatch or a combine whose
request came from the same prepared-operation entry (`ep_core.prepared`) as an earlier call of this rank.

That entry's key holds every array's dtype, shape, strides and device, every scalar and flag, the handle's layout
fields and the executor's device attributes, and the request passed the full validation when the entry was made.
So everything `DirectRank` derives from those (kernel configuration, buffer regions, SM count, flags, launch shape,
the prepared launches, the output shapes, the envelope's fields) is what the first call derived: `DirectRank`
keeps it here (`RepeatDispatch`, `RepeatCombine`, made by its full path with `record=True`) and the entry's token
(`requests.PreparedToken.plan`) holds it for the next request. A repeat does only what changes per call: the
failure guard and the handle's state, the pointers (the handle's arrays are read every time), the allocations,
the envelope's sequence number, the launches, the new handle and the error report. A CPU-sync dispatch learns its
rows from its counts after the dispatch kernel, exactly as the full path does (`DirectRank._sync_counts`).

What the key does not cover is checked on every call and, when it differs, the repeat returns None having done
nothing, and the caller takes the full path (which raises what an uncached call raises): the scratch of the last
operation (a switch copies the barrier epoch), the test flag `debug_skip_scaleout_signal`, the dtype, shape and
contiguity of the handle's `topk_idx` (int32 or int64: a launch flag), the hybrid handle's forward metadata, and
a prepared epilogue when rows are to be copied.
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
from ep_core.kernels.prepared_launch import (
    PreparedOp,
    combine_words,
    dispatch_words,
    epilogue_outputs,
    record_wait,
)
from ep_core.requests import CombineResult, DispatchResult

__all__ = [
    "RepeatCombine",
    "RepeatDispatch",
    "array_ptr",
    "epilogue_outputs",
    "handle_topk_idx",
    "note_handle_topk_idx",
]

_Q = struct.Struct("<q")
_I32, _I64, _F32, _U16 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.uint16)


class _Envelopes:
    """The envelope words of one plan by the handle's launch number: `pack_envelope(kind, seq, fields + (launch,))`.
    Its digest is the CRC-32 of the packed fields, and a CRC-32 continues over appended bytes
    (`crc32(b, crc32(a)) == crc32(a + b)`), so the fields' CRC is computed once and each launch number (a new one
    for every handle) only appends its eight bytes; the word is bit for bit `pack_envelope`'s."""

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


# `DirectRank`'s names of a new handle's int32 arrays -> the handle's fields
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
    """The pointers of a handle's array fields `names`: a field's own array when it is set (every field of a plain
    handle; of a block handle, a view read from its block or an array the caller put there), else its part of the
    handle's block (`ep_core.handle`), without making a view."""
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
_DISPATCH_FIELDS = (
    "dst_buffer_slot_idx",
    "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert",
    "recv_src_metadata",
)
_COMBINE_FIELDS = ("psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata")
_FWD = ("token_metadata_at_forward",)


def handle_topk_idx(rank: Any, handle: EPHandle, num_tokens: int) -> tuple[int, bool] | None:
    """`(pointer, is_int32)` of a handle's `topk_idx` when it is a contiguous int64/int32 `[num_tokens, K]` array
    (what the full path's checks accept), else None. The verdict is kept per handle while the same array object
    with the same shape is there (as `validation.check_handle` keeps its own); the pointer is read every time."""
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
    """Keep `handle_topk_idx`'s verdict for a new handle whose `topk_idx` is `idx`, a copy of the dispatch's
    validated routing from an allocator that returns what it is asked for (C-contiguous, the routing's shape and
    dtype), so that its combine does not describe it again."""
    try:  # noqa: SIM105 (every new handle passes here: a `with` costs about half a microsecond more)
        rank._handle_idx[handle] = (idx, idx.shape, True, is_int32)
    except TypeError:  # not weak-referenceable: checked at first use
        pass


@dataclass(eq=False)
class RepeatDispatch:
    """A dispatch (cached or not, with or without CPU sync) as its first call resolved it (module doc)."""

    rank: Any  # the DirectRank
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
    # the copy epilogue as a programmatic dependent launch (`DirectRank._epilogue_pdl`)
    epilogue_pdl: bool = False
    cpu_sync: bool = False  # rows from the counts, read after the dispatch kernel (`DirectRank._sync_counts`)
    # the outputs are views of the receive region (`DirectRank.zero_copy_views`), stored by the dispatch kernel,
    # which also writes the handle's metadata: no epilogue (a no-sync call: `DirectRank.finish_dispatch`)
    zero_copy: bool = False
    config: Any = None  # the kernel configuration (zero-copy: where the views lie)

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

    def zero_copy_outputs(self, rows: int, x_name: str = "") -> tuple:
        """A zero-copy dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: the rank's views of its
        receive region (`DirectRank.zero_copy_views`), the data named `x_name` and the scales by their dtype where
        the caller names an executor's dtypes (`GpuExecutor` and its express lane; else numpy's). A no-sync call's
        are the same on every call (the worst-case rows): made once and kept."""
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

    def _alloc_arrays(self, rank: Any, allocate: Any) -> dict:
        """A new handle's int32 arrays, viewed (an allocator that carves no `handle_block`)."""
        block = getattr(rank._allocator, "int32_block", None)
        views = None if block is None else block(self._int32_key)
        if views is not None:  # one allocation (`DirectRank._alloc_int32`'s block, by the shapes' key)
            return dict(zip(self._int32_names, views))
        if allocate is not None:
            # the request's allocator by name, as GpuExecutor's wrapper calls it (no block to carve)
            return {name: allocate(shape, "int32") for name, shape in self.int32_shapes.items()}
        return rank._alloc_int32(self.int32_shapes)

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
        copy_ptr: int = 0,
        made: Any = None,
    ) -> DispatchResult | None:
        """The dispatch, or None (nothing done: the caller takes the full path). `idx_ptr` / `topk_idx`: the
        caller's routing (ignored when cached: the handle's). `allocate(shape, dtype_name)`: the request's
        allocator for the outputs, called as `GpuExecutor`'s wrapper of it calls it (`x_name`: x's dtype name);
        None: the rank's allocator (numpy dtypes). `wait` / `signal`: the executor's stream-order pairs, issued
        with the dispatch launch and with the last launch (`PreparedLaunch.run`). `copy_ptr`: the new handle's
        copy of the routing, which the kernel fills (`DirectRank.launch_dispatch`'s `topk_idx_copy`; 0: none).
        `made`: the allocations of an express lane (`ep_core.kernels.express.ExpressDispatch`) instead of
        `allocate`'s, a dispatch without a handle: `made.start()` (after the guard) gives the new handle's block,
        its routing copy (the handle's `topk_idx`) and that copy's pointer; `made.outputs(rows, num_recv,
        meta_ptr)` the outputs (the metadata too where `meta_ptr` is None: a CPU-sync dispatch's) and the
        epilogue's words."""
        rank = self.rank
        if rank._last_scratch != self.scratch or rank.debug_skip_scaleout_signal != self.skip_signal:
            return None
        rank.guard()
        cached = self.cached
        if cached:
            rank._check_handle(handle)
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
        # a lone rank's cached dispatch is its epilogue alone, never a dependent launch
        alone = cached and rank.epilogue_only(cached, rows, self.zero_padding)
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
            if made is not None:
                # the express lane's one allocation: the block, the routing copy (and the outputs)
                block, topk_idx, copy_ptr = made.start()
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
                    arrays = self._alloc_arrays(rank, allocate)
                dst_slot, psum_rank = arrays["dst_slot"], arrays["psum_rank"]
                psum_expert, unaligned = arrays["psum_expert"], arrays["unaligned"]
                fwd = arrays.get("fwd")
                meta = arrays.get("src_metadata")
                dst_ptr, psum_rank_ptr = array_ptr(dst_slot, "dst_slot"), array_ptr(psum_rank, "psum_rank")
                psum_expert_ptr, unaligned_ptr = (
                    array_ptr(psum_expert, "psum_expert"),
                    array_ptr(unaligned, "unaligned"),
                )
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
            meta_ptr if zero_copy else None,  # a zero-copy dispatch's kernel writes the metadata
        )
        # the epilogue follows (CPU sync: if rows); a zero-copy dispatch is its one launch
        copies = not zero_copy and (self.cpu_sync or rows > 0 or self.zero_padding)
        if alone:  # counted as launched, as the full path does; the epilogue takes the stream-order wait
            rank._num_collective_launches += 1
        else:
            rank._launch_prepared(self.prepared.main, dynamic, False, True, wait, None if copies else signal)
            wait = None
        launch_number = rank._num_collective_launches
        expert_list: list = []
        if self.cpu_sync:
            epr = self.num_experts // rank.num_ranks
            rank._copy_counts(psum_rank_ptr, unaligned_ptr, epr, new_block is not None)
            num_recv, num_expanded, expert_list = rank._sync_counts(epr, self.alignment)
            rows = num_expanded if self.expand else num_recv
        if zero_copy:  # the kernel's outputs where it stored them (the handle below)
            recv_x, recv_sf, recv_idx, recv_w = self.zero_copy_outputs(rows, x_name)
        elif made is not None:
            # (`meta`: a CPU-sync dispatch's metadata, made with its outputs; else None, the block holds it)
            recv_x, recv_sf, recv_idx, recv_w, meta, outputs = made.outputs(rows, num_recv, meta_ptr)
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
            rank._launch_prepared(epilogue, dynamic + outputs, False, False, wait, signal)
        elif copies and signal is not None:  # a CPU-sync dispatch that received no rows
            record_wait(signal[0], rank.stream.handle, signal[1])
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
        rank._report_input_error()
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)


@dataclass(eq=False)
class RepeatCombine:
    """A combine as its first call resolved it (module doc)."""

    rank: Any  # the DirectRank
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

    def __post_init__(self) -> None:
        self._envelopes = _Envelopes(OP_COMBINE, self.env_fields)

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
    ) -> CombineResult | None:
        """The combine, or None (nothing done: the caller takes the full path). `allocate(shape, dtype_name)`:
        the request's allocator (None: the rank's, numpy dtypes)."""
        rank = self.rank
        if rank._last_scratch != self.scratch or (self.zero_copy and x_ptr != self.buffer_ptr):
            return None
        rank.guard()
        rank._check_handle(handle)
        seen = handle_topk_idx(rank, handle, self.num_tokens)
        if seen is None or seen[1] != self.idx32:
            return None
        if self.hybrid and handle.__dict__.get("token_metadata_at_forward", MISSING) is None:
            return None
        ptrs = _handle_ptrs(handle, _COMBINE_FIELDS + _FWD if self.hybrid else _COMBINE_FIELDS)
        psum_ptr, meta_ptr = ptrs[:2]
        fwd_ptr = ptrs[2] if self.hybrid else 0
        t, hidden, k = self.num_tokens, self.hidden, self.topk
        if allocate is None:
            combined = rank._alloc((t, hidden), _U16)
            combined_w = rank._alloc((t, k), _F32) if self.has_weights else None
        else:
            combined = allocate((t, hidden), "bfloat16")
            combined_w = allocate((t, k), "float32") if self.has_weights else None
        dynamic = combine_words(
            seen[0],
            psum_ptr,
            meta_ptr,
            fwd_ptr,
            x_ptr,
            w_ptr,
            bias0,
            bias1,
            array_ptr(combined, "combined_x"),
            array_ptr(combined_w, "combined_w") if combined_w is not None else 0,
            self._envelopes.word(rank._num_collective_launches + 1, rank._handle_launch.get(handle, -1)),
            # a zero-copy combine reads the dispatch's slots
            array_ptr(handle.dst_buffer_slot_idx, "dst_buffer_slot_idx") if self.zero_copy else None,
        )
        reduce = self.prepared.epilogue  # a split combine's reduce launch (DirectRank.combine_split), or None
        rank._launch_prepared(
            self.prepared.main, dynamic, False, True, wait, signal if reduce is None else None
        )
        if reduce is not None:
            rank._launch_prepared(reduce, (*dynamic[:-1], 0), False, False, None, signal)
        rank._report_input_error()
        return CombineResult(combined, combined_w)
