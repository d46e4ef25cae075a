#!/usr/bin/env python3
"""What ``defer_epilogue=True`` buys: a dispatch -> compute -> combine loop with and without it (issue 42).

    python benchmarks/bench_defer.py --out DIR [--quick] [--setup one|loopback|both] [--gemm M[,N,K]]
        [--tokens T] [--hidden H] [--topk K] [--experts E] [--iters N] [--cpu-sync 1|0|both] [--device cuda|cpu]
    python benchmarks/bench_defer.py --dry-run ...    # the planned rows, no torch work

Setups (each row says its ``setup``):

- ``one``: one rank of an ``EPBuffer`` over a one-rank nccl group (this process; gloo and the CPU reference
  backend with ``--device cpu``). Every token stays on the rank: the dispatch is its kernel (the tails into the
  receive region) and the copy epilogue; the combine its send part and the reduce.
- ``loopback``: 2 ranks of ``ep_torch.loopback.LoopbackGroup`` sharing the GPU (ep's ipc kernels, each rank on its
  own stream). An ordinary CPU-sync dispatch cannot run there (the first rank's host wait would wait for the second
  rank's launch), so its plain rows use ``do_cpu_sync=False``; the deferred CPU-sync dispatch can (every rank launches
  before any waits).

One iteration, on the compute stream, with a stand-in compute that does not depend on the communication (a bf16
``[M, K] @ [K, N]`` GEMM, the size ``--gemm`` picks; think of another micro-batch's attention):

- ``compute``: the GEMM twice (the compute alone);
- ``comm``: dispatch, then combine of the received rows (the communication alone, ordinary calls);
- ``plain``: dispatch, GEMM, combine, GEMM (ordinary calls: the compute stream waits for each call's end, and a
  CPU-sync dispatch holds the host until its counts are in);
- ``deferred``: dispatch with ``defer_epilogue=True`` (and ``async_with_compute_stream=True``, DeepEP's rule), GEMM,
  ``current_stream_wait()``; combine likewise, GEMM, wait. The GEMMs are issued between the deferred call and its
  wait, so they run beside the communication kernel.

Every mode's first iteration is checked before any timing: the combined rows equal the reference (each token times
the number of ranks it went to: a sum of equal bf16 values, exact for 1 and 2), the deferred ones bitwise the plain
ones, the GEMM's output the compute mode's.

Per mode: ``iter_us`` (median time of one iteration between CUDA events recorded on the compute stream at each
iteration's start; ``mean_us`` the whole loop over its iterations) and the host time of the dispatch and combine
calls (``host_dispatch_us``, ``host_combine_us``: perf_counter around the call alone, median; with the previous
iteration's GEMM queued, an ordinary CPU-sync dispatch waits for it). Per setup and CPU-sync choice, the overlap row:
``saved_us = plain - deferred`` and ``overlap = saved_us / min(compute, comm)`` (1.0: the shorter one fully hidden;
the ideal loop is ``max(compute, comm)``, the serial one ``compute + comm``).

Writes DIR/bench_defer.json (the rows) and prints a table. ``--quick`` runs in well under 2 minutes on one H100.
Without a GPU (and without ``--device cpu``) it prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODES = ("compute", "comm", "plain", "deferred")


@dataclass(frozen=True)
class Plan:
    out: str
    device: str
    setups: tuple[str, ...]
    cpu_syncs: tuple[bool, ...]
    tokens: int
    hidden: int
    topk: int
    experts: int
    gemm: tuple[int, int, int]
    iters: int
    warmup: int
    dry_run: bool = False
    runs: list[tuple[str, bool]] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and iterations (under 2 minutes)")
    ap.add_argument("--setup", choices=("one", "loopback", "both"), default="both")
    ap.add_argument("--cpu-sync", choices=("1", "0", "both"), default=None, help="default: both (quick: 1)")
    ap.add_argument("--gemm", default="4096", help="M[,N,K] of the stand-in GEMM (one number: square)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096; quick: 1024)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument(
        "--iters", type=int, default=None, help="timed iterations per mode (default 100; quick: 20)"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="print the planned rows and exit (no torch work)")
    return ap


def _gemm_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.replace("x", ",").split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) < 1:
        raise SystemExit(f"--gemm: expected M or M,N,K (positive ints), got {text!r}")
    return parts[0], parts[1], parts[2]


def plan_from_args(args: argparse.Namespace) -> Plan:
    quick = bool(args.quick)
    setups = ("one", "loopback") if args.setup == "both" else (args.setup,)
    sync = args.cpu_sync or ("1" if quick else "both")
    cpu_syncs = (True, False) if sync == "both" else (sync == "1",)
    tokens = args.tokens if args.tokens is not None else (1024 if quick else 4096)
    iters = args.iters if args.iters is not None else (20 if quick else 100)
    if args.experts % 2 or args.topk > args.experts:
        raise SystemExit(f"--experts: expected an even count >= --topk ({args.topk}), got {args.experts}")
    if tokens < 1 or iters < 1 or args.hidden % 16:
        raise SystemExit("--tokens and --iters must be >= 1, --hidden a multiple of 16")
    plan = Plan(
        out=args.out,
        device=args.device,
        setups=setups,
        cpu_syncs=cpu_syncs,
        tokens=tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        gemm=_gemm_shape(args.gemm),
        iters=iters,
        warmup=args.warmup,
        dry_run=bool(args.dry_run),
    )
    plan.runs.extend((s, c) for s in setups for c in cpu_syncs)
    return plan


# ---------------------------------------------------------------------------------------------------------------
# rows (pure: checked on the CPU by tests/test_bench_defer.py)


def mode_row(setup: str, cpu_sync: bool, mode: str, iter_s: list[float], total_s: float, host: dict) -> dict:
    """One mode's row from its per-iteration times (seconds) and host call times (``{"dispatch": [s...], ...}``)."""
    row: dict[str, Any] = {
        "setup": setup,
        "cpu_sync": cpu_sync,
        "mode": mode,
        "iters": len(iter_s),
        "iter_us": statistics.median(iter_s) * 1e6,
        "mean_us": total_s / max(len(iter_s), 1) * 1e6,
    }
    for call in ("dispatch", "combine"):
        times = host.get(call) or []
        row[f"host_{call}_us"] = statistics.median(times) * 1e6 if times else None
    return row


