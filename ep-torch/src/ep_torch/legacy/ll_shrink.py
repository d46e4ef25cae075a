"""V1 low-latency mode with rank masking (``Buffer(enable_shrink=True)``): ``ShrinkLowLatency`` on the CPU backend
(gloo groups), ``NativeShrink`` on CUDA with the native kernels (``ll_native=True``; see its docstring).

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

Unmasked, the same steps run over the buffer's own host channel (``ShrinkLowLatency.over_channel``): the CPU
backend's low-latency road where V2's inner buffer refuses the sizes (more than its 256 experts per rank or 32 top-k
lanes; ``LowLatencyMode._cpu_road``). Every rank takes part in every step (an allgather with the envelope check, so
a refusal or a disagreement is raised on every rank), nothing is masked.

The group's store is torch.distributed's default store, hosted by one rank (rank 0 under ``ep_torch.launch``): that
rank cannot be the lost one here.

On CUDA (``NativeShrink``) the native kernels take the mask themselves (``include/ep_core/ll_native.cuh``): the same
semantics per (token, expert), the same numerics; a kernel's wait that expires masks the peer on the device and the
host reports it (``RankMaskedWarning``) at its next low-latency call or query. Compiled and tested on the host; not
yet run on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ep_core.errors import EPStateError
from ep_core.rank_mask import MaskedExchange, RankMask

from .fp8 import per_token_cast_to_fp8
from .low_latency import LowLatencyHandle, weighted_lane_sum

__all__ = ["NativeShrink", "ShrinkLowLatency", "shrink_unsupported"]

# per group: enable_shrink buffers built so far (every rank builds a group's buffers in the same order)
_BUILT: dict[str, int] = {}


def shrink_unsupported(where: str, what: str) -> NotImplementedError:
    """The refusal of ``enable_shrink`` where it is not implemented (CUDA; no silent fallback)."""
    return NotImplementedError(
        f"{where}: enable_shrink=True (rank masking) with {what}: not implemented; it runs on the CPU backend of a "
        "process group (gloo, CPU tensors) and on CUDA with the native low-latency kernels (ll_native=True, over "
        "ipc or a loopback group) only"
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

    @classmethod
    def over_channel(cls, rank: int, num_ranks: int, channel: Any) -> ShrinkLowLatency:
        """The unmasked steps over ``channel`` (the buffer's ``ep_core.envelope.Channel``): no mask, no timeout of
        its own (the channel's bootstrap bounds the wait and fails the step)."""
        obj = cls.__new__(cls)
        obj.mask = RankMask(rank, num_ranks)
        obj.exchange = _ChannelExchange(channel, rank)
        return obj

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
        # use_logfmt in the envelope: ranks that disagree on the rows' format all raise EPMismatchError
        config = {
            "hidden": hidden,
            "num_topk": handle.num_topk,
            "num_experts": num_experts,
            "use_logfmt": bool(use_logfmt),
        }
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


class _ChannelExchange:
    """``MaskedExchange.exchange`` over a ``Channel``: every rank's messages gathered in one enveloped step (each
    rank receives every rank's messages and keeps those addressed to it: the CPU backend's test road, not a fast
    one)."""

    def __init__(self, channel: Any, rank: int) -> None:
        self.channel, self.rank = channel, rank

    def exchange(self, op: str, config: dict[str, Any], payloads: dict[int, Any]) -> dict[int, Any]:
        every = self.channel.exchange(op, config, payloads)
        return {p: msgs[self.rank] for p, msgs in enumerate(every) if p != self.rank}

    def announce(self, op: str, error: BaseException) -> None:
        self.channel.announce(op, error)


class NativeShrink:
    """The rank mask of one V1 ``Buffer`` on CUDA with the native kernels (``ll_kernels.native_*``).

    ``mask``: the host ``RankMask``; ``device()``: its device twin, int32 [N + 1] (``ll_native.cuh``: mask[r] != 0 =
    masked, mask[N] the generation), which every native low-latency kernel reads and which a kernel's expired wait
    sets (no host sync). ``merge`` takes those into the host mask with a ``RankMaskedWarning`` (host-mapped records
    of the region, stamped with the generation, so a record from before a clean is not taken after it).
    ``gen``: the cleans so far. Unmasking is ``clean`` (a collective kernel that also restarts the epochs, so that
    a rank that sat out while masked can rejoin); unmasking one rank is refused once a low-latency call ran while it
    was masked (its epochs lag)."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.mask = RankMask(rank, num_ranks)
        self.gen = 0
        self.calls = 0  # native low-latency calls issued (unmasking one rank: none since it was masked)
        self._since = [0] * num_ranks  # `calls` when each rank was masked (-1: masked by a kernel's timeout)
        self._dev: torch.Tensor | None = None

    def device(self) -> torch.Tensor:
        dev = torch.device("cuda", torch.cuda.current_device())
        if self._dev is None or self._dev.device != dev:
            flags = np.concatenate([self.mask.flags, np.array([self.gen], np.int32)])
            self._dev = torch.from_numpy(flags).to(dev)
        return self._dev

    def merge(self, reg: Any, op: str) -> None:
        """Mask on the host the ranks a kernel masked after a timeout in this generation (warning naming each)."""
        if reg is None:
            return
        n = self.mask.num_ranks
        rec = reg.herr[4 : 4 + n].numpy()
        for r in np.flatnonzero(rec == self.gen + 1):
            if not self.mask.is_masked(int(r)):
                self._since[int(r)] = -1
                # the kernel's wait was in an earlier call of this generation: reported at this one
                self.mask.mask_lost(
                    int(r), f"a low-latency kernel's wait (reported at {op})", reg.timeout_ms / 1000.0
                )

    def update(self, rank_to_mask: int, mask: bool) -> None:
        r = self.mask._check_rank("rank_to_mask", rank_to_mask)
        if not mask and self.mask.is_masked(r) and self._since[r] != self.calls:
            raise EPStateError(
                f"low_latency_update_mask_buffer(rank_to_mask={r}, mask=False): on CUDA a rank masked while "
                "low-latency calls ran cannot be unmasked alone (its kernels' epochs lag the others'); call "
                "low_latency_clean_mask_buffer() on every rank (a collective that unmasks every rank and restarts "
                "the epochs)"
            )
        self.mask.update(r, bool(mask))
        self._since[r] = self.calls
        self.device()[r : r + 1].fill_(int(bool(mask)))

    def query(self, reg: Any, mask_status: torch.Tensor, op: str) -> None:
        mask_status.copy_(self.device()[: self.mask.num_ranks])
        self.merge(reg, op)

    def clean(self, reg: Any, comm: Any) -> None:
        """Unmask every rank and restart the epochs (a collective: every rank, the ones that sat out included,
        between the same two operations, after their results were waited for)."""
        from . import ll_kernels

        self.mask.clean()
        self.gen += 1
        self._since = [self.calls] * self.mask.num_ranks
        dev = self.device()
        if reg is None:  # no native call yet: nothing to resynchronise
            dev[: self.mask.num_ranks].zero_()
            dev[self.mask.num_ranks :].fill_(self.gen)
            return
        if comm is not None:
            torch.cuda.current_stream().wait_stream(comm)
        ll_kernels.native_clean(reg, dev, self.gen)
