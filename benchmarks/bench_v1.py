#!/usr/bin/env python3
"""Decode benchmark of the DeepEP V1 surface (``ep_torch.Buffer`` low-latency mode) next to the V2 path
(``ep_torch.ElasticBuffer`` dispatch without CPU sync + combine), in the same run, CUDA-graph replay timing.

    python benchmarks/bench_v1.py [--ranks 1 8] [--tokens 128] [--iters 50] [--json PATH] [--quick] [--procs]

Per EP size N, T tokens per rank, hidden 7168, top-8 of 256 experts (uniform random routing):

- EP1: one process (gloo group of one, ep's ipc transport), labelled ``own``;
- N > 1: the loopback group (``ep_torch.loopback.LoopbackGroup``), labelled ``loopback``: the N ranks are N streams
  of this process on one GPU, each a real ``ElasticBuffer`` / V1 ``Buffer`` over ep-core's loopback domain (its own
  symmetric buffer, executor and stream; the device's SMs split between the ranks), so the rows run exactly the
  kernels and host code a V1/V2 user gets; every rank's op is captured in ONE CUDA graph and the time is that of
  all N ranks' op together (as ``bench_ep``'s loopback rows); no ``torch-ops`` rows there (see ``_measure``);
- ``--procs``: N > 1 as one process per rank instead (one GPU each when the machine has N, else time-sliced on
  GPU 0, labelled ``shared``: an upper bound that means little).

- ``v1 ll_dispatch bf16`` / ``v1 ll_dispatch fp8``: ``low_latency_dispatch(use_fp8=...)`` into the packed masked
  layout ``[E_local, N*T, H]`` (ep-torch's CUDA epilogue, ``legacy.ll_kernels``); ``... torch-ops``: the same
  through the torch composition (``ll_use_kernels=False``, the bitwise reference of the kernels);
- ``v1 ll_combine lanes=G``: ``low_latency_combine`` (weighted, bitwise vs legacy.reference) with G top-k lanes per
  ep combine (``ll_lanes_per_combine``; 1, 2, 4 and all K (automatic when it fits): wider rows mean fewer launches but
  fewer warps per block in ep's kernels), gather and weighted sum as kernels; ``torch-ops`` rows: the torch ops;
- ``... sms=S``: the automatic combine on all S SMs (``ll_combine_num_sms``; ep's default is the dispatch's count);
- ``... copy``: the same over ep's copying dispatch (``ll_zero_copy=False``; by default the inner dispatch is
  zero-copy on CUDA in one NVLink domain and the packing reads the rows where they arrived);
- ``... nondet``: the same (kernels) over ep's non-deterministic dispatch (``ll_deterministic=False``: no count /
  prefix phases; the packing orders rows by their source key);
- ``v2 dispatch bf16`` / ``v2 combine``: ``ElasticBuffer.dispatch(do_cpu_sync=False)`` and ``combine`` (run
  first, so their rows survive a V1 failure; a failing op is reported and the run goes on);
- ``v1 ll_combine native logfmt``: the native combine with ``use_logfmt=True`` (rows scaled by 1/8 so every chunk
  encodes; bitwise against the reference's LogFMT round trip);
- ``... dispatch+combine``: a decode step's communication in one graph (V2: dispatch then combine of its rows;
  V1: low-latency dispatch, identity "experts", weighted combine, checked bitwise too).

Each op is captured alone in a CUDA graph (after warm-up) and replayed ``iters`` times back to back between two CUDA
events; the reported time is the mean per replay (processes: the max over ranks). Checks on every rank, before the
op's row: each V1 combine bitwise against ``legacy.reference.ll_combine_reference``, each V1 dispatch's
``recv_count`` against the routing, the native FP8 dispatch bitwise against ``fp8_cast_reference`` on the first rank
(``CHECK FAILED`` lines). ``v1 ll_dispatch bf16|fp8 native own by token``: the same with ``EPKIT_LL_OWN_BY_TOKEN=1``
(a rank's own rows written token by token, FP8 cast once a token, instead of one block per expert; issue 44's A/B). ``--dry-run-cpu`` runs the same harness on the
CPU reference backend (tiny sizes, host timer; the loopback group in one thread per rank). Exit status 0 (also
"skipped" without a GPU), 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8
# the loopback group's ranks need a hardware queue per stream (ep_torch.loopback); CUDA reads the count when the
# context is created, which the EP1 rows do first
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_v1.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8], help="EP sizes (default 1 8)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128, decode)")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--experts", type=int, default=NUM_EXPERTS)
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--iters", type=int, default=50, help="graph replays timed per op")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="only the kernels' rows (no torch-ops rows)",
    )
    ap.add_argument(
        "--procs",
        action="store_true",
        help="EP sizes > 1 as one process per rank (one GPU each when there are enough, else time-sliced on GPU 0, "
        "labelled shared) instead of the loopback group",
    )
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="development: run the harness on CPU over the reference backend (tiny sizes, host timer, no graphs)",
    )
    args = ap.parse_args(argv)
    for n in args.ranks:
        if n < 1 or args.experts % n:
            ap.error(f"--ranks: {args.experts} experts must split evenly over {n} ranks")
    return args


def _time_graph(torch, fn, iters: int, barrier) -> float:
    """Capture ``fn()`` (already warmed up), replay ``iters`` times; mean ms per replay."""
    from ep_torch.cuda_graph import avoid_record_stream

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with avoid_record_stream():
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.synchronize()
    graph.replay()  # one untimed replay
    torch.cuda.synchronize()
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _time_host(torch, fn, iters: int, barrier) -> float:
    """--dry-run-cpu: host wall time per call (checks the harness, not a measurement)."""
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


class _Procs:
    """This process is rank ``rank`` of ``n`` (a gloo group; ep's ipc transport on CUDA)."""

    def __init__(self, torch, rank: int, n: int, cpu: bool) -> None:
        import torch.distributed as dist

        self.dist, self.torch, self.n, self.cpu = dist, torch, n, cpu
        self.ranks = [rank]
        shared = not cpu and torch.cuda.device_count() < n
        if not cpu:
            torch.cuda.set_device(0 if shared else rank)
        if shared:
            os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # nothing to detect between processes on one GPU
        self.label = "cpu" if cpu else ("shared" if shared else "own")
        self.row_rank = rank
        self.transport = None if cpu else "ipc"

    def each(self, fn):
        return [fn(self.ranks[0])]

    def barrier(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()
        self.dist.barrier()

    def v2(self, **kw):
        from ep_torch import ElasticBuffer

        return [ElasticBuffer(None, explicitly_destroy=True, transport=self.transport, **kw)]

    def v1(self, *args, **kw):
        from ep_torch.legacy import Buffer

        return [Buffer(None, *args, explicitly_destroy=True, transport=self.transport, **kw)]


class _Loopback:
    """All ``n`` ranks in this process: ``ep_torch.loopback.LoopbackGroup`` (ep-core's loopback domain on the GPU,
    one stream per rank; the reference executor in one thread per rank on the CPU)."""

    def __init__(self, torch, n: int, cpu: bool) -> None:
        from ep_torch.loopback import LoopbackGroup

        self.torch, self.n, self.cpu = torch, n, cpu
        if not cpu:
            os.environ.setdefault(
                "EPKIT_NVLINK_GBS", "450"
            )  # the planner's figure, as for processes on one GPU
        self.group = LoopbackGroup(
            n, device="cpu" if cpu else "cuda", gpu_timeout_secs=20.0, timeout_secs=60.0
        )
        self.ranks = list(range(n))
        self.label = "loopback"
        self.row_rank = "all"

    def each(self, fn):
        return self.group.run(fn)

    def barrier(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()

    def v2(self, **kw):
        return self.group.elastic_buffers(**kw)

    def v1(self, *args, **kw):
        return self.group.v1_buffers(*args, explicitly_destroy=True, **kw)


def _inputs(torch, rank: int, cfg: dict, dev):
    t, h, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    return x, idx, w


def _measure(torch, ctx, cfg: dict) -> tuple[list[dict], list[str]]:
    """Every row on ``ctx``'s ranks (one per process, or all of a loopback group): ``(rows, failures)``."""
    import numpy as np
    from ep_torch.legacy import Buffer
    from ep_torch.legacy.low_latency import lanes_per_combine
    from ep_torch.legacy.reference import ll_combine_reference

    cpu, n = ctx.cpu, ctx.n
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    t, h, e, k, iters = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"], cfg["iters"]
    timer = _time_host if cpu else _time_graph
    epr = e // n
    R = ctx.ranks
    inp = {r: _inputs(torch, r, cfg, dev) for r in R}
    rows: list[dict] = []
    failures: list[str] = []
    who = "loopback" if ctx.label == "loopback" else f"rank {R[0]}"
    if ctx.label == "shared":
        iters = min(iters, 20)  # time-sliced processes: every op takes several scheduler slices

    def row(op: str, fn) -> bool:
        """Time ``fn`` on every rank here; an error is recorded (announced to the peers by ep in processes)."""
        try:
            ms = timer(torch, lambda: ctx.each(fn), iters, ctx.barrier)
        except Exception as exc:  # keep the other rows
            failures.append(f"{who}: {op}: {type(exc).__name__}: {str(exc)[:300]}")
            return False
        rows.append({"ep": n, "gpu": ctx.label, "tokens": t, "op": op, "ms": ms, "rank": ctx.row_rank})
        print(f"bench_v1: EP{n} {ctx.label} {op}: {ms * 1e3:.1f} us", file=sys.stderr, flush=True)
        return True

    # V2 first: its rows survive a V1 failure
    v2 = dict(zip(R, ctx.v2(num_max_tokens_per_rank=t, hidden=h, num_topk=k)))

    def v2_dispatch(r):
        x, idx, w = inp[r]
        return v2[r].dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, do_cpu_sync=False)

    ctx.each(v2_dispatch)
    row("v2 dispatch bf16", v2_dispatch)
    d2 = dict(zip(R, ctx.each(v2_dispatch)))
    ctx.each(lambda r: v2[r].combine(d2[r][0], d2[r][3]))
    row("v2 combine", lambda r: v2[r].combine(d2[r][0], d2[r][3]))

    def v2_step(r):  # a decode step's communication: dispatch, then combine of the received rows
        rx, _, _, handle, _ = v2_dispatch(r)
        return v2[r].combine(rx, handle)

    row("v2 dispatch+combine bf16", v2_step)
    if (
        not cpu
    ):  # V2's zero-copy roads: dispatch outputs read in the receive regions, combine inputs written there

        def v2_dispatch_zc(r):
            x, idx, w = inp[r]
            return v2[r].dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=e, do_cpu_sync=False, zero_copy=True
            )

        ctx.each(v2_dispatch_zc)
        row("v2 dispatch bf16 zero-copy", v2_dispatch_zc)
        try:
            d2 = dict(zip(R, ctx.each(v2_dispatch)))
            zbufs = {r: v2[r].get_combine_buffer(d2[r][3]) for r in R}
            for r in R:
                zbufs[r][: d2[r][0].shape[0]].copy_(d2[r][0])
            ctx.each(lambda r: v2[r].combine(zbufs[r], d2[r][3], zero_copy=True))
            row("v2 combine zero-copy", lambda r: v2[r].combine(zbufs[r], d2[r][3], zero_copy=True))
        except Exception as exc:
            failures.append(f"{who}: v2 combine zero-copy: {type(exc).__name__}: {str(exc)[:300]}")
    ctx.barrier()
    ctx.each(lambda r: v2[r].destroy())

    if not cpu:
        _measure_native(torch, ctx, cfg, inp, row, failures, who)

    v1 = dict(zip(R, ctx.v1(0, Buffer.get_low_latency_rdma_size_hint(t, h, n, e), low_latency_mode=True,
                            num_qps_per_rank=epr, ll_native=False)))  # fmt: skip

    def setall(**kw):
        for b in v1.values():
            for key, val in kw.items():
                setattr(b, key, val)

    def v1_dispatch(r, fp8=False):
        x, idx, _ = inp[r]
        return v1[r].low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

    # the check of the dispatch's counts: recv_count[e] of rank r = (token, lane) pairs of every rank choosing
    # r's local expert e
    all_idx = torch.cat([_inputs(torch, s, cfg, "cpu")[1] for s in range(n)]).flatten()
    want_counts = torch.bincount(all_idx[all_idx >= 0], minlength=e).to(torch.int32)
    ok = True
    # torch-ops rows only in processes: in a loopback group a torch kernel's first (lazy) load inside a rank's call
    # could wait for the kernels of the ranks before it (ep_torch.loopback)
    torch_ops = not cfg["quick"] and ctx.label != "loopback"
    paths = ((None, ""), (False, " torch-ops")) if torch_ops else ((None, ""),)
    for use, tag in paths:  # ep-torch's kernels (on CUDA), then the torch ops
        setall(ll_use_kernels=use)
        for fp8 in (False, True):
            if not ok:
                break
            try:
                # the first call builds the buffers and compiles the kernels
                outs = ctx.each(lambda r, fp8=fp8: v1_dispatch(r, fp8))
            except Exception as exc:
                failures.append(f"{who}: v1 ll_dispatch: {type(exc).__name__}: {str(exc)[:300]}")
                ok = False
                break
            for r, out in zip(R, outs):
                got = out[1].cpu()
                if not torch.equal(got, want_counts[r * epr : (r + 1) * epr]):
                    failures.append(
                        f"rank {r}: v1 ll_dispatch{tag} fp8={fp8}: recv_count {got.tolist()} is wrong"
                    )
            op = f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'}{tag}"
            ok = ok and row(op, lambda r, fp8=fp8: v1_dispatch(r, fp8))
    setall(ll_use_kernels=None)
    state: dict = {}
    refs: dict = {}
    if ok:
        for r, out in zip(R, ctx.each(v1_dispatch)):
            recv, _cnt, handle, _, _ = out
            state[r] = (recv.clone(), handle)  # the "experts": identity
            x, idx, w = inp[r]
            xb = x.cpu().view(torch.int16).numpy().view(np.uint16)
            refs[r] = ll_combine_reference(
                np.repeat(xb[:, None, :], k, axis=1), idx.cpu().numpy(), w.cpu().numpy()
            )

    def v1_combine(r):
        _, idx, w = inp[r]
        y, handle = state[r]
        return v1[r].low_latency_combine(y, idx, w, handle)[0]

    def checked(op: str) -> bool:
        """One combine on every rank, bitwise against ll_combine_reference, then its row."""
        try:
            combs = ctx.each(v1_combine)
            if not cpu:
                torch.cuda.synchronize()
        except Exception as exc:
            failures.append(f"{who}: {op}: {type(exc).__name__}: {str(exc)[:300]}")
            return False
        for r, comb in zip(R, combs):
            if not np.array_equal(comb.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                failures.append(f"rank {r}: {op} differs from ll_combine_reference")
        return row(op, v1_combine)

    auto = lanes_per_combine(k, h)
    lane_rows = [(g, None) for g in sorted({auto, k} | {g for g in (1, 2, 4) if g < k})]
    if torch_ops:
        lane_rows += [(1, False), (k, False)]
    for lanes, use in dict.fromkeys(lane_rows):
        if not ok:
            break  # after a failure the buffer may be unusable
        setall(ll_lanes_per_combine=lanes, ll_use_kernels=use)
        op = f"v1 ll_combine lanes={lanes}{' (auto)' if lanes == auto else ''}{' torch-ops' if use is False else ''}"
        ok = checked(op)
    setall(ll_use_kernels=None, ll_lanes_per_combine=0)

    def v1_step(r):  # a decode step's communication: dispatch, the "experts" (identity), weighted combine
        _, idx, w = inp[r]
        recv, _, handle, _, _ = v1_dispatch(r)
        return v1[r].low_latency_combine(recv, idx, w, handle)[0]

    if ok:
        try:
            steps = ctx.each(v1_step)
            if not cpu:
                torch.cuda.synchronize()
            for r, comb in zip(R, steps):
                if not np.array_equal(comb.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                    failures.append(f"rank {r}: v1 ll_dispatch+combine differs from ll_combine_reference")
            ok = row(f"v1 ll_dispatch+combine bf16 lanes={auto} (auto)", v1_step)
        except Exception as exc:
            failures.append(f"{who}: v1 ll_dispatch+combine: {type(exc).__name__}: {str(exc)[:300]}")
            ok = False
    if ok and ctx.label == "own":  # the wide combine rows leave few warps per block: every SM instead
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        setall(ll_use_kernels=None, ll_lanes_per_combine=0, ll_combine_num_sms=sms)
        ok = checked(f"v1 ll_combine lanes={auto} (auto) sms={sms}")
        setall(ll_combine_num_sms=0)
    # the copying dispatch underneath (ll_zero_copy=False: the rows copied out of the buffer first), then ep's
    # non-deterministic one (the packing orders rows by key; rebuilt inner buffers), which copies too
    setall(ll_use_kernels=None, ll_lanes_per_combine=0, ll_zero_copy=False)
    for fp8 in (False, True):
        if not ok:
            break
        ok = row(f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'} copy", lambda r, fp8=fp8: v1_dispatch(r, fp8))
    setall(ll_deterministic=False)
    for fp8 in (False, True):
        if not ok:
            break
        try:
            ctx.each(lambda r, fp8=fp8: v1_dispatch(r, fp8))
        except Exception as exc:
            failures.append(f"{who}: v1 ll_dispatch nondet: {type(exc).__name__}: {str(exc)[:300]}")
            ok = False
            break
        ok = row(f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'} nondet", lambda r, fp8=fp8: v1_dispatch(r, fp8))
    if ok:
        for r, out in zip(R, ctx.each(v1_dispatch)):
            state[r] = (out[0].clone(), out[2])
        ok = checked(f"v1 ll_combine lanes={auto} (auto) nondet")
    if ok:
        ctx.barrier()
        ctx.each(lambda r: v1[r].destroy())
    return rows, failures


def _fp8_bitwise(torch, cfg: dict, n: int, rank: int, recv) -> bool:
    """``rank``'s FP8 dispatch output (the cast fused into the native kernels) equals legacy.reference's cast of its
    rows in V1's packed order, bytes and scales."""
    import numpy as np
    from ep_torch.legacy.reference import fp8_cast_reference, ll_expected_rows

    ins = [_inputs(torch, s, cfg, "cpu") for s in range(n)]
    xs = [i[0].view(torch.int16).numpy().view(np.uint16) for i in ins]
    want = ll_expected_rows([i[1].numpy() for i in ins], rank, cfg["experts"])
    q, s = recv[0].cpu().view(torch.uint8).numpy(), recv[1].cpu().numpy()
    rq, rs = fp8_cast_reference(np.stack([xs[src][t] for rows in want for src, t in rows]))
    got_q = np.concatenate([q[le, : len(rows)] for le, rows in enumerate(want)])
    got_s = np.concatenate([s[le, : len(rows)] for le, rows in enumerate(want)])
    return np.array_equal(got_q, rq) and np.array_equal(got_s.view(np.int32), rs.view(np.int32))


def _measure_native(torch, ctx, cfg: dict, inp: dict, row, failures: list, who: str) -> None:
    """V1 low-latency mode on its own kernels (``ll_native=True``, ``legacy.ll_kernels.native_*``): dispatch bf16 /
    FP8, the combine (bitwise against ll_combine_reference), the decode step, and the step with the hook split
    (dispatch send, a stand-in expert GEMM, hook, combine send, hook) against the same step without the split."""
    import numpy as np
    from ep_torch.legacy import Buffer
    from ep_torch.legacy.reference import ll_combine_reference

    n, R = ctx.n, ctx.ranks
    t, h, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    epr = e // n
    v1 = dict(zip(R, ctx.v1(0, Buffer.get_low_latency_rdma_size_hint(t, h, n, e), low_latency_mode=True,
                            num_qps_per_rank=epr, ll_native=True)))  # fmt: skip
    all_idx = torch.cat([_inputs(torch, s, cfg, "cpu")[1] for s in range(n)]).flatten()
    want_counts = torch.bincount(all_idx[all_idx >= 0], minlength=e).to(torch.int32)

    def disp(r, fp8=False, hook=False):
        x, idx, _ = inp[r]
        return v1[r].low_latency_dispatch(x, idx, t, e, use_fp8=fp8, return_recv_hook=hook)

    try:
        # issue 44's A/B (EPKIT_LL_OWN_BY_TOKEN=1): a rank's own rows token by token in the receive
        for fp8, by_token in ((False, ""), (True, ""), (False, " own by token"), (True, " own by token")):
            os.environ["EPKIT_LL_OWN_BY_TOKEN"] = "1" if by_token else "0"
            try:
                what = f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'} native{by_token}"
                outs = ctx.each(lambda r, fp8=fp8: disp(r, fp8))
                for r, out in zip(R, outs):
                    if not torch.equal(out[1].cpu(), want_counts[r * epr : (r + 1) * epr]):
                        failures.append(f"rank {r}: {what}: recv_count is wrong")
                if fp8 and not _fp8_bitwise(torch, cfg, n, R[0], outs[0][0]):
                    failures.append(f"rank {R[0]}: {what} differs from fp8_cast_reference")
                row(what, lambda r, fp8=fp8: disp(r, fp8))
            finally:
                os.environ.pop("EPKIT_LL_OWN_BY_TOKEN", None)
        state, refs = {}, {}
        for r, out in zip(R, ctx.each(disp)):
            state[r] = (out[0].clone(), out[2])
            x, idx, w = inp[r]
            xb = x.cpu().view(torch.int16).numpy().view(np.uint16)
            refs[r] = ll_combine_reference(
                np.repeat(xb[:, None, :], k, axis=1), idx.cpu().numpy(), w.cpu().numpy()
            )

        def comb(r):
            _, idx, w = inp[r]
            return v1[r].low_latency_combine(state[r][0], idx, w, state[r][1])[0]

        for r, c in zip(R, ctx.each(comb)):
            if not np.array_equal(c.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                failures.append(f"rank {r}: v1 ll_combine native differs from ll_combine_reference")
        row("v1 ll_combine native", comb)
        # LogFMT (use_logfmt=True): the rows scaled by 1/8 so every chunk encodes (|x| < 1: 10 bits a value),
        # checked against the model's round trip; hidden % 512 == 0 only
        if h % 512 == 0:
            small, lrefs = {}, {}
            for r in R:
                x, idx, w = inp[r]
                small[r] = (state[r][0].float() / 8).to(torch.bfloat16)
                xb = (x.float() / 8).to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
                lrefs[r] = ll_combine_reference(
                    np.repeat(xb[:, None, :], k, axis=1), idx.cpu().numpy(), w.cpu().numpy(), use_logfmt=True
                )

            def comb_logfmt(r):
                _, idx, w = inp[r]
                return v1[r].low_latency_combine(small[r], idx, w, state[r][1], use_logfmt=True)[0]

            for r, c in zip(R, ctx.each(comb_logfmt)):
                if not np.array_equal(c.cpu().view(torch.int16).numpy().view(np.uint16), lrefs[r]):
                    failures.append(
                        f"rank {r}: v1 ll_combine native logfmt differs from ll_combine_reference"
                    )
            row("v1 ll_combine native logfmt", comb_logfmt)
        # the same without the local shortcut: a rank's own rows through the buffer like a peer's (two passes)
        os.environ["EPKIT_LL_LOCAL_DIRECT"] = "0"
        try:
            for fp8 in (False, True):
                row(
                    f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'} native no-local",
                    lambda r, fp8=fp8: disp(r, fp8),
                )
            for r, c in zip(R, ctx.each(comb)):
                if not np.array_equal(c.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                    failures.append(
                        f"rank {r}: v1 ll_combine native no-local differs from ll_combine_reference"
                    )
            row("v1 ll_combine native no-local", comb)
        finally:
            os.environ.pop("EPKIT_LL_LOCAL_DIRECT", None)
        wmat = torch.randn(h, h, dtype=torch.bfloat16, device=inp[R[0]][0].device) / 64

        def gemm(r):  # the stand-in expert compute between dispatch and combine
            return inp[r][0] @ wmat

        # its kernels loaded before any rank's call: a lazy load inside a loopback rank's call could wait for the
        # kernels of the ranks before it (ep_torch.loopback)
        gemm(R[0])
        torch.cuda.synchronize()

        def step(r):
            _, idx, w = inp[r]
            recv, _, handle, _, _ = disp(r)
            gemm(r)
            return v1[r].low_latency_combine(recv, idx, w, handle)[0]

        hooks: dict = {}

        def step_hook_send(r):
            recv, _, handle, _, hk = disp(r, hook=True)
            hooks[r] = (recv, handle, hk)

        def step_hook_rest(r):  # the decode loop: send, GEMM, hook, combine (no split in the combine)
            _, idx, w = inp[r]
            gemm(r)
            recv, handle, hk = hooks[r]
            hk()
            return v1[r].low_latency_combine(recv, idx, w, handle)[0]

        each = ctx.each  # _row_whole replaces ctx.each while it times this

        def step_hook_all():  # every rank's send first (each rank's receive is then deferred past its GEMM)
            each(step_hook_send)
            return each(step_hook_rest)

        for r, c in zip(R, ctx.each(step)):
            if not np.array_equal(c.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                failures.append(f"rank {r}: v1 ll step native differs from ll_combine_reference")
        row("v1 ll dispatch+gemm+combine native", step)
        for r, c in zip(R, step_hook_all()):
            if not np.array_equal(c.cpu().view(torch.int16).numpy().view(np.uint16), refs[r]):
                failures.append(f"rank {r}: v1 ll step native (hook) differs from ll_combine_reference")
        _row_whole(torch, ctx, row, "v1 ll dispatch+gemm+combine native hook split", step_hook_all, cfg)
        ctx.barrier()
        ctx.each(lambda r: v1[r].destroy())
    except Exception as exc:
        failures.append(f"{who}: v1 native: {type(exc).__name__}: {str(exc)[:300]}")


def _row_whole(torch, ctx, row, op: str, fn, cfg: dict) -> None:
    """``row`` for a function of all ranks at once (``fn()`` once per timed iteration instead of once per rank)."""
    saved = ctx.each
    try:
        ctx.each = lambda f: fn()
        row(op, None)
    finally:
        ctx.each = saved


def _rank(rank: int, n: int, cfg: dict, out_path: str) -> None:
    """One process of an EP group (``spawn``): its rows, gathered on rank 0."""
    import torch
    import torch.distributed as dist

    rows, failures = _measure(torch, _Procs(torch, rank, n, cfg["dry_run_cpu"]), cfg)
    gathered: list = [None] * n
    dist.all_gather_object(gathered, (rows, failures))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except Exception as exc:  # pragma: no cover
        print(f"bench_v1: skipped (no torch: {exc})")
        return 0
    if args.dry_run_cpu:
        args.tokens, args.hidden, args.experts, args.topk, args.iters = 4, 512, 16, 4, 2
    elif not torch.cuda.is_available():
        print("bench_v1: skipped (no CUDA device)")
        return 0
    import tempfile

    from ep_torch.launch import spawn

    cfg = {"tokens": args.tokens, "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
           "iters": args.iters, "seed": args.seed, "dry_run_cpu": args.dry_run_cpu,
           "quick": args.quick}  # fmt: skip
    rows: list[dict] = []
    failures: list[str] = []
    for n in args.ranks:
        t0 = time.time()
        if n == 1 or args.procs:  # one process per rank
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                path = tmp.name
            spawn(_rank, n, cfg, path)
            with open(path) as f:
                per_rank = json.load(f)
            os.unlink(path)
        else:  # the loopback group: every rank in this process, one stream each
            per_rank = [_measure(torch, _Loopback(torch, n, args.dry_run_cpu), cfg)]
        for r_rows, r_fail in per_rank:
            rows.extend(r_rows)
            failures.extend(r_fail)
        print(f"bench_v1: EP{n} done in {time.time() - t0:.1f} s", file=sys.stderr)
    table: dict[tuple, dict] = {}
    for r in rows:
        key = (r["ep"], r["gpu"], r["op"])
        agg = table.setdefault(key, {"ep": r["ep"], "op": r["op"], "gpu": r["gpu"], "ms": []})
        agg["ms"].append(r["ms"])
    how = "CPU dry run, host timer" if args.dry_run_cpu else "CUDA-graph replay"
    print(f"\nDecode, T={args.tokens} tokens per rank, hidden {args.hidden}, top-{args.topk} of {args.experts} "
          f"experts, {how} (mean of {args.iters}); processes: max over ranks; loopback: all ranks in one graph")  # fmt: skip
    print(f"{'EP':>4} {'GPU':<9} {'op':<42} {'us (max rank)':>14} {'us (mean)':>10}")
    for agg in table.values():
        ms = agg["ms"]
        print(
            f"{agg['ep']:>4} {agg['gpu']:<9} {agg['op']:<42} {max(ms) * 1e3:>14.1f} {sum(ms) / len(ms) * 1e3:>10.1f}"
        )
    for msg in failures:
        print(f"CHECK FAILED: {msg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