def overlap_row(rows: list[dict]) -> dict:
    """The overlap ``defer_epilogue`` buys, from one setup's four mode rows (module doc)."""
    by = {r["mode"]: r for r in rows}
    missing = [m for m in MODES if m not in by]
    if missing:
        raise ValueError(f"overlap_row: rows of modes {missing} missing")
    compute, comm = by["compute"]["iter_us"], by["comm"]["iter_us"]
    plain, deferred = by["plain"]["iter_us"], by["deferred"]["iter_us"]
    hidden = min(compute, comm)
    return {
        "setup": by["plain"]["setup"],
        "cpu_sync": by["plain"]["cpu_sync"],
        "mode": "overlap",
        "serial_us": compute + comm,
        "ideal_us": max(compute, comm),
        "plain_us": plain,
        "deferred_us": deferred,
        "saved_us": plain - deferred,
        "overlap": (plain - deferred) / hidden if hidden > 0 else None,
        "host_dispatch_plain_us": by["plain"]["host_dispatch_us"],
        "host_dispatch_deferred_us": by["deferred"]["host_dispatch_us"],
    }


def table(rows: list[dict]) -> str:
    """The printed table: one line a row."""

    def num(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    head = (
        f"{'setup':9} {'sync':4} {'mode':9} {'iter_us':>9} {'mean_us':>9} {'host_disp':>9} {'host_comb':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        sync = "cpu" if r["cpu_sync"] else "none"
        if r["mode"] == "overlap":
            lines.append(
                f"{r['setup']:9} {sync:4} {'overlap':9} saved {num(r['saved_us'])} us of min(compute, comm): "
                f"{num(r['overlap'], 2)} (serial {num(r['serial_us'])}, ideal {num(r['ideal_us'])}, "
                f"host dispatch {num(r['host_dispatch_plain_us'])} -> {num(r['host_dispatch_deferred_us'])} us)"
            )
        else:
            lines.append(
                f"{r['setup']:9} {sync:4} {r['mode']:9} {num(r['iter_us']):>9} {num(r['mean_us']):>9} "
                f"{num(r['host_dispatch_us']):>9} {num(r['host_combine_us']):>9}"
            )
    return "\n".join(lines)


def planned(plan: Plan) -> list[str]:
    """The rows a run of `plan` writes, as ``setup/sync/mode`` names (``--dry-run`` prints them)."""
    return [f"{s}/{'cpu' if c else 'none'}/{m}" for s, c in plan.runs for m in (*MODES, "overlap")]


# ---------------------------------------------------------------------------------------------------------------
# the loop


class _Clock:
    """Per-iteration marks on the compute stream: CUDA events (device time), or perf_counter on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> tuple[list[float], float]:
        """Seconds between consecutive marks, and from the first to the last."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            s = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        else:
            s = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return s, sum(s)


class _Ranks:
    """The ranks of one setup behind one interface: ``call(fn)`` runs ``fn(rank)`` for each and returns the list."""

    def __init__(self, setup: str, plan: Plan) -> None:
        import torch

        self.setup, self.plan = setup, plan
        self.cuda = plan.device == "cuda"
        m, h, k = plan.tokens, plan.hidden, plan.topk
        if setup == "one":
            import ep_torch
            import torch.distributed as dist

            self.group = None
            self.n = 1
            self.device = (
                torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
            )
            self.bufs = [
                ep_torch.EPBuffer(
                    dist.group.WORLD, num_max_tokens_per_rank=m, hidden=h, num_topk=k, deterministic=True,
                    explicitly_destroy=True,
                )
            ]  # fmt: skip
        else:
            from ep_torch.loopback import LoopbackGroup

            self.group = LoopbackGroup(2, device=plan.device, gpu_timeout_secs=30)
            self.n = 2
            self.device = self.group.device
            self.bufs = self.group.elastic_buffers(num_max_tokens_per_rank=m, hidden=h, num_topk=k)

    def call(self, fn: Any) -> list[Any]:
        if self.group is None:
            return [fn(0)]
        return self.group.run(fn)

    def close(self) -> None:
        for b in self.bufs:
            b.destroy()
        if self.group is not None:
            self.group.close()


def _inputs(plan: Plan, n: int, device: Any) -> list[tuple]:
    """Each rank's ``(x, topk_idx, topk_weights)`` (some tokens routed nowhere, some lanes -1)."""
    import torch

    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 + r)
        t = plan.tokens
        x = torch.randn(t, plan.hidden, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(plan.experts, generator=g)[: plan.topk] for _ in range(t)])
        idx[::5, 0] = -1
        idx[7::97] = -1  # tokens that go nowhere
        w = torch.rand(t, plan.topk, generator=g)
        out.append((x.to(device), idx.to(device), w.to(device)))
    return out


