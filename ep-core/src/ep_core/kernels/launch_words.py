"""The per-call words of a rank's prepared launches (`ep_core.kernels.prepared_launch`), by name in the order the
dispatch and combine sides pass them (`DirectRank`, its repeats `ep_core.kernels.repeat` and the express lanes
`ep_core.kernels.express` build them in this order), and the combine launch's shared memory."""

from __future__ import annotations

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
