"""DeepEP 2.6's additions on CUDA tensors (issue 42), one rank over nccl: ``lb_get_redundancy_mapping`` works (host
math, the mapping on the counts' device); ``resize``, ``combine(out_dtype=torch.float32)`` and
``BucketBuffer.send_recv`` refuse with ``NotImplementedError`` naming themselves (no GPU path yet), and the buffer
keeps working after each refusal. Marked ``gpu``: not run without a device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn


def _gpu_rank(rank: int, n: int) -> None:
    import ep_torch

    torch.cuda.set_device(rank)
    mib2 = ep_torch.get_num_allocation_alignment()
    buf = ep_torch.EPBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=16,
        hidden=64,
        num_topk=2,
        lb_allocation_plan_or_num_bytes=mib2,
        explicitly_destroy=True,
    )
    m = buf.lb_get_redundancy_mapping(torch.tensor([5, 0, 3], dtype=torch.int32, device="cuda"), 2)
    assert m.is_cuda and m.dtype == torch.int32 and tuple(m.shape) == (buf.num_nvlink_ranks, 2)
    x = torch.randn(8, 64, device="cuda").bfloat16()
    idx = torch.tensor([[0, 1]] * 8, dtype=torch.int64, device="cuda")
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=2)
    with pytest.raises(NotImplementedError, match="out_dtype"):
        buf.combine(recv_x, handle, out_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="resize"):
        buf.resize(num_max_tokens_per_rank=32, hidden=64)
    out, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(out, x)
    torch.cuda.synchronize()
    buf.destroy()

    bucket = ep_torch.BucketBuffer(None, 2 << 20, explicitly_destroy=True, transport="ipc")
    t = bucket.storage[:256].view(torch.float32)
    with pytest.raises(NotImplementedError, match="send_recv"):
        bucket.send_recv(t[:32], t[32:], 0, 0)
    t.fill_(1.0)
    assert torch.equal(bucket.all_reduce(t).wait(), torch.ones(64, device="cuda"))
    torch.cuda.synchronize()
    bucket.destroy()


@pytest.mark.gpu
def test_gpu_surface_26():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc = subprocess.run(
        [sys.executable, __file__, "_gpu_rank", "1"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


if __name__ == "__main__":
    spawn(globals()[sys.argv[1]], int(sys.argv[2]), backend="nccl")
