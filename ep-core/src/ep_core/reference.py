"""Exact numpy reference of dispatch and combine: the oracle for every kernel test.

Lists indexed by rank in (`xs[r]` is rank r's input), one output per rank out. Data moves bit-exactly (rows copied,
never converted); bf16 is stored as uint16 bits (`ep_core.bf16`), FP8 data as uint8 (or any 1-byte dtype), scale
packs as 4-byte values copied as bits.

Semantics (SPEC §2-3, behaviour doc §1.5-1.7):

- A token goes once to each distinct destination rank among its valid top-k lanes; the master lane of a
  (token, rank) pair is the highest lane that targets that rank. Negative ids select nothing.
- Row order. Received tokens (non-expand rows; the handle's metadata rows in both layouts), `deterministic=True`:
  by the source token's global index `s*M + t` (`EPHandle.deterministic_sort`) in every mode. Default: grouped by
  scale-up region `s % S_u` of the source rank (direct mode: by source rank), inside a region by (source rank,
  source token). Expand rows: grouped by local expert, inside an expert by (source rank, source token). The
  non-deterministic kernels may order rows differently inside a region / expert: kernel tests run deterministic
  mode or compare through `canonical_order`. A cached dispatch keeps the order of its handles.
- Rows past the true count (worst-case shapes) and expand padding rows are zero here; the kernels leave them
  unspecified (padding zeroed with `do_zero_padding=True`): compare valid rows only
  (`DispatchOutput.num_valid_rows`, `DispatchOutput.valid_expanded_rows`).
- `dst_buffer_slot_idx[t, master lane of (t, d)] = src_rank*M + slot`, slot = position of t among the tokens this
  rank sends to d, in token order.
- Combine: unweighted; fp32 accumulation, bf16 rounding (nearest even) once per reduction level; a level adds its
  operands in ascending order of their representative lane (the highest of the group), the final level from
  float(bias0) (+ float(bias1)), else from the first operand (one operand is returned bit for bit, -0.0 included);
  no operand and no bias is +0.0. Levels: (1) per rank: the caller's row (non-expand) or the local sum of the
  token's expanded rows (expand with multiple reduction); (2) hybrid mode with multiple reduction only: per
  scale-out domain; (3) at the source. Expand without multiple reduction: every lane is one operand of the final one.
- `combined_topk_weights[t, k]`: lane k's weight as sent back by the rank that owns lane k's expert, 0.0 for
  negative lanes.

Hybrid mode (`num_scaleup_ranks < num_ranks`) produces direct-mode fields only, with the hybrid grouping, psums and
reduction levels; `token_metadata_at_forward` / `channel_linked_list` are None and column 1 of
`recv_src_metadata` stays `src_rank*K + master_lane`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep_core.bf16 import as_bf16_bits, bf16_to_float32, float32_to_bf16
from ep_core.handle import EPHandle

__all__ = [
    "CombineOutput",
    "DispatchOutput",
    "align",
    "as_bf16_bits",
    "bf16_to_float32",
    "canonical_order",
    "combine",
    "dispatch",
    "expand_worst_case_rows",
    "float32_to_bf16",
    "sort_rows_by_source",
]

MAX_TOPK = 32
NUM_ALIGNED_SF_PACKS = 4


def align(a: int, b: int) -> int:
    """Round `a` up to a multiple of `b`."""
    return (a + b - 1) // b * b


def expand_worst_case_rows(
    num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int, expert_alignment: int
) -> int:
    """Rows of an expand-layout output without CPU sync: `align(N*M*min(K, epr) + (A-1)*epr, A)`."""
    a = expert_alignment
    return align(
        num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts) + (a - 1) * num_local_experts,
        a,
    )


@dataclass(eq=False)
class DispatchOutput:
    """One rank's dispatch result. `recv_sf` is None for bf16 input.

    `recv_x`: `[R, hidden]` (R = `handle.num_expanded_tokens` with expand, else `handle.num_recv_tokens`).
    `recv_topk_idx`: `[R, K]` int64 local expert ids / -1 (None with expand).
    `recv_topk_weights`: `[R, K]` float32 full rows (non-expand) or `[R]` float32 (expand); None without weights.
    """

    recv_x: np.ndarray
    recv_sf: np.ndarray | None
    recv_topk_idx: np.ndarray | None
    recv_topk_weights: np.ndarray | None
    handle: EPHandle

    @property
    def num_valid_rows(self) -> int:
        """True number of received tokens (`psum_num_recv_tokens_per_scaleup_rank[-1]`)."""
        return _num_received(self.handle)

    @property
    def valid_expanded_rows(self) -> np.ndarray:
        """Boolean mask over the rows of an expand-layout output: True at (token, expert) rows, False at padding."""
        return valid_expanded_rows(self.handle, self.recv_x.shape[0])


@dataclass(eq=False)
class CombineOutput:
    """One rank's combine result: `combined_x` `[T, hidden]` bf16 bits (uint16), or float32 with `fp32_output`;
    weights `[T, K]` float32 or None."""

    combined_x: np.ndarray
    combined_topk_weights: np.ndarray | None


# --------------------------------------------------------------------------------------------------------------
# helpers


def _num_received(handle: EPHandle) -> int:
    psum = np.asarray(handle.psum_num_recv_tokens_per_scaleup_rank)
    return int(psum[-1]) if psum.size else 0


def valid_expanded_rows(handle: EPHandle, num_rows: int | None = None) -> np.ndarray:
    """Mask of the expand-layout rows that hold a (token, local expert) pair."""
    rows = handle.num_expanded_tokens if num_rows is None else num_rows
    mask = np.zeros(rows, dtype=bool)
    meta = np.asarray(handle.recv_src_metadata)[: _num_received(handle), 2:]
    mask[meta[meta >= 0]] = True
    return mask


def _check_routing(r: int, idx: Any, num_experts: int, max_tokens: int) -> np.ndarray:
    a = np.asarray(idx)
    if a.ndim != 2:
        raise ValueError(f"topk_idxs[{r}]: expected a 2-D [num_tokens, num_topk] array, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"topk_idxs[{r}]: expected an integer dtype (int64 or int32), got {a.dtype}")
    a = a.astype(np.int64)
    t, k = a.shape
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"topk_idxs[{r}]: num_topk must be in [1, {MAX_TOPK}], got {k}")
    if t > max_tokens:
        raise ValueError(
            f"topk_idxs[{r}]: num_tokens ({t}) must be <= num_max_tokens_per_rank ({max_tokens})"
        )
    if a.size and a.max() >= num_experts:
        raise ValueError(
            f"topk_idxs[{r}]: expert id {int(a.max())} out of range [0, {num_experts}); use -1 for none"
        )
    a = np.where(a < 0, -1, a)
    if k > 1 and t:
        s = np.sort(a, axis=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if dup.any():
            tok = int(np.flatnonzero(dup.any(axis=1))[0])
            raise ValueError(
                f"topk_idxs[{r}]: token {tok} selects expert {int(s[tok][1:][dup[tok]][0])} twice; "
                "every expert may appear once per token"
            )
    return a


def _split_x(r: int, x: Any, sf: Any) -> tuple[np.ndarray, np.ndarray | None]:
    if isinstance(x, tuple):
        if len(x) != 2 or sf is not None:
            raise TypeError(f"xs[{r}]: expected a bf16 array or an FP8 tuple (data, sf)")
        x, sf = x
    data = np.asarray(x)
    if data.ndim != 2:
        raise ValueError(f"xs[{r}]: expected a 2-D [num_tokens, hidden] array, got shape {data.shape}")
    if sf is None:
        if data.dtype.itemsize != 1:
            data = as_bf16_bits(data)
        return data, None
    s = np.asarray(sf)
    if s.ndim != 2 or s.shape[0] != data.shape[0]:
        raise ValueError(f"sf[{r}]: expected [num_tokens={data.shape[0]}, num_sf_packs], got shape {s.shape}")
    if s.dtype.itemsize != 4:
        raise TypeError(f"sf[{r}]: scale packs must be 4-byte values (float32 or int32), got {s.dtype}")
    if data.dtype.itemsize != 1:
        raise TypeError(f"xs[{r}]: FP8 data must have a 1-byte dtype, got {data.dtype}")
    return data, s


def _empty_sf(rows: int, packs: int, dtype: np.dtype, col_major: bool) -> np.ndarray:
    if not col_major:
        return np.zeros((rows, packs), dtype=dtype)
    return np.zeros((packs, align(rows, NUM_ALIGNED_SF_PACKS)), dtype=dtype).T[:rows]


# --------------------------------------------------------------------------------------------------------------
# dispatch


def _plan(
    idxs: list[np.ndarray],
    *,
    num_experts: int,
    max_tokens: int,
    alignment: int,
    num_scaleup: int,
    do_expand: bool,
    do_cpu_sync: bool,
    num_sms: int,
    by_source: bool = False,
) -> list[EPHandle]:
    """Compute every rank's handle (the layout) from the routing. Rows of a source rank are in token order; the
    sources are walked region by region (`s % S_u`, then `s`), or in rank order with `by_source` (the
    deterministic order; the same walk in direct mode)."""
    n = len(idxs)
    epr = num_experts // n
    k = idxs[0].shape[1]
    m = max_tokens
    owners = [np.where(i >= 0, i // epr, -1) for i in idxs]
    slots = [np.full(i.shape, -1, dtype=np.int32) for i in idxs]
    # per (source, destination): tokens sent (ascending) and their master lane
    sent: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for s in range(n):
        for d in range(n):
            hit = owners[s] == d
            tokens = np.flatnonzero(hit.any(axis=1))
            master = (k - 1 - np.argmax(hit[tokens, ::-1], axis=1)).astype(np.int64)
            slots[s][tokens, master] = (s * m + np.arange(tokens.size)).astype(np.int32)
            sent[(s, d)] = (tokens, master)
    handles = []
    for d in range(n):
        src_parts, tok_parts, master_parts = [], [], []
        region_counts = [
            sum(sent[(s, d)][0].size for s in range(g, n, num_scaleup)) for g in range(num_scaleup)
        ]
        walk = range(n) if by_source else [s for g in range(num_scaleup) for s in range(g, n, num_scaleup)]
        for s in walk:
            tokens, master = sent[(s, d)]
            src_parts.append(np.full(tokens.size, s, dtype=np.int64))
            tok_parts.append(tokens.astype(np.int64))
            master_parts.append(master)
        src = np.concatenate(src_parts)
        tok = np.concatenate(tok_parts)
        master = np.concatenate(master_parts)
        num_recv = src.size
        local = np.full((num_recv, k), -1, dtype=np.int64)
        for s in range(n):
            sel = src == s
            rows = idxs[s][tok[sel]]
            local[sel] = np.where(owners[s][tok[sel]] == d, rows - d * epr, -1)
        counts = np.bincount(local[local >= 0], minlength=epr).astype(np.int64)
        aligned = (counts + alignment - 1) // alignment * alignment
        starts = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)

        meta_valid = np.full((num_recv, k + 2), -1, dtype=np.int32)
        meta_valid[:, 0] = src * m + tok
        meta_valid[:, 1] = src * k + master
        if do_expand:
            ii, kk = np.nonzero(local >= 0)
            e = local[ii, kk]
            order = np.lexsort((meta_valid[ii, 0], e))
            ii, kk, e = ii[order], kk[order], e[order]
            first = np.concatenate([[0], np.cumsum(counts)[:-1]])
            pos = np.arange(e.size) - first[e]
            meta_valid[ii, 2 + kk] = (starts[e] + pos).astype(np.int32)

        if do_cpu_sync:
            num_recv_rows = num_recv
            num_expanded = int(aligned.sum())
            expert_list = [int(c) for c in aligned]
        else:
            num_recv_rows = n * m
            num_expanded = expand_worst_case_rows(n, m, k, epr, alignment)
            expert_list = []
        meta = np.full((num_recv_rows, k + 2), -1, dtype=np.int32)
        meta[:num_recv] = meta_valid
        psum_expert = (starts + counts) if do_expand else np.cumsum(aligned)
        handles.append(
            EPHandle(
                do_expand=do_expand,
                num_experts=num_experts,
                expert_alignment=alignment,
                num_max_tokens_per_rank=m,
                num_sms=num_sms,
                topk_idx=idxs[d].copy(),
                num_recv_tokens=num_recv_rows,
                num_expanded_tokens=num_expanded,
                num_recv_tokens_per_expert_list=expert_list,
                psum_num_recv_tokens_per_scaleup_rank=np.cumsum(region_counts).astype(np.int32),
                psum_num_recv_tokens_per_expert=psum_expert.astype(np.int32),
                num_unaligned_recv_tokens_per_expert=counts.astype(np.int32),
                recv_src_metadata=meta,
                dst_buffer_slot_idx=slots[d],
                num_ranks=n,
                rank=d,
            )
        )
    return handles


def _move(
    d: int,
    handle: EPHandle,
    handles: Sequence[EPHandle],
    data: list[np.ndarray],
    sfs: list[np.ndarray | None],
    weights: list[np.ndarray] | None,
    *,
    col_major_sf: bool,
) -> DispatchOutput:
    """Place the source rows into rank d's outputs following d's handle (works for any row order)."""
    n = len(handles)
    m = handle.num_max_tokens_per_rank
    epr = handle.num_experts // n
    k = handle.num_topk
    hidden_shape = data[0].shape[1:]
    num_recv = _num_received(handle)
    meta = np.asarray(handle.recv_src_metadata)[:num_recv]
    src = meta[:, 0].astype(np.int64)
    src_rank, tok = src // m, src % m
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    recv_x = np.zeros((rows, *hidden_shape), dtype=data[0].dtype)
    has_sf = sfs[0] is not None
    recv_sf = _empty_sf(rows, sfs[0].shape[1], sfs[0].dtype, col_major_sf) if has_sf else None
    recv_idx = None if handle.do_expand else np.full((rows, k), -1, dtype=np.int64)
    if weights is None:
        recv_w = None
    else:
        recv_w = np.zeros((rows,) if handle.do_expand else (rows, k), dtype=np.float32)
    for s in range(n):
        sel = np.flatnonzero(src_rank == s)
        if sel.size == 0:
            continue
        t = tok[sel]
        if not handle.do_expand:
            recv_x[sel] = data[s][t]
            if has_sf:
                recv_sf[sel] = sfs[s][t]
            gidx = np.asarray(handles[s].topk_idx).astype(np.int64)[t]
            recv_idx[sel] = np.where((gidx >= 0) & (gidx // epr == d), gidx - d * epr, -1)
            if recv_w is not None:
                recv_w.view(np.uint32)[sel] = weights[s][t].view(np.uint32)
            continue
        exp_rows = meta[sel, 2:]
        for lane in range(k):
            p = exp_rows[:, lane] >= 0
            if not p.any():
                continue
            dst = exp_rows[p, lane]
            recv_x[dst] = data[s][t[p]]
            if has_sf:
                recv_sf[dst] = sfs[s][t[p]]
            if recv_w is not None:
                recv_w.view(np.uint32)[dst] = weights[s][t[p], lane].view(np.uint32)
    return DispatchOutput(recv_x, recv_sf, recv_idx, recv_w, handle)


def dispatch(
    xs: Sequence[Any],
    topk_idxs: Sequence[Any] | None = None,
    topk_weights: Sequence[Any] | None = None,
    *,
    num_experts: int | None = None,
    num_max_tokens_per_rank: int | None = None,
    expert_alignment: int | None = None,
    do_expand: bool | None = None,
    deterministic: bool = False,
    sf: Sequence[Any] | None = None,
    do_cpu_sync: bool | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    do_zero_padding: bool = False,
    handles: Sequence[EPHandle] | None = None,
    num_scaleup_ranks: int | None = None,
    num_sms: int = 0,
) -> list[DispatchOutput]:
    """Reference dispatch over all ranks; returns one `DispatchOutput` per rank.

    `xs[r]`: `[T_r, hidden]` bf16 (uint16 bits, or float32 rounded to bf16), or an FP8 tuple `(data, sf)`; FP8
    scales may also be passed separately as `sf[r]`. `topk_idxs[r]`: `[T_r, K]` global expert ids, negative = none.
    `topk_weights[r]`: `[T_r, K]` float32 or None (all ranks alike). With `handles` (one per rank, from a previous
    dispatch) this is a cached dispatch: `topk_idxs` must be None, the routing, sizes and row order come from the
    handles, and new `topk_weights` may be given; the returned handles are the given ones.
    `deterministic=True` orders the rows by the source token's global index (module doc, "Row order"; it changes
    only hybrid mode's non-expanded rows: elsewhere the default order is that one); a cached dispatch keeps its
    handles' order. `do_zero_padding` only documents intent (padding rows are always zero here); both are validated
    like the real API.
    """
    n = len(xs)
    if n == 0:
        raise ValueError("xs: expected one input per rank, got an empty list")
    if do_zero_padding and not (do_expand if do_expand is not None else (handles and handles[0].do_expand)):
        raise ValueError("do_zero_padding: only valid together with do_expand=True")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if handles is not None:
        if topk_idxs is not None:
            raise ValueError("topk_idxs: must be None for a cached dispatch (the handle holds the routing)")
        if do_cpu_sync:
            raise ValueError("do_cpu_sync: a cached dispatch cannot do a CPU sync; leave it None or False")
        if len(handles) != n:
            raise ValueError(f"handles: expected {n} handles (one per rank), got {len(handles)}")
        h0 = handles[0]
        for name, given, cached in (
            ("num_experts", num_experts, h0.num_experts),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank, h0.num_max_tokens_per_rank),
            ("expert_alignment", expert_alignment, h0.expert_alignment),
            ("do_expand", do_expand, h0.do_expand),
        ):
            if given is not None and given != cached:
                raise ValueError(f"{name}: {given} differs from the cached handle's {cached}")
        idxs = [np.asarray(h.topk_idx).astype(np.int64) for h in handles]
        out_handles = list(handles)
    else:
        if topk_idxs is None or num_experts is None or num_max_tokens_per_rank is None:
            raise ValueError(
                "topk_idxs, num_experts and num_max_tokens_per_rank are required without handles"
            )
        if len(topk_idxs) != n:
            raise ValueError(f"topk_idxs: expected {n} arrays (one per rank), got {len(topk_idxs)}")
        if num_experts <= 0 or num_experts % n:
            raise ValueError(
                f"num_experts: must be a positive multiple of the number of ranks ({n}), got {num_experts}"
            )
        if num_max_tokens_per_rank <= 0:
            raise ValueError(f"num_max_tokens_per_rank: must be > 0, got {num_max_tokens_per_rank}")
        alignment = 1 if expert_alignment is None else expert_alignment
        if alignment < 1:
            raise ValueError(f"expert_alignment: must be >= 1, got {alignment}")
        su = n if num_scaleup_ranks is None else num_scaleup_ranks
        if su < 1 or n % su:
            raise ValueError(f"num_scaleup_ranks: must divide the number of ranks ({n}), got {su}")
        idxs = [_check_routing(r, i, num_experts, num_max_tokens_per_rank) for r, i in enumerate(topk_idxs)]
        if len({i.shape[1] for i in idxs}) != 1:
            raise ValueError(
                f"topk_idxs: every rank must use the same num_topk, got {[i.shape[1] for i in idxs]}"
            )
        out_handles = _plan(
            idxs,
            num_experts=num_experts,
            max_tokens=num_max_tokens_per_rank,
            alignment=alignment,
            num_scaleup=su,
            do_expand=bool(do_expand),
            do_cpu_sync=do_cpu_sync is not False,
            num_sms=num_sms,
            by_source=bool(deterministic),
        )
    data, sfs = [], []
    for r in range(n):
        dr, sr = _split_x(r, xs[r], None if sf is None else sf[r])
        if dr.shape[0] != idxs[r].shape[0]:
            raise ValueError(f"xs[{r}]: {dr.shape[0]} rows, but the routing has {idxs[r].shape[0]} tokens")
        data.append(dr)
        sfs.append(sr)
    if len({(d.dtype, d.shape[1:]) for d in data}) != 1 or len({s is None for s in sfs}) != 1:
        raise ValueError(
            "xs: every rank must pass the same hidden size, dtype and format (bf16 or FP8 tuple)"
        )
    if sfs[0] is not None and len({(s.shape[1], s.dtype) for s in sfs}) != 1:
        raise ValueError("sf: every rank must pass the same number and dtype of scale packs")
    weights = None
    if topk_weights is not None:
        weights = []
        for r, w in enumerate(topk_weights):
            wa = np.asarray(w)
            if wa.dtype != np.float32:
                raise TypeError(f"topk_weights[{r}]: expected float32, got {wa.dtype}")
            if wa.shape != idxs[r].shape:
                raise ValueError(f"topk_weights[{r}]: expected shape {idxs[r].shape}, got {wa.shape}")
            weights.append(np.ascontiguousarray(wa))
    return [
        _move(d, out_handles[d], out_handles, data, sfs, weights, col_major_sf=use_tma_aligned_col_major_sf)
        for d in range(n)
    ]


# --------------------------------------------------------------------------------------------------------------
# combine


def _ordered_sum(
    group: np.ndarray, rep: np.ndarray, values: np.ndarray, num_groups: int, init: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum `values` (bf16 bits, one row per operand) per group in ascending `rep` order, in fp32.

    Returns (fp32 sums [G, H], has-operand-or-init mask [G], representative = max rep per group, -1 if none).
    Starts from `init` when given, otherwise from each group's first operand.
    """
    hidden_shape = values.shape[1:]
    if init is not None:
        acc = init.astype(np.float32, copy=True)
        has = np.ones(num_groups, dtype=bool)
    else:
        acc = np.zeros((num_groups, *hidden_shape), dtype=np.float32)
        has = np.zeros(num_groups, dtype=bool)
    top = np.full(num_groups, -1, dtype=np.int64)
    if group.size == 0:
        return acc, has, top
    order = np.lexsort((rep, group))
    g = group[order]
    first = np.searchsorted(g, g, side="left")
    pos = np.arange(g.size) - first
    for j in range(int(pos.max()) + 1):
        sel = np.flatnonzero(pos == j)
        gi = g[sel]
        v = bf16_to_float32(values[order[sel]])
        acc[gi] = np.where(has[gi].reshape(-1, *([1] * len(hidden_shape))), acc[gi] + v, v)
        has[gi] = True
        top[gi] = rep[order[sel]]
    return acc, has, top


