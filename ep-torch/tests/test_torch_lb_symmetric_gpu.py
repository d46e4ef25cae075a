"""``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads`` on the symmetric road (issue 42), marker ``gpu``: the LB
region in symmetric memory, the bytes moved by ``ep_core.lb_copy``'s kernels, bitwise ``ep_core.load_balance``'s
oracles.

- 2 processes sharing the GPU over ipc (``two cuda``): ``lb_path == "symmetric"``; three rounds of a prefetch over
  three tensor pairs (bf16 and fp32, one expert tensor at an address only 4-byte aligned: the kernel's byte path; one
  of 128 KiB an expert: spread over the grid) with a mapping that changes every round, and a reduce (every owner's
  gradients bitwise the ascending (rank, slot) sum), on ``num_sms`` 0 (the theoretical count) and 3; then a barrier
  that times out: rank 1 skips its launch, rank 0's call records the wait and the next check raises
  ``EPTimeoutError`` naming rank 1.
- 1 rank over nccl (``one nccl``): the same body on one rank (its own slots; the barriers with itself).
- 2 ranks as streams of one process (``loopback cuda``): the kernels themselves (``ep_core.lb_copy.launch``) over two
  ``torch`` allocations of one GPU, each rank on its own stream, against the oracles: the loopback domain's
  arrangement (DESIGN §4).

The two-process body also runs on the CPU reference backend (``two cpu``: the all_to_all road) without the marker,
which checks the test itself where no GPU is."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

L, R, H = 3, 4, 64  # local experts, redundant slots, hidden of the gradients
SHAPES = ((2, 64), (40,), (1024, 64))  # per expert: bf16 256 B, fp32 160 B, bf16 128 KiB


def _mapping(nvl: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-1, nvl * L, (nvl, R), generator=g, dtype=torch.int32)
    m[0, 0] = m[nvl - 1, 1] = 0  # one expert in two rows
    m[0, 1] = 0  # and twice in one row
    return m


def _experts(rank: int, dev: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    w = [torch.randn(L, *SHAPES[0], generator=g).bfloat16(), torch.randn(L, *SHAPES[1], generator=g)]
    w.append(torch.randn(L, *SHAPES[2], generator=g).bfloat16())
    out = [t.to(dev) for t in w]
    # the fp32 experts at an address 4 bytes past an aligned one: the kernel's unaligned road
    flat = torch.empty(w[1].numel() + 1, dtype=torch.float32, device=dev)
    flat[1:].copy_(out[1].reshape(-1))
    out[1] = flat[1:].view(L, *SHAPES[1])
    return out


def _grads(rank: int, rnd: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return torch.randn(L, H, generator=g).to(dev), torch.randn(R, H, generator=g).to(dev)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy()


def _body(rank: int, n: int, cuda: bool, transport: str) -> None:
    import ep_torch
    import torch.distributed as dist
    from ep_core.errors import EPTimeoutError
    from ep_core.load_balance import prefetch_reference, reduce_grads_reference

    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan = ep_torch.BufferAllocator()
    slots = [
        plan.allocate((R, *s), torch.bfloat16 if i != 1 else torch.float32) for i, s in enumerate(SHAPES)
    ]
    rg = plan.allocate((R, H), torch.float32)
    buf = ep_torch.EPBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=8, hidden=64, lb_allocation_plan_or_num_bytes=plan,
        explicitly_destroy=True, transport=transport, num_gpu_timeout_secs=30,
    )  # fmt: skip
    want_road = "symmetric" if cuda else "all_to_all"
    assert buf.lb_path == want_road, f"rank {rank}: {buf.lb_path} ({buf.lb_path_reason})"
    assert slots[0].device == dev and slots[0].data_ptr() == buf.lb_storage.data_ptr()
    experts = _experts(rank, dev)
    every = [[_bytes(t) for t in _experts(r, torch.device("cpu"))] for r in range(n)]
    for rnd, sms in enumerate((0, 3, 0)):
        m = _mapping(n, 7 + rnd)
        mapping = m.to(dev)
        start = []
        for i, t in enumerate(slots):
            t.copy_(torch.full(t.shape, float(rnd + i), dtype=t.dtype))
            start.append(_bytes(t))
        buf.lb_prefetch_weights(slots, experts, mapping, num_sms=sms)
        for i, t in enumerate(slots):
            want = prefetch_reference([start[i]] * n, [e[i] for e in every], m.numpy())[rank]
            assert np.array_equal(_bytes(t), want), f"rank {rank} round {rnd}: tensor {i}"
        grads, red = _grads(rank, rnd, dev)
        rg.copy_(red)
        buf.lb_reduce_grads(rg, grads, mapping, num_sms=sms)
        all_g = [_grads(r, rnd, torch.device("cpu")) for r in range(n)]
        want_g = reduce_grads_reference(
            [x[1].numpy() for x in all_g], [x[0].numpy() for x in all_g], m.numpy()
        )
        got = grads.cpu().numpy()
        assert np.array_equal(got.view(np.uint32), want_g[rank].view(np.uint32)), (
            f"rank {rank} round {rnd}: grads"
        )
        if cuda:
            assert buf._lb_sym.last_launch[1] == (
                sms or min(buf.lb_get_theoretical_num_sms(), buf._lb_sym.device_sms)
            )
    if cuda and n > 1:
        # a barrier that times out: rank 1 passes the host step but launches nothing
        sym = buf._lb_sym
        sym.timeout_ms = 2000
        if rank == 1:
            sym._launch = lambda *a, **k: None
        buf.lb_prefetch_weights(slots, experts, _mapping(n, 7).to(dev))
        torch.cuda.synchronize()
        if rank == 0:
            with pytest.raises(EPTimeoutError, match="waiting for rank 1"):
                sym.check("lb_prefetch_weights")
        dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    assert buf.lb_storage is None
    print(f"rank {rank}: lb {want_road} ok")


def _two_cpu(rank: int, n: int) -> None:
    _body(rank, n, False, "reference")


def _two_cuda(rank: int, n: int) -> None:
    torch.cuda.set_device(0)  # every process on the one GPU: ipc
    _body(rank, n, True, "ipc")


def _loopback() -> None:
    """Two ranks as streams of this process: the kernels over two allocations of one GPU (module doc)."""
    from ep_core import lb_copy
    from ep_core.load_balance import lb_routes, prefetch_reference, reduce_grads_reference

    n, dev = 2, torch.device("cuda", 0)
    lb_copy.load(0)  # before any launch: a lazy load could wait for a barrier kernel already spinning
    num = 2 << 20
    regions = [torch.zeros(num + lb_copy.SYNC_BYTES, dtype=torch.uint8, device=dev) for _ in range(n)]
    bases = [int(t.data_ptr()) for t in regions]
    sync = torch.tensor([b + lb_copy.sync_offset(num) for b in bases], dtype=torch.int64, device=dev)
    herr = [torch.zeros(4, dtype=torch.int32).pin_memory() for _ in range(n)]
    streams = [torch.cuda.Stream(dev) for _ in range(n)]
    per = 2 * 1024 * 64  # bf16 [1024, 64] an expert
    experts = [
        torch.randn(L, per // 2, generator=torch.Generator().manual_seed(r)).bfloat16().to(dev)
        for r in range(n)
    ]
    slots = [t[: R * per].view(R, per) for t in regions]
    red_g = [t[R * per : R * per + R * H * 4].view(torch.float32).view(R, H) for t in regions]
    gen = 0
    for rnd, sms in enumerate((4, 1, 8)):
        m = _mapping(n, 20 + rnd).numpy()
        routes = [lb_routes(m, r, L) for r in range(n)]
        for r in range(n):
            slots[r].fill_(rnd)
            red_g[r].copy_(_grads(r, rnd, dev)[1])
        grads = [_grads(r, rnd, dev)[0] for r in range(n)]
        start = [s.cpu().numpy() for s in slots]
        starts_g = [g.cpu().numpy() for g in grads]
        slot_g = [g.cpu().numpy() for g in red_g]
        pairs = [[(slots[r].data_ptr(), experts[r].data_ptr(), per)] for r in range(n)]
        tables = [
            torch.from_numpy(lb_copy.prefetch_tasks(routes[r], pairs[r], bases)).to(dev) for r in range(n)
        ]
        reduce = [
            lb_copy.reduce_table(routes[r], grads[r].data_ptr(), red_g[r].data_ptr(), H * 4, L, bases)
            for r in range(n)
        ]
        rtables = [torch.from_numpy(flat).to(dev) for flat, _ in reduce]
        torch.cuda.synchronize()
        for kind in ("copy", "reduce"):
            gen += 1
            for r in range(n):
                with torch.cuda.stream(streams[r]):
                    table, count = (
                        (tables[r], tables[r].numel() // 3) if kind == "copy" else (rtables[r], reduce[r][1])
                    )
                    lb_copy.launch(
                        kind, table.data_ptr(), count, hidden=H, sync_table=sync.data_ptr(), rank=r, num_ranks=n,
                        generation=gen, timeout_ms=20000, herr=herr[r].data_ptr(), num_sms=sms, device=0,
                        stream=streams[r].cuda_stream,
                    )  # fmt: skip
            torch.cuda.synchronize()
            assert all(int(h[0]) == 0 for h in herr), [h.tolist() for h in herr]
        want = prefetch_reference(
            start, [e.view(torch.uint8).reshape(L, -1).cpu().numpy() for e in experts], m
        )
        want_g = reduce_grads_reference(slot_g, starts_g, m)
        for r in range(n):
            assert np.array_equal(slots[r].cpu().numpy(), want[r]), f"loopback rank {r} round {rnd}: slots"
            got = grads[r].cpu().numpy()
            assert np.array_equal(got.view(np.uint32), want_g[r].view(np.uint32)), f"loopback rank {r}: grads"
    print("loopback ok")


def _script(args: list[str], limit: float) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = {k: v for k, v in os.environ.items() if k not in ("EPKIT_SCALEUP_RANKS", "EPKIT_TORCH_TRANSPORT")}
    env.setdefault("EPKIT_NVLINK_GBS", "450")
    code, out = run_script(__file__, args, limit, env=env, what=" ".join(args) + ": ")
    assert code == 0, out[-4000:]


def test_body_on_cpu_reference():
    _script(["two", "cpu"], 240)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_ipc_two_processes():
    _script(["two", "cuda"], 180)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_nccl_one_rank():
    _script(["one", "nccl"], 180)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_loopback_two_ranks():
    _script(["loopback", "cuda"], 180)


if __name__ == "__main__":
    what, how = sys.argv[1], sys.argv[2]
    if what == "loopback":
        _loopback()
    elif what == "two":
        from ep_torch.launch import spawn

        spawn(_two_cuda if how == "cuda" else _two_cpu, 2)
    else:
        import torch.distributed as dist
        from ep_torch.launch import free_port, init_rank

        init_rank(0, 1, free_port(), how)
        try:
            _body(0, 1, True, "nccl")
        finally:
            dist.destroy_process_group()
