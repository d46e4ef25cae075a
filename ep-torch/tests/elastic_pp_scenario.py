"""The PP scenario of the GPU test (``test_torch_elastic_gpu.py``), written once for any device so that the CPU
reference backend runs it too (``test_torch_elastic_cpu.py``): a ring exchange of growing tensors, an in-flight
limit, and (two ranks) a ping-pong. A scenario bug then shows on the CPU first."""

from __future__ import annotations

import time
from typing import Any

import torch

#: the phases' configurations: (num_max_tensor_bytes, num_max_inflight_tensors)
RING_CONFIG = (1 << 16, 2)
INFLIGHT_CONFIG = (4096, 2)
PING_PONG_NUMEL = 1024  # float32: exactly INFLIGHT_CONFIG's num_max_tensor_bytes (the limit is inclusive)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def payload(src: int, dst: int, seq: int, numel: int, dev: torch.device, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 100 * dst + seq)
    return (torch.randn(numel, generator=g) * 100).to(dtype).to(dev)


def run(buf: Any, rank: int, n: int, dev: torch.device, res: list) -> None:
    """Appends `(check, ok, detail)` to `res`. `buf` an ElasticBuffer on `dev` (cuda: ipc, cpu: reference)."""
    buf.pp_set_config(*RING_CONFIG)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    sent: dict[int, int] = {}
    got: dict[int, int] = {}
    ok = True
    for step in range(5):
        numel = 1 << (8 + step)  # 1 KiB .. 16 KiB of float32, bf16 on odd steps
        dt = torch.bfloat16 if step % 2 else torch.float32
        for dst in (nxt, prv):
            buf.pp_send(payload(rank, dst, sent.get(dst, 0), numel, dev, dt), dst)
            sent[dst] = sent.get(dst, 0) + 1
        for src in (prv, nxt):
            want = payload(src, rank, got.get(src, 0), numel, dev, dt)
            out = torch.empty_like(want)
            buf.pp_recv(out, src)
            got[src] = got.get(src, 0) + 1
            ok = ok and bool(torch.equal(out, want))
    _sync(dev)
    res.append(("pp/ring", ok, f"{n} ranks"))
    # in flight: rank 0 queues 3 sends with 2 slots; on the GPU the third waits on the stream, not on the host (one
    # rank would wait for itself: its receives queue behind that wait); on the CPU the host waits
    buf.pp_set_config(*INFLIGHT_CONFIG)
    numel = INFLIGHT_CONFIG[0] // 4
    if n > 1 and rank == 0:
        t0 = time.monotonic()
        for i in range(3):
            buf.pp_send(torch.full((numel,), float(i), device=dev), 1)
        host = time.monotonic() - t0
        if dev.type == "cuda":
            res.append(("pp/in-flight sends return at once", host < 0.5, f"{host:.3f} s"))
    if n > 1 and rank == 1:
        time.sleep(1.0)
        vals = []
        for _ in range(3):
            t = torch.empty(numel, device=dev)
            buf.pp_recv(t, 0)
            vals.append(float(t[0]))
        res.append(("pp/in-flight order", vals == [0.0, 1.0, 2.0], str(vals)))
    _sync(dev)
    buf.barrier()
    # ping-pong, under INFLIGHT_CONFIG
    if n == 2:
        x = torch.arange(PING_PONG_NUMEL, dtype=torch.float32, device=dev)
        for _ in range(10):
            if rank == 0:
                buf.pp_send(x, 1)
                buf.pp_recv(x, 1)
            else:
                y = torch.empty_like(x)
                buf.pp_recv(y, 0)
                buf.pp_send(y + 1, 0)
        _sync(dev)
        if rank == 0:
            want = torch.arange(PING_PONG_NUMEL, dtype=torch.float32, device=dev) + 10
            res.append(("pp/ping-pong", bool(torch.equal(x, want)), ""))
