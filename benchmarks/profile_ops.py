#!/usr/bin/env python3
"""Where the GPU time of one dispatch / combine goes: every kernel (and memset / memcpy) that an op puts on the
device, with its duration, from CUPTI (torch.profiler) over CUDA-graph replays of the loopback domain.

The decode benchmark (`bench_ep.py --decode`) reports one number per op; this script splits it: the dispatch
kernel, its copy epilogue, the combine kernel, the zero-copy dispatch (no epilogue), any memset, and the gap between
them (launch latency inside the graph). It is the measurement behind issue 17's levers.

    python benchmarks/profile_ops.py --out OUTDIR [--ranks 1] [--tokens 128] [--sms 16] [--iters 20]
    python benchmarks/profile_ops.py --out OUTDIR --phases [--ranks N --sms S]   # EP1 @16 and EP8 @8 by default
    python benchmarks/profile_ops.py ... --staged-combine   # combine launched with its shared memory (staged path)
    python benchmarks/profile_ops.py ... --register-combine # combine without it (register path; staged is default)
    python benchmarks/profile_ops.py ... --fp8              # FP8 dispatch (row-major scales), as bench_ep.py
    python benchmarks/profile_ops.py ... --no-overlap       # prefer_overlap_with_compute=False, as bench_ep.py

Writes OUTDIR/profile_ops_ep<N>.json and prints a table per op: activity name, count per replay, mean us, and the
replay's span (first start to last end on the device).

`--phases` builds the kernels with the phase-timing instrument (EPKIT_PHASE_TIMING=1, a separate JIT build:
include/ep_core/phase_timing.cuh) and prints, per op and kernel, when each phase boundary was reached (%globaltimer,
us after the kernel's first block started, mean over replays and ranks, and the slowest rank), the step from the
previous boundary, the kernel's span and the gap between the dispatch kernel and its epilogue. Block-0 stamps
("b0 ...") time the serial path; "last" stamps the slowest block. Writes OUTDIR/profile_phases_ep<N>.json.
Each op also gets its passes' rates (`pass_bytes`, `pass_rates`; JSON key "passes"): the bytes a pass reads and
writes, counted from the routing as the kernels move them, all ranks together, over the pass's time (the mean rank's
and the slowest rank's), in GB/s and GB/s per SM. Set beside `bench_sm_copy.py` at the same SM count (copy, fan-out 5) in the same run, they
say whether a pass is short of what its SMs can move or at it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


# Slot names of include/ep_core/phase_timing.cuh (kernel index -> slot -> name); grid barriers n = 1.. are added.
PHASE_KERNELS = ("dispatch", "epilogue", "combine")
PHASE_SLOTS = 32
PHASE_MAX_RANKS = 8
PHASE_NAMES = {
    0: {
        0: "start (first block)",
        1: "b0 setup",
        2: "b0 count (det)",
        3: "b0 cross-rank entry barrier",
        4: "b0 prefix (det)",
        5: "b0 send loop issued",
        6: "b0 stores done, counts flushed",
        7: "b0 expert counts stored",
        8: "b0 rank counts released",
        9: "b0 every count received",
        10: "b0 handle written",
        11: "last block: send + flush",
        15: "end (last block)",
    },
    1: {
        0: "start (first block)",
        1: "b0 setup",
        2: "b0 row loop issued",
        3: "last block: rows stored",
        15: "end (last block)",
    },
    2: {
        0: "start (first block)",
        1: "b0 setup",
        2: "b0 cross-rank entry barrier",
        3: "b0 rows sent",
        4: "b0 cross-rank exit barrier",
        5: "b0 tokens reduced",
        11: "last block: rows sent",
        12: "last block: tokens reduced",
        15: "end (last block)",
    },
}
for _names in PHASE_NAMES.values():
    for _n in range(1, 8):
        _names[16 + _n] = f"grid barrier {_n}: last arrival"
        _names[24 + _n] = f"grid barrier {_n}: b0 leaves"


@contextlib.contextmanager
def staged_combine_launches(enabled: bool = True):
    """While active, every direct combine launch prepared by a RankDriver gets `KernelConfig.combine_dynamic_smem_bytes`
    of dynamic shared memory, which makes the kernel take its staged (bulk-copy) path. Since c5fd13a the executor
    does this itself (`_combine_smem`), so the flag only matters for older checkouts."""
    if not enabled:
        yield
        return
    from ep_core.kernels import _source, rank_driver

    orig = rank_driver.RankDriver._prepare

    def _prepare(self, kernel, name, geo, shared_mem, *rest, **kw):
        if name == "ep_combine_impl" and shared_mem == 0:
            cfg = next((c for c, ks in _source._loaded.items() if ks.combine is kernel), None)
            if cfg is not None and not cfg.is_hybrid:
                shared_mem = cfg.combine_dynamic_smem_bytes
        return orig(self, kernel, name, geo, shared_mem, *rest, **kw)

    rank_driver.RankDriver._prepare = _prepare
    try:
        yield
    finally:
        rank_driver.RankDriver._prepare = orig


@contextlib.contextmanager
def register_combine_launches(enabled: bool = True):
    """While active, direct combines launch without dynamic shared memory (executor `_combine_smem` -> 0), so the
    kernel takes its register path: A/B of the staged combine (the default since c5fd13a) on the same build."""
    if not enabled:
        yield
        return
    from ep_core.kernels import rank_driver

    orig = rank_driver._combine_smem
    rank_driver._combine_smem = lambda cfg: 0
    try:
        yield
    finally:
        rank_driver._combine_smem = orig


class PhaseReader:
    """The module globals `ep_core_phase_ts[rank][kernel][slot]` of every loaded instance of `num_ranks` ranks (an
    op may run kernels of two instances: an FP8 dispatch's and the bf16 combine's): zeroed before a replay, read
    after it, merged (a stamp is nonzero only in the instance whose kernel wrote it)."""

    def __init__(self, num_ranks: int) -> None:
        from ep_core.kernels import _cuda, _source

        ks = [k for c, k in _source._loaded.items() if c.num_ranks == num_ranks and not c.is_hybrid]
        if not ks:
            raise SystemExit(f"profile_ops --phases: no loaded EP{num_ranks} kernels")
        drv = _cuda.driver()
        self.drv, self.check = drv, _cuda.check
        self.size = 8 * PHASE_MAX_RANKS * len(PHASE_KERNELS) * PHASE_SLOTS
        self.ptrs = []
        for lib in {id(k.dispatch.module._library): k.dispatch.module._library for k in ks}.values():
            ptr, size = self.check(drv.cuLibraryGetGlobal(lib, b"ep_core_phase_ts"), "cuLibraryGetGlobal")
            if int(size) != self.size:
                raise SystemExit(
                    f"profile_ops --phases: ep_core_phase_ts has {int(size)} bytes; update the mirror"
                )
            self.ptrs.append(int(ptr))

    def zero(self) -> None:
        for ptr in self.ptrs:
            self.check(self.drv.cuMemsetD8(ptr, 0, self.size), "cuMemsetD8")

    def read(self):
        import numpy as np

        merged = np.zeros(self.size // 8, dtype=np.uint64)
        host = np.zeros_like(merged)
        for ptr in self.ptrs:
            self.check(self.drv.cuMemcpyDtoH(host.ctypes.data, ptr, self.size), "cuMemcpyDtoH")
            np.maximum(merged, host, out=merged)
        return merged.reshape(PHASE_MAX_RANKS, len(PHASE_KERNELS), PHASE_SLOTS)


def phase_op(torch, replay, iters, num_ranks):
    """Replays one graph `iters` times, reading the stamps after each; returns per-kernel phase statistics. The
    reader is made after the warm-up replays, when every instance the op runs is loaded."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    reader = PhaseReader(num_ranks)
    samples = []
    for _ in range(iters):
        reader.zero()
        replay()
        torch.cuda.synchronize()
        samples.append(reader.read()[: min(num_ranks, PHASE_MAX_RANKS)].astype("int64"))
    out = {}
    for k, kname in enumerate(PHASE_KERNELS):
        starts = [s[r, k, 0] for s in samples for r in range(s.shape[0])]
        if not any(starts):
            continue
        slots = {}
        for slot in range(PHASE_SLOTS):
            offs, per_replay_max, slowest, by_rank = [], [], [], {}
            for s in samples:
                row = {
                    r: (s[r, k, slot] - s[r, k, 0]) / 1e3
                    for r in range(s.shape[0])
                    if s[r, k, slot] and s[r, k, 0]
                }
                offs.extend(row.values())
                if row:
                    per_replay_max.append(max(row.values()))
                    slowest.append(max(row, key=row.get))
                for r, v in row.items():
                    by_rank.setdefault(r, []).append(v)
            if offs and slot != 0:
                slots[slot] = {
                    "name": PHASE_NAMES[k].get(slot, f"slot {slot}"),
                    "mean_us": statistics.mean(offs),
                    "max_rank_us": statistics.mean(per_replay_max),
                    "rank_us": {r: statistics.mean(v) for r, v in sorted(by_rank.items())},
                    # the rank that was slowest in most replays, and in how many of them
                    "slowest_rank": statistics.mode(slowest),
                    "slowest_rank_replays": slowest.count(statistics.mode(slowest)),
                }
        skew = [
            (max(s[:, k, 0]) - min(s[:, k, 0])) / 1e3 for s in samples if all(s[:, k, 0])
        ]  # ranks' kernel starts
        entry = {"slots": slots, "start_skew_us": statistics.mean(skew) if skew else 0.0}
        if k == 1:  # gap between the dispatch kernel's last block and the epilogue's first
            gaps = [
                (s[r, 1, 0] - s[r, 0, 15]) / 1e3
                for s in samples
                for r in range(s.shape[0])
                if s[r, 1, 0] and s[r, 0, 15]
            ]
            entry["gap_after_dispatch_us"] = statistics.mean(gaps) if gaps else None
        out[kname] = entry
    return out


