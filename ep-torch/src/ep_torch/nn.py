"""``MoEDispatcher``: the intended use of dispatch/combine inside a model, with any expert computation::

    dispatcher = MoEDispatcher(buffer, num_experts=E)
    y = dispatcher(x, topk_idx, topk_weights, experts)   # experts: this rank's E / N expert modules

``forward`` dispatches the tokens (differentiably), runs each local expert on its rows, weights each output by its
top-k weight, sums per received row and combines back. Gradients reach ``x``, ``topk_weights`` and the experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import functional
from .buffer import ElasticBuffer

__all__ = ["MoEDispatcher", "apply_grouped_experts", "apply_local_experts"]

Expert = Callable[[torch.Tensor], torch.Tensor]


def apply_local_experts(
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    experts: Sequence[Expert],
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per received row (non-expand layout): ``sum_k w[k] * experts[idx[k]](x)`` over its local lanes.

    ``recv_topk_idx`` holds local expert ids (-1 for lanes elsewhere); the result is bf16, ready for combine.
    """
    xf = recv_x.to(compute_dtype)
    # A rank that received nothing still returns a result connected to recv_x: combine's backward is a collective,
    # so every rank must take part in it.
    out = xf * 0 if recv_x.shape[0] == 0 else xf.new_zeros(recv_x.shape[0], recv_x.shape[1])
    for e, expert in enumerate(experts):
        rows, lanes = (recv_topk_idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = expert(xf.index_select(0, rows))
        w = recv_topk_weights[rows, lanes].to(compute_dtype).unsqueeze(1)
        out = out.index_add(0, rows, h * w)
    return out.to(torch.bfloat16)


def apply_grouped_experts(
    recv_x: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    num_tokens_per_expert: Sequence[int],
    num_rows_per_expert: Sequence[int],
    experts: Sequence[Expert],
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Expand layout (one row per (token, local expert), grouped by expert, blocks aligned): expert ``e`` runs on
    its contiguous rows ``[start_e, start_e + num_tokens_per_expert[e])``, where blocks are
    ``num_rows_per_expert`` (aligned) long; each row is weighted by its own weight. Padding rows give zeros.
    This is the shape a grouped GEMM consumes."""
    xf = recv_x.to(compute_dtype)
    pieces = []
    start = 0
    for expert, count, rows in zip(experts, num_tokens_per_expert, num_rows_per_expert):
        block = xf[start : start + count]
        h = expert(block) * recv_topk_weights[start : start + count].to(compute_dtype).unsqueeze(1)
        pieces.append(h)
        if rows > count:
            pieces.append(xf.new_zeros(rows - count, xf.shape[1]))
        start += rows
    if start < xf.shape[0]:  # slack rows past the last block
        pieces.append(xf.new_zeros(xf.shape[0] - start, xf.shape[1]))
    out = torch.cat(pieces) if pieces else xf * 0
    return out.to(torch.bfloat16)


class MoEDispatcher(nn.Module):
    """Dispatch -> local experts -> combine over an :class:`~ep_torch.ElasticBuffer` (or ``EPBuffer``)."""

    def __init__(
        self,
        buffer: ElasticBuffer,
        num_experts: int,
        *,
        layout: str = "rank",
        expert_alignment: int = 1,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``layout="rank"``: one row per received token, experts gather their rows; ``"expert"``: the expand
        layout, contiguous per-expert blocks aligned to ``expert_alignment`` (grouped-GEMM friendly)."""
        super().__init__()
        if layout not in ("rank", "expert"):
            raise ValueError(f"layout: expected 'rank' or 'expert', got {layout!r}")
        if num_experts % buffer.num_ranks:
            raise ValueError(
                f"num_experts: must be a multiple of the number of ranks ({buffer.num_ranks}), got {num_experts}"
            )
        self.buffer = buffer
        self.num_experts = num_experts
        self.num_local_experts = num_experts // buffer.num_ranks
        self.layout = layout
        self.expert_alignment = expert_alignment
        self.compute_dtype = compute_dtype
        self.last_handle: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Sequence[Expert]
    ) -> torch.Tensor:
        """``x`` [T, hidden] bf16, ``topk_idx`` [T, K] global ids, ``topk_weights`` [T, K] float32 -> [T, hidden] bf16."""
        if len(experts) != self.num_local_experts:
            raise ValueError(
                f"experts: expected this rank's {self.num_local_experts} experts, got {len(experts)}"
            )
        expand = self.layout == "expert"
        recv_x, recv_idx, recv_w, handle = functional.dispatch(
            self.buffer,
            x,
            topk_idx,
            topk_weights,
            num_experts=self.num_experts,
            expert_alignment=self.expert_alignment,
            do_expand=expand,
        )
        if expand:
            h = functional.get_handle(handle)
            counts = h.num_unaligned_recv_tokens_per_expert.tolist()
            y = apply_grouped_experts(
                recv_x,
                recv_w,
                counts,
                h.num_recv_tokens_per_expert_list,
                experts,
                compute_dtype=self.compute_dtype,
            )
        else:
            assert recv_idx is not None
            y = apply_local_experts(recv_x, recv_idx, recv_w, experts, compute_dtype=self.compute_dtype)
        self.last_handle = handle
        out = functional.combine(self.buffer, y, handle)
        assert isinstance(out, torch.Tensor)
        return out
