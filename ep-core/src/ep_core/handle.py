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

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EPHandle"]


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
