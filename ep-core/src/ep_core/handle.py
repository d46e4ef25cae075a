"""`EPHandle`: the layout a dispatch produced, reused by combine and by a cached re-dispatch.

The fields and their meanings are DeepEP V2's (behaviour doc §1.1, SPEC §2). The array fields hold whatever array
type the producer uses: numpy arrays in `ep_core.reference`, device arrays in `ep_core.EPBuffer`, torch tensors in
ep_torch. Shapes and dtypes (direct mode; `T` = tokens of this rank, `K` = top-k, `epr` = experts per rank,
`S_u` = scale-up ranks, `R` = `num_recv_tokens`):

| field | shape / dtype | meaning |
|---|---|---|
| `topk_idx` | `[T, K]` int64 (or int32) | the routing the dispatch used (global expert ids, negative = none) |
| `psum_num_recv_tokens_per_scaleup_rank` | `[S_u]` int32 | inclusive prefix sum of rows per source region |
| `psum_num_recv_tokens_per_expert` | `[epr]` int32 | non-expand: inclusive psum of aligned counts; expand: `start_e + count_e` |
| `num_unaligned_recv_tokens_per_expert` | `[epr]` int32 | true per-expert counts |
| `recv_src_metadata` | `[R, K+2]` int32 | col 0 `src_rank*M + src_token`, col 1 `src_rank*K + master_lane`, cols 2.. expanded row or -1 |
| `dst_buffer_slot_idx` | `[T, K]` int32 | at the master lane of each (token, destination): `own_rank*M + slot`; -1 elsewhere |
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ep_core.errors import EPTypeError, EPValueError

__all__ = ["ARRAY_FIELDS", "BLOCK_PARTS", "MISSING", "EPHandle"]

# A new handle of a repeated dispatch keeps its int32 arrays in one block (`ep_core.kernels.array_block`) and sets
# `handle.__dict__[BLOCK_PARTS] = (block, {field name: part}, keys, shapes)` instead of those fields: the kernels
# read the parts' pointers (`block.ptrs`), and a field's view is made the first time it is read (`_InBlock`, each
# such field's class attribute), then kept as the field's value. Replacing a field is an ordinary attribute write.
# `keys`: the size of the handle's `__dict__` as the dispatch left it; `shapes`: `(the shapes of the arrays
# `validation.handle_fingerprint` reads after `topk_idx` that are in the block, whether `recv_src_metadata` is the
# handle's own array)`, or None (no shortcut: the fingerprint reads every field).
BLOCK_PARTS = "_block_parts"
# the array fields the validation checks (`topk_idx` first; every one but it may be in a block)
ARRAY_FIELDS = (
    "topk_idx",
    "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert",
    "recv_src_metadata",
    "dst_buffer_slot_idx",
)
MISSING = object()  # `dict.get`'s default for an absent field

# DeepEP's expand-mode sort key: expert * 1e10, minus 5e9 plus the source id for a valid row (so valid rows come
# first inside their expert, by source), padding rows keep expert * 1e10.
_EXPERT_KEY = 10_000_000_000


def _host(name: str, a: Any) -> np.ndarray:
    """A host numpy copy (or view) of a numpy array or torch tensor; other array types are refused."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "detach") and hasattr(a, "copy_"):
        return a.detach().cpu().numpy()
    raise EPTypeError(
        f"{name}: deterministic_sort takes numpy arrays or torch tensors, got {type(a).__name__}"
    )


def _permute(name: str, a: Any, perm: np.ndarray) -> None:
    """`a[:] = a[perm]` in place, on the array's own device (a torch tensor is indexed where it lives)."""
    if a is None:
        return
    if isinstance(a, np.ndarray):
        a[...] = a[perm]
    elif hasattr(a, "copy_") and hasattr(a, "device"):
        torch = sys.modules["torch"]  # a is a torch tensor, so torch is loaded (ep_core never imports it)
        a.copy_(a[torch.as_tensor(perm, device=a.device)])
    else:
        _host(name, a)  # raises EPTypeError


