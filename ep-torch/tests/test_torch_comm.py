"""DeepEP 2.5's module-level surface on ep (issue 42): ``ep_torch.comm`` (domain sizes of a group and of a buffer,
barrier, comm stream, ``destroy_all_managed_nccl_comm``), the alignment queries, ``BufferAllocator``'s meta tensors
materialised in place, ``BufferBase``/``BucketSession`` exports. Domain sizes on 2 and 4 gloo ranks (CPU
backend), with and without emulated nodes (``EPKIT_SCALEUP_RANKS``)."""

from __future__ import annotations

import os
import sys

import ep_torch
import pytest
import torch
import torch.distributed as dist
from ep_torch import comm


def test_exports_match_deepep_2_5():
    for name in (
        "EPBuffer", "EPHandle", "EngramBuffer", "PPBuffer", "BucketBuffer", "BucketSession", "BufferAllocator",
        "BufferBase", "EventOverlap", "EventHandle", "topk_idx_t", "get_num_allocation_alignment",
        "get_num_rdma_alignment", "get_num_tma_alignment", "comm",
    ):  # fmt: skip
        assert name in ep_torch.__all__ and hasattr(ep_torch, name), name
    for name in (
        "get_physical_domain_size",
        "get_logical_domain_size",
        "destroy_all_managed_nccl_comm",
        "barrier",
        "get_nccl_comm_handle",
        "NCCLCommHandle",
    ):
        assert callable(getattr(comm, name))
    from ep_torch.bucket_buffer import BucketSession

    assert ep_torch.BucketSession is BucketSession


def test_alignments_are_deepeps():
    assert ep_torch.get_num_allocation_alignment() == 2 * 1024 * 1024
    assert ep_torch.get_num_rdma_alignment() == 64
    assert ep_torch.get_num_tma_alignment() == 32


def test_buffer_base_is_every_buffer():
    for cls in (ep_torch.ElasticBuffer, ep_torch.EPBuffer, ep_torch.PPBuffer, ep_torch.EngramBuffer):
        assert issubclass(cls, ep_torch.BufferBase), cls
    assert issubclass(ep_torch.BucketBuffer, ep_torch.BufferBase)
    assert issubclass(ep_torch.Buffer, ep_torch.BufferBase)
    assert not issubclass(ep_torch.EPHandle, ep_torch.BufferBase)


def test_allocator_plans_meta_tensors_and_materializes_in_place():
    mib2 = 2 * 1024 * 1024
    plan = ep_torch.BufferAllocator()
    assert plan.num_bytes == 0 and plan.alignment == mib2
    a = plan.allocate((3, 5), torch.float32)
    b = plan.allocate([mib2 // 4 + 1], torch.bfloat16)  # 1 MiB + 2 bytes: the next starts 4 MiB in
    c = plan.allocate(torch.Size([0]), torch.int32)
    d = plan.allocate(7, torch.uint8)
    assert all(t.device.type == "meta" for t in (a, b, c, d))
    assert [off for _, off in plan.allocations] == [0, mib2, 2 * mib2, 2 * mib2]
    assert plan.num_bytes == 3 * mib2
    storage = torch.arange(plan.num_bytes, dtype=torch.int64).to(torch.uint8)
    ref_a = a  # a reference taken before materialisation sees the storage after it
    plan.materialize(storage)
    assert ref_a.device.type == "cpu" and ref_a.shape == (3, 5) and ref_a.dtype == torch.float32
    assert b.shape == (mib2 // 4 + 1,) and d.shape == (7,) and c.numel() == 0
    a.fill_(1.5)
    assert torch.equal(storage[:60].view(torch.float32), torch.full((15,), 1.5))
    assert torch.equal(d, (torch.arange(7) + 2 * mib2).to(torch.uint8))
    assert d.data_ptr() == storage.data_ptr() + 2 * mib2
    with pytest.raises(RuntimeError, match="materialized"):
        plan.allocate(4, torch.float32)
    with pytest.raises(RuntimeError, match="once"):
        plan.materialize(storage)


def test_allocator_refuses_bad_storage_and_dtype():
    plan = ep_torch.BufferAllocator()
    plan.allocate(4, torch.float32)
    with pytest.raises(ValueError, match="bytes"):
        plan.materialize(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        plan.materialize(torch.zeros(plan.num_bytes // 4, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        plan.allocate(4, "float32")


def test_destroy_all_managed_nccl_comm_and_stream_on_cpu():
    comm.destroy_all_managed_nccl_comm()  # nothing cached: a no-op
    if not torch.cuda.is_available():
        assert comm.get_comm_stream(None) is None


def _ranks(rank: int, n: int) -> None:
    su = int(os.environ.get("EPKIT_SCALEUP_RANKS") or n)
    group = dist.group.WORLD
    assert comm.get_physical_domain_size(group) == (n // su, su)
    assert comm.get_logical_domain_size(group) == ((n // su, su) if su < n else (1, n))
    assert comm.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, n)
    assert comm.get_physical_domain_size(None) == (n // su, su)
    buf = ep_torch.EPBuffer(group, num_max_tokens_per_rank=8, hidden=64, explicitly_destroy=True)
    assert comm.get_physical_domain_size(buf) == buf.get_physical_domain_size() == (n // su, su)
    assert comm.get_logical_domain_size(buf) == buf.get_logical_domain_size()
    comm.barrier(buf)
    comm.barrier(buf, wait_comm_stream=False, with_cpu_sync=True)
    with pytest.raises(ValueError, match="context"):
        comm.barrier(buf, context_idx=1)
    # no NCCL communicator on a gloo group (every rank refuses alike: no collective started)
    with pytest.raises(ValueError, match="nccl backend"):
        comm.get_nccl_comm_handle(group)
    handle = comm.NCCLCommHandle(1234, False)
    assert handle.get() == 1234 and not handle.managed
    assert comm.get_comm_stream(buf) is None  # the CPU backend
    v1 = ep_torch.Buffer(group, int(1e8), 0, explicitly_destroy=True)
    assert comm.get_physical_domain_size(v1) == (n // su, su)
    buf.destroy()
    v1.destroy()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_domain_sizes_of_groups_and_buffers(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def _nccl_one(rank: int, n: int) -> None:
    """One rank over nccl: the group's communicator borrowed (or a managed one), cached; force_new_comm a managed
    one; destroy_all_managed_nccl_comm empties the cache."""
    torch.cuda.set_device(0)
    group = dist.group.WORLD
    torch.ones(1, device="cuda").sum()
    dist.all_reduce(torch.ones(1, device="cuda"))  # torch makes the group's communicator now
    h = comm.get_nccl_comm_handle(group)
    assert h.get() != 0 and comm.get_nccl_comm_handle(group) is h
    fresh = comm.get_nccl_comm_handle(group, force_new_comm=True)
    assert fresh.managed and fresh.get() not in (0, h.get())
    comm.destroy_all_managed_nccl_comm()
    assert comm.get_nccl_comm_handle(group) is not h


@pytest.mark.gpu
def test_gpu_nccl_comm_handle_one_rank():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ep_torch_testing import run_script

    code, out = run_script(__file__, ["_nccl_one", "1"], 180, what="nccl: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    if sys.argv[1] == "_nccl_one":
        from ep_torch.launch import spawn

        spawn(_nccl_one, 1, backend="nccl")
    else:
        from ep_torch_testing import spawn_cpu

        spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
