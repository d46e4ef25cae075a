"""V1's normal-mode handles: the 6-tuple of an intranode dispatch and the 10-tuple of an internode one, each
carrying ep's handle for the combine."""

from __future__ import annotations

from typing import Any

__all__ = ["V1Handle", "V1InternodeHandle"]


class V1Handle(tuple):
    """V1's intranode handle ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)``. ep computes ``rank_prefix_matrix`` [N, N] int32 (column j: inclusive prefix over
    source ranks of tokens sent to rank j), ``recv_src_idx`` [R] int32 (source token of each row) and
    ``is_token_in_rank`` [T, N] bool; the channel matrices and ``send_head`` describe V1's channel kernels, which ep
    does not have: they are None. ``ep_handle`` is ep's own handle, used by combine and cached dispatch."""

    ep_handle: Any
    num_rows: int  # rows the caller sees (num_worst_tokens when given)
    perm: Any  # internode: V1 rows = ep rows[perm]; None when ep's order is V1's

    def __new__(cls, items: tuple, ep_handle: Any, num_rows: int, perm: Any = None) -> V1Handle:
        obj = super().__new__(cls, items)
        obj.ep_handle = ep_handle
        obj.num_rows = num_rows
        obj.perm = perm
        return obj


class V1InternodeHandle(V1Handle):
    """V1's internode handle (ranks on several nodes), the 10-tuple ``(is_token_in_rank [T, N] bool,
    rdma_channel_prefix_matrix [nodes, 1], gbl_channel_prefix_matrix [N, 1], recv_rdma_channel_prefix_matrix
    [nodes, 1], recv_rdma_rank_prefix_sum [nodes], recv_gbl_channel_prefix_matrix [N, 1], recv_gbl_rank_prefix_sum
    [N], recv_src_meta [R, 8] uint8, send_rdma_head [T, nodes], send_nvl_head [num_rdma_recv_tokens, S_u])``, int32
    unless noted. ep has no channels: the channel matrices are one channel (the counts, V1's inclusive prefix over
    one channel); the heads are slot positions in that channel, -1 where not sent; ``send_nvl_head`` has S_u
    columns (V1: NUM_MAX_NVL_PEERS = 8). ``recv_src_meta`` holds V1's SourceMeta bytes (int32 src_rdma_rank, int32
    is_token_in_nvl_rank_bits). See ``legacy.internode``."""
