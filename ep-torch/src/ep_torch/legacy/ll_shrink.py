"""V1 low-latency mode with rank masking (``Buffer(enable_shrink=True)``) on the CPU backend (gloo groups).

The mask is ``ep_core.rank_mask.RankMask`` (one per buffer, local to the rank, DeepEP's mask buffer) and every step
goes through ``ep_core.rank_mask.MaskedExchange`` over the group's store instead of a gloo collective: a collective
needs every rank, while a masked rank is neither sent to nor waited for. Each step sends each unmasked peer only what
it needs (V1's messages): the dispatch, the rows of the tokens that chose one of the peer's experts; the combine,
the expert outputs of the peer's tokens. A peer whose message does not arrive within ``num_cpu_timeout_secs`` is
masked with a ``RankMaskedWarning`` and the step finishes without it.

Numerics are V1 low-latency mode's (``legacy.reference``, the same bits as the unmasked path) over the routing with
masked ranks' experts dropped: a dispatch packs, per local expert, the rows of the ranks it received from, in
(source rank, source token) order (a masked source's block counts 0 in ``recv_count`` and ``layout_range``); a
combine sums, in ascending lane order, the lanes whose expert's rank is unmasked when the combine's messages are in
(a lane of a masked rank contributes nothing, as if its expert id were -1).

The group's store is torch.distributed's default store, hosted by one rank (rank 0 under ``ep_torch.launch``): that
rank cannot be the lost one here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ep_core.rank_mask import MaskedExchange, RankMask

from .fp8 import per_token_cast_to_fp8
from .low_latency import LowLatencyHandle, weighted_lane_sum

__all__ = ["ShrinkLowLatency", "shrink_unsupported"]

# per group: enable_shrink buffers built so far (every rank builds a group's buffers in the same order)
_BUILT: dict[str, int] = {}


def shrink_unsupported(where: str, what: str) -> NotImplementedError:
    """The refusal of ``enable_shrink`` where it is not implemented (CUDA; no silent fallback)."""
    return NotImplementedError(
        f"{where}: enable_shrink=True (rank masking) with {what}: not implemented (the CUDA low-latency kernels take "
        "no rank mask yet); it runs on the CPU backend of a process group (gloo, CPU tensors) only"
    )


class ShrinkLowLatency:
    """The rank mask of one V1 ``Buffer`` and its masked low-latency steps (see the module docstring)."""

    def __init__(self, rank: int, num_ranks: int, bootstrap: Any, timeout_s: float) -> None:
        store = getattr(bootstrap, "_store", None)
        if store is None:
            raise shrink_unsupported("Buffer", "a group without torch.distributed's default store")
        name = bootstrap._group_name()
        _BUILT[name] = _BUILT.get(name, 0) + 1
        self.mask = RankMask(rank, num_ranks)
        self.exchange = MaskedExchange(
            store, self.mask, f"ep_torch/ll_mask/{name}/{_BUILT[name]}", timeout_s, bootstrap.rank_state
        )

    def announce(self, op: str, error: BaseException) -> None:
        self.exchange.announce(op, error)

    # ------------------------------------------------------------------------------------------------------------
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        m: int,
        num_experts: int,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle]:
        mask = self.mask
        me, n = mask.rank, mask.num_ranks
        epr = num_experts // n
        t, h = int(x.shape[0]), int(x.shape[1])
        k = int(topk_idx.shape[1])
        idx = mask.drop_lanes(topk_idx.numpy(), num_experts)  # nothing is sent to a masked rank
        rows = x.contiguous().view(torch.int16).numpy()
        owner = np.where(idx >= 0, idx // epr, -1)
        mine = None

        def message(dst: int) -> tuple:
            sel = np.flatnonzero((owner == dst).any(axis=1))
            return sel.astype(np.int32), rows[sel], idx[sel]

        payloads = {p: message(p) for p in mask.unmasked_peers()}
        if not mask.is_masked(me):
            mine = message(me)
        config = {
            "num_max_dispatch_tokens_per_rank": m,
            "hidden": h,
            "num_topk": k,
            "num_experts": num_experts,
            "use_fp8": use_fp8,
            "round_scale": round_scale,
            "use_ue8m0": use_ue8m0,
        }
        got = self.exchange.exchange("low_latency_dispatch", config, payloads)
        if mine is not None:
            got[me] = mine
        slots = n * m
        recv = np.zeros((epr, slots, h), np.int16)
        src_info = np.full((epr, slots), -1, np.int32)
        slot_src = np.full(
            (epr, slots), -1, np.int32
        )  # the source rank of each packed row (the combine's address)
        per_src = np.zeros((epr, n), np.int64)
        count = np.zeros(epr, np.int32)
        for e in range(epr):
            g = me * epr + e
            for s in sorted(got):  # a source that is masked, or lost in this step, has no block
                if mask.is_masked(s):
                    continue
                tok, xs, lanes = got[s]
                sel = np.flatnonzero((lanes == g).any(axis=1))
                c = int(sel.size)
                recv[e, count[e] : count[e] + c] = xs[sel]
                src_info[e, count[e] : count[e] + c] = tok[sel]
                slot_src[e, count[e] : count[e] + c] = s
                per_src[e, s] = c
                count[e] += c
        layout_range = torch.from_numpy(((np.cumsum(per_src, 1) - per_src) << 32) | per_src)
        handle = LowLatencyHandle(
            (torch.from_numpy(src_info), layout_range, m, h, num_experts),
            None,
            None,
            None,
            num_topk=k,
            num_tokens=t,
        )
        handle.shrink = slot_src
        recv_count = torch.from_numpy(count)
        packed = torch.from_numpy(recv).view(torch.bfloat16)
        if not use_fp8:
            return packed, recv_count, handle
        q, s = per_token_cast_to_fp8(packed, round_scale=round_scale, use_ue8m0=use_ue8m0, col_major=False)
        # V1's scales: the last two dimensions column-major (as legacy.low_latency allocates them)
        scales = torch.empty(epr, s.shape[2], slots, dtype=s.dtype).transpose(1, 2)
        scales.copy_(s)
        return (q, scales), recv_count, handle

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
    ) -> torch.Tensor:
        mask = self.mask
        me, n = mask.rank, mask.num_ranks
        src_info, _, _, hidden, num_experts = handle
        epr = num_experts // n
        slot_src = handle.shrink
        info = src_info.numpy()
        rows = x.contiguous().view(torch.int16).numpy()
        mine = None

        def message(dst: int) -> tuple:
            e, i = np.nonzero(slot_src == dst)
            return (me * epr + e).astype(np.int32), info[e, i], rows[e, i]

        payloads = {p: message(p) for p in mask.unmasked_peers()}
        if not mask.is_masked(me):
            mine = message(me)
        config = {"hidden": hidden, "num_topk": handle.num_topk, "num_experts": num_experts}
        got = self.exchange.exchange("low_latency_combine", config, payloads)
        if mine is not None:
            got[me] = mine
        idx = topk_idx.numpy().astype(np.int64)
        t, k = idx.shape
        y = np.zeros((t, k, hidden), np.int16)
        have = np.zeros((t, k), bool)
        for r, (experts, tokens, ys) in got.items():
            if mask.is_masked(r):
                continue
            for j in range(
                k
            ):  # each (expert, token) row lands on the lanes of that token that chose that expert
                lane = np.flatnonzero(idx[tokens, j] == experts)
                y[tokens[lane], j] = ys[lane]
                have[tokens[lane], j] = True
        # zero contribution: lanes of masked ranks' experts (and any lane whose row did not come)
        live = torch.from_numpy(np.where(have, mask.drop_lanes(idx, num_experts), -1))
        rows_in = torch.from_numpy(y).view(torch.bfloat16)
        if use_logfmt:  # the numbers of V1's encoded transfer (legacy.logfmt), as the unmasked CPU path
            from .logfmt import roundtrip_torch

            rows_in = roundtrip_torch(rows_in)
        return weighted_lane_sum(rows_in, live, topk_weights)
