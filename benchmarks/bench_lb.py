#!/usr/bin/env python3
"""How fast ``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads`` move bytes, next to a torch copy of the same
bytes (issue 42's target: at least 80% of the copy ceiling).

Two roads (``ep_torch.load_balance``'s docstring): ``symmetric`` (the LB region in symmetric memory, the bytes moved
by ``ep_core.lb_copy``'s kernels on ``--num-sms`` blocks, 0 = ``lb_get_theoretical_num_sms()``) and ``all_to_all``
(own slots by ``Tensor.copy_``, the others through the group's ``all_to_all_single``). ``--road`` picks one
(default ``symmetric`` on the GPU); every row names the road that ran (``road``, and ``launch``: the kernels' kind, blocks and
tasks of the last call).

One rank, one GPU: every redundant slot holds one of this rank's own experts (the symmetric road: the kernel copies
local to local, with both barriers; the all_to_all road: one device copy per slot and tensor; an
``lb_reduce_grads`` slot is one fp32 add into the expert's gradients). The methods run on a one-rank LB object
(``ep_torch.load_balance.LoadBalance`` with a ``LocalBootstrap``), not a full ``EPBuffer``: they read nothing else of
the buffer.

- prefetch: ``R`` slots of DeepSeek-V3-sized experts, two tensors each (``w13 [4096, 7168]`` and
  ``w2 [7168, 2048]`` bf16, 88 MB an expert); ceiling: one ``Tensor.copy_`` of all those bytes (contiguous).
- reduce: ``R`` slots of ``[hidden]`` fp32 gradients added into ``L`` experts; ceiling: one ``Tensor.add_`` of
  the same bytes (contiguous, in place), and the copy rate for reference.

Rates are the bytes read plus written per second (GB/s, 1e9), best of ``--runs`` timed repetitions (CUDA events).
``*_s`` times a whole call (its host work too: the enveloped exchange of the call's sizes and mapping, a host
collective, during which the GPU idles); ``*_gpu_s`` times the GPU work (5 calls back to back, per call: each
call's host work overlaps the GPU work queued before it, and a ``torch.cuda._sleep`` queued first hides the first
one's, except on a shared GPU): the rate the bytes move at, which ``*_vs_copy_gpu`` compares with the ceiling.

    python benchmarks/bench_lb.py --out OUTDIR [--slots 4] [--runs 10] [--road symmetric|all_to_all] [--num-sms 0]
    python benchmarks/bench_lb.py --out OUTDIR --nprocs 2 [--share-gpu] [--scale 4] [--road ...] [--num-sms 0]

Writes OUTDIR/bench_lb[_<road>].json. Without a GPU it prints "skipped" (``--device cpu`` runs it on the host: the
all_to_all road).

``--nprocs 2``: the cross-rank bytes. Two processes, each one rank of a full ``EPBuffer`` with the LB region planned
as above, every slot of a rank holding one of the *peer's* experts (so every byte crosses ranks). ``--share-gpu``
(or fewer GPUs than ranks): both on GPU 0, a gloo group, the ipc transport; else one GPU each over nccl. The
symmetric road is the buffer's own where the transport maps the peers (both); ``--road all_to_all`` sends the same
calls through ``all_to_all_single`` (gloo through host memory when the GPU is shared, else NCCL). Each rank checks
what it received against the peer's experts (regenerated from the peer's seed) before timing; both ranks run each
timed repetition together (a barrier before each); rank 0's CUDA-event times are reported. ``*_gbs``: the bytes
every rank wrote, read plus written, over the time (both ranks' bytes: on one shared GPU they share its HBM); the
ceiling is one ``Tensor.copy_`` of the same total bytes on one GPU (``copy_gbs``), so ``prefetch_vs_copy_gpu`` is the
issue's 80% target for the cross-rank path. Writes OUTDIR/bench_lb_n2[_shared][_<road>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

_HIDE_CYCLES = 50_000_000  # about 25 ms at 2 GHz: longer than a call's host work
_GPU_REPS = 5  # calls per timed repetition of the *_gpu_s rows


def _road(buf, road: str) -> None:
    """``--road all_to_all`` on a buffer whose LB region is symmetric: the calls take all_to_all_single (the region
    stays where it is; any memory serves that road)."""
    if road == "all_to_all" and buf._lb_sym is not None:
        buf._lb_sym_kept, buf._lb_sym = buf._lb_sym, None
        buf.lb_path, buf.lb_path_reason = "all_to_all", "--road all_to_all"


def _launch(buf) -> list | None:
    sym = getattr(buf, "_lb_sym", None)
    return list(sym.last_launch) if sym is not None and sym.last_launch else None


def _timer(device: str):
    import time

    import torch

    def run(fn, runs: int, gpu_only: bool = False) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(runs):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                reps = _GPU_REPS if gpu_only else 1
                if gpu_only:
                    torch.cuda._sleep(_HIDE_CYCLES)  # the first call's host work runs meanwhile
                a.record()
                for _ in range(reps):  # the later calls' host work overlaps the GPU work queued before them
                    fn()
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3 / reps)
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return best

    return run


def _multi(rank: int, n: int, args_d: dict) -> None:
    """One rank of the ``--nprocs`` run (module doc)."""
    import ep_torch
    import torch
    import torch.distributed as dist

    shared = args_d["shared"]
    torch.cuda.set_device(0 if shared else rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    r, num_local, scale, runs = args_d["slots"], args_d["experts"], args_d["scale"], args_d["runs"]
    shapes = [(4096 // scale, 7168), (7168 // scale, 2048)]
    hidden = 8 * 1024 * 1024 // scale
    plan = ep_torch.BufferAllocator()
    dst = [plan.allocate((r, *s), torch.bfloat16) for s in shapes]
    red_grads = plan.allocate((r, hidden), torch.float32)
    buf = ep_torch.EPBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=128, hidden=1024, num_topk=8,
        lb_allocation_plan_or_num_bytes=plan, explicitly_destroy=True, **({"transport": "ipc"} if shared else {}),
    )  # fmt: skip
    road, sms = args_d["road"], args_d["num_sms"]
    _road(buf, road)
    if road == "symmetric" and buf.lb_path != "symmetric":
        raise SystemExit(f"rank {rank}: the symmetric road is not available here: {buf.lb_path_reason}")

    def experts(of: int) -> list:
        g = torch.Generator().manual_seed(1000 + of)
        return [torch.randn(num_local, *s, generator=g).to(torch.bfloat16).to(dev) for s in shapes]

    src = experts(rank)
    # every slot of rank q holds an expert of the next rank: all bytes cross ranks
    mapping = torch.tensor(
        [[((q + 1) % n) * num_local + c % num_local for c in range(r)] for q in range(n)], dtype=torch.int32
    ).to(dev)
    grads = torch.zeros(num_local, hidden, device=dev)

    def slot_grads(of: int):
        return torch.randn(r, hidden, generator=torch.Generator().manual_seed(2000 + of)).to(dev)

    red_grads.copy_(slot_grads(rank))

    def timed(fn, gpu_only: bool = False) -> float:
        fn()  # warm-up (and the checked run)
        best = float("inf")
        for _ in range(runs):
            torch.cuda.synchronize()
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = _GPU_REPS if gpu_only else 1
            if gpu_only and not shared:
                # the first call's host work runs while the GPU sleeps (on a shared GPU the ranks' sleeps would
                # take turns, and the first rank's timing would wait for the other's)
                torch.cuda._sleep(_HIDE_CYCLES)
            a.record()
            for _ in range(reps):  # the later calls' host work overlaps the GPU work queued before them
                fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3 / reps)
        return best

    t_prefetch = timed(lambda: buf.lb_prefetch_weights(dst, src, mapping, num_sms=sms))
    launch_prefetch = _launch(buf)
    peer = experts((rank + 1) % n)
    for d, s in zip(dst, peer, strict=True):
        want = s[torch.arange(r, device=dev) % num_local]
        assert torch.equal(d, want), f"rank {rank}: the prefetched slots are not the peer's experts"
    del peer
    # checked: each expert gains the slots that hold it on the previous rank, in ascending slot order
    buf.lb_reduce_grads(red_grads, grads, mapping, num_sms=sms)
    want = torch.zeros_like(grads)
    theirs = slot_grads((rank - 1) % n)
    for c in range(r):
        want[c % num_local] += theirs[c]
    assert torch.equal(grads, want), f"rank {rank}: the reduced gradients"
    del want, theirs
    torch.cuda.synchronize()
    dist.barrier()
    t_reduce = timed(lambda: buf.lb_reduce_grads(red_grads, grads, mapping, num_sms=sms))
    t_reduce_gpu = timed(lambda: buf.lb_reduce_grads(red_grads, grads, mapping, num_sms=sms), True)
    launch_reduce = _launch(buf)
    t_prefetch_gpu = timed(lambda: buf.lb_prefetch_weights(dst, src, mapping, num_sms=sms), True)
    moved = sum(d.nbytes for d in dst) * n  # every rank's slots
    grad_bytes = red_grads.nbytes * n
    rows = None
    if rank == 0:
        flat_src = torch.empty(moved, dtype=torch.uint8, device=dev)
        flat_dst = torch.empty_like(flat_src)
        t_copy = min(_copy_time(flat_dst, flat_src) for _ in range(runs))
        del flat_src, flat_dst
        rows = {
            "device": torch.cuda.get_device_name(dev),
            "setup": "shared" if shared else "gpus",
            "nprocs": n,
            "transport": buf.transport,
            "group_backend": dist.get_backend(),
            "road": buf.lb_path,
            "launch": {"prefetch": launch_prefetch, "reduce": launch_reduce},
            "slots": r,
            "experts": num_local,
            "prefetch_bytes": moved,
            "prefetch_s": t_prefetch,
            "copy_s": t_copy,
            "prefetch_gbs": 2 * moved / t_prefetch / 1e9,
            "copy_gbs": 2 * moved / t_copy / 1e9,
            "prefetch_vs_copy": t_copy / t_prefetch,
            "prefetch_gpu_s": t_prefetch_gpu,
            "prefetch_gpu_gbs": 2 * moved / t_prefetch_gpu / 1e9,
            "prefetch_vs_copy_gpu": t_copy / t_prefetch_gpu,
            "reduce_bytes": grad_bytes,
            "reduce_s": t_reduce,
            "reduce_gbs": 3 * grad_bytes / t_reduce / 1e9,
            "reduce_vs_copy": (2 * grad_bytes / (2 * moved / t_copy)) / t_reduce,
            "reduce_gpu_s": t_reduce_gpu,
            "reduce_gpu_gbs": 3 * grad_bytes / t_reduce_gpu / 1e9,
            "reduce_vs_copy_gpu": (2 * grad_bytes / (2 * moved / t_copy)) / t_reduce_gpu,
        }
        out = Path(args_d["out"])
        out.mkdir(parents=True, exist_ok=True)
        name = f"bench_lb_n{n}{'_shared' if shared else ''}_{road}.json"
        (out / name).write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows, indent=1))
    torch.cuda.synchronize()
    dist.barrier()
    if getattr(buf, "_lb_sym_kept", None) is not None:
        buf._lb_sym = buf._lb_sym_kept  # released with the buffer
    buf.destroy()


def _copy_time(dst, src) -> float:
    import torch

    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dst.copy_(src)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide the expert sizes (a quick CPU run)")
    ap.add_argument("--nprocs", type=int, default=1, help="2: the cross-rank bytes (module doc)")
    ap.add_argument(
        "--share-gpu", action="store_true", help="--nprocs: every rank on GPU 0 (ipc, gloo group)"
    )
    ap.add_argument(
        "--road", choices=("symmetric", "all_to_all"), help="module doc (default: symmetric on the GPU)"
    )
    ap.add_argument(
        "--num-sms", type=int, default=0, help="the kernels' blocks (0: lb_get_theoretical_num_sms)"
    )
    args = ap.parse_args()
    args.road = args.road or ("symmetric" if args.device == "cuda" else "all_to_all")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no GPU")
        return 0
    if args.nprocs > 1:
        if args.device != "cuda":
            raise SystemExit("--nprocs: a GPU run (--device cuda)")
        from ep_torch.launch import spawn

        shared = args.share_gpu or torch.cuda.device_count() < args.nprocs
        opts = {"shared": shared, "slots": args.slots, "experts": args.experts, "scale": args.scale}
        opts |= {"runs": args.runs, "out": args.out, "road": args.road, "num_sms": args.num_sms}
        spawn(_multi, args.nprocs, opts, backend="gloo" if shared else "nccl")
        return 0
    from ep_core.bootstrap import LocalBootstrap
    from ep_torch import BufferAllocator
    from ep_torch.load_balance import LoadBalance

    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    r, num_local = args.slots, args.experts
    shapes = [(4096 // args.scale, 7168), (7168 // args.scale, 2048)]
    hidden = 8 * 1024 * 1024 // args.scale  # 32 MB of fp32 gradients a slot

    class OneRank(LoadBalance):
        def __init__(self, plan: BufferAllocator) -> None:
            self.bootstrap = LocalBootstrap()
            self.device, self.rank_idx, self.num_ranks, self.num_nvlink_ranks, self.group = dev, 0, 1, 1, None
            self._init_lb(plan, plan.num_bytes)

        def _rt(self) -> SimpleNamespace:
            """What the LB road asks of the runtime: a storage that maps its peers (one rank: itself) on the
            symmetric road, none on the other; the GPU wait bound."""
            peers = {"peer_bases": lambda n: [0] * n} if args.road == "symmetric" else {}
            return SimpleNamespace(
                storage=SimpleNamespace(**peers), config=SimpleNamespace(num_gpu_timeout_secs=100)
            )

    plan = BufferAllocator()
    dst = [plan.allocate((r, *s), torch.bfloat16) for s in shapes]
    red_grads = plan.allocate((r, hidden), torch.float32)
    lb = OneRank(plan)
    if args.road == "symmetric" and lb.lb_path != "symmetric":
        raise SystemExit(f"the symmetric road is not available here: {lb.lb_path_reason}")
    src = [torch.randn(num_local, *s, device=dev).to(torch.bfloat16) for s in shapes]
    grads = torch.zeros(num_local, hidden, device=dev)
    red_grads.normal_()
    mapping = torch.arange(r, dtype=torch.int32).view(1, r) % num_local  # slot c holds expert c
    timed = _timer(dev.type)

    moved = sum(d.nbytes for d in dst)  # bytes written (and read) by a prefetch
    flat_src = torch.empty(moved, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    sms = args.num_sms
    t_prefetch = timed(lambda: lb.lb_prefetch_weights(dst, src, mapping, num_sms=sms), args.runs)
    t_prefetch_gpu = timed(lambda: lb.lb_prefetch_weights(dst, src, mapping, num_sms=sms), args.runs, True)
    launch_prefetch = _launch(lb)
    t_copy = timed(lambda: flat_dst.copy_(flat_src), args.runs)
    for d, s in zip(dst, src, strict=True):  # what the prefetch wrote
        assert torch.equal(d, s[:r]), "prefetch result"

    grad_bytes = red_grads.nbytes
    acc = torch.zeros(r, hidden, device=dev)
    t_reduce = timed(lambda: lb.lb_reduce_grads(red_grads, grads, mapping, num_sms=sms), args.runs)
    t_reduce_gpu = timed(lambda: lb.lb_reduce_grads(red_grads, grads, mapping, num_sms=sms), args.runs, True)
    launch_reduce = _launch(lb)
    t_add = timed(lambda: acc.add_(red_grads), args.runs)
    flat_g = torch.empty(grad_bytes, dtype=torch.uint8, device=dev)
    flat_g2 = torch.empty_like(flat_g)
    t_gcopy = timed(lambda: flat_g2.copy_(flat_g), args.runs)

    def gbs(nbytes: float, t: float) -> float:
        return nbytes / t / 1e9

    rows = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "slots": r,
        "experts": num_local,
        "road": lb.lb_path,
        "launch": {"prefetch": launch_prefetch, "reduce": launch_reduce},
        "prefetch_bytes": moved,
        "prefetch_s": t_prefetch,
        "copy_s": t_copy,
        "prefetch_gbs": gbs(2 * moved, t_prefetch),
        "copy_gbs": gbs(2 * moved, t_copy),
        "prefetch_vs_copy": t_copy / t_prefetch,
        "prefetch_gpu_s": t_prefetch_gpu,
        "prefetch_vs_copy_gpu": t_copy / t_prefetch_gpu,
        "reduce_bytes": grad_bytes,
        "reduce_s": t_reduce,
        "add_s": t_add,
        "reduce_gbs": gbs(3 * grad_bytes, t_reduce),
        "add_gbs": gbs(3 * grad_bytes, t_add),
        "reduce_vs_add": t_add / t_reduce,
        "reduce_gpu_s": t_reduce_gpu,
        "reduce_vs_add_gpu": t_add / t_reduce_gpu,
        "grad_copy_gbs": gbs(2 * grad_bytes, t_gcopy),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_lb_{lb.lb_path}.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
