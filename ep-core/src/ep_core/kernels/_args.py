"""Python mirror of `ep_core::OpArgs` (include/ep_core/args.cuh): 44 eight-byte fields in declaration order."""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["FLAGS", "OP_ARGS_FIELDS", "pack_op_args"]

OP_ARGS_FIELDS: tuple[str, ...] = (
    "workspace",
    "recv_region",
    "scratch",
    "peer_bases",
    "own_base",
    "nccl_window",
    "rank",
    "num_tokens",
    "num_max_tokens",
    "num_experts",
    "expert_alignment",
    "flags",
    "timeout_cycles",
    "x",
    "x_stride",
    "sf",
    "sf_stride0",
    "sf_stride1",
    "topk_idx",
    "topk_weights",
    "dst_slot",
    "psum_rank",
    "psum_expert",
    "unaligned_expert",
    "cum_stats",
    "src_metadata",
    "recv_x",
    "recv_sf",
    "sf_out_stride0",
    "sf_out_stride1",
    "recv_topk_idx",
    "recv_topk_weights",
    "num_out_rows",
    "comb_x",
    "comb_weights",
    "bias0",
    "bias1",
    "combined_x",
    "combined_weights",
    "fwd_meta",
    "nccl_devcomm",
    "host_error",
    "envelope",
    "topk_idx_copy",
)

FLAGS: dict[str, int] = {
    "expand": 1 << 0,
    "cached": 1 << 1,
    "deterministic": 1 << 2,
    "zero_padding": 1 << 3,
    "sf_col_major": 1 << 4,
    "topk_idx32": 1 << 5,
    "multiple_reduction": 1 << 6,
    "rank_layout": 1 << 7,
    "skip_scaleout_signal": 1 << 8,
    "combine_weights": 1 << 9,
    "combine_send_only": 1 << 10,
    "combine_reduce_only": 1 << 11,
    "combine_zero_copy": 1 << 12,
    "dispatch_zero_copy": 1 << 13,
}

_STRUCT = struct.Struct("<" + "q" * len(OP_ARGS_FIELDS))
_INDEX = {name: i for i, name in enumerate(OP_ARGS_FIELDS)}


def pack_op_args(**fields: Any) -> bytes:
    """Bytes of one `OpArgs`; unnamed fields are 0 (null pointers). Pointers are ints (or None)."""
    values = [0] * len(OP_ARGS_FIELDS)
    for name, value in fields.items():
        try:
            i = _INDEX[name]
        except KeyError:
            raise KeyError(f"OpArgs has no field {name!r}") from None
        v = 0 if value is None else int(value)
        if v >= 1 << 63:
            v -= 1 << 64
        values[i] = v
    return _STRUCT.pack(*values)