def _expected(inputs: list[tuple], n: int, experts: int) -> list[Any]:
    """Each rank's combined rows: x times the number of ranks the token went to (unweighted combine)."""
    import torch

    per_rank = experts // n
    out = []
    for x, idx, _ in inputs:
        hit = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device)
        for r in range(n):
            hit[:, r] = ((idx >= r * per_rank) & (idx < (r + 1) * per_rank)).any(1)
        count = hit.sum(1, keepdim=True)
        # (a token sent nowhere combines to +0, not to x * 0's -0 of a negative x)
        out.append(torch.where(count > 0, x.float() * count.float(), 0.0).bfloat16())
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _run_setup(plan: Plan, setup: str, cpu_sync: bool) -> list[dict]:
    import torch

    ranks = _Ranks(setup, plan)
    dev, n = ranks.device, ranks.n
    inputs = _inputs(plan, n, dev)
    want = _expected(inputs, n, plan.experts)
    gm, gn, gk = plan.gemm
    g = torch.Generator().manual_seed(7)
    a = torch.randn(gm, gk, generator=g).bfloat16().to(dev)
    b = torch.randn(gk, gn, generator=g).bfloat16().to(dev)
    gemm_out = torch.empty(gm, gn, dtype=torch.bfloat16, device=dev)
    # loopback: no ordinary CPU-sync dispatch (module doc); the deferred one keeps `cpu_sync`
    plain_sync = cpu_sync and setup == "one"
    kw = dict(num_experts=plan.experts, do_handle_copy=False)

    def gemm() -> None:
        torch.matmul(a, b, out=gemm_out)

    def dispatch(r: int, deferred: bool, host: dict) -> Any:
        x, idx, w = inputs[r]
        t0 = time.perf_counter()
        if deferred:
            got = ranks.bufs[r].dispatch(
                x, idx, w, **kw, do_cpu_sync=cpu_sync, async_with_compute_stream=True, defer_epilogue=True
            )
        else:
            got = ranks.bufs[r].dispatch(x, idx, w, **kw, do_cpu_sync=plain_sync)
        host.setdefault("dispatch", []).append(time.perf_counter() - t0)
        return got

    def combine(r: int, recv: Any, deferred: bool, host: dict) -> Any:
        t0 = time.perf_counter()
        if deferred:
            got = ranks.bufs[r].combine(recv[0], recv[3], async_with_compute_stream=True, defer_epilogue=True)
        else:
            got = ranks.bufs[r].combine(recv[0], recv[3])
        host.setdefault("combine", []).append(time.perf_counter() - t0)
        return got

    def one_iter(mode: str, host: dict) -> list[Any] | None:
        if mode == "compute":
            gemm()
            gemm()
            return None
        deferred = mode == "deferred"
        recv = ranks.call(lambda r: dispatch(r, deferred, host))
        if deferred:
            gemm()  # beside the dispatch kernel: issued between the call and its wait
            recv = ranks.call(lambda r: recv[r].current_stream_wait())
        elif mode == "plain":
            gemm()
        out = ranks.call(lambda r: combine(r, recv[r], deferred, host))
        if deferred:
            gemm()
            out = ranks.call(lambda r: out[r].current_stream_wait())
        elif mode == "plain":
            gemm()
        return [o[0] for o in out]

    rows = []
    try:
        # correctness first: every mode's combined rows against the reference, deferred bitwise plain
        gemm()
        ref_gemm = gemm_out.clone()
        firsts: dict[str, list[Any]] = {}
        for mode in MODES:
            got = one_iter(mode, {})
            if ranks.cuda:
                torch.cuda.synchronize()
            if got is None:
                assert _same(gemm_out, ref_gemm), f"{setup}: the GEMM's output changed"
                continue
            firsts[mode] = got
            for r in range(n):
                assert _same(got[r], want[r]), f"{setup} {mode} cpu_sync={cpu_sync}: rank {r}'s combined rows"
        for r in range(n):
            assert _same(firsts["deferred"][r], firsts["plain"][r]), f"{setup}: rank {r}: deferred != plain"
        assert _same(gemm_out, ref_gemm), f"{setup}: the GEMM's output beside the communication"
        # timing
        for mode in MODES:
            for _ in range(plan.warmup):
                one_iter(mode, {})
            if ranks.cuda:
                torch.cuda.synchronize()
            host: dict = {}
            clock = _Clock(ranks.cuda)
            clock.mark()
            for _ in range(plan.iters):
                one_iter(mode, host)
                clock.mark()
            spans, total = clock.spans()
            rows.append(mode_row(setup, cpu_sync, mode, spans, total, host))
        rows.append(overlap_row(rows[-len(MODES) :]))
    finally:
        if ranks.cuda:
            torch.cuda.synchronize()
        ranks.close()
    return rows


def run(plan: Plan) -> list[dict]:
    import torch

    rows: list[dict] = []
    one = "one" in plan.setups
    if one:
        import torch.distributed as dist
        from ep_torch.launch import free_port, init_rank

        init_rank(0, 1, free_port(), "nccl" if plan.device == "cuda" else "gloo")
    try:
        for setup, cpu_sync in plan.runs:
            rows.extend(_run_setup(plan, setup, cpu_sync))
            if plan.device == "cuda":
                torch.cuda.synchronize()
    finally:
        if one:
            dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    plan = plan_from_args(build_parser().parse_args(argv))
    if plan.dry_run:
        print(json.dumps({k: v for k, v in asdict(plan).items() if k != "runs"}, default=list))
        print("\n".join(planned(plan)))
        return 0
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no GPU (--device cpu runs the loop on the CPU reference backend)")
        return 0
    t0 = time.perf_counter()
    rows = run(plan)
    meta = {
        "device": torch.cuda.get_device_name() if plan.device == "cuda" else "cpu",
        "tokens": plan.tokens,
        "hidden": plan.hidden,
        "topk": plan.topk,
        "experts": plan.experts,
        "gemm": plan.gemm,
        "iters": plan.iters,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_defer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