def own_pairs(idxs, n):
    """(token, destination rank) pairs of all ranks (deduplicated) and those whose destination is the source
    itself, as python ints."""
    rows = bench_ep.pair_matrix(idxs, n)
    return sum(map(sum, rows)), sum(rows[r][r] for r in range(n))


# (kernel, pass) -> (the phase slot where the pass starts, 0 = the kernel's start; the slot where its last block is
# done).
PASS_SLOTS = {
    ("dispatch", "send"): (0, 11),
    ("epilogue", "copy"): (0, 3),
    ("combine", "send"): (0, 11),
    ("combine", "reduce"): (4, 12),
}


def pass_bytes(idxs, n, tokens, fp8):
    """Bytes each pass of each op reads and writes in HBM, all ranks together, counted from the routing as the
    kernels move them (direct mode): a rank's own copy of a token carries only its tail in the dispatch's send
    (`kDirectOwnRowsTailOnly`; the epilogue reads the hidden part from x), and the combine leaves its own rows by
    reference (`EPKIT_COMBINE_LOCAL_REF`, the default). Returns {op: {(kernel, pass): (read, written)}}."""
    import ep_layout

    S, own = own_pairs(idxs, n)
    K, H = bench_ep.TOPK, bench_ep.HIDDEN
    hb = H * (1 if fp8 else 2)
    packs = H // 128 if fp8 else 0
    d_tok = ep_layout.make_dispatch_token_layout(H, 1 if fp8 else 2, packs, K).get_num_bytes()
    c_tok = ep_layout.make_combine_token_layout(H, K).get_num_bytes()
    x_read = n * tokens * (hb + 4 * packs) if n > 1 else 0  # a lone rank's send never loads the hidden part
    send = (x_read, (S - own) * d_tok + own * (d_tok - hb))
    # the epilogue reads every row (a kept row's hidden part from x) and writes hidden, scales, ids, weights, metadata
    outputs = S * (hb + 4 * packs + 8 * K + 4 * K + 4 * (K + 2))
    copy = (S * d_tok, outputs)
    ordinary = {("dispatch", "send"): send, ("epilogue", "copy"): copy}
    zero_copy = {("dispatch", "send"): (n * tokens * (hb + 4 * packs), S * (hb + 4 * packs + 12 * K + 8))}
    comb = {
        ("combine", "send"): ((S - own) * 2 * H, (S - own) * c_tok),
        ("combine", "reduce"): ((S - own) * c_tok + own * 2 * H, n * tokens * 2 * H),
    }
    return {
        "dispatch": ordinary,
        "dispatch_cached": ordinary,
        "dispatch_deterministic": ordinary,
        "dispatch_zero_copy": zero_copy,
        "combine": comb,
    }


