"""``EPHandle`` with torch tensors: ep-core's handle, plus what the torch backends keep alongside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from ep_core import EPHandle as _CoreHandle

__all__ = ["EPHandle"]


@dataclass(eq=False)
class EPHandle(_CoreHandle):
    """The layout of one dispatch (DeepEP's ``EPHandle``; fields in SPEC §2 / behaviour doc §1.1).

    Array fields are torch tensors on the buffer's device: ``topk_idx`` (``topk_idx_t``),
    ``psum_num_recv_tokens_per_scaleup_rank``, ``psum_num_recv_tokens_per_expert``,
    ``num_unaligned_recv_tokens_per_expert``, ``recv_src_metadata`` and ``dst_buffer_slot_idx`` (int32).
    ``num_recv_tokens_per_expert_list`` is a Python list of **aligned** counts (empty without CPU sync).
    Pass it back to ``combine`` and to a cached ``dispatch``.
    """

    # What the backend that produced the handle needs to reuse it (the CPU reference backend keeps every rank's
    # numpy handle here; the GPU backend its ep-core handle). Not part of DeepEP's surface.
    backend_state: Any = field(default=None, repr=False)
    buffer_id: int = field(default=0, repr=False)

    @classmethod
    def from_core(
        cls,
        core: _CoreHandle,
        device: torch.device,
        *,
        topk_idx: torch.Tensor | None = None,
        backend_state: Any = None,
        buffer_id: int = 0,
    ) -> EPHandle:
        """Wrap an ep-core handle holding numpy arrays; ``topk_idx`` (the caller's tensor) replaces the copy."""

        def t(a: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(
            do_expand=core.do_expand,
            num_experts=core.num_experts,
            expert_alignment=core.expert_alignment,
            num_max_tokens_per_rank=core.num_max_tokens_per_rank,
            num_sms=core.num_sms,
            topk_idx=topk_idx if topk_idx is not None else t(core.topk_idx, torch.int64),
            num_recv_tokens=core.num_recv_tokens,
            num_expanded_tokens=core.num_expanded_tokens,
            num_recv_tokens_per_expert_list=list(core.num_recv_tokens_per_expert_list),
            psum_num_recv_tokens_per_scaleup_rank=t(core.psum_num_recv_tokens_per_scaleup_rank, torch.int32),
            psum_num_recv_tokens_per_expert=t(core.psum_num_recv_tokens_per_expert, torch.int32),
            num_unaligned_recv_tokens_per_expert=t(core.num_unaligned_recv_tokens_per_expert, torch.int32),
            recv_src_metadata=t(core.recv_src_metadata, torch.int32),
            dst_buffer_slot_idx=t(core.dst_buffer_slot_idx, torch.int32),
            token_metadata_at_forward=None,
            channel_linked_list=None,
            num_ranks=core.num_ranks,
            rank=core.rank,
            backend_state=backend_state,
            buffer_id=buffer_id,
        )
