"""``EPBuffer.resize`` (DeepEP 2.6's name, ep's semantics, issue 42) on 2 and 4 gloo ranks and 4 ranks as 2 emulated
nodes (CPU backend): after a resize the buffer has the new sizes and its dispatch/combine are bitwise those of a
buffer built with them; the LB region and its contents stay; handles from before are refused as stale; a refusal on
one rank is announced to every rank and leaves the buffer as it was; a disagreement raises on every rank until
``reset()``."""

from __future__ import annotations

import os
import sys

import ep_torch
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError

E, K = 8, 2


def _inputs(rank: int, tokens: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int64)
    idx[::3, 1] = -1
    w = torch.rand(tokens, K, generator=g)
    return x, idx, w


def _round_trip(buf, rank: int, tokens: int, hidden: int, seed: int):
    x, idx, w = _inputs(rank, tokens, hidden, seed)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    return [recv_x, recv_idx, recv_w, out, out_w], handle


def _ranks(rank: int, n: int) -> None:
    group = dist.group.WORLD
    mib2 = ep_torch.get_num_allocation_alignment()
    buf = ep_torch.EPBuffer(
        group,
        num_max_tokens_per_rank=8,
        hidden=64,
        num_topk=K,
        lb_allocation_plan_or_num_bytes=mib2,
        explicitly_destroy=True,
    )
    lb = buf.lb_storage
    lb[:16] = torch.arange(16, dtype=torch.uint8) + rank
    _, old_handle = _round_trip(buf, rank, 8, 64, 0)

    # larger: the MoE settings' size hint
    buf.resize(num_max_tokens_per_rank=32, hidden=128, num_topk=K)
    assert buf.num_max_tokens_per_rank == 32
    assert buf.num_bytes == ep_torch.EPBuffer.get_buffer_size_hint(group, 32, 128, K)
    assert buf.lb_storage is lb and torch.equal(lb[:16], torch.arange(16, dtype=torch.uint8) + rank)
    got, _ = _round_trip(buf, rank, 32, 128, 1)
    with ep_torch.EPBuffer(
        group, num_max_tokens_per_rank=32, hidden=128, num_topk=K, explicitly_destroy=True
    ) as fresh:
        want, _ = _round_trip(fresh, rank, 32, 128, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # a handle from before the resize indexes the old storage: refused
    x_old = torch.zeros(old_handle.num_recv_tokens, 64).bfloat16()
    with pytest.raises(EPStateError, match="stale"):
        buf.combine(x_old, old_handle)
    # smaller, by bytes
    buf.resize(num_bytes=2 * mib2, num_max_tokens_per_rank=4)  # num_bytes wins; M stays the default M
    assert buf.num_bytes == 2 * mib2 and buf.num_max_tokens_per_rank == 4
    got, _ = _round_trip(buf, rank, 4, 64, 2)

    # a refusal on one rank: every rank raises, the buffer keeps its size and works
    if rank == n - 1:
        with pytest.raises(ValueError, match="num_bytes"):
            buf.resize(num_bytes=1000)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.resize(num_bytes=4 * mib2)
    if rank == 0:
        with pytest.raises(TypeError, match="hidden"):
            buf.resize(num_max_tokens_per_rank=8, hidden="64")
    else:
        with pytest.raises(EPPeerError, match="rank 0"):
            buf.resize(num_max_tokens_per_rank=8, hidden=64)
    assert buf.num_bytes == 2 * mib2
    again, _ = _round_trip(buf, rank, 4, 64, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    # ranks that disagree: every rank raises; refused until reset(); the old storage still serves
    with pytest.raises(EPMismatchError, match="num_max_tokens_per_rank"):
        buf.resize(num_max_tokens_per_rank=16 + (rank == 0), hidden=64)
    with pytest.raises(EPStateError, match="reset"):
        buf.resize(num_max_tokens_per_rank=16, hidden=64)
    buf.reset()
    assert buf.num_bytes == 2 * mib2
    again, _ = _round_trip(buf, rank, 4, 64, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    buf.destroy()
    with pytest.raises(EPStateError, match="destroy"):
        buf.resize(num_bytes=2 * mib2)
    dist.barrier()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_resize(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def test_signature():
    import inspect

    p = inspect.signature(ep_torch.EPBuffer.resize).parameters
    assert list(p)[1:] == ["num_bytes", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch"]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