def pass_rates(phases, moved):
    """Per pass: bytes, its time and GB/s read + written, all ranks' bytes over the mean rank's pass (each rank's
    SMs moved its share in that time) and over the slowest rank's (the GPU's rate while every rank's pass ran)."""
    rates = {}
    for (kname, pname), (read, written) in moved.items():
        start, end = PASS_SLOTS[(kname, pname)]
        slots = phases.get(kname, {}).get("slots", {})
        if end not in slots or (start and start not in slots):
            continue
        us = slots[end]["mean_us"] - (slots[start]["mean_us"] if start else 0.0)
        slowest_us = slots[end]["max_rank_us"] - (slots[start]["mean_us"] if start else 0.0)
        rates[f"{kname} {pname}"] = {
            "read_bytes": read,
            "written_bytes": written,
            "us": us,
            "slowest_rank_us": slowest_us,
            "gbs": _gbs(read + written, us),
            "write_gbs": _gbs(written, us),
            "gbs_slowest_rank": _gbs(read + written, slowest_us),
        }
    return rates


def _gbs(nbytes, us):
    return nbytes / (us * 1e3) if us > 0 else float("nan")


def print_phases(n, sms, op, phases, rates=None) -> None:
    for kname in (k for k in PHASE_KERNELS if k in phases):
        entry = phases[kname]
        head = f"== EP{n} @{sms} SMs {op} / {kname}: rank start skew {entry['start_skew_us']:.1f} us"
        if entry.get("gap_after_dispatch_us") is not None:
            head += f", starts {entry['gap_after_dispatch_us']:.1f} us after the dispatch kernel ended"
        print(head)
        prev = 0.0
        for slot, v in sorted(entry["slots"].items(), key=lambda kv: kv[1]["mean_us"]):
            print(
                f"   {v['mean_us']:8.2f} us (+{v['mean_us'] - prev:7.2f})  slowest rank {v['max_rank_us']:8.2f}  "
                f"[{slot:2d}] {v['name']}"
            )
            prev = v["mean_us"]
        for slot in (
            end for (kn, _), (_, end) in PASS_SLOTS.items() if kn == kname and end in entry["slots"]
        ):
            v = entry["slots"][slot]
            if len(v.get("rank_us", {})) > 1:
                print(
                    f"   [{slot:2d}] per rank: "
                    + " ".join(f"{us:.1f}" for us in v["rank_us"].values())
                    + " us; "
                    f"slowest rank {v['slowest_rank']} in {v['slowest_rank_replays']} replays"
                )
    for name, r in (rates or {}).items():
        print(
            f"   pass {name}: {r['read_bytes'] / 1e6:.1f} MB read + {r['written_bytes'] / 1e6:.1f} MB written in "
            f"{r['us']:.1f} us = {r['gbs']:.0f} GB/s (writes {r['write_gbs']:.0f}; "
            f"{r['gbs'] / (n * sms):.1f} GB/s per SM of {n * sms}); by the slowest rank ({r['slowest_rank_us']:.1f} "
            f"us) {r['gbs_slowest_rank']:.0f} GB/s"
        )


