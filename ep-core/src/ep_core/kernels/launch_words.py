"""The per-call words of a rank's prepared launches (`ep_core.kernels.prepared_launch`): their names in the order
the kernels' launches take them, and the one place each tuple of words is built in that order (`dispatch_words`,
`combine_words`, `epilogue_outputs`), for the full path (`DirectRank`), its repeats (`ep_core.kernels.repeat`) and
the express lanes (`ep_core.kernels.express`) alike; and the combine launch's shared memory."""

from __future__ import annotations

from typing import Any

from ep_core.kernels.plan import KernelConfig

# the per-call fields of each prepared launch (ep_core.kernels.prepared_launch), in the order DirectRank passes them
_DISPATCH_DYNAMIC = (
    "x",
    "sf",
    "topk_idx",
    "topk_weights",
    "dst_slot",
    "fwd_meta",
    "psum_rank",
    "psum_expert",
    "unaligned_expert",
    "cum_stats",
    "topk_idx_copy",
    "envelope",
)
# a zero-copy dispatch's kernel also writes the handle's metadata (the envelope stays last)
_DISPATCH_ZERO_COPY_DYNAMIC = (*_DISPATCH_DYNAMIC[:-1], "src_metadata", "envelope")
_EPILOGUE_DYNAMIC = (
    "envelope",
    "src_metadata",
    "recv_x",
    "recv_sf",
    "sf_out_stride0",
    "sf_out_stride1",
    "recv_topk_idx",
    "recv_topk_weights",
    "num_out_rows",
)
# the epilogue's launch starts from the dispatch launch's words: the dispatch's per-call fields, then its own
_EPILOGUE_DYNAMIC_ALL = _DISPATCH_DYNAMIC + _EPILOGUE_DYNAMIC
_COMBINE_DYNAMIC = (
    "topk_idx",
    "psum_rank",
    "src_metadata",
    "fwd_meta",
    "comb_x",
    "comb_weights",
    "bias0",
    "bias1",
    "combined_x",
    "combined_weights",
    "envelope",
)
# a zero-copy combine also reads the dispatch's slots (the envelope stays last: it says whether a launch is collective)
_COMBINE_ZERO_COPY_DYNAMIC = (*_COMBINE_DYNAMIC[:-1], "dst_slot", "envelope")


def combine_smem(cfg: KernelConfig) -> int:
    """The combine launch's dynamic shared memory: the direct combine stages rows through it with bulk copies
    (`KernelConfig.combine_dynamic_smem_bytes`, 0 when it does not fit: the register path); hybrid and cross-node
    combines do not use it (helper-latency's request 3, issue 17)."""
    if cfg.is_hybrid or cfg.is_direct_xnode:
        return 0
    return cfg.combine_dynamic_smem_bytes


def dispatch_words(
    x: int,
    sf: int,
    topk_idx: int,
    topk_weights: int,
    dst_slot: int,
    fwd_meta: int,
    psum_rank: int,
    psum_expert: int,
    unaligned_expert: int,
    cum_stats: int,
    topk_idx_copy: int,
    envelope: int,
    src_metadata: int | None = None,
) -> tuple:
    """The dispatch launch's per-call words, in `_DISPATCH_DYNAMIC` order; with `src_metadata` (a zero-copy
    dispatch, whose kernel writes the handle's metadata), in `_DISPATCH_ZERO_COPY_DYNAMIC` order."""
    if src_metadata is None:
        return (
            x,
            sf,
            topk_idx,
            topk_weights,
            dst_slot,
            fwd_meta,
            psum_rank,
            psum_expert,
            unaligned_expert,
            cum_stats,
            topk_idx_copy,
            envelope,
        )
    return (
        x,
        sf,
        topk_idx,
        topk_weights,
        dst_slot,
        fwd_meta,
        psum_rank,
        psum_expert,
        unaligned_expert,
        cum_stats,
        topk_idx_copy,
        src_metadata,
        envelope,
    )


def combine_words(
    topk_idx: int,
    psum_rank: int,
    src_metadata: int,
    fwd_meta: int,
    comb_x: int,
    comb_weights: int,
    bias0: int,
    bias1: int,
    combined_x: int,
    combined_weights: int,
    envelope: int,
    dst_slot: int | None = None,
) -> tuple:
    """The combine launch's per-call words, in `_COMBINE_DYNAMIC` order; with `dst_slot` (a zero-copy combine,
    which reads the dispatch's slots), in `_COMBINE_ZERO_COPY_DYNAMIC` order."""
    if dst_slot is None:
        return (
            topk_idx,
            psum_rank,
            src_metadata,
            fwd_meta,
            comb_x,
            comb_weights,
            bias0,
            bias1,
            combined_x,
            combined_weights,
            envelope,
        )
    return (
        topk_idx,
        psum_rank,
        src_metadata,
        fwd_meta,
        comb_x,
        comb_weights,
        bias0,
        bias1,
        combined_x,
        combined_weights,
        dst_slot,
        envelope,
    )


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
    """The copy epilogue's own per-call words, in `_EPILOGUE_DYNAMIC` order; the envelope is 0: the
    epilogue meets no peer and is not a collective launch. `ptr` is `view_ptr` (full path) or `array_ptr` (a repeat);
    `meta_ptr`: the handle's `recv_src_metadata`."""
    return (
        0,
        meta_ptr,
        ptr(recv_x, "recv_x"),
        ptr(recv_sf, "recv_sf") if recv_sf is not None else 0,
        sf_strides[0],
        sf_strides[1],
        ptr(recv_idx, "recv_topk_idx") if recv_idx is not None else 0,
        ptr(recv_w, "recv_topk_weights") if recv_w is not None else 0,
        rows,
    )
