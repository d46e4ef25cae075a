#!/usr/bin/env python3
"""Host cost of the single calls an eager ep_torch dispatch / combine is made of (issue 18's budget), on one GPU.

Each row is the host time of one call in a loop (median of 5 rounds, no synchronization inside a round): torch's
allocation and stream queries, the event pair and a kernel launch through cuda-python (ep_jit) and through
ep_launch's C++ path, so that the per-call budget of `bench_host_overhead.py` can be read as a sum.

    python benchmarks/bench_host_calls.py --out OUTDIR [--iters 500]

Writes OUTDIR/bench_host_calls.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time
from pathlib import Path

SRC = r"""
struct Words { long long w[43]; };
extern "C" __global__ void nop_words(Words a) { if (a.w[0] == 1 && threadIdx.x == 1024) a.w[1] = 0; }
"""


def _time(fn, iters: int, sync) -> float:
    per_call = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - t0) / iters * 1e6)
        sync()
    return statistics.median(per_call)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args(argv)

    import ep_jit
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_host_calls: needs an NVIDIA GPU")
    torch.cuda.init()
    from cuda.bindings import driver as drv

    kernel = ep_jit.load(ep_jit.compile(SRC, name="bench_host_calls")).function("nop_words")
    stream = torch.cuda.Stream()
    comm = torch.cuda.Stream(priority=-1)
    s, c = stream.cuda_stream, comm.cuda_stream
    ev = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    words = struct.pack("<43q", *range(43))
    rows = []

    def add(name, fn, iters=args.iters):
        fn()
        us = _time(fn, iters, torch.cuda.synchronize)
        rows.append({"call": name, "host_us_per_call": us})
        print(f"{name:70s} {us:8.2f} us/call")

    add(
        "torch.empty((1024, 7168), bf16, cuda)",
        lambda: torch.empty((1024, 7168), dtype=torch.bfloat16, device="cuda"),
    )
    add("torch.empty((128, 8), int32, cuda)", lambda: torch.empty((128, 8), dtype=torch.int32, device="cuda"))
    add(
        "torch._C._cuda_getCurrentRawStream(current_device())",
        lambda: torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()),
    )
    add("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    add(
        "cuda-python cuEventRecord + cuStreamWaitEvent",
        lambda: (drv.cuEventRecord(ev, s), drv.cuStreamWaitEvent(c, ev, 0)),
    )
    add(
        "ep_jit Kernel.launch (cuda-python cuLaunchKernelEx, struct arg)",
        lambda: kernel.launch(1, 32, [ep_jit.struct(words)], stream=c),
    )
    add(
        "ep_jit Kernel.launch, cooperative",
        lambda: kernel.launch(1, 32, [ep_jit.struct(words)], stream=c, cooperative=True),
    )
    try:
        import ep_launch
    except ImportError as exc:
        print(f"ep_launch not importable: {exc}")
    else:
        evh = int(ev)
        add("ep_launch.record_wait", lambda: ep_launch.record_wait(evh, s, c))
        plain = ep_launch.Launch(int(kernel._func), 1, 32, 0, False, words, list(range(11)))
        coop = ep_launch.Launch(int(kernel._func), 1, 32, 0, True, words, list(range(11)))
        values = tuple(range(100, 111))
        add("ep_launch.Launch (11 patched words)", lambda: plain(c, values))
        add("ep_launch.Launch, cooperative", lambda: coop(c, values))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_host_calls.json").write_text(json.dumps({"iters": args.iters, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