def run_config(torch, n, t, sms, iters, phases, out, fp8=False, overlap=True):
    from ep_core.loopback import LoopbackDomain

    xs, sfs, idxs, ws = bench_ep.make_inputs(n, fp8, "uniform", seed=7, tokens=t)
    if fp8:
        xs = [(x, sf) for x, sf in zip(xs, sfs)]
    dom = LoopbackDomain(
        n,
        num_max_tokens_per_rank=t,
        hidden=bench_ep.HIDDEN,
        num_topk=bench_ep.TOPK,
        num_sms=sms,
        gpu_timeout_secs=20.0,
        prefer_overlap_with_compute=overlap,
    )
    allocs = [bench_ep.CachingAllocator(s) for s in dom.streams]
    for rank, a in zip(dom.ranks, allocs):
        rank._allocator = a
    timer = bench_ep.Timer(dom.streams)
    kw = {"num_experts": bench_ep.NUM_EXPERTS, "num_sms": sms}
    state = {}

    def reset(tag):
        for a in allocs:
            a.reset(tag)

    def disp():
        reset("nosync")
        dom.dispatch(xs, idxs, ws, do_cpu_sync=False, **kw)

    def disp_det():
        reset("det")
        dom.dispatch(xs, idxs, ws, do_cpu_sync=False, deterministic=True, **kw)

    reset("sync")
    state["sync"] = dom.dispatch(xs, idxs, ws, do_cpu_sync=True, **kw)
    handles = [o.handle for o in state["sync"]]

    def cached():
        reset("cached")
        dom.dispatch(xs, None, ws, handles=handles, num_sms=sms)

    ys = [
        torch.randn(o.recv_x.shape[0], bench_ep.HIDDEN, dtype=torch.bfloat16, device="cuda")
        for o in state["sync"]
    ]

    def comb():
        reset("comb")
        dom.combine(ys, handles, num_sms=sms)

    def disp_zc():  # the outputs stored in place in the receive regions (no copy epilogue)
        reset("zc")
        dom.dispatch(xs, idxs, ws, do_cpu_sync=False, zero_copy=True, **kw)

    ops = [
        ("dispatch", disp),
        ("dispatch_cached", cached),
        ("combine", comb),
        ("dispatch_zero_copy", disp_zc),
    ]
    result = {
        "ranks": n,
        "tokens": t,
        "sms": sms,
        "dtype": "fp8" if fp8 else "bf16",
        "prefer_overlap_with_compute": overlap,
        "ops": {},
    }
    if phases:
        ops.insert(2, ("dispatch_deterministic", disp_det))
        moved = pass_bytes(idxs, n, t, fp8)
        for name, fn in ops:
            ph = phase_op(torch, _capture(timer, fn), iters, n)
            ph["passes"] = pass_rates(ph, moved.get(name, {}))
            result["ops"][name] = ph
            print_phases(n, sms, name, ph, ph["passes"])
        path = out / f"profile_phases_ep{n}{'_fp8' if fp8 else ''}.json"
    else:
        for name, fn in ops:
            r = profile_op(torch, _capture(timer, fn), iters)
            one, many = timer.run_graph_pair(fn, iters)
            r["graph_us"], r["batch_us"] = one * 1e3, many * 1e3
            r.update(timer.last_batch)
            result["ops"][name] = r
            print(
                f"== EP{n} {name}: graph replay {r['graph_us']:.1f} us (events, 1 replay), "
                f"{r['batch_us']:.1f} us per replay back to back (bench_ep's GPU us; host "
                f"{r.get('batch_host_us_per_launch', float('nan')):.1f} us per cuGraphLaunch), "
                f"device span {r['span_us_median']:.1f} us"
            )
            for a in r["activities"]:
                print(
                    f"   {a['per_replay']:5.1f} x {a['mean_us']:8.2f} us (max {a['max_us']:8.2f})  "
                    f"{a['name'][:90]}"
                )
        path = out / f"profile_ops_ep{n}{'_fp8' if fp8 else ''}.json"
    dom.close()
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--ranks", type=int, default=None, help="ranks (default 1; --phases: EP1 and EP8)")
    ap.add_argument("--tokens", type=int, default=bench_ep.DECODE_TOKENS)
    ap.add_argument(
        "--sms", type=int, default=None, help="SMs per rank (default 16; --phases: 16 at EP1, 8 at EP8)"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--fp8", action="store_true", help="FP8 dispatch (data + row-major scales), as bench_ep's"
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="prefer_overlap_with_compute=False: the copy epilogue and the combine's reduce on each rank's share",
    )
    ap.add_argument("--phases", action="store_true", help="phase timing of every kernel (instrumented build)")
    ap.add_argument(
        "--staged-combine",
        action="store_true",
        help="launch the combine with KernelConfig.combine_dynamic_smem_bytes (its staged bulk-copy path)",
    )
    ap.add_argument(
        "--register-combine",
        action="store_true",
        help="launch the combine without shared memory (its register path), to compare with the staged default",
    )
    args = ap.parse_args(argv)
    if args.phases:
        os.environ["EPKIT_PHASE_TIMING"] = "1"  # before the first kernel load (ep_core.kernels._source)
    torch = bench_ep._torch()
    if not torch.cuda.is_available():
        print("profile_ops: skipped (no CUDA device)")
        return 0
    if args.ranks is None and args.phases:
        configs = [(1, args.sms or 16), (8, args.sms or 8)]
    else:
        n = args.ranks or 1
        configs = [(n, args.sms or 16)]
    for n, sms in configs:
        with (
            staged_combine_launches(args.staged_combine),
            register_combine_launches(args.register_combine),
        ):
            run_config(
                torch,
                n,
                args.tokens,
                sms,
                args.iters,
                args.phases,
                Path(args.out),
                fp8=args.fp8,
                overlap=not args.no_overlap,
            )
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
