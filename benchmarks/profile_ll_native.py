"""Where V1 low-latency mode's own kernels spend their time: per-kernel GPU time of ``low_latency_dispatch`` (bf16,
FP8) and ``low_latency_combine`` on the native road, one loopback group per EP size (all ranks in this process, one
stream each), under ``torch.profiler``.

    python benchmarks/profile_ll_native.py [--ranks 1 8] [--tokens 128] [--iters 20]
    python benchmarks/profile_ll_native.py --step [--recv-blocks 0 8 4]     # the decode step, diagnosed

Eager calls (not graph replays): a kernel's own time is what it is in a graph; the sum over kernels is not the op's
latency (ranks overlap, launches have gaps); ``benchmarks/bench_v1.py`` times the ops in graphs.
"""

from __future__ import annotations

import argparse
import os
import sys


def _table(prof, title: str) -> None:
    """The kernels' own GPU time (``self_device_time_total``): CPU-side ops show 0 and are left out."""
    rows = []
    for ev in prof.key_averages():
        tot = getattr(ev, "self_device_time_total", None)
        if tot is None:
            tot = getattr(ev, "self_cuda_time_total", 0.0)
        if tot > 0:
            rows.append((ev.key, ev.count, tot))
    print(f"\n{title}")
    print(f"{'kernel':<48} {'calls':>6} {'us each':>9} {'us total':>10}")
    for name, c, tot in sorted(rows, key=lambda r: -r[2]):
        print(f"{name[:48]:<48} {c:>6} {tot / c:>9.1f} {tot:>10.1f}")


def _profile(torch, n: int, args: argparse.Namespace) -> None:
    from ep_torch.legacy import Buffer
    from ep_torch.loopback import LoopbackGroup
    from torch.profiler import ProfilerActivity, profile

    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=20.0, timeout_secs=60.0)
    size = Buffer.get_low_latency_rdma_size_hint(t, h, n, e)
    bufs = dict(zip(range(n), group.v1_buffers(0, size, low_latency_mode=True, num_qps_per_rank=e // n,
                                               explicitly_destroy=True, ll_native=True)))  # fmt: skip
    inp = {}
    for r in range(n):
        g = torch.Generator().manual_seed(1000 + r)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
        inp[r] = (x, idx, torch.rand(t, k, generator=g).cuda())
    state = {}

    def disp(r, fp8=False):
        x, idx, _ = inp[r]
        state[r] = bufs[r].low_latency_dispatch(x, idx, t, e, use_fp8=fp8)
        return state[r]

    def comb(r):
        _, idx, w = inp[r]
        recv, _, handle, _, _ = state[r]
        return bufs[r].low_latency_combine(recv, idx, w, handle)[0]

    for name, fn in (("dispatch bf16", disp), ("dispatch fp8", lambda r: disp(r, True)), ("combine", comb)):
        if name == "combine":
            group.run(disp)
        for _ in range(3):
            group.run(fn)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                group.run(fn)
            torch.cuda.synchronize()
        _table(prof, f"EP{n} {name}: {args.iters} calls x {n} ranks (T={t}, hidden {h}, top-{k} of {e})")
    torch.cuda.synchronize()
    group.run(lambda r: bufs[r].destroy())


def _step(torch, n: int, args: argparse.Namespace, recv_blocks: int, work: str) -> str:
    """The decode step each rank in turn (dispatch, stand-in expert work, combine: every rank's receive spins on
    the GPU the ranks share while later ranks still run their work) against the same calls unstepped (every
    dispatch, then every combine). ``work``: "none", "ew" (elementwise kernels: any CTA may run whenever an SM has
    room) or "gemm" (cuBLAS: its persistent / split-K kernels may expect all their CTAs resident at once, which
    spinning receives of other ranks can prevent). ``recv_blocks`` > 0 overrides the receives' grid cap
    (``NativeRegion.recv_blocks``). A short GPU timeout (3 s) turns a starved wait into an error here instead of a
    hang. One line: verdict, us."""
    import time

    from ep_torch.legacy import Buffer
    from ep_torch.loopback import LoopbackGroup

    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=3.0, timeout_secs=60.0)
    size = Buffer.get_low_latency_rdma_size_hint(t, h, n, e)
    bufs = dict(zip(range(n), group.v1_buffers(0, size, low_latency_mode=True, num_qps_per_rank=e // n,
                                               explicitly_destroy=True, ll_native=True)))  # fmt: skip
    inp = {}
    for r in range(n):
        g = torch.Generator().manual_seed(2000 + r)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
        inp[r] = (x, idx, torch.rand(t, k, generator=g).cuda())
    wmat = torch.randn(h, h, dtype=torch.bfloat16, device="cuda") / 64
    state = {}

    def disp(r):
        x, idx, _ = inp[r]
        state[r] = bufs[r].low_latency_dispatch(x, idx, t, e, use_fp8=False)

    def comb(r):
        _, idx, w = inp[r]
        recv, _, handle, _, _ = state[r]
        return bufs[r].low_latency_combine(recv, idx, w, handle)[0]

    big = torch.ones(16 << 20, device="cuda")

    def step(r):
        disp(r)
        if work == "gemm":
            inp[r][0] @ wmat
        elif work == "ew":
            big.mul(1.0001).add_(1.0)
        return comb(r)

    verdict = "ok"
    try:
        group.run(disp)
        if recv_blocks > 0:
            for b in bufs.values():
                b._ll_region.recv_blocks = recv_blocks
        want = [c.clone() for c in group.run(comb)]
        inp[0][0] @ wmat  # cuBLAS's kernel loaded before any rank's call
        torch.cuda.synchronize()
        got = group.run(step)
        torch.cuda.synchronize()
        bad = [r for r in range(n) if not torch.equal(got[r], want[r])]
        if bad:
            verdict = f"WRONG on ranks {bad}"
        t0 = time.perf_counter()
        for _ in range(args.iters):
            group.run(step)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / args.iters * 1e6
    except Exception as exc:
        verdict, us = f"{type(exc).__name__}: {str(exc)[:200]}", float("nan")
    try:
        torch.cuda.synchronize()
        group.run(lambda r: bufs[r].destroy())
    except Exception as exc:
        verdict += f" (destroy: {type(exc).__name__})"
    blocks = recv_blocks or "default"
    return f"EP{n} step work={work} recv_blocks={blocks}: {verdict}, {us:.1f} us a step (eager)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="profile_ll_native.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--step", action="store_true", help="diagnose the decode step instead (see _step)")
    ap.add_argument(
        "--recv-blocks", type=int, nargs="+", default=[0], help="--step: grid caps to try (0: as built)"
    )
    ap.add_argument("--out", default=None, help="ignored (gpu-suite.sh passes it)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_ll_native: skipped (no CUDA device)")
        return 0
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    for n in args.ranks:
        if not args.step:
            _profile(torch, n, args)
            continue
        for blocks in args.recv_blocks:
            for work in ("none", "ew", "gemm"):
                print(_step(torch, n, args, blocks, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
