#!/usr/bin/env python3
"""Host cost of one ep_torch call: the CPU time a Python process spends per dispatch / combine, GPU work excluded.

One rank on one GPU (an nccl group of size 1, the automatic transport), a small batch (T tokens, default 128) so
that the GPU is never the bottleneck: each op is issued `--iters` times without synchronizing, and the host time
per call is reported (median over 5 rounds). `--profile` adds a cProfile of the cached dispatch + combine loop
(top functions by own time), which is where host overhead hides.

    python benchmarks/bench_host_overhead.py --out OUTDIR [--tokens 128] [--iters 200] [--profile]

Writes OUTDIR/bench_host_overhead.json (and bench_host_overhead.prof.txt with --profile). The launch path (ep_launch's
C++ launches and events, or cuda-python) is printed and recorded; `EPKIT_NATIVE_LAUNCH=0` times the cuda-python one.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8


def _rounds(fn, iters: int, rounds: int = 5) -> float:
    """Median over rounds of host microseconds per call (no synchronization inside a round)."""
    import torch

    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from ep_torch import ElasticBuffer
    from ep_torch.launch import free_port, init_rank

    if not torch.cuda.is_available():
        raise SystemExit("bench_host_overhead: needs an NVIDIA GPU")
    init_rank(0, 1, free_port(), "nccl")
    t = args.tokens
    buf = ElasticBuffer(
        None, num_max_tokens_per_rank=t, hidden=HIDDEN, num_topk=TOPK, explicitly_destroy=True
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.rand(t, NUM_EXPERTS, device="cuda", generator=g).topk(TOPK, dim=1).indices
    w = torch.rand(t, TOPK, device="cuda", generator=g)
    kw = {"num_experts": NUM_EXPERTS, "num_sms": 16}
    rows = torch.randperm(t, device="cuda", generator=g)

    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
    launch_path = getattr(buf.runtime.executor, "launch_path", "?")
    print(f"launch path: {launch_path}")
    ops = {
        "dispatch (CPU sync)": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw),
        "dispatch (no CPU sync)": lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw
        ),
        "dispatch (cached)": lambda: buf.dispatch(x, handle=handle, num_sms=16),
        "combine": lambda: buf.combine(recv_x, handle, num_sms=16),
        "torch: x.index_select + index_add_ (reference point)": lambda: torch.zeros_like(x).index_add_(
            0, rows, x.index_select(0, rows)
        ),
    }
    for fn in ops.values():  # warm up (JIT, allocator)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    results = []
    for name, fn in ops.items():
        us = _rounds(fn, args.iters if "CPU sync)" not in name else max(20, args.iters // 5))
        results.append({"op": name, "host_us_per_call": us})
        print(f"{name:55s} {us:9.1f} us/call (host)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            ops["dispatch (cached)"]()
            ops["combine"]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(40)
        (out / "bench_host_overhead.prof.txt").write_text(s.getvalue())
        print(s.getvalue()[:6000])
    (out / "bench_host_overhead.json").write_text(
        json.dumps(
            {"tokens": t, "hidden": HIDDEN, "iters": args.iters, "launch_path": launch_path, "rows": results},
            indent=1,
        )
    )
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
