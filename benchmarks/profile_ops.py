#!/usr/bin/env python3
"""Where the GPU time of one dispatch / combine goes: every kernel (and memset / memcpy) that an op puts on the
device, with its duration, from CUPTI (torch.profiler) over CUDA-graph replays of the loopback domain.

The decode benchmark (`bench_ep.py --decode`) reports one number per op; this script splits it: the dispatch
kernel, its copy epilogue, the combine kernel, any memset, and the gap between them (launch latency inside the
graph). It is the measurement behind issue 17's levers.

    python benchmarks/profile_ops.py --out OUTDIR [--ranks 1] [--tokens 128] [--sms 16] [--iters 20]

Writes OUTDIR/profile_ops_ep<N>.json and prints a table per op: activity name, count per replay, mean us, and the
replay's span (first start to last end on the device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ep  # (inputs, allocator and graph capture of the benchmark itself)


def _capture(timer, fn):
    from ep_core.kernels import _cuda

    drv = _cuda.driver()
    fn()
    timer.torch.cuda.synchronize()
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    _cuda.check(drv.cuStreamBeginCapture(timer.main.handle, mode), "cuStreamBeginCapture")
    fork = timer.Event(timing=False)
    fork.record(timer.main)
    joins = [timer.Event(timing=False) for _ in timer.streams]
    for s in timer.streams:
        s.wait_event(fork)
    fn()
    for s, ev in zip(timer.streams, joins):
        ev.record(s)
        timer.main.wait_event(ev)
    graph = _cuda.check(drv.cuStreamEndCapture(timer.main.handle), "cuStreamEndCapture")
    exe = _cuda.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return lambda: _cuda.check(drv.cuGraphLaunch(exe, timer.main.handle), "cuGraphLaunch")


def profile_op(torch, replay, iters):
    """Replays one graph `iters` times under the profiler; returns per-activity stats and the span per replay."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    spans = []
    per_name: dict[str, list[float]] = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    # split into replays: a gap of more than 200 us on the device separates two synchronized replays
    groups, cur, last_end = [], [], None
    for e in events:
        if last_end is not None and e.time_range.start - last_end > 200:
            groups.append(cur)
            cur = []
        cur.append(e)
        last_end = max(last_end or 0, e.time_range.end)
    if cur:
        groups.append(cur)
    for g in groups:
        spans.append(max(e.time_range.end for e in g) - min(e.time_range.start for e in g))
        for e in g:
            per_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    n = max(1, len(groups))
    acts = [
        {"name": k, "per_replay": len(v) / n, "mean_us": statistics.mean(v), "max_us": max(v)}
        for k, v in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    ]
    return {
        "replays": len(groups),
        "span_us_median": statistics.median(spans) if spans else None,
        "activities": acts,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=bench_ep.DECODE_TOKENS)
    ap.add_argument("--sms", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    torch = bench_ep._torch()
    if not torch.cuda.is_available():
        print("profile_ops: skipped (no CUDA device)")
        return 0
    from ep_core.loopback import LoopbackDomain

    n, t = args.ranks, args.tokens
    xs, _sfs, idxs, ws = bench_ep.make_inputs(n, False, "uniform", seed=7, tokens=t)
    dom = LoopbackDomain(
        n,
        num_max_tokens_per_rank=t,
        hidden=bench_ep.HIDDEN,
        num_topk=bench_ep.TOPK,
        num_sms=args.sms,
        gpu_timeout_secs=20.0,
    )
    allocs = [bench_ep.CachingAllocator(s) for s in dom.streams]
    for rank, a in zip(dom.ranks, allocs):
        rank._allocator = a
    timer = bench_ep.Timer(dom.streams)
    kw = {"num_experts": bench_ep.NUM_EXPERTS, "num_sms": args.sms}
    state = {}

    def reset(tag):
        for a in allocs:
            a.reset(tag)

    def disp():
        reset("nosync")
        dom.dispatch(xs, idxs, ws, do_cpu_sync=False, **kw)

    reset("sync")
    state["sync"] = dom.dispatch(xs, idxs, ws, do_cpu_sync=True, **kw)
    handles = [o.handle for o in state["sync"]]

    def cached():
        reset("cached")
        dom.dispatch(xs, None, ws, handles=handles, num_sms=args.sms)

    ys = [
        torch.randn(o.recv_x.shape[0], bench_ep.HIDDEN, dtype=torch.bfloat16, device="cuda")
        for o in state["sync"]
    ]

    def comb():
        reset("comb")
        dom.combine(ys, handles, num_sms=args.sms)

    result = {"ranks": n, "tokens": t, "sms": args.sms, "ops": {}}
    for name, fn in (("dispatch", disp), ("dispatch_cached", cached), ("combine", comb)):
        r = profile_op(torch, _capture(timer, fn), args.iters)
        r["graph_us"] = timer.run_graph(fn, args.iters) * 1e3
        result["ops"][name] = r
        print(
            f"== EP{n} {name}: graph replay {r['graph_us']:.1f} us (events), device span {r['span_us_median']:.1f} us"
        )
        for a in r["activities"]:
            print(
                f"   {a['per_replay']:5.1f} x {a['mean_us']:8.2f} us (max {a['max_us']:8.2f})  {a['name'][:90]}"
            )
    dom.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_ops_ep{n}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
