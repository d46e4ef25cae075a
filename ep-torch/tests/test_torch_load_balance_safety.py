"""Collective safety of ``lb_prefetch_weights`` / ``lb_reduce_grads`` (issue 41) on 2 and 3 gloo ranks: a bad
argument on one rank is announced (its peers raise ``EPPeerError`` naming it, nobody waits in a raw all-to-all),
ranks holding different mappings all raise ``EPMismatchError`` and the buffer refuses until ``reset()``, and the
calls after each case are exact against ``ep_core.load_balance``'s reference."""

from __future__ import annotations

import os
import sys

import ep_torch
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError
from ep_core.load_balance import prefetch_reference, reduce_grads_reference

L, R, H = 2, 3, 8  # local experts, redundant slots, hidden


def _mapping(n: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, n * L, (n, R), generator=g, dtype=torch.int32)


def _weights(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90 + rank)
    return torch.randn(L, H, generator=g), torch.randn(R, H, generator=g)


def _valid_round(buf, slots, grads_slots, mapping, n: int, rank: int) -> None:
    w, red = _weights(rank)
    slots.zero_()
    buf.lb_prefetch_weights(slots, w, mapping)
    zeros = [np.zeros((R, H), np.float32)] * n
    want = prefetch_reference(zeros, [_weights(r)[0].numpy() for r in range(n)], mapping.numpy())
    assert np.array_equal(slots.numpy(), want[rank])
    grads_slots.copy_(red)
    grads = torch.zeros(L, H)
    buf.lb_reduce_grads(grads_slots, grads, mapping)
    want = reduce_grads_reference(
        [_weights(r)[1].numpy() for r in range(n)], [np.zeros((L, H), np.float32)] * n, mapping.numpy()
    )
    assert np.array_equal(grads.numpy(), want[rank])


def _ranks(rank: int, n: int) -> None:
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    group = dist.group.WORLD
    plan = ep_torch.BufferAllocator()
    slots = plan.allocate((R, H), torch.float32)
    grads_slots = plan.allocate((R, H), torch.float32)
    buf = ep_torch.EPBuffer(
        group,
        num_max_tokens_per_rank=8,
        hidden=64,
        lb_allocation_plan_or_num_bytes=plan,
        num_cpu_timeout_secs=20,
    )
    mapping = _mapping(n)
    w, _ = _weights(rank)

    # one rank's bad argument (a tensor outside the LB region): that rank raises it, every peer names it
    bad = torch.zeros(R, H) if rank == 0 else slots
    with pytest.raises(ValueError if rank == 0 else EPPeerError) as info:
        buf.lb_prefetch_weights(bad, w, mapping)
    if rank:
        assert "rank 0" in str(info.value) and "LB region" in str(info.value), info.value
    _valid_round(buf, slots, grads_slots, mapping, n, rank)

    # the same in lb_reduce_grads (a float64 gradient on the last rank)
    grads = torch.zeros(L, H, dtype=torch.float64 if rank == n - 1 else torch.float32)
    with pytest.raises(ValueError if rank == n - 1 else EPPeerError) as info:
        buf.lb_reduce_grads(grads_slots, grads, mapping)
    if rank != n - 1:
        assert f"rank {n - 1}" in str(info.value) and "float32" in str(info.value), info.value
    _valid_round(buf, slots, grads_slots, mapping, n, rank)

    # ranks of one domain with different mappings: every rank raises, the buffer refuses until reset()
    other = _mapping(n, seed=11) if rank == 1 else mapping
    with pytest.raises(EPMismatchError, match="different redundancy_mapping"):
        buf.lb_prefetch_weights(slots, w, other)
    with pytest.raises(EPStateError, match="reset"):
        buf.lb_prefetch_weights(slots, w, mapping)
    buf.reset()
    _valid_round(buf, slots, grads_slots, mapping, n, rank)
    dist.barrier()


@pytest.mark.parametrize("ranks", [2, 3])
def test_lb_collective_safety(ranks):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
