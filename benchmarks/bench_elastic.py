#!/usr/bin/env python3
"""Benchmark of ElasticBuffer's PP send/recv, Engram fetch and AGRS all-gather on the ipc transport (issue 20).

    python benchmarks/bench_elastic.py [--nprocs N] [--share-gpu] [--out DIR] [--quick]

N processes (default 2) form a gloo group; each is one rank of an ``ep_torch.ElasticBuffer(transport="ipc")`` on GPU
``rank`` (``--share-gpu``, or fewer GPUs than ranks: every rank on GPU 0; the times are then time-sliced between
the processes and only the relations within one run mean something). Measured, each with its baseline in the
same run (CUDA-event times on rank 0, median of repetitions):

1. PP: a ping-pong between ranks 0 and 1 (``pp_send`` then ``pp_recv`` of the echo), tensor sizes 1-64 MiB,
   2 slots in flight; one-way GB/s = 2 * bytes * rounds / time. Each hop is two copy-engine copies (into the
   peer's slot, out of it). Baseline: the device copy ceiling, a ``copy_`` of the same bytes on GPU 0 (and the
   peer copy GPU 0 -> GPU 1 with two GPUs).
2. Engram: ``engram_fetch`` of T rows of hidden 7168 bf16 (random entries of every rank's table) from the storage in
   host NUMA memory (the row says ``storage``: ``host``, or ``gpu`` where host memory could not be mapped); the
   gather runs on SMs. Baseline: a plain pinned host-to-device copy of the same bytes.
3. AGRS: ``all_gather`` of 1-64 MiB per rank inside a session, and ep's ``reduce_scatter`` of the same bytes per
   rank. Baselines: ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` on an NCCL group of the
   same ranks (only with one GPU per rank). Bus GB/s: bytes * (N - 1) / time (reduce-scatter: bytes * (N - 1) / N).

SMs: PP and all-gather move their bytes on none (copy engine, ordered by signal words); each wait for a peer's
signal holds one thread block (one thread) while it waits (bounded by num_gpu_timeout_secs: ep_core.signal_wait).
Engram's gather and the reduce-scatter's sum use torch kernels.
Writes DIR/bench_elastic_n{N}[_shared].json and prints a table. Exit status 0 (also without a GPU: "skipped").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

MiB = 1 << 20


def _time(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (CUDA events on the current stream)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _worker(rank: int, n: int, shared: bool, quick: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    from ep_torch import ElasticBuffer

    dev = 0 if shared else rank
    torch.cuda.set_device(dev)
    reps = 3 if quick else 10
    rows: list[dict] = []
    sizes = [1 * MiB, 16 * MiB] if quick else [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    big = max(sizes)

    # 1. PP ping-pong --------------------------------------------------------------------------------------
    buf = ElasticBuffer(None, num_bytes=ElasticBuffer.get_pp_buffer_size_hint(big, 2), transport="ipc")
    buf.pp_set_config(big, 2)
    for b in sizes:
        x = torch.randn(b // 4, device="cuda")
        rounds = 4

        def ping(x=x, rounds=rounds) -> None:
            for _ in range(rounds):
                if rank == 0:
                    buf.pp_send(x, 1)
                    buf.pp_recv(x, 1)
                elif rank == 1:
                    buf.pp_recv(x, 0)
                    buf.pp_send(x, 0)

        dist.barrier()
        t = _time(ping, reps) if rank in (0, 1) else 0.0
        ceiling = _time(lambda x=x: torch.empty_like(x).copy_(x), reps)
        row = {"op": "pp", "bytes": b, "gbs": 2 * b * rounds / t / 1e9 if t else 0, "sms": 0}
        row["ceiling_d2d_gbs"] = 2 * b / ceiling / 1e9  # read + write of a device copy
        if not shared and torch.cuda.device_count() > 1 and rank == 0:
            y = torch.empty(b // 4, device="cuda:1")
            row["ceiling_peer_gbs"] = b / _time(lambda x=x, y=y: y.copy_(x), reps) / 1e9
        rows.append(row)
        dist.barrier()
    del buf
    torch.cuda.synchronize()
    dist.barrier()

    # 2. Engram fetch --------------------------------------------------------------------------------------
    hidden, entries = 7168, 4096
    tokens = 1024 if quick else 4096
    gpu, cpu = ElasticBuffer.get_engram_storage_size_hint(entries, hidden, tokens)
    buf = ElasticBuffer(None, num_bytes=gpu + cpu, num_cpu_bytes=cpu, transport="ipc")
    buf.engram_write(torch.randn(entries, hidden, device="cuda").to(torch.bfloat16))
    idx = torch.randint(0, entries * n, (tokens, 1), dtype=torch.int32, device="cuda")
    t = _time(lambda: buf.engram_fetch(idx)(), reps)
    nbytes = tokens * hidden * 2
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _time(lambda: dst.copy_(host, non_blocking=True), reps)
    rows.append(
        {
            "op": "engram_fetch",
            "bytes": nbytes,
            "gbs": nbytes / t / 1e9,
            "h2d_gbs": nbytes / h2d / 1e9,
            "sms": "gather",
            "storage": buf.__dict__["_elastic_state"].backend.engram_storage,
        }
    )
    del buf
    torch.cuda.synchronize()
    dist.barrier()

    # 3. AGRS all-gather -----------------------------------------------------------------------------------
    if n > 1:
        need = ElasticBuffer.get_agrs_num_max_session_bytes(None, [(big // 4,)], torch.float32)
        buf = ElasticBuffer(
            None, num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(None, need), transport="ipc"
        )
        buf.agrs_set_config(need, 1)
        nccl = None
        if not shared and torch.cuda.device_count() >= n:
            nccl = dist.new_group(backend="nccl")
        for b in sizes:
            x = torch.randn(b // 4, device="cuda")

            def ag(x=x) -> None:
                with buf.agrs_new_session():
                    _, handle = buf.all_gather(x)
                    handle()

            dist.barrier()
            t = _time(ag, reps)
            row = {"op": "all_gather", "bytes": b, "gbs": b * (n - 1) / t / 1e9, "sms": 0}
            if nccl is not None:
                o = torch.empty(n * x.numel(), device="cuda")
                tt = _time(lambda x=x, o=o: dist.all_gather_into_tensor(o, x, group=nccl), reps)
                row["torch_nccl_gbs"] = b * (n - 1) / tt / 1e9
            rows.append(row)
            xs = torch.randn(b // 4, device="cuda")  # reduce-scatter of b bytes per rank into b / N

            def rs(xs=xs) -> None:
                with buf.agrs_new_session():
                    buf.reduce_scatter(xs)

            t = _time(rs, reps) if (b // 4) % n == 0 else 0.0
            row = {
                "op": "reduce_scatter",
                "bytes": b,
                "gbs": b * (n - 1) / n / t / 1e9 if t else 0,
                "sms": "sum",
            }
            if nccl is not None and t:
                o = torch.empty(xs.numel() // n, device="cuda")
                tt = _time(lambda xs=xs, o=o: dist.reduce_scatter_tensor(o, xs, group=nccl), reps)
                row["torch_nccl_gbs"] = b * (n - 1) / n / tt / 1e9
            rows.append(row)
        del buf
    torch.cuda.synchronize()
    if rank == 0:
        name = f"bench_elastic_n{n}{'_shared' if shared else ''}.json"
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, name).write_text(json.dumps({"nprocs": n, "shared_gpu": shared, "rows": rows}, indent=1))
        for r in rows:
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--share-gpu", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.nprocs < 2:
        print("--nprocs: expected >= 2 (PP needs a peer)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("skipped: no GPU")
        return 0
    shared = args.share_gpu or torch.cuda.device_count() < args.nprocs
    from ep_torch import launch

    launch.spawn(_worker, args.nprocs, shared, args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
