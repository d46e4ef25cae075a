"""``EPBuffer.lb_get_redundancy_mapping`` (DeepEP 2.6's name; ep's signature and algorithm, issue 42) on 2 and 4
gloo ranks and 4 ranks as 2 emulated nodes (CPU backend), against an independent greedy reference: the mapping of
every LSA domain from its ranks' counts, the same on every rank of the domain, usable by ``lb_prefetch_weights``;
the envelope (a one-rank refusal announced to every rank, a disagreement raised on every rank, then ``reset()``)."""

from __future__ import annotations

import os
import sys
from fractions import Fraction

import ep_torch
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError

L, R = 3, 2  # local experts, redundant slots


def _reference(loads: list[list[int]], num_red: int) -> list[list[int]]:
    """Each step: the smallest (-share, expert, rank load, rank) over every (loaded expert, rank that may host it)."""
    nvl = len(loads)
    flat = [v for row in loads for v in row]
    inst = {e: [e // L] for e in range(len(flat))}
    out = [[-1] * num_red for _ in range(nvl)]
    fill = [0] * nvl
    while True:
        load = [
            sum((Fraction(flat[e], len(inst[e])) for e in inst if r in inst[e]), Fraction(0))
            for r in range(nvl)
        ]
        pairs = [
            (-Fraction(flat[e], len(inst[e])), e, load[r], r)
            for e in inst
            if flat[e] > 0
            for r in range(nvl)
            if fill[r] < num_red and r not in inst[e]
        ]
        if not pairs:
            return out
        _, e, _, r = min(pairs)
        out[r][fill[r]] = e
        fill[r] += 1
        inst[e].append(r)


def _counts(rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    c = torch.randint(0, 40, (L,), generator=g, dtype=torch.int32)
    c[rank % L] = 0  # experts with no tokens
    return c


def _ranks(rank: int, n: int) -> None:
    group = dist.group.WORLD
    mib2 = ep_torch.get_num_allocation_alignment()
    buf = ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64, lb_allocation_plan_or_num_bytes=mib2)
    nvl = buf.num_nvlink_ranks
    domain = [rank - rank % nvl + s for s in range(nvl)]
    for seed in range(3):
        counts = _counts(rank, seed)
        if seed == 1:
            counts = counts.long()  # int64 counts work alike
        m = buf.lb_get_redundancy_mapping(counts, R)
        assert m.dtype == torch.int32 and tuple(m.shape) == (nvl, R) and m.device == counts.device
        want = _reference([_counts(r, seed).tolist() for r in domain], R)
        assert m.tolist() == want, (m.tolist(), want)
        every = [torch.empty_like(m) for _ in range(n)]
        dist.all_gather(every, m)
        assert all(torch.equal(every[r], m) for r in domain)
    # zero slots, no load anywhere
    assert tuple(buf.lb_get_redundancy_mapping(counts, 0).shape) == (nvl, 0)
    assert (buf.lb_get_redundancy_mapping(torch.zeros(L, dtype=torch.int32), R) == -1).all()
    # the mapping drives lb_prefetch_weights: each filled slot receives its expert's weights
    slots = buf.lb_storage[: R * 32].view(torch.float32).view(R, 8)
    slots.fill_(-1.0)
    weights = torch.arange(L * 8, dtype=torch.float32).view(L, 8) + 1000 * rank
    m = buf.lb_get_redundancy_mapping(_counts(rank, 0), R)
    buf.lb_prefetch_weights(slots, weights, m)
    for c, e in enumerate(m[rank % nvl].tolist()):
        owner = domain[e // L] if e >= 0 else None
        want = (
            torch.full((8,), -1.0)
            if e < 0
            else torch.arange(8, dtype=torch.float32) + (e % L) * 8 + 1000 * owner
        )
        assert torch.equal(slots[c], want)

    # a refusal on one rank: announced, every rank raises, the buffer stays usable
    if rank == n - 1:
        with pytest.raises(ValueError, match="num_recv_tokens_per_expert"):
            buf.lb_get_redundancy_mapping(counts.float(), R)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.lb_get_redundancy_mapping(counts, R)
    if rank == 0:
        with pytest.raises(ValueError, match="num_redundant_experts"):
            buf.lb_get_redundancy_mapping(counts, -1)
    else:
        with pytest.raises(EPPeerError, match="rank 0"):
            buf.lb_get_redundancy_mapping(counts, R)
    assert buf.lb_get_redundancy_mapping(_counts(rank, 0), R).tolist() == m.tolist()
    # a disagreement: every rank raises the same error; refused until reset()
    with pytest.raises(EPMismatchError, match="num_redundant_experts"):
        buf.lb_get_redundancy_mapping(counts, R + (rank == 0))
    with pytest.raises(EPStateError, match="reset"):
        buf.lb_get_redundancy_mapping(counts, R)
    buf.reset()
    assert buf.lb_get_redundancy_mapping(_counts(rank, 0), R).tolist() == m.tolist()
    # a dispatch after all that still pairs (the steps stayed in line)
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[0, 1], [2, -1], [1, 3], [-1, -1]], dtype=torch.int64)
    recv = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(4, 2), num_experts=2 * n)
    buf.combine(recv[0], recv[3])
    dist.barrier()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_redundancy_mapping(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def test_signature():
    import inspect

    p = inspect.signature(ep_torch.EPBuffer.lb_get_redundancy_mapping).parameters
    assert list(p)[1:] == ["num_recv_tokens_per_expert", "num_redundant_experts"]


def test_reference_is_np_free_and_matches_core():
    from ep_core.load_balance import plan_redundancy_mapping

    rng = np.random.default_rng(3)
    for _ in range(5):
        loads = rng.integers(0, 9, size=(3, L))
        assert plan_redundancy_mapping(loads, R).tolist() == _reference(loads.tolist(), R)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
