#!/usr/bin/env python3
"""Host cost of one ep_torch call: the CPU time a Python process spends per dispatch / combine, GPU work excluded.

One rank on one GPU (an nccl group of size 1, the automatic transport), a small batch (T tokens, default 128) so
that the GPU is never the bottleneck: each op is issued `--iters` times without synchronizing, and the host time
per call is reported: the median and the minimum over `--rounds` rounds, each round running every op in turn, and
the median ratio to the torch reference of the same round (the steadier figure on a shared host). `--profile` adds
a cProfile of the cached dispatch + combine loop (top functions by own time), which is where host overhead hides.

    python benchmarks/bench_host_overhead.py --out OUTDIR [--tokens 128] [--iters 200] [--rounds 5] [--profile]

After the table, each ep_torch op is run once more under `ep-core/benchmarks/host_steps.py`'s timing wrappers
(per-step inclusive / own us per call: validation, the repeat road, torch allocations, launches, the handle), and
the single torch calls the path makes are timed on their own (`--no-breakdown` skips both).

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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep-core" / "benchmarks"))

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


def _interleaved(ops: dict, iters: int, rounds: int) -> dict:
    """Host us per call of every op, per round: each round runs every op in turn (`iters` calls, a fifth of that
    for the CPU-sync dispatch), so a drift of the host's speed meets every op of a round alike and the ratio of an
    op to the torch reference of the same round is steadier than either alone (a shared host varies by 2x)."""
    import torch

    out: dict = {name: [] for name in ops}
    for _ in range(rounds):
        for name, fn in ops.items():
            n = iters if name != "dispatch (CPU sync)" else max(20, iters // 5)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[name].append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
    return out


def _single_calls(torch, x, idx, iters: int) -> list[dict]:
    """Host us of the single torch calls an eager call makes (the outputs' and handle arrays' allocations, the
    handle's topk_idx copy, the stream query, pointer reads), each in a loop of its own."""
    from ep_torch.buffer import _current_stream

    block = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    rows = []
    calls = {
        "torch.empty((1024, 7168), bf16, cuda)": lambda: torch.empty(
            (1024, 7168), dtype=torch.bfloat16, device="cuda"
        ),
        "torch.empty((1024, 8), int32, cuda)": lambda: torch.empty(
            (1024, 8), dtype=torch.int32, device="cuda"
        ),
        "block.as_strided((1024, 8), (8, 1), off) (a handle array carved)": lambda: block.as_strided(
            (1024, 8), (8, 1), 4096
        ),
        "topk_idx.clone() [128, 8] int64": idx.clone,
        "ep_torch _current_stream()": _current_stream,
        "x.data_ptr()": x.data_ptr,
    }
    for name, fn in calls.items():
        us = _rounds(fn, iters)
        rows.append({"call": name, "host_us_per_call": us})
        print(f"   single call: {name:66s} {us:7.2f} us")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every op in turn (median, min, ratio)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-step and single-call rows")
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
    # FP8 x: e4m3 data and one float32 scale per 128 channels
    x8 = (x.to(torch.float8_e4m3fn), torch.rand(t, HIDDEN // 128, device="cuda", generator=g))

    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
    # a no-sync handle has the worst-case rows: its combine takes that many
    recv_ns = buf.dispatch(x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw)[0]
    # the zero-copy road: outputs left in the buffer's memory; recv_x is the combine buffer, combined in place
    zc_x, _, _, zc_handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, zero_copy=True, **kw
    )
    launch_path = getattr(buf.runtime.executor, "launch_path", "?")
    print(f"launch path: {launch_path}")
    ops = {
        "dispatch (CPU sync)": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw),
        "dispatch (no CPU sync)": lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw
        ),
        "dispatch (FP8, no CPU sync)": lambda: buf.dispatch(
            x8, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw
        ),
        "dispatch (cached)": lambda: buf.dispatch(x, handle=handle, num_sms=16),
        "combine": lambda: buf.combine(recv_x, handle, num_sms=16),
        # a training step's pattern: every combine meets the handle its dispatch has just made
        "dispatch (no CPU sync) + combine of its new handle": lambda: buf.combine(
            recv_ns,
            buf.dispatch(x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw)[3],
            num_sms=16,
        ),
        "dispatch (zero-copy, no CPU sync)": lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, zero_copy=True, **kw
        ),
        "combine (zero-copy)": lambda: buf.combine(zc_x, zc_handle, num_sms=16, zero_copy=True),
        "torch: x.index_select + index_add_ (reference point)": lambda: torch.zeros_like(x).index_add_(
            0, rows, x.index_select(0, rows)
        ),
    }
    for fn in ops.values():  # warm up (JIT, allocator)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    results = []
    ref = "torch: x.index_select + index_add_ (reference point)"
    per_round = _interleaved(ops, args.iters, args.rounds)
    for name, times in per_round.items():
        ratios = [a / b for a, b in zip(times, per_round[ref])]
        row = {
            "op": name,
            "host_us_per_call": statistics.median(times),
            "min_us": min(times),
            "x_torch_reference": statistics.median(ratios),
        }
        results.append(row)
        print(
            f"{name:55s} {row['host_us_per_call']:9.1f} us/call (host)  min {row['min_us']:7.1f}  "
            f"{row['x_torch_reference']:5.2f}x the reference"
        )
    # A/B of the handle block: the no-sync dispatch with a new handle's int32 arrays allocated one by one
    from ep_core.kernels import array_block

    executor, mode = buf.runtime.executor, array_block.MODE
    array_block.MODE = "0"
    executor._allocators.clear()  # the executor's allocator wrappers picked the block when made
    try:
        name = "dispatch (no CPU sync), handle arrays one by one (EPKIT_HANDLE_BLOCK=0)"
        ops["dispatch (no CPU sync)"]()
        us = _rounds(ops["dispatch (no CPU sync)"], args.iters)
        results.append({"op": name, "host_us_per_call": us})
        print(f"{name:55s} {us:9.1f} us/call (host)")
    finally:
        array_block.MODE = mode
        executor._allocators.clear()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps: dict = {}
    singles: list = []
    if not args.no_breakdown:
        from bench_host_torch import TORCH_STEPS
        from host_steps import STEPS, breakdown, format_rows

        for (name, fn), row in zip(ops.items(), results):
            if name.startswith("torch"):
                continue
            n = args.iters if name != "dispatch (CPU sync)" else max(20, args.iters // 5)
            steps[name] = breakdown(fn, n, TORCH_STEPS + STEPS)
            torch.cuda.synchronize()
            print(format_rows(name, row["host_us_per_call"], steps[name]))
        singles = _single_calls(torch, x, idx, args.iters)
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
            {
                "tokens": t,
                "hidden": HIDDEN,
                "iters": args.iters,
                "launch_path": launch_path,
                "rows": results,
                "steps": steps,
                "single_calls": singles,
            },
            indent=1,
        )
    )
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
