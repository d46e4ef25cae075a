#!/usr/bin/env python3
"""Benchmark of ep's direct-mode dispatch and combine kernels in the loopback domain on one GPU.

Default (throughput) run: loopback EP8 (8 ranks on one GPU, SMs per rank 4/8/16) and EP1 (SMs 4..64), T=4096
tokens per rank, hidden 7168, top-8 of 256 experts, bf16 and FP8 dispatch, bf16 combine, uniform and unbalanced
routing. Per op: median time over CUDA events (L2 flushed before every run), bytes moved, achieved bandwidth as a
fraction of the device-to-device copy ceiling measured in the same run, SMs used, and the ratio against a
torch-native baseline measured in the same run (sort by destination, peer copies, host sync for counts, index_add_
combine).

Decode (latency) run, `--decode`: small batches as in inference decoding. T=128 tokens per rank (`--tokens`
overrides it), EP8 at 4/8/16 SMs per rank and EP1 at 8/16/32, bf16 and FP8 dispatch, bf16 combine, uniform
routing, 30 timed iterations by default. Times are printed in microseconds, next to the floor (bytes moved / copy
ceiling, in us) and the torch-native baseline at the same T; JSON rows keep every default column (`time_ms`, ...)
and add `time_us`, `floor_us` and `torch_us`. A decode row's GPU time of a graph-replayed op is the mean over
DECODE_BATCH replays launched back to back between two events, queued while a spinning kernel holds the stream
(so the device runs them one after another without waiting for the host: the ~10 us submission latency of
cuGraphLaunch and the host's launch rate are both hidden; `batch_submit_hidden` in the JSON row is the fraction of
timed batches whose every launch was queued before the start event ran, 1.0 unless the hold was too short, and the
progress line flags it otherwise); the old measurement, one replay between two events (submission included), stays
in `time_us_1replay` and its own table column. Each graph-replayed decode row also has `graph_floor_us`: the same
back-to-back replays of a graph of the same shape with nothing in it (on every rank stream, as many one-block
kernels as the op's graph holds per rank, `graph_kernels` in all), the part of the row's time that the fork / join
of N rank streams and the kernel launches cost before any kernel does work.

Ops: `dispatch` (no CPU sync), `dispatch_cached`, `dispatch_deterministic` and `combine` are timed as CUDA-graph
replays of all ranks' launches (GPU time: N ranks launched from one Python thread would otherwise measure the
host); `*_eager` are the same ops launched eagerly, `dispatch_cpu_sync` waits on the host for the counts (eager).
`combine_zero_copy` (direct mode, bf16) is the combine of the same rows written into the ranks' combine buffers
(`LoopbackDomain.combine_buffers`, `zero_copy=True`): its bytes are one pass (each expert row read where it is, each
token written), so its % of the ceiling is its own; compare its time with `combine`'s. `dispatch_zero_copy` (direct
mode, no CPU sync) stores the outputs in place in the receive regions (`zero_copy=True`, deterministic order, no copy
epilogue): its bytes are x read once and each copy written once; compare its time with `dispatch`'s.

    python benchmarks/bench_ep.py --out OUTDIR [--quick]              # throughput, T=4096
    python benchmarks/bench_ep.py --out OUTDIR --decode [--quick]     # latency, T=128
    python benchmarks/bench_ep.py --out OUTDIR [--decode] --tokens T  # another T
    python benchmarks/bench_ep.py --out OUTDIR --hybrid [--quick]     # emulated nodes, T=4096
    python benchmarks/bench_ep.py --out OUTDIR --ranks 8 --no-overlap # epilogues on each rank's share of the GPU

`--no-overlap` builds the domains with prefer_overlap_with_compute=False: the dispatch's copy epilogue and the
combine's reduce run on device SMs // ranks per rank (DeepEP V2's placement: every SM of a rank's GPU), the dispatch
and combine kernels on the swept SMs per rank. Rows carry `prefer_overlap_with_compute`.

Hybrid run, `--hybrid`: loopback EP8 as emulated nodes, 2 nodes x 4 ranks and 4 nodes x 2 (`num_scaleup_ranks`
4 and 2), next to direct-mode EP8 on the same inputs, bf16 and FP8 dispatch, bf16 combine, uniform routing, 16
SMs per rank. Rows add `scaleup_ranks`, `cross_node_pairs` and `cross_node_bytes` (the (token, destination
node) pairs that leave their node, counted from the routing: a token crosses once per destination node, so these
are what a real network would carry; direct mode would send one copy per remote *rank*,
`cross_node_rank_pairs`) and `qps` (the planner's QP count for the domain). On one GPU the "network" is a
load/store emulation: the times are emulation figures, not network figures.

Writes OUTDIR/bench_ep.json and OUTDIR/bench_ep.png (default run), OUTDIR/bench_ep_decode.json and .png
(`--decode`); a `--tokens` other than the mode's default adds `_t<T>` to the name (bench_ep_t1024.json,
bench_ep_decode_t64.json), so runs never overwrite each other. Prints a table. Needs torch (inputs and the
baseline) and an NVIDIA GPU; without one it prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8
DEFAULT_TOKENS = 4096  # tokens per rank of the throughput run
DECODE_TOKENS = 128  # tokens per rank of the decode (latency) run
ITERS, DECODE_ITERS = 10, 30  # timed iterations per op (medians)
DECODE_BATCH = (
    20  # decode: graph replays launched back to back per timed iteration (GPU time without submission)
)
# decode: before a batch's start event the stream is held busy (a spinning kernel) for at least this long, and for
# 2x the longest host time one batch's launches took so far, so every launch is queued before timing starts
HOLD_MIN_US = 200.0
# clock64 ticks per us for the hold (H200: at most 1.98 GHz, so the hold lasts rather longer than asked)
HOLD_CYCLES_PER_US = 2000
# BENCH_EP_HOLD=0: no hold (the batch then starts right after the start event, as before 8ee6ac3)
HOLD = os.environ.get("BENCH_EP_HOLD", "1").strip() != "0"
TORCH_ITERS, DECODE_TORCH_ITERS = 3, 10  # timed iterations of the torch-native baseline


@dataclass(frozen=True)
class Config:
    """One domain of the run: ranks, dispatch dtype, routing, and the SMs per rank to sweep."""

    ranks: int
    fp8: bool
    routing: str
    sms: tuple[int, ...]
    scaleup: int | None = None  # ranks per emulated node (hybrid mode); None: one NVLink domain (direct mode)


@dataclass(frozen=True)
class BenchPlan:
    """Everything the command line decides, resolved before torch or CUDA is touched."""

    decode: bool
    quick: bool
    tokens: int
    iters: int
    torch_iters: int
    configs: tuple[Config, ...]
    out: str  # output directory
    stem: str  # output file name without suffix
    hybrid: bool = False  # emulated nodes (`--hybrid`)
    overlap: bool = True  # prefer_overlap_with_compute (`--no-overlap`: False)

    @property
    def json_name(self) -> str:
        return f"{self.stem}.json"

    @property
    def png_name(self) -> str:
        return f"{self.stem}.png"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. `8,16,132`."""
    values = tuple(_positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers, got {text!r}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Default: throughput run at T=4096, writes bench_ep.json/.png. --decode: latency run at T=128 "
        "(EP8 at 4/8/16 SMs per rank, EP1 at 8/16/32, bf16 and FP8, uniform routing), times in us with the "
        "floor and the torch baseline, writes bench_ep_decode.json/.png.",
    )
    ap.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    ap.add_argument(
        "--iters",
        type=_positive_int,
        default=None,
        help=f"timed iterations per op (default: {ITERS}, {DECODE_ITERS} with --decode)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="EP8 at 16 SMs and EP1 at 16 SMs only, bf16 uniform (with --decode: EP8 at 8, EP1 at 16)",
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help=f"latency preset: T={DECODE_TOKENS} tokens per rank, EP8 at 4/8/16 SMs per rank and EP1 at 8/16/32, "
        "bf16 and FP8 dispatch, combine, cached dispatch; times in us next to the floor (bytes / copy ceiling) "
        "and the torch-native baseline; writes bench_ep_decode.json/.png",
    )
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="emulated nodes: EP8 as 2x4 and 4x2 (num_scaleup_ranks 4 and 2) next to direct EP8, T=4096, 16 SMs "
        "per rank, bf16 and FP8; rows add the bytes that cross node boundaries; writes bench_ep_hybrid.json/.png",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="prefer_overlap_with_compute=False: each rank's dispatch copy epilogue runs on its share of the GPU "
        "(device SMs // ranks), not on the op's SMs per rank, as DeepEP V2 runs its epilogues on every SM; "
        "adds _no-overlap to the output file names",
    )
    ap.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        metavar="T",
        help=f"tokens per rank (default: {DEFAULT_TOKENS}, {DECODE_TOKENS} with --decode); a T other than the "
        "mode's default adds _t<T> to the output file names",
    )
    ap.add_argument(
        "--ranks",
        type=_int_list,
        default=None,
        metavar="N[,N]",
        help="keep only the mode's domains of these rank counts (e.g. 1); adds _ep<N> to the output file names",
    )
    ap.add_argument(
        "--sms",
        type=_int_list,
        default=None,
        metavar="S[,S]",
        help="SMs per rank to sweep instead of the mode's (e.g. 8,16,32,132 with --ranks 1: the decode optimum "
        "against the planner's count); adds _sms<S> to the output file names",
    )
    return ap


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Turn parsed arguments into the run: tokens, iterations, domains and SM sweeps, output file stem."""
    decode = bool(args.decode)
    mode_tokens = DECODE_TOKENS if decode else DEFAULT_TOKENS
    tokens = mode_tokens if args.tokens is None else int(args.tokens)
    iters = args.iters if args.iters is not None else (DECODE_ITERS if decode else ITERS)
    configs: list[Config] = []
    hybrid = bool(getattr(args, "hybrid", False))
    if hybrid and decode:
        raise SystemExit("bench_ep: --hybrid and --decode are separate runs; pick one")
    if hybrid:
        for fp8 in (False,) if args.quick else (False, True):
            for scaleup in (4, 2, None):
                configs.append(Config(8, fp8, "uniform", (16,), scaleup))
    elif args.quick:
        sms8, sms1 = ((8,), (16,)) if decode else ((16,), (16,))
        configs = [Config(8, False, "uniform", sms8), Config(1, False, "uniform", sms1)]
    elif decode:
        for fp8 in (False, True):
            configs.append(Config(8, fp8, "uniform", (4, 8, 16)))
            configs.append(Config(1, fp8, "uniform", (8, 16, 32)))
    else:
        for fp8 in (False, True):
            for kind in ("uniform", "unbalanced"):
                configs.append(Config(8, fp8, kind, (4, 8, 16)))
                configs.append(Config(1, fp8, kind, (4, 8, 16, 32, 64)))
    ranks, sms = getattr(args, "ranks", None), getattr(args, "sms", None)
    if ranks is not None:
        configs = [c for c in configs if c.ranks in ranks]
        if not configs:
            raise SystemExit(f"bench_ep: --ranks {','.join(map(str, ranks))}: no domain of this run has them")
    if sms is not None:
        configs = [dataclasses.replace(c, sms=tuple(sms)) for c in configs]
    stem = "bench_ep_decode" if decode else ("bench_ep_hybrid" if hybrid else "bench_ep")
    if tokens != mode_tokens:
        stem += f"_t{tokens}"
    if ranks is not None:
        stem += "_ep" + "-".join(map(str, ranks))
    if sms is not None:
        stem += "_sms" + "-".join(map(str, sms))
    overlap = not getattr(args, "no_overlap", False)
    if not overlap:
        stem += "_no-overlap"
    return BenchPlan(
        decode=decode,
        quick=bool(args.quick),
        tokens=tokens,
        iters=iters,
        torch_iters=0 if hybrid else (DECODE_TORCH_ITERS if decode else TORCH_ITERS),  # hybrid: vs direct
        configs=tuple(configs),
        out=str(args.out),
        stem=stem,
        hybrid=hybrid,
        overlap=overlap,
    )


def _torch():
    import torch

    return torch


class CachingAllocator:
    """Reuses output arrays across iterations (same shapes every iteration; all uses are on the rank's stream)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.pool: dict = {}
        self.calls = 0
        self.tag = ""

    def reset(self, tag: str) -> None:
        self.calls = 0
        self.tag = tag

    def __call__(self, shape, dtype, strides=None):
        from ep_core.kernels._cuda import DeviceArray

        key = (self.tag, self.calls, tuple(shape), str(dtype), strides)
        self.calls += 1
        a = self.pool.get(key)
        if a is None:  # plain cuMemAlloc: also valid while the rank streams are captured into a graph
            a = DeviceArray(shape, dtype, None, strides)
            self.pool[key] = a
        return a


def make_inputs(n, fp8, kind, seed, tokens):
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(seed)
    epr = NUM_EXPERTS // n
    xs, sfs, idxs, ws = [], [], [], []
    weight = torch.ones(NUM_EXPERTS, device="cuda")
    if kind == "unbalanced":
        weight[: max(epr, NUM_EXPERTS // 8)] = 4.0
    for _ in range(n):
        u = torch.rand(tokens, NUM_EXPERTS, device="cuda", generator=g).clamp_(1e-9, 1 - 1e-9)
        keys = weight.log() - torch.log(-torch.log(u))
        idx = keys.topk(TOPK, dim=1).indices.to(torch.int64).contiguous()
        idxs.append(idx)
        ws.append(torch.rand(tokens, TOPK, device="cuda", generator=g).contiguous())
        if fp8:
            x = (torch.randn(tokens, HIDDEN, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
            xs.append(x.view(torch.uint8))
            sfs.append(torch.rand(tokens, HIDDEN // 128, device="cuda", generator=g))
        else:
            xs.append(torch.randn(tokens, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16))
    return xs, sfs if fp8 else None, idxs, ws


def pair_matrix(idxs, n):
    """(token, destination rank) pairs (deduplicated per token; -1 lanes go nowhere) as python ints, [src][dst]."""
    torch = _torch()
    epr = NUM_EXPERTS // n
    rows = []
    for idx in idxs:
        dst = torch.where(idx >= 0, idx // epr, -1)
        onehot = (dst.unsqueeze(-1) == torch.arange(n, device=idx.device)).any(1)  # [tokens, n]
        rows.append(onehot.sum(0).tolist())
    return rows


def pairs_per_rank(idxs, n):
    """(token, destination rank) pairs sent and received per rank (deduplicated), as python ints."""
    rows = pair_matrix(idxs, n)
    return [sum(r) for r in rows], [sum(r[d] for r in rows) for d in range(n)]


class Timer:
    """Median of CUDA-event times on a main stream forked to / joined from the rank streams, L2 flushed first."""

    def __init__(self, streams) -> None:
        from ep_core.kernels._cuda import Event, Stream

        torch = _torch()
        self.torch = torch
        self.streams = streams
        self.main = Stream()
        self.Event = Event
        self.flush = torch.empty(512 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
        self.last_batch: dict = {}  # run_graph_pair's batch diagnostics (JSON row columns)

    def run(self, fn, iters: int, warmup: int = 2) -> float:
        torch = self.torch
        times = []
        for i in range(warmup + iters):
            self.flush.zero_()
            torch.cuda.synchronize()
            start, stop = self.Event(), self.Event()
            joins = [self.Event(timing=False) for _ in self.streams]
            start.record(self.main)
            for s in self.streams:
                s.wait_event(start)
            fn()
            for s, ev in zip(self.streams, joins):
                ev.record(s)
                self.main.wait_event(ev)
            stop.record(self.main)
            stop.synchronize()
            if i >= warmup:
                times.append(start.elapsed_ms(stop))
        return statistics.median(times)

    def run_graph(self, fn, iters: int, warmup: int = 2) -> float:
        """Capture `fn` (all ranks' launches, forked from and joined to the main stream) into one CUDA graph and
        time its replays: GPU time without the Python launch overhead of N ranks (one replay between two events:
        the host's submission of cuGraphLaunch is included)."""
        return self.run_graph_pair(fn, iters, warmup, batch=0)[0]

    def run_graph_pair(
        self, fn, iters: int, warmup: int = 2, batch: int = DECODE_BATCH
    ) -> tuple[float, float]:
        """`run_graph`'s median of one replay, and the median over `iters` of the mean time of `batch` replays
        launched back to back between two events (no flush between them) behind a spinning kernel
        (`time_back_to_back`): the device time per op without the submission latency that a single replay's events
        see (nan when `batch` is 0). `self.last_batch` then holds `batch_submit_hidden` and
        `batch_host_us_per_launch` (the host's cuGraphLaunch time per replay: above the device time, a real stream
        of such ops would be host-bound)."""
        from ep_core.kernels import _cuda

        drv = _cuda.driver()
        torch = self.torch
        fn()  # eager warm-up: loads kernels and fills the allocator's pool
        torch.cuda.synchronize()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _cuda.check(drv.cuStreamBeginCapture(self.main.handle, mode), "cuStreamBeginCapture")
        fork = self.Event(timing=False)
        fork.record(self.main)
        joins = [self.Event(timing=False) for _ in self.streams]
        for s in self.streams:
            s.wait_event(fork)
        fn()
        for s, ev in zip(self.streams, joins):
            ev.record(s)
            self.main.wait_event(ev)
        graph = _cuda.check(drv.cuStreamEndCapture(self.main.handle), "cuStreamEndCapture")
        kernels = graph_kernel_count(drv, graph)
        exe = _cuda.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        times = []
        for i in range(warmup + iters):
            self.flush.zero_()
            torch.cuda.synchronize()
            start, stop = self.Event(), self.Event()
            start.record(self.main)
            _cuda.check(drv.cuGraphLaunch(exe, self.main.handle), "cuGraphLaunch")
            stop.record(self.main)
            stop.synchronize()
            if i >= warmup:
                times.append(start.elapsed_ms(stop))
        batched, hidden, host = [], [], []
        hold_us = 5 * HOLD_MIN_US
        ext = torch.cuda.ExternalStream(int(self.main)) if HOLD else None  # torch's view of the main stream

        def hold(us):
            if HOLD:
                with torch.cuda.stream(ext):
                    torch.cuda._sleep(int(us * HOLD_CYCLES_PER_US))

        def launch():
            _cuda.check(drv.cuGraphLaunch(exe, self.main.handle), "cuGraphLaunch")

        for i in range(warmup + iters if batch > 0 else 0):
            self.flush.zero_()
            torch.cuda.synchronize()
            start, stop = self.Event(), self.Event()

            def elapsed(start=start, stop=stop):
                stop.synchronize()
                return start.elapsed_ms(stop)

            ms, host_us, ok = time_back_to_back(
                hold,
                lambda start=start: start.record(self.main),
                launch,
                lambda stop=stop: stop.record(self.main),
                lambda start=start: event_done(start),
                elapsed,
                batch,
                hold_us,
            )
            hold_us = max(hold_us, HOLD_MIN_US, 2 * host_us)
            if i >= warmup:
                batched.append(ms)
                hidden.append(ok)
                host.append(host_us / batch)
        self.last_batch = (
            {
                "batch_submit_hidden": sum(hidden) / len(hidden),
                "batch_host_us_per_launch": statistics.median(host),
                "graph_kernels": kernels,
            }
            if batched
            else {}
        )
        _cuda.check(drv.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
        _cuda.check(drv.cuGraphDestroy(graph), "cuGraphDestroy")
        return statistics.median(times), (statistics.median(batched) if batched else float("nan"))


def graph_kernel_count(drv, graph) -> int:
    """Kernel nodes of a captured graph (memsets, event and wait nodes not counted); `drv` is cuda.bindings.driver."""

    def ok(result, what):
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {result[0]}")
        return result[1:]

    count = ok(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    nodes = ok(drv.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0]
    kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    return sum(ok(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")[0] == kernel for node in nodes)


def graph_floor_fn(torch, streams, kernels_per_stream: int):
    """The decode graph's structure with nothing in it: on every rank stream, `kernels_per_stream` one-block
    kernels (an in-place add on 256 floats) where an op launches its dispatch, epilogue or combine kernels."""
    bufs = [torch.zeros(256, device="cuda") for _ in streams]
    views = [torch.cuda.ExternalStream(int(s)) for s in streams]

    def fn():
        for view, buf in zip(views, bufs):
            with torch.cuda.stream(view):
                for _ in range(kernels_per_stream):
                    buf.add_(1.0)

    return fn


def time_back_to_back(
    hold, record_start, launch, record_stop, start_done, elapsed_ms, batch: int, hold_us: float
):
    """One timed batch of a decode row: the stream held busy for `hold_us` (a spinning kernel, not timed), the start
    event, `batch` launches back to back, the stop event. The device then runs every launch one after another with
    no idle gap waiting for the host, and the events see device time only. Returns (ms per launch, host us taken to
    queue the launches, hidden), `hidden` = the start event had not run yet when the last launch was queued (then
    no launch can have waited for its submission; False means the hold was too short to tell)."""
    hold(hold_us)
    record_start()
    t0 = time.perf_counter()
    for _ in range(batch):
        launch()
    host_us = (time.perf_counter() - t0) * 1e6
    hidden = not start_done()
    record_stop()
    return elapsed_ms() / batch, host_us, hidden


def event_done(event) -> bool:
    """Whether a recorded event has run (cuEventQuery: CUDA_SUCCESS; CUDA_ERROR_NOT_READY while pending)."""
    from ep_core.kernels import _cuda

    drv = _cuda.driver()
    return drv.cuEventQuery(event._event)[0] == drv.CUresult.CUDA_SUCCESS


def copy_ceiling_gbs() -> float:
    torch = _torch()
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    return 2 * n / (ms * 1e-3) / 1e9


def torch_baseline(xs, sfs, idxs, n, iters, do_combine=True):
    """What a user writes without ep: per source rank, sort (token, destination) pairs by destination, gather,
    host-sync the counts, copy each chunk into the destination rank's receive buffer; combine: copy every chunk
    back, index_add_ into fp32 and cast to bf16. Returns (dispatch_ms, combine_ms)."""
    torch = _torch()
    epr = NUM_EXPERTS // n

    def plan(idx):
        onehot = torch.zeros(idx.shape[0], n, dtype=torch.bool, device="cuda")
        onehot.scatter_(1, (idx // epr).clamp_min(0), True)
        tok, dst = onehot.nonzero(as_tuple=True)
        order = torch.argsort(dst, stable=True)
        counts = torch.bincount(dst, minlength=n)
        return tok[order], counts

    recv = [None] * n
    state = {}

    def dispatch():
        chunks_to = [[] for _ in range(n)]
        for s in range(n):
            tok, counts = plan(idxs[s])
            rows = xs[s].index_select(0, tok)
            sf_rows = sfs[s].index_select(0, tok) if sfs is not None else None
            c = counts.tolist()  # host sync for the sizes
            off = 0
            for d in range(n):
                chunks_to[d].append(
                    (
                        s,
                        tok[off : off + c[d]],
                        rows[off : off + c[d]],
                        None if sf_rows is None else sf_rows[off : off + c[d]],
                    )
                )
                off += c[d]
        for d in range(n):
            total = sum(ch[2].shape[0] for ch in chunks_to[d])
            buf = torch.empty(total, HIDDEN, dtype=xs[0].dtype, device="cuda")
            sbuf = (
                None
                if sfs is None
                else torch.empty(total, sfs[0].shape[1], dtype=sfs[0].dtype, device="cuda")
            )
            off = 0
            for _s, _, rows, sf_rows in chunks_to[d]:
                buf[off : off + rows.shape[0]].copy_(rows)  # peer copy
                if sbuf is not None:
                    sbuf[off : off + rows.shape[0]].copy_(sf_rows)
                off += rows.shape[0]
            recv[d] = buf
        state["chunks"] = chunks_to

    def combine():
        outs = [torch.zeros(idxs[s].shape[0], HIDDEN, dtype=torch.float32, device="cuda") for s in range(n)]
        for d in range(n):
            y = recv[d]
            off = 0
            for s, tok, rows, _ in state["chunks"][d]:
                part = torch.empty(rows.shape[0], HIDDEN, dtype=torch.bfloat16, device="cuda")
                part.copy_(y[off : off + rows.shape[0]])  # peer copy back
                outs[s].index_add_(0, tok, part.float())
                off += rows.shape[0]
        return [o.to(torch.bfloat16) for o in outs]

    def med(fn):
        times = []
        flush = torch.empty(512 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
        for i in range(iters + 1):
            flush.zero_()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            if i:
                times.append(a.elapsed_time(b))
        return statistics.median(times)

    d_ms = med(dispatch)
    c_ms = med(combine) if do_combine else float("nan")
    return d_ms, c_ms


def make_row(
    n, fp8, kind, op, sms, ms, nbytes, base_ms, ceiling, pairs_per_token, decode=False, single_ms=None
) -> dict:
    """One result row. `ms` and `base_ms` (the torch baseline) are GPU times in ms, `ceiling` the copy ceiling in
    GB/s (read + write). Decode rows add `time_us`, `floor_us` (bytes / ceiling) and `torch_us`; with `single_ms`
    (one graph replay between two events, host submission included) also `time_us_1replay`."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    row = {
        "ranks": n,
        "dtype": "fp8" if fp8 else "bf16",
        "routing": kind,
        "op": op,
        "sms_per_rank": sms,
        "sms_total": sms * n,
        "time_ms": ms,
        "bytes": nbytes,
        "gbs": gbs,
        "frac_ceiling": gbs / ceiling,
        "torch_ms": base_ms,
        "speedup_vs_torch": base_ms / ms if base_ms == base_ms else None,
        "pairs_per_token": pairs_per_token,
    }
    if decode:
        row["time_us"] = ms * 1e3
        row["floor_us"] = nbytes / (ceiling * 1e9) * 1e6
        row["torch_us"] = base_ms * 1e3
        if single_ms is not None:
            row["time_us_1replay"] = single_ms * 1e3
    return row


def progress_line(r: dict) -> str:
    """The line printed as each row is measured: ms for throughput rows, us (with the floor) for decode rows."""
    ms, base = r["time_ms"], r["torch_ms"]
    speedup = (base / ms) if base == base else 0
    head = f"EP{r['ranks']:<2} {r['dtype']:4} {r['routing']:10} {r['op']:22} sms/rank {r['sms_per_rank']:3}  "
    if "time_us" in r:
        line = (
            f"{head}{r['time_us']:8.1f} us  floor {r['floor_us']:6.1f} us  {r['gbs']:7.0f} GB/s  "
            f"{100 * r['frac_ceiling']:5.1f}% ceil  torch {r['torch_us']:8.1f} us  x{speedup:5.2f}"
        )
        if "time_us_1replay" in r:
            line += f"  (1 replay incl. submit {r['time_us_1replay']:6.1f} us)"
        if "graph_floor_us" in r:
            line += f"  graph floor {r['graph_floor_us']:5.1f} us"
        if r.get("batch_submit_hidden", 1.0) < 1.0:  # some batch may have waited for the host: an upper bound
            line += f"  [submission hidden in {100 * r['batch_submit_hidden']:.0f}% of batches]"
        return line
    return (
        f"{head}{ms:8.3f} ms  {r['gbs']:7.0f} GB/s  "
        f"{100 * r['frac_ceiling']:5.1f}% ceil  torch {base:8.3f} ms  x{speedup:5.2f}"
    )


def topology_name(r: dict) -> str:
    """`2x4` (nodes x ranks per node) for a hybrid row, `direct` for one NVLink domain."""
    su = r.get("scaleup_ranks")
    return "direct" if su is None else f"{r['ranks'] // su}x{su}"


def hybrid_table_lines(rows: list[dict]) -> list[str]:
    """The hybrid run's table: emulated topology, time, and what crosses node boundaries."""
    lines = [
        "| topology | dtype | op | SMs/rank | ms | GB/s | % ceiling | cross-node MB | (token, node) pairs "
        "| (token, rank) pairs | QPs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("scaleup_ranks") is not None:
            cross = (
                f"{r['cross_node_bytes'] / 1e6:.1f} | {r['cross_node_pairs']} | {r['cross_node_rank_pairs']} | "
                f"{r['qps']}"
            )
        else:
            cross = "- | - | - | -"
        lines.append(
            f"| {topology_name(r)} | {r['dtype']} | {r['op']} | {r['sms_per_rank']} | {r['time_ms']:.3f} | "
            f"{r['gbs']:.0f} | {100 * r['frac_ceiling']:.1f} | {cross} |"
        )
    return lines


def table_lines(rows: list[dict], decode: bool = False) -> list[str]:
    """The markdown table printed at the end of the run (decode: times in us, with the floor)."""
    if any("scaleup_ranks" in r for r in rows):
        return hybrid_table_lines(rows)
    if decode:
        # rows timed as back-to-back graph replays also carry the one-replay time (host submission included)
        single = any("time_us_1replay" in r for r in rows)
        graph = any("graph_floor_us" in r for r in rows)
        lines = [
            "| EP | dtype | routing | op | SMs/rank | us | floor us | GB/s | % ceiling | torch us | x torch |"
            + (" 1-replay us (incl. submit) |" if single else "")
            + (" graph floor us |" if graph else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|"
            + ("---|" if single else "")
            + ("---|" if graph else ""),
        ]
        for r in rows:
            sp = r["speedup_vs_torch"]
            torch_cols = f"{r['torch_us']:.1f} | {sp:.2f}" if sp else "- | -"
            line = (
                f"| {r['ranks']} | {r['dtype']} | {r['routing']} | {r['op']} | {r['sms_per_rank']} | "
                f"{r['time_us']:.1f} | {r['floor_us']:.1f} | {r['gbs']:.0f} | {100 * r['frac_ceiling']:.1f} | "
                f"{torch_cols} |"
            )
            for on, key in ((single, "time_us_1replay"), (graph, "graph_floor_us")):
                if on:
                    v = r.get(key)
                    line += f" {v:.1f} |" if v is not None else " - |"
            lines.append(line)
        return lines
    lines = [
        "| EP | dtype | routing | op | SMs/rank | ms | GB/s | % ceiling | torch ms | x torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = r["speedup_vs_torch"]
        lines.append(
            f"| {r['ranks']} | {r['dtype']} | {r['routing']} | {r['op']} | {r['sms_per_rank']} | {r['time_ms']:.3f} | "
            f"{r['gbs']:.0f} | {100 * r['frac_ceiling']:.1f} | {r['torch_ms']:.2f} | {sp:.2f} |"
            if sp
            else f"| {r['ranks']} | {r['dtype']} | {r['routing']} | {r['op']} | {r['sms_per_rank']} | "
            f"{r['time_ms']:.3f} | {r['gbs']:.0f} | {100 * r['frac_ceiling']:.1f} | - | - |"
        )
    return lines


def cross_node_pairs(idxs, n, scaleup):
    """(token, destination node) pairs whose node is not the source's, and (token, destination rank) pairs whose
    rank is on another node: what hybrid mode and direct mode across nodes send over the network."""
    torch = _torch()
    epr = NUM_EXPERTS // n
    nodes = n // scaleup
    by_node = by_rank = 0
    for s, idx in enumerate(idxs):
        home = s // scaleup
        dst = (idx // epr).clamp_min(0)
        valid = idx >= 0
        rank_hot = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device)
        rank_hot.scatter_(1, torch.where(valid, dst, torch.full_like(dst, s)), True)
        node_hot = rank_hot.view(idx.shape[0], nodes, scaleup).any(dim=2)
        by_node += int(node_hot.sum()) - int(node_hot[:, home].sum())
        by_rank += int(rank_hot.sum()) - int(rank_hot.view(-1, nodes, scaleup)[:, home].sum())
    return by_node, by_rank


def bench_config(
    n,
    fp8,
    kind,
    sms_list,
    iters,
    ceiling,
    torch_iters,
    rows,
    quick,
    tokens,
    decode=False,
    scaleup=None,
    hybrid_run=False,
    overlap=True,
):
    torch = _torch()
    from ep_core.loopback import LoopbackDomain

    xs, sfs, idxs, ws = make_inputs(n, fp8, kind, seed=1234 + n, tokens=tokens)
    sent, _recv = pairs_per_rank(idxs, n)
    S = sum(sent)
    elem = 1 if fp8 else 2
    hb = HIDDEN * elem
    packs = HIDDEN // 128 if fp8 else 0
    import ep_layout

    d_tok = ep_layout.make_dispatch_token_layout(HIDDEN, elem, packs, TOPK).get_num_bytes()
    c_tok = ep_layout.make_combine_token_layout(HIDDEN, TOPK).get_num_bytes()
    # bytes that must move through HBM: read x, write each copy to the receive region, read it, write recv_x
    dispatch_bytes = n * tokens * hb + 2 * S * d_tok + S * (hb + packs * 4)
    # combine: read each expert row, write it to its source slot, read it back, write the reduced token
    combine_bytes = S * 2 * HIDDEN + 2 * S * c_tok + n * tokens * 2 * HIDDEN
    # zero-copy combine: read each expert row where it is (its rank's combine buffer), write the reduced token
    zero_copy_bytes = S * 2 * HIDDEN + n * tokens * 2 * HIDDEN
    # zero-copy dispatch: read x, write each copy once where the caller reads it (hidden, scales, ids, weights, ids)
    zero_copy_dispatch_bytes = n * tokens * hb + S * (hb + packs * 4 + 12 * TOPK + 8)
    t_disp = t_comb = float("nan")
    if torch_iters:
        t_disp, t_comb = torch_baseline(xs, sfs, idxs, n, torch_iters, do_combine=not fp8)
    hybrid_cols = {}
    if hybrid_run:
        hybrid_cols["scaleup_ranks"] = None
    if scaleup is not None:
        from ep_core import planner
        from ep_core.topology import Topology

        by_node, by_rank = cross_node_pairs(idxs, n, scaleup)
        topo = Topology(num_ranks=n, num_nvlink_ranks=scaleup)
        hybrid_cols = {
            "scaleup_ranks": scaleup,
            "cross_node_pairs": by_node,
            "cross_node_bytes": by_node * d_tok,
            "cross_node_rank_pairs": by_rank,
            "qps": planner.get_theoretical_num_qps(topo, max(sms_list)),
        }
    dom = LoopbackDomain(
        n,
        num_max_tokens_per_rank=tokens,
        hidden=HIDDEN,
        num_topk=TOPK,
        num_sms=max(sms_list),
        gpu_timeout_secs=20.0,
        prefer_overlap_with_compute=overlap,
        **({} if scaleup is None else {"num_scaleup_ranks": scaleup}),
    )
    allocs = [CachingAllocator(s) for s in dom.streams]
    for rank, a in zip(dom.ranks, allocs):
        rank._allocator = a
    timer = Timer(dom.streams)
    graph_floors: dict[int, float | None] = {}  # decode: graph floor us by kernels per rank stream
    x_args = [(x, sf) for x, sf in zip(xs, sfs)] if fp8 else xs
    for sms in sms_list:
        state = {}

        def disp(sms=sms, state=state):
            for a in allocs:
                a.reset("nosync")
            state["out"] = dom.dispatch(
                x_args, idxs, ws, num_experts=NUM_EXPERTS, do_cpu_sync=False, num_sms=sms
            )

        def disp_sync(sms=sms, state=state):
            for a in allocs:
                a.reset("sync")
            state["sync"] = dom.dispatch(
                x_args, idxs, ws, num_experts=NUM_EXPERTS, do_cpu_sync=True, num_sms=sms
            )

        def disp_cached(sms=sms, state=state):
            for a in allocs:
                a.reset("cached")
            dom.dispatch(x_args, None, ws, handles=[o.handle for o in state["sync"]], num_sms=sms)

        def disp_det(sms=sms, state=state):
            for a in allocs:
                a.reset("det")
            dom.dispatch(
                x_args, idxs, ws, num_experts=NUM_EXPERTS, do_cpu_sync=False, num_sms=sms, deterministic=True
            )

        # decode: GPU time = back-to-back replays (no host submission), the one-replay time kept beside it, and
        # the graph floor: the same replays with one-block kernels in the op's kernels' places
        batch_info = {}

        def graph(f, op, batch_info=batch_info):
            if not decode:
                return timer.run_graph(f, iters), None
            one, many = timer.run_graph_pair(f, iters)
            info = batch_info[op] = dict(timer.last_batch)
            k = -(-info.get("graph_kernels", 0) // n)
            if k and k not in graph_floors:
                try:
                    graph_floors[k] = (
                        timer.run_graph_pair(graph_floor_fn(torch, dom.streams, k), iters)[1] * 1e3
                    )
                except Exception as exc:  # a diagnostic column: the op's own row stands without it
                    print(
                        f"graph floor of {k} kernel(s) per rank: not measured ({type(exc).__name__}: {exc})"
                    )
                    graph_floors[k] = None
            if graph_floors.get(k) is not None:
                info["graph_floor_us"] = graph_floors[k]
            return many, one

        single = {}
        t_nosync, single["dispatch"] = graph(disp, "dispatch")
        t_nosync_eager = timer.run(disp, iters)
        t_sync = timer.run(disp_sync, iters)
        t_cached, single["dispatch_cached"] = graph(disp_cached, "dispatch_cached")
        t_det, single["dispatch_deterministic"] = (
            graph(disp_det, "dispatch_deterministic") if not quick else (float("nan"), None)
        )
        t_disp_zc = float("nan")
        if scaleup is None:  # zero-copy: direct mode; the outputs are views of the receive regions

            def disp_zc(sms=sms):
                for a in allocs:
                    a.reset("disp_zc")
                dom.dispatch(
                    x_args, idxs, ws, num_experts=NUM_EXPERTS, do_cpu_sync=False, num_sms=sms, zero_copy=True
                )

            t_disp_zc, single["dispatch_zero_copy"] = graph(disp_zc, "dispatch_zero_copy")
        dom.synchronize()
        outs = state["sync"]
        ys = [torch.randn(o.recv_x.shape[0], HIDDEN, dtype=torch.bfloat16, device="cuda") for o in outs]

        def comb(sms=sms, outs=outs, ys=ys):
            for a in allocs:
                a.reset("comb")
            dom.combine(ys, [o.handle for o in outs], num_sms=sms)

        t_comb_ours, single["combine"] = graph(comb, "combine") if not fp8 else (float("nan"), None)
        t_comb_eager = timer.run(comb, iters) if not fp8 else float("nan")
        dom.synchronize()
        t_comb_zc = float("nan")
        if (
            not fp8 and scaleup is None
        ):  # zero-copy: direct mode; the same rows, written into the ranks' buffers
            from ep_core.kernels import _cuda

            handles = [o.handle for o in outs]
            bufs = dom.combine_buffers(handles, HIDDEN)
            torch.cuda.synchronize()  # ys complete on torch's stream
            for b, y, st in zip(bufs, ys, dom.streams):  # once: a zero-copy combine only reads them
                _cuda.copy_device(b.ptr, y.data_ptr(), y.numel() * 2, st)

            def comb_zc(sms=sms, handles=handles, bufs=bufs):
                for a in allocs:
                    a.reset("comb_zc")
                dom.combine(bufs, handles, num_sms=sms, zero_copy=True)

            t_comb_zc, single["combine_zero_copy"] = graph(comb_zc, "combine_zero_copy")
            dom.synchronize()
        for op, ms, nbytes, base in (
            ("dispatch", t_nosync, dispatch_bytes, t_disp),
            ("dispatch_eager", t_nosync_eager, dispatch_bytes, t_disp),
            ("dispatch_cpu_sync", t_sync, dispatch_bytes, t_disp),
            ("dispatch_cached", t_cached, dispatch_bytes, t_disp),
            ("dispatch_deterministic", t_det, dispatch_bytes, t_disp),
            ("dispatch_zero_copy", t_disp_zc, zero_copy_dispatch_bytes, t_disp),
            ("combine", t_comb_ours, combine_bytes, t_comb),
            ("combine_eager", t_comb_eager, combine_bytes, t_comb),
            ("combine_zero_copy", t_comb_zc, zero_copy_bytes, t_comb),
        ):
            if math.isnan(ms):
                continue
            rows.append(
                make_row(
                    n,
                    fp8,
                    kind,
                    op,
                    sms,
                    ms,
                    nbytes,
                    base,
                    ceiling,
                    S / (n * tokens),
                    decode=decode,
                    single_ms=single.get(op),
                )
            )
            rows[-1].update(hybrid_cols)
            rows[-1]["prefer_overlap_with_compute"] = overlap
            rows[-1].update(batch_info.get(op, {}))
            print(progress_line(rows[-1]), flush=True)
    dom.close()
    torch.cuda.empty_cache()


def plot_hybrid(rows, path, tokens):
    """Hybrid run: time per op for each emulated topology (nodes x ranks per node) and direct-mode EP8."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover
        print(f"no plot: {e}")
        return
    ops = ("dispatch", "dispatch_cached", "combine")

    def name(r):
        return f"{r['dtype']} {topology_name(r)}"

    names = sorted({name(r) for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(ops)
    for j, op in enumerate(ops):
        vals = [next((r["time_ms"] for r in rows if name(r) == nm and r["op"] == op), 0.0) for nm in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=op)
    ax.set_xticks([i + width for i in range(len(names))], names)
    ax.set_ylabel("time (ms, CUDA-graph replay)")
    ax.set_title(f"loopback EP8, emulated nodes: T={tokens}, hidden {HIDDEN}, top-{TOPK} of {NUM_EXPERTS}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def plot(rows, path, tokens, decode=False):
    """Throughput run: % of the copy ceiling against SMs per rank. Decode run: time in us against SMs per rank,
    the torch-native baseline dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover
        print(f"no plot: {e}")
        return
    ops = ("dispatch", "dispatch_cached", "combine") if decode else ("dispatch", "combine")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, n in zip(axes, (8, 1)):
        for dtype, routing, op in sorted(
            {(r["dtype"], r["routing"], r["op"]) for r in rows if r["ranks"] == n}
        ):
            if op not in ops:
                continue
            sel = [
                r
                for r in rows
                if r["ranks"] == n and r["dtype"] == dtype and r["routing"] == routing and r["op"] == op
            ]
            pts = sorted(
                (r["sms_per_rank"], r["time_us"] if decode else 100 * r["frac_ceiling"]) for r in sel
            )
            if pts:
                (line,) = ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=f"{op} {dtype} {routing}",
                )
                base_us = sel[0].get("torch_us", float("nan"))
                if decode and op != "dispatch_cached" and base_us == base_us:
                    ax.axhline(
                        base_us,
                        color=line.get_color(),
                        ls="--",
                        lw=0.8,
                        label=f"torch {op} {dtype} {routing}",
                    )
        if decode:
            ax.set_ylabel(f"time (us, mean of {DECODE_BATCH} back-to-back CUDA-graph replays)")
            ax.set_yscale("log")
        else:
            ax.axhline(50, color="gray", ls="--", lw=0.8)
            ax.set_ylabel("% of D2D copy ceiling")
        ax.set_title(f"loopback EP{n}: T={tokens}, hidden {HIDDEN}, top-{TOPK} of {NUM_EXPERTS}")
        ax.set_xlabel("SMs per rank")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    plan = plan_from_args(build_parser().parse_args(argv))
    try:
        torch = _torch()
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"bench_ep: skipped ({e})")
        return 0
    torch.cuda.init()
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    from concurrent.futures import ThreadPoolExecutor

    from ep_core.kernels._source import compile_kernels
    from ep_core.kernels.plan import KernelConfig

    t0 = time.time()
    cfgs = [KernelConfig(n, TOPK, HIDDEN, e, p) for n in (8, 1) for (e, p) in ((2, 0), (1, HIDDEN // 128))]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(compile_kernels, cfgs))
    print(f"compiled {len(cfgs)} kernel sets in {time.time() - t0:.1f} s")
    ceiling = copy_ceiling_gbs()
    print(f"device-to-device copy ceiling: {ceiling:.0f} GB/s (read + write)")
    props = torch.cuda.get_device_properties(0)
    rows: list[dict] = []
    for c in plan.configs:
        bench_config(
            c.ranks,
            c.fp8,
            c.routing,
            list(c.sms),
            plan.iters,
            ceiling,
            plan.torch_iters,
            rows,
            plan.quick,
            plan.tokens,
            decode=plan.decode,
            scaleup=c.scaleup,
            hybrid_run=plan.hybrid,
            overlap=plan.overlap,
        )
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "copy_ceiling_gbs": ceiling,
        "prefer_overlap_with_compute": plan.overlap,
        "tokens_per_rank": plan.tokens,
        "hidden": HIDDEN,
        "num_experts": NUM_EXPERTS,
        "topk": TOPK,
        "rows": rows,
    }
    if plan.decode:
        result["mode"] = "decode"
        result["iters"] = plan.iters
    (out / plan.json_name).write_text(json.dumps(result, indent=1))
    if plan.hybrid:
        plot_hybrid(rows, out / plan.png_name, plan.tokens)
    else:
        plot(rows, out / plan.png_name, plan.tokens, decode=plan.decode)
    print()
    for line in table_lines(rows, decode=plan.decode):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
