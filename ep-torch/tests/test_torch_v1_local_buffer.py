"""V1 ``Buffer.get_local_buffer_tensor`` (issue 42, ``ep_torch.legacy.local_tensor``): a view of this rank's own
buffer memory, DeepEP's shapes (``[:size.numel()].view(size)``, ``offset`` in bytes), refusals by name. CPU: 2 ranks
over gloo (the reference backend's host storage); GPU (``gpu``): 2 processes sharing the GPU (ipc), one rank over
nccl (the window's local memory) and a loopback group's low-latency region."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPStateError, EPTypeError, EPValueError
from ep_torch.launch import spawn
from ep_torch.legacy import Buffer

T, H, K, E, M = 5, 512, 2, 8, 8  # H: low-latency mode's tested size


def _ptr(region) -> int:
    return int(region.ptr)


def _inputs(rank: int, device: str):
    g = torch.Generator().manual_seed(70 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x.to(device), idx.to(device)


def _normal(rank: int, n: int, device: str, transport: str | None = None) -> None:
    transport = transport or ("ipc" if device == "cuda" else None)
    buf = Buffer(
        None, int(1e8), 0, explicitly_destroy=True, num_max_tokens_per_rank=T, hidden=H, transport=transport
    )
    region = buf._inner.runtime.data
    whole = buf.get_local_buffer_tensor(torch.uint8)
    assert whole.dtype == torch.uint8 and whole.dim() == 1 and whole.numel() == region.shape[0]
    assert whole.data_ptr() == _ptr(region) and whole.device.type == device
    # DeepEP's shape rule: [:size.numel()].view(size); offset in bytes
    v = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=64)
    assert v.shape == (4, 8) and v.dtype == torch.bfloat16 and v.data_ptr() == _ptr(region) + 64
    v.fill_(1.5)  # the same memory as the byte view
    assert torch.equal(
        whole[64 : 64 + 64].view(torch.bfloat16).cpu(), torch.full((32,), 1.5, dtype=torch.bfloat16)
    )
    f = buf.get_local_buffer_tensor(torch.float32, offset=8)
    assert (
        f.numel() == (region.shape[0] - 8) // 4
    )  # never past the region (DeepEP's count ignores the offset)
    assert buf.get_local_buffer_tensor(torch.int64, offset=region.shape[0]).numel() == 0
    assert buf.get_local_buffer_tensor(torch.int32, (2, 0, 3)).shape == (2, 0, 3)
    for kwargs, err, text in [
        ({"offset": -8}, EPValueError, "offset must be a byte offset"),
        ({"offset": 6, "dtype": torch.float32}, EPValueError, "multiple of 4"),
        ({"offset": region.shape[0] + 2}, EPValueError, "offset"),
        ({"size": torch.Size([region.shape[0] // 2 + 1]), "dtype": torch.int16}, EPValueError, "size"),
        ({"size": torch.Size([region.shape[0]]), "offset": 2}, EPValueError, "size"),
        ({"size": (2, -1)}, EPValueError, "negative"),
        ({"size": "abc"}, EPTypeError, "size"),
        ({"dtype": "bfloat16"}, EPTypeError, "dtype"),
        ({"offset": 1.0}, EPTypeError, "offset"),
        ({"use_rdma_buffer": True}, EPValueError, "no RDMA buffer"),
    ]:
        kw = {"dtype": torch.uint8, **kwargs}
        with pytest.raises(err, match=text):
            buf.get_local_buffer_tensor(**kw)
    # the view survives dispatch and combine (the buffer is never rebuilt when sized up front)
    x, idx = _inputs(rank, device)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    rx, _, _, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx
    )
    buf.combine(rx, handle)
    assert buf._inner.runtime.data.ptr == region.ptr
    dist.barrier()
    buf.destroy()
    with pytest.raises(EPStateError, match="destroyed"):
        buf.get_local_buffer_tensor(torch.uint8)

    # not sized up front: refused by name (the lazily built buffer is rebuilt for larger dispatches)
    lazy = Buffer(None, int(1e8), 0, explicitly_destroy=True, transport=transport)
    with pytest.raises(EPValueError, match="num_max_tokens_per_rank"):
        lazy.get_local_buffer_tensor(torch.uint8)
    lazy.destroy()


def _low_latency(rank: int, n: int, device: str) -> None:
    transport = "ipc" if device == "cuda" else None
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, transport=transport)
    with pytest.raises(EPStateError, match="first low_latency_dispatch"):
        buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    with pytest.raises(EPValueError, match="use_rdma_buffer=True"):  # no normal-mode buffer sized up front
        buf.get_local_buffer_tensor(torch.uint8)
    x, idx = _inputs(rank, device)
    buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    region = buf._ll_inner.runtime.data
    t = buf.get_local_buffer_tensor(torch.int32, torch.Size([3, 5]), offset=128, use_rdma_buffer=True)
    assert t.shape == (3, 5) and t.data_ptr() == _ptr(region) + 128
    assert buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == region.shape[0]
    dist.barrier()
    buf.destroy()


def _ranks(rank: int, n: int, device: str = "cpu") -> None:
    _normal(rank, n, device)
    _low_latency(rank, n, device)


def _ranks_shared_gpu(rank: int, n: int) -> None:
    torch.cuda.set_device(0)  # several processes on one GPU over a gloo bootstrap: ep's ipc transport
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    _ranks(rank, n, "cuda")


def _rank_gpu_nccl(rank: int, n: int) -> None:
    torch.cuda.set_device(rank)
    _normal(rank, n, "cuda", "nccl")  # the NCCL window's local memory


def test_local_buffer_tensor_cpu():
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", "2"], 300, what="2 ranks: ")
    assert code == 0, out[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_local_buffer_tensor_shared_gpu():
    proc = subprocess.run(
        [sys.executable, __file__, "_ranks_shared_gpu", "2"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_local_buffer_tensor_one_rank_over_nccl():
    proc = subprocess.run(
        [sys.executable, __file__, "_rank_gpu_nccl", "1"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_local_buffer_tensor_loopback_gpu(monkeypatch):
    """A loopback group's rank views its own region of the group's allocation (the low-latency buffer)."""
    from ep_torch.loopback import LoopbackGroup

    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")  # the planner's figure for ranks on one GPU
    torch.cuda.set_device(0)
    group = LoopbackGroup(2, device="cuda", gpu_timeout_secs=20.0)
    v1 = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True)
    inp = [_inputs(r, "cuda") for r in range(2)]
    group.run(lambda r: v1[r].low_latency_dispatch(inp[r][0], inp[r][1], M, E, use_fp8=False))
    torch.cuda.synchronize()
    views = [b.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True) for b in v1]
    for b, v in zip(v1, views):
        assert v.is_cuda and v.data_ptr() == int(b._ll_inner.runtime.data.ptr)
    assert views[0].data_ptr() != views[1].data_ptr()
    for b in v1:
        b.destroy()
    group.close()


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    worker = sys.argv[1]  # the GPU ranks start afresh (a forked process cannot use CUDA)
    if "gpu" in worker:
        spawn(globals()[worker], int(sys.argv[2]), backend="nccl" if "nccl" in worker else "gloo")
    else:
        spawn_cpu(globals()[worker], int(sys.argv[2]))
