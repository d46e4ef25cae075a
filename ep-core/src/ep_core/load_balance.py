"""Redundant-expert load balancing (DeepEP 2.5's ``EPBuffer.lb_*``): the routes and the numpy reference.

A redundancy mapping is ``[num_nvlink_ranks, num_redundant_experts]`` int32, the same on every rank of an NVLink
(LSA) domain: ``[r, c]`` is the expert in redundant slot ``c`` of LSA rank ``r``, or -1. Expert ``e`` (ids local to
the domain) belongs to LSA rank ``e // num_local_experts``. Prefetch: every filled slot receives a copy of its
expert's weights from the owner. Reduce: every owner adds the redundant gradients of every slot holding its expert,
in ascending (LSA rank, slot) order, one fp32 add each (DeepEP adds with unordered atomics: the same sum up to
order). ``LBRoutes`` is what one rank sends and receives (the bytes move in ``ep_torch.load_balance``);
``prefetch_reference`` / ``reduce_grads_reference`` are the oracles; ``ep_core.lb_copy``'s kernels move the bytes
over symmetric memory where the transport maps the peers.

``plan_redundancy_mapping`` (ep's answer to DeepEP 2.6's ``lb_get_redundancy_mapping``, unseen) gives the next free
slot to the expert with the largest load per instance, on the least loaded rank that may take it (exact rational
arithmetic, so every rank computes the same mapping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ep_core.errors import EPValueError

__all__ = [
    "LBRoutes",
    "check_redundancy_mapping",
    "lb_num_sms",
    "lb_routes",
    "plan_redundancy_mapping",
    "prefetch_reference",
    "reduce_grads_reference",
]


def check_redundancy_mapping(
    mapping: np.ndarray, num_nvlink_ranks: int, num_local_experts: int
) -> np.ndarray:
    """The mapping as an int64 numpy array after checking its shape and ids (``EPValueError`` otherwise)."""
    m = np.asarray(mapping)
    if m.ndim != 2 or m.shape[0] != num_nvlink_ranks:
        raise EPValueError(
            f"redundancy_mapping: expected [num_nvlink_ranks={num_nvlink_ranks}, num_redundant_experts], got "
            f"{list(m.shape)}"
        )
    if m.dtype != np.int32:
        raise EPValueError(f"redundancy_mapping: expected int32, got {m.dtype}")
    if num_local_experts < 1:
        raise EPValueError(f"num_local_experts: expected a positive count, got {num_local_experts}")
    hi = num_nvlink_ranks * num_local_experts
    bad = (m < -1) | (m >= hi)
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad)[0])
        raise EPValueError(
            f"redundancy_mapping[{r}, {c}] = {int(m[r, c])}: expected -1 or an expert id of the LSA domain in "
            f"[0, {hi})"
        )
    return m.astype(np.int64)


@dataclass(frozen=True)
class LBRoutes:
    """One LSA rank's part of a prefetch (reduce runs the same routes backwards).

    ``send[r]``: ``(local expert, slot)`` pairs whose weights this rank sends to LSA rank ``r``, slot order.
    ``recv[s]``: the slots of this rank's row that LSA rank ``s`` fills, slot order (``s`` may be this rank).
    """

    lsa_rank: int
    send: tuple[tuple[tuple[int, int], ...], ...]
    recv: tuple[tuple[int, ...], ...]

    @property
    def send_counts(self) -> list[int]:
        return [len(v) for v in self.send]

    @property
    def recv_counts(self) -> list[int]:
        return [len(v) for v in self.recv]


def lb_routes(mapping: np.ndarray, lsa_rank: int, num_local_experts: int) -> LBRoutes:
    """The routes of LSA rank ``lsa_rank`` for a checked mapping (``check_redundancy_mapping``)."""
    m = np.asarray(mapping)
    nvl = m.shape[0]
    send = []
    for r in range(nvl):
        pairs = [
            (int(e) % num_local_experts, c)
            for c, e in enumerate(m[r])
            if e >= 0 and e // num_local_experts == lsa_rank
        ]
        send.append(tuple(pairs))
    row = m[lsa_rank]
    recv = tuple(
        tuple(c for c, e in enumerate(row) if e >= 0 and e // num_local_experts == s) for s in range(nvl)
    )
    return LBRoutes(lsa_rank, tuple(send), recv)


def prefetch_reference(
    redundant: Sequence[np.ndarray], experts: Sequence[np.ndarray], mapping: np.ndarray
) -> list[np.ndarray]:
    """Every LSA rank's redundant weights after a prefetch: copies of ``redundant[r]`` with each filled slot
    replaced by its expert's row of ``experts[owner]`` (byte copies; empty slots keep their bytes)."""
    m = np.asarray(mapping).astype(np.int64)
    num_local = experts[0].shape[0]
    out = [np.array(x, copy=True) for x in redundant]
    for r in range(m.shape[0]):
        for c, e in enumerate(m[r]):
            if e >= 0:
                out[r][c] = experts[e // num_local][e % num_local]
    return out


def reduce_grads_reference(
    redundant_grads: Sequence[np.ndarray], expert_grads: Sequence[np.ndarray], mapping: np.ndarray
) -> list[np.ndarray]:
    """Every LSA rank's expert gradients after a reduce: ``expert_grads[o][l]`` plus, in ascending (rank, slot)
    order, one fp32 add of each slot's redundant gradients that holds expert ``o * L + l``."""
    m = np.asarray(mapping).astype(np.int64)
    num_local = expert_grads[0].shape[0]
    out = [np.array(g, dtype=np.float32, copy=True) for g in expert_grads]
    for r in range(m.shape[0]):
        for c, e in enumerate(m[r]):
            if e >= 0:
                o, lo = divmod(int(e), num_local)
                out[o][lo] = (out[o][lo] + redundant_grads[r][c].astype(np.float32)).astype(np.float32)
    return out


def lb_num_sms(nvlink_gbs: float, sm_read_gbs: float = 200.0, sm_write_gbs: float = 50.0) -> int:
    """SMs that keep up with the NVLink bandwidth when each reads expert weights from HBM and writes them to a peer:
    ``ceil(max(nvlink / sm_read, nvlink / sm_write))`` rounded up to even (DeepEP's LB estimate; the per-SM
    bandwidths are ep's planner defaults)."""
    if nvlink_gbs <= 0 or sm_read_gbs <= 0 or sm_write_gbs <= 0:
        raise EPValueError(
            f"lb_num_sms: bandwidths must be > 0, got {nvlink_gbs}, {sm_read_gbs}, {sm_write_gbs}"
        )
    raw = math.ceil(max(nvlink_gbs / sm_read_gbs, nvlink_gbs / sm_write_gbs))
    return max(2, -(-raw // 2) * 2)


def plan_redundancy_mapping(loads: np.ndarray, num_redundant_experts: int) -> np.ndarray:
    """A redundancy mapping ``[num_nvlink_ranks, num_redundant_experts]`` int32 for the loads ``[num_nvlink_ranks,
    num_local_experts]`` (row ``r``: the tokens each local expert of LSA rank ``r`` received; integers >= 0).

    An expert's load is shared equally by its instances (its owner's plus its redundant copies); a rank's load is the
    sum of its instances' shares. Until every slot is filled: take the expert with the largest share (ties: the
    smaller id) that some rank may still host (a rank with a free slot, not its owner, not hosting it yet) and put a
    copy in the first free slot of the least loaded such rank (ties: the smaller rank). Experts with no load are
    never copied; slots left over stay -1. Deterministic (exact fractions): every rank computes the same mapping."""
    w = np.asarray(loads)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise EPValueError(
            f"loads: expected [num_nvlink_ranks, num_local_experts] (both > 0), got {list(w.shape)}"
        )
    if not np.issubdtype(w.dtype, np.integer) or (w < 0).any():
        raise EPValueError("loads: expected integer token counts >= 0")
    if (
        isinstance(num_redundant_experts, bool)
        or not isinstance(num_redundant_experts, int)
        or num_redundant_experts < 0
    ):
        raise EPValueError(f"num_redundant_experts: expected an int >= 0, got {num_redundant_experts!r}")
    nvl, num_local = w.shape
    load = [int(v) for v in w.reshape(-1)]
    count = [1] * len(load)
    mapping = np.full((nvl, num_redundant_experts), -1, dtype=np.int32)
    hosted: list[set[int]] = [set() for _ in range(nvl)]
    used = [0] * nvl

    def rank_load(r: int) -> Fraction:
        own = range(r * num_local, (r + 1) * num_local)
        return sum((Fraction(load[e], count[e]) for e in (*own, *hosted[r])), Fraction(0))

    order = sorted(range(len(load)), key=lambda e: (-load[e], e))
    for _ in range(nvl * num_redundant_experts):
        best = None
        for e in sorted((e for e in order if load[e] > 0), key=lambda e: (-Fraction(load[e], count[e]), e)):
            ranks = [
                r
                for r in range(nvl)
                if used[r] < num_redundant_experts and r != e // num_local and e not in hosted[r]
            ]
            if ranks:
                best = (e, min(ranks, key=lambda r: (rank_load(r), r)))
                break
        if best is None:
            break
        e, r = best
        mapping[r, used[r]] = e
        used[r] += 1
        hosted[r].add(e)
        count[e] += 1
    return mapping
