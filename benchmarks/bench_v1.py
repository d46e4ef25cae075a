#!/usr/bin/env python3
"""Decode benchmark of the DeepEP V1 surface (``ep_torch.Buffer`` low-latency mode) next to the V2 path
(``ep_torch.ElasticBuffer`` dispatch without CPU sync + combine), in the same run, CUDA-graph replay timing.

    python benchmarks/bench_v1.py [--ranks 1 8] [--tokens 128] [--iters 50] [--json PATH] [--quick]

Per EP size N (one process per rank over a gloo group, ep's ipc transport; one GPU per rank when the machine has N
GPUs, else every rank on GPU 0, labelled ``shared``: processes on one GPU are time-sliced, so those times are an
upper bound and mean little), T tokens per rank, hidden 7168, top-8 of 256 experts (uniform random routing):

- ``v1 ll_dispatch bf16`` / ``v1 ll_dispatch fp8``: ``low_latency_dispatch(use_fp8=...)`` into the packed masked
  layout ``[E_local, N*T, H]`` (ep-torch's CUDA epilogue, ``legacy_ll_kernels``); ``... torch-ops``: the same
  through the torch composition (``ll_use_kernels=False``, the bitwise reference of the kernels);
- ``v1 ll_combine lanes=G``: ``low_latency_combine`` (weighted, bitwise vs legacy_reference) with G top-k lanes per
  ep combine (``ll_lanes_per_combine``; 1, 2, 4 and all K (automatic when it fits): wider rows mean fewer launches but
  fewer warps per block in ep's kernels), gather and weighted sum as kernels; ``torch-ops`` rows: the torch ops;
- ``... sms=S``: the automatic combine on all S SMs (``ll_combine_num_sms``; ep's default is the dispatch's count);
- ``... nondet``: the same (kernels) over ep's non-deterministic dispatch (``ll_deterministic=False``: no count /
  prefix phases; the packing orders rows by their source key);
- ``v2 dispatch bf16`` / ``v2 combine``: ``ElasticBuffer.dispatch(do_cpu_sync=False)`` and ``combine`` (run
  first, so their rows survive a V1 failure; a failing op is reported and the run goes on).

Each op is captured alone in a CUDA graph (after warm-up) and replayed ``iters`` times back to back between two CUDA
events; the reported time is the mean per replay, the max over ranks. The first replay's outputs are checked once:
V1 combine bitwise against ``legacy_reference.ll_combine_reference``. Exit status 0 (also "skipped" without a GPU),
1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8


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
        "--dry-run-cpu",
        action="store_true",
        help="development: run the harness on CPU over the reference backend (tiny sizes, host timer, no graphs)",
    )
    args = ap.parse_args(argv)
    for n in args.ranks:
        if n < 1 or args.experts % n:
            ap.error(f"--ranks: {args.experts} experts must split evenly over {n} ranks")
    return args


def _time_graph(torch, fn, iters: int) -> float:
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
    import torch.distributed as dist

    graph.replay()  # one untimed replay
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _time_host(torch, fn, iters: int) -> float:
    """--dry-run-cpu: host wall time per call (checks the harness, not a measurement)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rank(rank: int, n: int, cfg: dict, out_path: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from ep_torch import ElasticBuffer
    from ep_torch.legacy import Buffer
    from ep_torch.legacy_ll import lanes_per_combine
    from ep_torch.legacy_reference import ll_combine_reference

    cpu = cfg["dry_run_cpu"]
    transport = None if cpu else "ipc"
    shared = not cpu and torch.cuda.device_count() < n
    if not cpu:
        torch.cuda.set_device(0 if shared else rank)
    if shared:
        os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # nothing to detect between processes on one GPU
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    timer = _time_host if cpu else _time_graph
    t, h, e, k, iters = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"], cfg["iters"]
    epr = e // n
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    rows: list[dict] = []
    failures: list[str] = []

    if shared:
        iters = min(iters, 20)  # time-sliced processes: every op takes several scheduler slices

    def row(op: str, fn) -> bool:
        """Time one op; an error is recorded (and announced to the peers by ep, so every rank lands here)."""
        try:
            ms = fn()
        except Exception as exc:  # keep the other rows
            failures.append(f"rank {rank}: {op}: {type(exc).__name__}: {str(exc)[:300]}")
            return False
        rows.append({"ep": n, "shared_gpu": shared, "tokens": t, "op": op, "ms": ms, "rank": rank})
        return True

    # V2 first: its rows survive a V1 failure
    v2 = ElasticBuffer(
        None, num_max_tokens_per_rank=t, hidden=h, num_topk=k, explicitly_destroy=True, transport=transport
    )

    def v2_dispatch():
        return v2.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, do_cpu_sync=False)

    v2_dispatch()
    row("v2 dispatch bf16", lambda: timer(torch, v2_dispatch, iters))
    rx, _, _, h2, _ = v2_dispatch()
    v2.combine(rx, h2)
    row("v2 combine", lambda: timer(torch, lambda: v2.combine(rx, h2), iters))
    _sync(torch)
    dist.barrier()
    v2.destroy()

    v1 = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(t, h, n, e), low_latency_mode=True,
                num_qps_per_rank=epr, explicitly_destroy=True, transport=transport)  # fmt: skip
    ok = True
    paths = ((None, ""),) if cfg["quick"] else ((None, ""), (False, " torch-ops"))
    for use, tag in paths:  # ep-torch's kernels (on CUDA), then the torch ops
        v1.ll_use_kernels = use
        for fp8 in (False, True):
            if not ok:
                break

            def v1_dispatch(fp8=fp8):
                return v1.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

            v1_dispatch()  # builds the buffer, compiles the kernels
            ok = ok and row(
                f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'}{tag}", lambda: timer(torch, v1_dispatch, iters)
            )
    v1.ll_use_kernels = None
    recv, _cnt, handle, _, _ = v1.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    y = recv.clone()  # the "experts": identity
    xb = x.cpu().view(torch.int16).numpy().view(np.uint16)
    ref = ll_combine_reference(np.repeat(xb[:, None, :], k, axis=1), idx.cpu().numpy(), w.cpu().numpy())
    auto = lanes_per_combine(k, h)
    lane_rows = [(g, None) for g in sorted({auto, k} | {g for g in (1, 2, 4) if g < k})]
    if not cfg["quick"]:
        lane_rows += [(1, False), (k, False)]
    for lanes, use in dict.fromkeys(lane_rows):
        if not ok:
            break  # after a failure the buffer may be unusable
        v1.ll_lanes_per_combine = lanes
        v1.ll_use_kernels = use
        op = f"v1 ll_combine lanes={lanes}{' (auto)' if lanes == auto else ''}{' torch-ops' if use is False else ''}"
        try:
            comb, _, _ = v1.low_latency_combine(y, idx, w, handle)
            _sync(torch)
        except Exception as exc:
            failures.append(f"rank {rank}: {op}: {type(exc).__name__}: {str(exc)[:300]}")
            ok = False
            break
        if not np.array_equal(comb.cpu().view(torch.int16).numpy().view(np.uint16), ref):
            failures.append(f"rank {rank}: {op} differs from ll_combine_reference")
        ok = row(op, lambda: timer(torch, lambda: v1.low_latency_combine(y, idx, w, handle), iters))
    if ok and not cpu and not shared:  # the wide combine rows leave few warps per block: every SM instead
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        v1.ll_use_kernels, v1.ll_lanes_per_combine, v1.ll_combine_num_sms = None, 0, sms
        op = f"v1 ll_combine lanes={auto} (auto) sms={sms}"
        try:
            comb, _, _ = v1.low_latency_combine(y, idx, w, handle)
            _sync(torch)
            if not np.array_equal(comb.cpu().view(torch.int16).numpy().view(np.uint16), ref):
                failures.append(f"rank {rank}: {op} differs from ll_combine_reference")
            ok = row(op, lambda: timer(torch, lambda: v1.low_latency_combine(y, idx, w, handle), iters))
        except Exception as exc:
            failures.append(f"rank {rank}: {op}: {type(exc).__name__}: {str(exc)[:300]}")
            ok = False
        v1.ll_combine_num_sms = 0
    # ep's non-deterministic dispatch underneath (the packing orders rows by key): a rebuilt inner buffer
    v1.ll_use_kernels, v1.ll_lanes_per_combine, v1.ll_deterministic = None, 0, False
    for fp8 in (False, True):
        if not ok:
            break

        def v1_dispatch_nd(fp8=fp8):
            return v1.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

        v1_dispatch_nd()
        ok = row(
            f"v1 ll_dispatch {'fp8' if fp8 else 'bf16'} nondet", lambda: timer(torch, v1_dispatch_nd, iters)
        )
    if ok:
        recv, _cnt, handle, _, _ = v1.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        y = recv.clone()
        comb, _, _ = v1.low_latency_combine(y, idx, w, handle)
        _sync(torch)
        if not np.array_equal(comb.cpu().view(torch.int16).numpy().view(np.uint16), ref):
            failures.append(f"rank {rank}: v1 ll_combine nondet differs from ll_combine_reference")
        op = f"v1 ll_combine lanes={auto} (auto) nondet"
        ok = row(op, lambda: timer(torch, lambda: v1.low_latency_combine(y, idx, w, handle), iters))
    if ok:
        _sync(torch)
        dist.barrier()
        v1.destroy()
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
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        t0 = time.time()
        spawn(_rank, n, cfg, path)
        with open(path) as f:
            per_rank = json.load(f)
        os.unlink(path)
        for r_rows, r_fail in per_rank:
            rows.extend(r_rows)
            failures.extend(r_fail)
        print(f"bench_v1: EP{n} done in {time.time() - t0:.1f} s", file=sys.stderr)
    table: dict[tuple, dict] = {}
    for r in rows:
        key = (r["ep"], r["op"])
        agg = table.setdefault(key, {"ep": r["ep"], "op": r["op"], "shared_gpu": r["shared_gpu"], "ms": []})
        agg["ms"].append(r["ms"])
    how = "CPU dry run, host timer" if args.dry_run_cpu else "CUDA-graph replay"
    print(f"\nDecode, T={args.tokens} tokens per rank, hidden {args.hidden}, top-{args.topk} of {args.experts} "
          f"experts, {how} (mean of {args.iters}), max over ranks")  # fmt: skip
    print(f"{'EP':>4} {'GPU':<8} {'op':<42} {'us (max rank)':>14} {'us (mean)':>10}")
    for agg in table.values():
        ms = agg["ms"]
        gpu = "shared" if agg["shared_gpu"] else "own"
        print(
            f"{agg['ep']:>4} {gpu:<8} {agg['op']:<42} {max(ms) * 1e3:>14.1f} {sum(ms) / len(ms) * 1e3:>10.1f}"
        )
    for msg in failures:
        print(f"CHECK FAILED: {msg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
