"""``EPBuffer``'s redundant-expert load balancing (DeepEP 2.5's ``lb_*``, issue 42) on 2 and 4 gloo ranks (CPU
backend), and 4 ranks as 2 emulated nodes (two LSA domains), against ``ep_core.load_balance``'s numpy reference:
the LB region from a ``BufferAllocator`` plan or a byte count, ``lb_prefetch_weights`` over two tensor pairs (bf16
and fp32), ``lb_reduce_grads`` (bitwise, ascending (rank, slot) order), the checks, ``lb_get_theoretical_num_sms``."""

from __future__ import annotations

import os
import sys

import ep_torch
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_core.load_balance import prefetch_reference, reduce_grads_reference

L, R, H = 3, 4, 16  # local experts, redundant slots, hidden of the gradients


def _mapping(nvl: int, node: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + node)
    m = torch.randint(-1, nvl * L, (nvl, R), generator=g, dtype=torch.int32)
    m[0, 0] = m[nvl - 1, 1] = 0  # one expert in two slots
    m[0, 1] = 0  # and twice in one row
    return m


def _experts(rank: int):
    g = torch.Generator().manual_seed(50 + rank)
    w1 = torch.randn(L, 2, 16, generator=g).to(torch.bfloat16)  # 64 bytes per expert
    w2 = torch.randn(L, 8, generator=g)  # 32 bytes per expert
    grads = torch.randn(L, H, generator=g)
    red_grads = torch.randn(R, H, generator=g)
    return w1, w2, grads, red_grads


def _ranks(rank: int, n: int) -> None:
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    group = dist.group.WORLD
    plan = ep_torch.BufferAllocator()
    r1 = plan.allocate((R, 2, 16), torch.bfloat16)
    r2 = plan.allocate((R, 8), torch.float32)
    rg = plan.allocate((R, H), torch.float32)
    assert r1.device.type == "meta"
    buf = ep_torch.EPBuffer(
        group,
        num_max_tokens_per_rank=8,
        hidden=64,
        lb_allocation_plan_or_num_bytes=plan,
        explicitly_destroy=True,
    )
    assert buf.num_lb_bytes == plan.num_bytes == 3 * ep_torch.get_num_allocation_alignment()
    assert r1.device.type == "cpu" and r1.data_ptr() == buf.lb_storage.data_ptr()
    # the CPU backend moves the bytes through all_to_all_single, and says so
    assert buf.lb_path == "all_to_all" and "CPU backend" in buf.lb_path_reason, buf.lb_path_reason
    assert (
        buf.lb_get_theoretical_num_sms() == 10
    )  # 450 GB/s: ceil(max(450/180, 450/45)) -> even (2.5's rates)
    nvl = buf.num_nvlink_ranks
    node, me = rank // nvl, rank % nvl
    mapping = _mapping(nvl, node)
    w1, w2, grads, red_grads = _experts(rank)
    r1.fill_(3.0)
    r2.fill_(-1.0)
    ev = buf.lb_prefetch_weights([r1, r2], [w1, w2], mapping, previous_event=buf.capture())
    ev.current_stream_wait() if ev.event is not None else None
    domain = [node * nvl + s for s in range(nvl)]
    m = mapping.numpy()
    for got, pick in ((r1, 0), (r2, 1)):
        experts = [_experts(r)[pick].view(torch.uint8).reshape(L, -1).numpy() for r in domain]
        start = np.full((R, experts[0].shape[1] // 1), 0, dtype=np.uint8)
        start[:] = (
            (torch.full((R, 2, 16), 3.0).to(torch.bfloat16) if pick == 0 else torch.full((R, 8), -1.0))
            .view(torch.uint8)
            .reshape(R, -1)
            .numpy()
        )
        want = prefetch_reference([start] * nvl, experts, m)[me]
        assert np.array_equal(got.view(torch.uint8).reshape(R, -1).numpy(), want), pick
    # a single tensor (not a sequence) works as well; a mapping changed in place is read anew (cached routes)
    mapping.copy_(mapping.roll(1, dims=1))
    r2.fill_(-1.0)
    buf.lb_prefetch_weights(r2, w2, mapping)
    experts = [_experts(r)[1].numpy() for r in domain]
    want2 = prefetch_reference([np.full((R, 8), -1.0, dtype=np.float32)] * nvl, experts, mapping.numpy())[me]
    assert np.array_equal(r2.numpy(), want2)
    m = mapping.numpy()
    # reduce: accumulate into the owners' gradients
    rg.copy_(red_grads)
    before = grads.clone()
    buf.lb_reduce_grads(rg, grads, mapping, num_sms=3)
    want = reduce_grads_reference(
        [_experts(r)[3].numpy() for r in domain], [_experts(r)[2].numpy() for r in domain], m
    )
    assert np.array_equal(grads.numpy(), want[me])
    assert not torch.equal(grads, before) or not any(((m >= 0) & (m // L == me)).flatten())

    # checks (every rank raises alike before any exchange)
    outside = torch.zeros(R, 8)
    with pytest.raises(ValueError, match="LB region"):
        buf.lb_prefetch_weights(outside, w2, mapping)
    with pytest.raises(ValueError, match="bytes per expert"):
        buf.lb_prefetch_weights(r2, w1, mapping)
    with pytest.raises(ValueError, match="int32"):
        buf.lb_prefetch_weights(r2, w2, mapping.long())
    with pytest.raises(ValueError, match="num_nvlink_ranks"):
        buf.lb_reduce_grads(rg, grads, mapping[:, :2].repeat(2, 1))
    with pytest.raises(ValueError, match="pair them"):
        buf.lb_prefetch_weights([r1, r2], [w1], mapping)
    with pytest.raises(ValueError, match="float32"):
        buf.lb_reduce_grads(rg, grads.double(), mapping)
    buf.destroy()
    assert buf.lb_storage is None

    # a byte count instead of a plan: lb_storage is the region; no region: lb_* refuse
    mib2 = ep_torch.get_num_allocation_alignment()
    b2 = ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64, lb_allocation_plan_or_num_bytes=mib2)
    assert b2.num_lb_bytes == mib2 and b2.lb_storage.numel() == mib2
    slots = b2.lb_storage[: R * 32].view(torch.float32).view(R, 8)
    b2.lb_prefetch_weights(slots, w2, mapping)
    b3 = ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64)
    assert b3.num_lb_bytes == 0 and b3.lb_storage is None
    with pytest.raises(RuntimeError, match="no LB region"):
        b3.lb_prefetch_weights(slots, w2, mapping)
    with pytest.raises(ValueError, match="multiple of"):
        ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64, lb_allocation_plan_or_num_bytes=1000)
    with pytest.raises(RuntimeError, match="materialized"):
        ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64, lb_allocation_plan_or_num_bytes=plan)
    dist.barrier()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_load_balance(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def test_signature_matches_deepep_2_5():
    import inspect

    p = inspect.signature(ep_torch.EPBuffer.lb_prefetch_weights).parameters
    assert list(p)[1:] == [
        "redundant_expert_weights",
        "expert_weights",
        "redundancy_mapping",
        "num_sms",
        "previous_event",
    ]
    p = inspect.signature(ep_torch.EPBuffer.lb_reduce_grads).parameters
    assert list(p)[1:] == [
        "redundant_expert_grads",
        "expert_grads",
        "redundancy_mapping",
        "num_sms",
        "previous_event",
    ]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
