"""CPU: DeepEP names that code written for DeepEP reaches for: `EventOverlap.hook_after_wait` and the
`hook_after_wait=` keyword, `ElasticBuffer.get_physical_domain_size()` / `get_logical_domain_size()` and
`nccl_comm_handle`, and `EPHandle.deterministic_sort` on a torch dispatch's outputs."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from ep_torch import ElasticBuffer, EPBuffer
from ep_torch.event import EventHandle, EventOverlap


def test_hook_after_wait_attribute_and_keyword():
    ev = EventOverlap(EventHandle(device="cpu"))
    assert ev.hook_after_wait is None
    ran = []
    ev.register_hook_after_wait(hook_after_wait=lambda: ran.append(1))
    assert callable(ev.hook_after_wait)
    with pytest.raises(RuntimeError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    assert ran == [1] and ev.hook_after_wait is None
    ev.hook_after_wait = lambda: ran.append(2)  # DeepEP code may set the attribute directly
    with ev:
        pass
    assert ran == [1, 2]


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from ep_torch.launch import free_port, init_rank

    init_rank(0, 1, free_port(), "gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cls", [ElasticBuffer, EPBuffer])
def test_domain_sizes_and_nccl_comm_handle(one_rank_group, cls):
    buf = cls(
        one_rank_group,
        num_max_tokens_per_rank=8,
        hidden=64,
        num_topk=2,
        transport="reference",
        explicitly_destroy=True,
    )
    assert buf.get_physical_domain_size() == (buf.num_rdma_ranks, buf.num_nvlink_ranks) == (1, 1)
    assert buf.get_logical_domain_size() == (buf.num_scaleout_ranks, buf.num_scaleup_ranks) == (1, 1)
    assert buf.nccl_comm_handle is None  # no NCCL communicator on the reference transport
    # with the nccl transport it is the transport's communicator (faked: the real one needs a GPU)
    comm = object()
    real_rt, real_tr = buf.runtime, buf.transport
    buf.runtime = types.SimpleNamespace(destroyed=False, transport=types.SimpleNamespace(communicator=comm))
    buf.transport = "nccl"
    assert buf.nccl_comm_handle is comm
    buf.runtime, buf.transport = real_rt, real_tr
    buf.destroy()
    assert buf.nccl_comm_handle is None


def test_deterministic_sort_on_a_torch_dispatch(one_rank_group):
    buf = ElasticBuffer(
        one_rank_group, num_max_tokens_per_rank=8, hidden=64, num_topk=2, transport="reference"
    )
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    idx = torch.rand(6, 8, generator=g).topk(2, dim=1).indices
    w = torch.rand(6, 2, generator=g)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=8)
    want = recv_x.clone()
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    recv_x, recv_idx, recv_w = recv_x[perm].clone(), recv_idx[perm].clone(), recv_w[perm].clone()
    handle.recv_src_metadata = handle.recv_src_metadata[perm].clone()
    handle.deterministic_sort(True, False, recv_x, None, recv_idx, recv_w)
    assert torch.equal(recv_x, want)
    assert torch.equal(handle.recv_src_metadata[:, 0], torch.arange(6, dtype=handle.recv_src_metadata.dtype))