def _bias_init(r: int, bias: Any, num_tokens: int, hidden_shape: tuple[int, ...]) -> np.ndarray | None:
    if bias is None:
        return None
    if isinstance(bias, list) or (
        not isinstance(bias, (tuple, np.ndarray)) and not hasattr(bias, "__array__")
    ):
        raise TypeError(
            f"bias[{r}]: expected None, one array or a tuple of two arrays, got {type(bias).__name__}"
        )
    parts = bias if isinstance(bias, tuple) else (bias,)
    if len(parts) != 2 and isinstance(bias, tuple):
        raise TypeError(f"bias[{r}]: a bias tuple must have exactly two arrays, got {len(parts)}")
    acc = None
    for i, b in enumerate(parts):
        bits = as_bf16_bits(b)
        if bits.shape != (num_tokens, *hidden_shape):
            raise ValueError(
                f"bias[{r}][{i}]: expected shape {(num_tokens, *hidden_shape)}, got {bits.shape}"
            )
        f = bf16_to_float32(bits)
        acc = f if acc is None else acc + f
    return acc


def combine(
    xs: Sequence[Any],
    handles: Sequence[EPHandle],
    *,
    topk_weights: Sequence[Any] | None = None,
    bias: Sequence[Any] | None = None,
    allow_multiple_reduction: bool = True,
    num_scaleup_ranks: int | None = None,
    fp32_output: bool = False,
) -> list[CombineOutput]:
    """Reference combine over all ranks; returns one `CombineOutput` per rank (in the handles' rank order).

    `fp32_output=True` (DeepEP 2.6's optional FP32 combine output): `combined_x` is the final level's float32 sum
    itself, not rounded to bf16 (the earlier levels still round; the bf16 output is this array rounded to nearest
    even).

    `xs[d]`: rank d's expert outputs, bf16 (uint16 bits or float32 of bf16 values): `[rows, hidden]` with one row
    per received token (non-expand) or per expanded row (expand). The handles may come from the kernels (any row
    order): only `recv_src_metadata`, the psums and `topk_idx` are read. `topk_weights[d]` (optional, all ranks
    alike) is what rank d sends back: `[rows, K]` (non-expand) or `[rows]` (expand). `bias[r]`: None, one
    `[T_r, hidden]` bf16 array or a tuple of two; a list is a TypeError.
    """
    n = len(handles)
    if len(xs) != n:
        raise ValueError(f"xs: expected {n} arrays (one per rank), got {len(xs)}")
    h0 = handles[0]
    do_expand = h0.do_expand
    m = h0.num_max_tokens_per_rank
    k = h0.num_topk
    epr = h0.num_experts // n
    su = h0.num_scaleup_ranks if num_scaleup_ranks is None else num_scaleup_ranks
    so = n // su
    if do_expand and not allow_multiple_reduction and topk_weights is not None:
        raise ValueError(
            "topk_weights: not allowed for an expand-layout combine with allow_multiple_reduction=False"
        )
    if bias is not None and len(bias) != n:
        raise ValueError(f"bias: expected {n} entries (one per rank), got {len(bias)}")
    xb = [as_bf16_bits(x) for x in xs]
    hidden_shape = xb[0].shape[1:]
    idxs = [np.asarray(h.topk_idx).astype(np.int64) for h in handles]

    # level 1: operands (source rank, token, representative lane, rank) with bf16 values
    op_src, op_tok, op_rep, op_rank, op_val = [], [], [], [], []
    out_w = None if topk_weights is None else [np.zeros(i.shape, dtype=np.float32) for i in idxs]
    for d, h in enumerate(handles):
        num_recv = _num_received(h)
        meta = np.asarray(h.recv_src_metadata)[:num_recv].astype(np.int64)
        src_rank, tok = meta[:, 0] // m, meta[:, 0] % m
        master = meta[:, 1] % k
        x = xb[d]
        if not do_expand:
            if x.shape[0] < num_recv:
                raise ValueError(f"xs[{d}]: expected at least {num_recv} rows, got {x.shape[0]}")
            op_src.append(src_rank), op_tok.append(tok), op_rep.append(master)
            op_rank.append(np.full(num_recv, d)), op_val.append(x[:num_recv])
        else:
            exp_rows = meta[:, 2:]
            if exp_rows.size and x.shape[0] <= exp_rows.max():
                raise ValueError(
                    f"xs[{d}]: expected at least {int(exp_rows.max()) + 1} rows, got {x.shape[0]}"
                )
            ii, kk = np.nonzero(exp_rows >= 0)
            if allow_multiple_reduction:
                acc, _, _ = _ordered_sum(ii, kk, x[exp_rows[ii, kk]], num_recv, None)
                op_src.append(src_rank), op_tok.append(tok), op_rep.append(master)
                op_rank.append(np.full(num_recv, d)), op_val.append(float32_to_bf16(acc))
            else:
                op_src.append(src_rank[ii]), op_tok.append(tok[ii]), op_rep.append(kk)
                op_rank.append(np.full(ii.size, d)), op_val.append(x[exp_rows[ii, kk]])
        if out_w is not None:
            w = np.asarray(topk_weights[d])
            if w.dtype != np.float32:
                raise TypeError(f"topk_weights[{d}]: expected float32, got {w.dtype}")
            for s in range(n):
                sel = np.flatnonzero(src_rank == s)
                if sel.size == 0:
                    continue
                t = tok[sel]
                g = idxs[s][t]
                owned = (g >= 0) & (g // epr == d)
                if do_expand:
                    er = exp_rows[sel]
                    vals = np.where(er >= 0, w[np.maximum(er, 0)], np.float32(0))
                else:
                    vals = w[sel]
                rr, ll = np.nonzero(owned)
                out_w[s][t[rr], ll] = vals[rr, ll]
    src = np.concatenate(op_src).astype(np.int64)
    tok = np.concatenate(op_tok).astype(np.int64)
    rep = np.concatenate(op_rep).astype(np.int64)
    rank = np.concatenate(op_rank).astype(np.int64)
    val = np.concatenate(op_val) if op_val else np.zeros((0, *hidden_shape), dtype=np.uint16)

    # level 2 (hybrid, multiple reduction): per scale-out domain of the rank that produced the operand
    if so > 1 and allow_multiple_reduction:
        key = (src * m + tok) * so + rank // su
        uniq, group = np.unique(key, return_inverse=True)
        acc, _, top = _ordered_sum(group, rep, val, uniq.size, None)
        val = float32_to_bf16(acc)
        src, tok, rep = uniq // so // m, uniq // so % m, top

    # final level at the source
    outs = []
    for s in range(n):
        num_tokens = idxs[s].shape[0]
        sel = np.flatnonzero(src == s)
        init = _bias_init(s, None if bias is None else bias[s], num_tokens, hidden_shape)
        acc, _, _ = _ordered_sum(tok[sel], rep[sel], val[sel], num_tokens, init)
        if sel.size:
            _check_distinct_reps(tok[sel], rep[sel])
        final = acc.astype(np.float32) if fp32_output else float32_to_bf16(acc)
        outs.append(CombineOutput(final, None if out_w is None else out_w[s]))
    return outs


def _check_distinct_reps(tok: np.ndarray, rep: np.ndarray) -> None:
    pairs = tok * (MAX_TOPK + 1) + rep
    if np.unique(pairs).size != pairs.size:
        raise ValueError(
            "handles: two operands of one token share a representative lane; the handles are inconsistent"
        )


# --------------------------------------------------------------------------------------------------------------
# comparing unordered outputs


def sort_rows_by_source(src_global_idx: Any, bounds: Any) -> np.ndarray:
    """Permutation that sorts rows by source id inside each segment `[bounds[i-1], bounds[i])` (bounds inclusive
    prefix sums, first segment starts at 0). Rows past `bounds[-1]` keep their place."""
    key = np.asarray(src_global_idx).astype(np.int64)
    b = np.concatenate([[0], np.asarray(bounds, dtype=np.int64)])
    perm = np.arange(key.size)
    for lo, hi in itertools.pairwise(b):
        perm[lo:hi] = lo + np.argsort(key[lo:hi], kind="stable")
    return perm


def canonical_order(out: DispatchOutput) -> DispatchOutput:
    """Return a copy of a dispatch output (reference or kernel, as numpy arrays) with the rows of each region
    (non-expand) and of each expert (expand) sorted by source id, and the handle's row references remapped.

    Two outputs that differ only in the order inside regions / experts have equal canonical forms, so kernels
    that are not run with `deterministic=True` are compared to the reference through this function. Only valid
    rows move; slack and padding rows stay where they are. `dst_buffer_slot_idx` (sender side) is not touched.
    """
    h = out.handle
    num_recv = _num_received(h)
    meta = np.array(h.recv_src_metadata, copy=True)
    perm_tok = sort_rows_by_source(meta[:num_recv, 0], np.asarray(h.psum_num_recv_tokens_per_scaleup_rank))
    meta[:num_recv] = meta[perm_tok]
    if not h.do_expand:
        perm_rows = np.arange(out.recv_x.shape[0])
        perm_rows[:num_recv] = perm_tok
    else:
        rows = out.recv_x.shape[0]
        exp = meta[:num_recv, 2:]
        owner_tok = np.full(rows, -1, dtype=np.int64)
        ii, kk = np.nonzero(exp >= 0)
        owner_tok[exp[ii, kk]] = ii
        key = np.where(
            owner_tok >= 0, meta[np.maximum(owner_tok, 0), 0].astype(np.int64), np.iinfo(np.int64).max
        )
        perm_rows = np.arange(rows)
        counts = np.asarray(h.num_unaligned_recv_tokens_per_expert).astype(np.int64)
        start = 0
        for c in counts:
            lo = int(start)
            seg = np.arange(lo, lo + int(c))
            perm_rows[seg] = seg[np.argsort(key[seg], kind="stable")]
            start = align(lo + int(c), h.expert_alignment)
        inv = np.empty(rows, dtype=np.int64)
        inv[perm_rows] = np.arange(rows)
        meta[:num_recv, 2:] = np.where(exp >= 0, inv[np.maximum(exp, 0)], -1)

    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(np.asarray(a)[perm_rows])

    handle = dataclasses.replace(h, recv_src_metadata=meta)
    return DispatchOutput(
        take(out.recv_x), take(out.recv_sf), take(out.recv_topk_idx), take(out.recv_topk_weights), handle
    )