def _assign(a: Any, value: np.ndarray) -> None:
    if isinstance(a, np.ndarray):
        a[...] = value
    else:
        a.copy_(a.new_tensor(value))


@dataclass(eq=False)
class EPHandle:
    """Layout of one dispatch; positional order matches DeepEP's `EPHandle` constructor."""

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: Any
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: Any
    psum_num_recv_tokens_per_expert: Any
    num_unaligned_recv_tokens_per_expert: Any
    recv_src_metadata: Any
    dst_buffer_slot_idx: Any
    token_metadata_at_forward: Any = None
    channel_linked_list: Any = None
    # Ours, not in DeepEP's positional list: set by the producer when known.
    num_ranks: int = 0
    rank: int = -1
    cached_recv_src_metadata_before_sort: Any = field(default=None, repr=False)

    def held(self) -> list:
        """Every value this handle holds in its fields, and the block of a repeated dispatch's handle whose arrays
        are not all viewed: what keeps the handle's memory (a caller records the tensors among them on streams)."""
        d = self.__dict__
        parts = d.get(BLOCK_PARTS)
        if parts is None:
            return list(d.values())
        return [v for k, v in d.items() if k != BLOCK_PARTS] + [parts[0].array]

    @property
    def num_topk(self) -> int:
        """K, from the shape of `topk_idx`."""
        return int(self.topk_idx.shape[1])

    @property
    def num_tokens(self) -> int:
        """Tokens of the rank that dispatched (rows of `topk_idx`)."""
        return int(self.topk_idx.shape[0])

    @property
    def num_scaleup_ranks(self) -> int:
        """`S_u`: the length of `psum_num_recv_tokens_per_scaleup_rank`."""
        return int(self.psum_num_recv_tokens_per_scaleup_rank.shape[0])

    @property
    def num_local_experts(self) -> int:
        """`epr`: the length of `num_unaligned_recv_tokens_per_expert`."""
        return int(self.num_unaligned_recv_tokens_per_expert.shape[0])

    @property
    def did_cpu_sync(self) -> bool:
        """Whether the dispatch had exact sizes (False: worst-case shapes, true count on the device)."""
        return len(self.num_recv_tokens_per_expert_list) > 0

    def deterministic_sort(
        self,
        do_cpu_sync: bool,
        is_cached_dispatch: bool,
        recv_x: Any,
        recv_sf: Any,
        recv_topk_idx: Any,
        recv_topk_weights: Any,
        channel_linked_list: Any = None,
        recv_row_indices: Any = None,
    ) -> None:
        """Sort a dispatch's received rows into the deterministic order, in place (DeepEP's `EPHandle` method;
        `recv_row_indices`: DeepEP 2.5's receive view's row indices, permuted with `recv_x`).

        Non-expand: `recv_x`, `recv_sf`, `recv_topk_weights`, `recv_topk_idx` (and, on a non-cached dispatch, this
        handle's `recv_src_metadata` and the hybrid `channel_linked_list`) are permuted so that rows are ordered by
        source id (`src_rank * M + src_token`); rows past the true count (no CPU sync) stay at the end. Expand
        (non-cached only): rows are sorted inside each expert, valid rows first by source id, then the padding;
        `recv_src_metadata[:, 2:]` is remapped to the new rows. A cached expand dispatch needs nothing. The sort
        keys come from the metadata as the first, non-cached dispatch left it
        (`cached_recv_src_metadata_before_sort`). Arrays are numpy arrays or torch tensors; the permutation is
        computed on the host (one copy of the keys) and applied on each array's own device.
        """
        if not is_cached_dispatch:
            self.cached_recv_src_metadata_before_sort = np.array(
                _host("recv_src_metadata", self.recv_src_metadata), copy=True
            )
        if self.cached_recv_src_metadata_before_sort is None:
            raise EPValueError(
                "is_cached_dispatch: True, but this handle was never sorted by a non-cached dispatch (no "
                "cached_recv_src_metadata_before_sort); sort the first dispatch's output first"
            )
        before = _host("cached_recv_src_metadata_before_sort", self.cached_recv_src_metadata_before_sort)
        rows = before.shape[0]
        psum = _host("psum_num_recv_tokens_per_scaleup_rank", self.psum_num_recv_tokens_per_scaleup_rank)
        num_recv = rows if do_cpu_sync else (int(psum[-1]) if psum.size else 0)
        out_of_range = np.arange(rows) >= num_recv
        keys = before[:, 0].astype(np.int64)
        keys[out_of_range] = np.iinfo(np.int64).max
        perm = np.argsort(keys, kind="stable")

        if not self.do_expand:
            for name, a in (
                ("recv_x", recv_x),
                ("recv_row_indices", recv_row_indices),
                ("recv_sf", recv_sf),
                ("recv_topk_weights", recv_topk_weights),
                ("recv_topk_idx", recv_topk_idx),
            ):
                _permute(name, a, perm)
            if not is_cached_dispatch:
                _permute("recv_src_metadata", self.recv_src_metadata, perm)
                if channel_linked_list is not None:
                    inv = np.empty_like(perm)
                    inv[perm] = np.arange(perm.size)
                    cll = np.array(_host("channel_linked_list", channel_linked_list), copy=True)
                    valid = (cll >= 0) & (cll < num_recv)
                    cll[valid] = inv[cll[valid]]
                    _assign(channel_linked_list, cll)
            return
        if is_cached_dispatch:
            return  # the copy epilogue placed the rows through the already-remapped recv_src_metadata[:, 2:]

        num_rows = int(recv_x.shape[0])
        psum_e = _host("psum_num_recv_tokens_per_expert", self.psum_num_recv_tokens_per_expert).astype(
            np.int64
        )
        counts = _host("num_unaligned_recv_tokens_per_expert", self.num_unaligned_recv_tokens_per_expert)
        starts = psum_e - counts.astype(np.int64)
        expert_of_row = np.searchsorted(starts[1:], np.arange(num_rows), side="right")
        row_keys = expert_of_row.astype(np.int64) * _EXPERT_KEY
        slots = before[:, 2:]
        valid = slots >= 0
        valid[out_of_range] = False
        src = np.broadcast_to(before[:, :1].astype(np.int64), slots.shape)
        np.add.at(row_keys, slots[valid], src[valid] - _EXPERT_KEY // 2)
        row_perm = np.argsort(row_keys, kind="stable")
        for name, a in (("recv_x", recv_x), ("recv_sf", recv_sf), ("recv_topk_weights", recv_topk_weights)):
            _permute(name, a, row_perm)
        inv = np.empty_like(row_perm)
        inv[row_perm] = np.arange(row_perm.size)
        meta = np.array(_host("recv_src_metadata", self.recv_src_metadata), copy=True)
        lanes = meta[:, 2:]
        lanes[valid] = inv[lanes[valid]]
        _assign(self.recv_src_metadata, meta)


class _InBlock:
    """The class attribute of an array field that a new handle may hold in its block (module doc). A non-data
    descriptor: a field set on the instance (every handle's, but a block handle's unread ones) is found in the
    instance's `__dict__` first and never reaches it, so reading a field costs what a plain attribute does; only a
    field still in the block comes here, and is viewed and kept as the field's value. (An `EPHandle.__getattr__`
    would do the same, but would slow down every attribute read of every handle.)"""

    __slots__ = ("default", "name")

    def __init__(self, name: str, default: Any) -> None:
        self.name = name
        self.default = default

    def __get__(self, handle: Any, owner: Any = None) -> Any:
        if handle is None:  # the class attribute: the dataclass default, if any
            if self.default is MISSING:
                raise AttributeError(self.name)
            return self.default
        d = handle.__dict__
        parts = d.get(BLOCK_PARTS)
        part = None if parts is None else parts[1].get(self.name)
        if part is None:
            if self.default is not MISSING:
                return self.default
            raise AttributeError(f"{type(handle).__name__!r} object has no attribute {self.name!r}")
        view = d[self.name] = parts[0].view(part)
        return view


for _name in (*ARRAY_FIELDS[1:], "token_metadata_at_forward"):
    setattr(EPHandle, _name, _InBlock(_name, EPHandle.__dict__.get(_name, MISSING)))
del _name
