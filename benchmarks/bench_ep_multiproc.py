#!/usr/bin/env python3
"""Multi-process benchmark of ep's direct-mode dispatch and combine: one EP rank per process, one GPU per process.

    python benchmarks/bench_ep_multiproc.py --nprocs N [--transport ipc|nccl] [--share-gpu] --out DIR [--quick]

Each of the N processes is one rank of an `ep_core.EPBuffer` (bootstrap: `ep_torch.ProcessGroupBootstrap` over a
gloo group) on GPU `rank` (`--share-gpu`: every rank on GPU 0, to verify the ipc path on one GPU; its times are
time-sliced and mean nothing). Per T in {4096, 8192} tokens per rank, hidden 7168, top-8 of 256 experts (uniform
random routing), FP8 and bf16 dispatch and bf16 combine, at SM counts {8, 16, 24, 32, 64} (clipped to the device):

1. check: one CPU-synced dispatch (and, for bf16, one combine of per-rank scaled expert outputs with the received
   weights) at every SM count, bitwise against `ep_core.reference` on the rank's own outputs (rows compared in
   canonical order, since the default dispatch is not deterministic);
2. time: the dispatch without CPU sync and the combine, median of CUDA-event times on the caller's stream. Before
   every run: the L2 is flushed (512 MiB memset), the ranks are aligned on the GPU (an NCCL all_reduce of one
   word; a host barrier when GPUs are shared), then a 2 ms spin kernel gives the host a head start so that host
   launch overhead is not timed;
3. baselines in the same run: the copy ceiling (peer-to-peer copy GPU 0 -> GPU 1 through torch, i.e.
   cudaMemcpyPeer; with one GPU the device-to-device copy, labelled so), and an NCCL `all_to_all_single`
   (torch.distributed, backend nccl; one process per GPU only) of the same rows (dispatch: every rank's
   deduplicated (token, destination) rows, data + scales; combine: the reverse, bf16).

Reported per rank r (JSON has every rank; the table shows the mean over ranks and the slowest rank):
  logical GB/s (DeepEP's convention, counts the rank's own share):
      dispatch: recv_tokens_r * (hidden * elem_bytes + num_scale_packs * 4) / t_r
      combine:  recv_tokens_r * hidden * 2 / t_r
  (recv_tokens_r = tokens rank r receives, one per (token, destination rank) pair, its own tokens included.)
  link utilisation: remote_rows_r * token_bytes / t_r / copy_ceiling, where remote_rows_r are the rows rank r
  receives from other ranks in the dispatch (the same rows travel back in the combine), token_bytes the buffer
  token of the op (data, scales, routing metadata; ep_layout); with one GPU every row counts, against the D2D copy.

Writes DIR/bench_ep_multiproc_n{N}_{transport}[_shared].json and .png and prints a table. Exit status: 0 (also when
there is no GPU: prints "skipped"), 1 when a bitwise check failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8
TOKENS = (4096, 8192)
SMS = (8, 16, 24, 32, 64)
QUICK_SMS = (24, 64)
SF_BLOCK = 128  # FP8 scale granularity: one float32 per 128 values
SLEEP_MS = 2.0
FLUSH_BYTES = 512 << 20

FORMULAS = {
    "logical_dispatch": "recv_tokens_r * (hidden * elem_bytes + num_scale_packs * 4) / t_r",
    "logical_combine": "recv_tokens_r * hidden * 2 / t_r",
    "link_util": "remote_rows_r * token_bytes / t_r / copy_ceiling_gbs",
    "aggregate": "table: mean over ranks of the per-rank GB/s; 'slowest' = min over ranks; ms = median per rank, "
    "max over ranks",
}

# published intranode figures (reference/peers.md section 2), drawn on the plot and printed for comparison
PUBLISHED = (
    ("DeepEP V2, EP8, SM100, 24 SMs", "dispatch", 24, 643.0),
    ("DeepEP V2, EP8, SM100, 64 SMs", "dispatch", 64, 726.0),
    ("DeepEP V2, EP8, SM100, 24 SMs", "combine", 24, 675.0),
    ("DeepEP V2, EP8, SM100, 64 SMs", "combine", 64, 740.0),
    ("DeepEP V1, EP8, H800", "dispatch", None, 153.0),
    ("DeepEP V1, EP8, H800", "combine", None, 158.0),
)


# ---------------------------------------------------------------------------------------------------------------
# arguments and launch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench_ep_multiproc.py",
        description="EP dispatch/combine benchmark with one rank per process (one GPU each, or --share-gpu).",
        epilog="Formulas: logical dispatch GB/s = "
        + FORMULAS["logical_dispatch"]
        + "; combine = "
        + FORMULAS["logical_combine"]
        + "; link utilisation = "
        + FORMULAS["link_util"]
        + ".",
    )
    ap.add_argument(
        "--nprocs", type=int, required=True, help="ranks (processes); one GPU each unless --share-gpu"
    )
    ap.add_argument("--transport", choices=("ipc", "nccl"), default="ipc")
    ap.add_argument(
        "--memory",
        choices=("symmem", "cuda_ipc"),
        default="symmem",
        help="ipc transport storage: ep_symmem VMM buffers or CUDA IPC handles (default symmem)",
    )
    ap.add_argument(
        "--share-gpu", action="store_true", help="every rank on GPU 0 (ipc only; times not meaningful)"
    )
    ap.add_argument("--out", required=True, help="output directory (JSON, PNG)")
    ap.add_argument("--quick", action="store_true", help="T=4096, bf16 + FP8, SMs 24 and 64, 5 iterations")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help=f"tokens per rank (default {TOKENS})")
    ap.add_argument("--sms", type=int, nargs="+", default=None, help=f"SMs per rank (default {SMS})")
    ap.add_argument("--dtypes", nargs="+", choices=("bf16", "fp8"), default=None, help="dispatch dtypes")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per op (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per op (default 3, quick 2)")
    ap.add_argument(
        "--no-check", action="store_true", help="skip the bitwise checks against ep_core.reference"
    )
    ap.add_argument("--no-nccl-baseline", action="store_true", help="skip the NCCL all_to_all baseline")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="host collective timeout in seconds")
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="development: run the harness on CPU tensors over the reference transport (tiny sizes, host timer)",
    )
    args = ap.parse_args(argv)
    if args.nprocs < 1:
        ap.error(f"--nprocs: expected >= 1, got {args.nprocs}")
    if args.share_gpu and args.transport == "nccl" and args.nprocs > 1:
        ap.error("--share-gpu: NCCL refuses two ranks on one GPU; use --transport ipc")
    args.tokens = args.tokens or ([4096] if args.quick else list(TOKENS))
    args.sms = args.sms or list(QUICK_SMS if args.quick else SMS)
    args.dtypes = args.dtypes or ["bf16", "fp8"]
    args.iters = args.iters or (5 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if NUM_EXPERTS % args.nprocs:
        ap.error(f"--nprocs: {NUM_EXPERTS} experts must split evenly over the ranks, got {args.nprocs}")
    return args


def result_stem(args: argparse.Namespace) -> str:
    tag = "cpu_reference" if args.dry_run_cpu else args.transport
    if args.transport == "ipc" and args.memory != "symmem" and not args.dry_run_cpu:
        tag += f"_{args.memory}"
    return f"bench_ep_multiproc_n{args.nprocs}_{tag}" + ("_shared" if args.share_gpu else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import torch.multiprocessing as mp
    except Exception as e:  # pragma: no cover
        print(f"bench_ep_multiproc: skipped (no torch: {e})")
        return 0
    if not args.dry_run_cpu:
        if not torch.cuda.is_available():
            print("bench_ep_multiproc: skipped (no CUDA device)")
            return 0
        ngpu = torch.cuda.device_count()
        if not args.share_gpu and args.nprocs > ngpu:
            print(
                f"bench_ep_multiproc: --nprocs {args.nprocs} needs {args.nprocs} GPUs (one per process), this "
                f"machine has {ngpu}; pass --share-gpu to put every rank on GPU 0 (ipc only)",
                file=sys.stderr,
            )
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = out / f".{result_stem(args)}.status"
    status.unlink(missing_ok=True)
    cfg = dict(vars(args))
    cfg["status"] = str(status)
    t0 = time.time()
    from ep_torch.launch import start_on_free_port

    start_on_free_port(
        lambda port: mp.start_processes(
            _rank_entry, args=({**cfg, "port": port},), nprocs=args.nprocs, join=True, start_method="spawn"
        )
    )
    code = int(status.read_text()) if status.exists() else 1
    status.unlink(missing_ok=True)
    print(f"bench_ep_multiproc: done in {time.time() - t0:.1f} s, exit status {code}")
    return code


# ---------------------------------------------------------------------------------------------------------------
# tensors and the reference


def _torch_dtypes():
    import torch

    return {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "uint16": torch.uint16,
        "int32": torch.int32,
        "int64": torch.int64,
    }


class TorchPool:
    """`EPBuffer` allocator of torch tensors, reused across iterations: outputs are keyed by (tag, call number,
    shape, dtype), so every timed run writes into the same tensors and allocation is not timed."""

    def __init__(self, device) -> None:
        self.device = device
        self.pool: dict = {}
        self.tag = ""
        self.calls = 0
        self.dtypes = _torch_dtypes()

    def use(self, tag: str) -> TorchPool:
        self.tag, self.calls = tag, 0
        return self

    def __call__(self, shape, dtype):
        import torch

        key = (self.tag, self.calls, tuple(shape), str(dtype))
        self.calls += 1
        t = self.pool.get(key)
        if t is None:
            t = torch.empty(tuple(int(s) for s in shape), dtype=self.dtypes[str(dtype)], device=self.device)
            self.pool[key] = t
        return t

    def drop(self, prefix: str) -> None:
        self.pool = {k: v for k, v in self.pool.items() if not k[0].startswith(prefix)}


def to_numpy(t):
    """Bits of a tensor as numpy (bf16 -> uint16, FP8 -> uint8); None stays None; numpy passes through."""
    import numpy as np
    import torch

    if t is None or isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16 if t.dtype == torch.bfloat16 else np.float16)
    if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def from_numpy(a, dtype, device):
    """Inverse of `to_numpy`: `dtype` is the torch dtype the bits stand for."""
    import numpy as np
    import torch

    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(a.view(np.uint8)).view(dtype).to(device)
    return torch.from_numpy(a).to(dtype).to(device)


def output_to_reference(res):
    """An `EPBuffer` `DispatchResult` (torch tensors) as the reference's `DispatchOutput` (numpy)."""
    import dataclasses

    from ep_core.reference import DispatchOutput

    h = res.handle
    arrays = {
        f: to_numpy(getattr(h, f))
        for f in (
            "topk_idx",
            "psum_num_recv_tokens_per_scaleup_rank",
            "psum_num_recv_tokens_per_expert",
            "num_unaligned_recv_tokens_per_expert",
            "recv_src_metadata",
            "dst_buffer_slot_idx",
        )
    }
    handle = dataclasses.replace(h, **arrays)
    return DispatchOutput(
        to_numpy(res.recv_x),
        to_numpy(res.recv_sf),
        to_numpy(res.recv_topk_idx),
        to_numpy(res.recv_topk_weights),
        handle,
    )


def compare_dispatch(got, want, *, canonical: bool, zero_padding: bool = False) -> list[str]:
    """Differences between a kernel's `DispatchOutput` and the reference's, over valid rows; [] when bit-equal.
    `canonical`: sort the kernel's rows by source first (non-deterministic dispatch)."""
    import numpy as np
    from ep_core import reference

    errs: list[str] = []
    if canonical:
        got = reference.canonical_order(got)
    hg, hw = got.handle, want.handle

    def bits(a):
        a = np.ascontiguousarray(a)
        return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a

    def same(name, a, b):
        if (a is None) != (b is None):
            errs.append(f"{name}: {'kernel' if a is None else 'reference'} output is None, the other is not")
            return
        if a is None:
            return
        a, b = bits(np.asarray(a)), bits(np.asarray(b))
        if a.shape != b.shape:
            errs.append(f"{name}: shape {a.shape} != reference {b.shape}")
            return
        if not np.array_equal(a, b):
            bad = np.argwhere(a != b)
            errs.append(f"{name}: {len(bad)} elements differ, first at {tuple(int(i) for i in bad[0])}")

    same(
        "psum_num_recv_tokens_per_scaleup_rank",
        hg.psum_num_recv_tokens_per_scaleup_rank,
        hw.psum_num_recv_tokens_per_scaleup_rank,
    )
    same(
        "num_unaligned_recv_tokens_per_expert",
        hg.num_unaligned_recv_tokens_per_expert,
        hw.num_unaligned_recv_tokens_per_expert,
    )
    if errs:
        return errs
    nv = want.num_valid_rows
    same("recv_src_metadata", np.asarray(hg.recv_src_metadata)[:nv], np.asarray(hw.recv_src_metadata)[:nv])
    if hw.do_expand:
        valid = want.valid_expanded_rows
        rows = min(len(valid), got.recv_x.shape[0])
        same("expanded rows", got.valid_expanded_rows[:rows], valid[:rows])
        v = valid[:rows]
        same("recv_x", got.recv_x[:rows][v], want.recv_x[:rows][v])
        if want.recv_sf is not None:
            same("recv_sf", got.recv_sf[:rows][v], want.recv_sf[:rows][v])
        if want.recv_topk_weights is not None:
            same("recv_topk_weights", got.recv_topk_weights[:rows][v], want.recv_topk_weights[:rows][v])
        if zero_padding:
            pad = ~v
            if np.any(got.recv_x[:rows][pad]):
                errs.append("recv_x: padding rows are not zero")
    else:
        same("recv_x", got.recv_x[:nv], want.recv_x[:nv])
        same(
            "recv_sf",
            None if want.recv_sf is None else got.recv_sf[:nv],
            None if want.recv_sf is None else want.recv_sf[:nv],
        )
        same("recv_topk_idx", got.recv_topk_idx[:nv], want.recv_topk_idx[:nv])
        if want.recv_topk_weights is not None:
            same("recv_topk_weights", got.recv_topk_weights[:nv], want.recv_topk_weights[:nv])
    return errs


def compare_combine(combined_x, combined_w, want) -> list[str]:
    """Differences between a kernel combine (torch tensors) and the reference's `CombineOutput`."""
    import numpy as np

    errs = []
    got = to_numpy(combined_x)
    if got.shape != want.combined_x.shape:
        return [f"combined_x: shape {got.shape} != reference {want.combined_x.shape}"]
    if not np.array_equal(got, want.combined_x):
        errs.append(f"combined_x: {int(np.sum(got != want.combined_x))} elements differ")
    if want.combined_topk_weights is not None:
        gw = to_numpy(combined_w)
        if gw is None or not np.array_equal(
            gw.view(np.uint32), np.asarray(want.combined_topk_weights, dtype=np.float32).view(np.uint32)
        ):
            errs.append("combined_topk_weights: differ from the reference")
    return errs


def scale_expert_output_torch(recv_x, rank: int):
    """The 'expert' of the checks: bf16(float(x) * (rank + 1)); exact in fp32, one bf16 rounding (RNE)."""
    import torch

    return (recv_x.float() * float(rank + 1)).to(torch.bfloat16)


def scale_expert_output_numpy(bits, rank: int):
    import numpy as np
    from ep_core.bf16 import bf16_to_float32, float32_to_bf16

    return float32_to_bf16(bf16_to_float32(bits) * np.float32(rank + 1))


# ---------------------------------------------------------------------------------------------------------------
# inputs


def rank_routing(r: int, tokens: int, seed: int, device):
    """Rank r's routing, the same in every process: uniform top-8 of 256 (top-k of random keys), weights > 0."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed * 100003 + r * 7 + 1)
    keys = torch.rand(tokens, NUM_EXPERTS, generator=g, device=device)
    idx = keys.topk(TOPK, dim=1).indices.to(torch.int64).contiguous()
    w = (torch.rand(tokens, TOPK, generator=g, device=device) + 0.05).contiguous()
    return idx, w


def rank_data(r: int, tokens: int, fp8: bool, seed: int, device):
    """Rank r's tokens, the same in every process: bf16 normal values, or FP8 e4m3 data + float32 scale packs."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed * 100003 + r * 7 + (3 if fp8 else 2))
    if fp8:
        data = (torch.randn(tokens, HIDDEN, generator=g, device=device) * 0.5).to(torch.float8_e4m3fn)
        sf = torch.rand(tokens, HIDDEN // SF_BLOCK, generator=g, device=device) + 0.01
        return data.contiguous(), sf.contiguous()
    return torch.randn(tokens, HIDDEN, generator=g, device=device, dtype=torch.bfloat16).contiguous(), None


def pair_counts(idxs, n: int):
    """counts[s][d] = tokens of rank s that go to rank d (deduplicated (token, destination) pairs)."""
    import torch

    epr = NUM_EXPERTS // n
    out = []
    for idx in idxs:
        hit = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device)
        hit.scatter_(1, (idx // epr).clamp_min(0), True)
        out.append([int(c) for c in hit.sum(0).tolist()])
    return out


# ---------------------------------------------------------------------------------------------------------------
# one rank


class RankContext:
    def __init__(self, cfg: dict, rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.cfg = cfg
        self.rank = rank
        self.size = int(cfg["nprocs"])
        self.cpu = bool(cfg["dry_run_cpu"])
        self.single_gpu = bool(cfg["share_gpu"]) or self.size == 1
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            dev = 0 if cfg["share_gpu"] else rank
            torch.cuda.set_device(dev)
            self.device = torch.device("cuda", dev)
            # create the device's primary context and make it current on this thread (ep_core uses it)
            torch.zeros(1, device=self.device)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cfg['port']}",
            rank=rank,
            world_size=self.size,
            timeout=timedelta(seconds=float(cfg["timeout"])),
        )
        self.nccl_group = None
        self.nccl_reason = ""
        if self.cpu:
            self.nccl_reason = "CPU dry run"
        elif cfg["share_gpu"] and self.size > 1:
            self.nccl_reason = "GPUs are shared (NCCL refuses two ranks on one GPU)"
        else:
            self.nccl_group = dist.new_group(backend="nccl")
        from ep_torch.bootstrap import ProcessGroupBootstrap

        self.boot = ProcessGroupBootstrap()
        self.pool = TorchPool(self.device)
        self.sleep_cycles = 0
        self.flush = None
        if not self.cpu:
            from ep_core.kernels import _cuda

            clock_khz = _cuda.device_attribute("CU_DEVICE_ATTRIBUTE_CLOCK_RATE")
            self.sleep_cycles = int(SLEEP_MS * clock_khz)
            self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
            self.align_word = torch.zeros(1, dtype=torch.int32, device=self.device)

    # -- timing ----------------------------------------------------------------------------------------------
    def _align(self) -> None:
        import torch.distributed as dist

        if self.nccl_group is not None:
            dist.all_reduce(self.align_word, group=self.nccl_group)  # GPU-side rendezvous of all ranks
        else:
            dist.barrier()

    def time_op(self, fn, iters: int, warmup: int) -> tuple[float, float]:
        """(median GPU ms, median host ms of the call) over `iters` runs after `warmup`."""
        import torch

        times, host = [], []
        for i in range(warmup + iters):
            if self.cpu:
                self._align()
                t0 = time.perf_counter()
                fn()
                dt = (time.perf_counter() - t0) * 1e3
                if i >= warmup:
                    times.append(dt)
                    host.append(dt)
                continue
            self.flush.zero_()
            if self.nccl_group is None:
                torch.cuda.synchronize()
            self._align()
            if self.sleep_cycles and hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(self.sleep_cycles)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            stop.record()
            stop.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(stop))
                host.append((h1 - h0) * 1e3)
        return statistics.median(times), statistics.median(host)

    def stream_arg(self) -> int:
        import torch

        return 0 if self.cpu else int(torch.cuda.current_stream().cuda_stream)


def measure_ceilings(ctx: RankContext) -> dict:
    """Rank 0: the copy ceiling of this run (GB/s of bytes copied): GPU 0 -> GPU 1 peer copy when every rank has its
    own GPU and there are >= 2, else the device-to-device copy on this GPU (labelled)."""
    import torch

    if ctx.cpu:
        return {"kind": "none (CPU dry run)", "gbs": float("nan")}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_ep import copy_ceiling_gbs  # read + write of a 1 GiB D2D copy

    d2d_rw = copy_ceiling_gbs()
    out = {"d2d_read_write_gbs": d2d_rw, "d2d_copy_gbs": d2d_rw / 2}
    if ctx.single_gpu:
        out.update(kind="D2D copy on one GPU (no peer: bytes copied per second)", gbs=d2d_rw / 2)
        return out
    n = 1 << 30

    def peer(src_dev: int, dst_dev: int) -> float:
        src = torch.empty(n, dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{dst_dev}")
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            times.append((time.perf_counter() - t0) / 4)
        del src, dst
        torch.cuda.empty_cache()
        return n / statistics.median(times) / 1e9

    out["can_access_peer_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    out["p2p_0_to_1_gbs"] = peer(0, 1)
    out["p2p_1_to_0_gbs"] = peer(1, 0)
    out.update(kind="peer copy GPU 0 -> GPU 1 (torch copy_, cudaMemcpyPeer)", gbs=out["p2p_0_to_1_gbs"])
    return out


def _check_msg(errs: list[str]) -> str:
    return "ok" if not errs else "FAIL: " + "; ".join(errs[:3])


def run_rank(ctx: RankContext) -> tuple[list[dict], dict]:
    """Every configuration on this rank; returns (rows, info)."""
    import ep_layout
    import torch
    from ep_core import EPBuffer, reference
    from ep_core.errors import EPConfigError

    cfg, rank, n, dev = ctx.cfg, ctx.rank, ctx.size, ctx.device
    info: dict = {"rank": rank, "device": str(dev)}
    if not ctx.cpu:
        info["device_name"] = torch.cuda.get_device_name(dev)
        info["device_sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
    device_sms = info.get("device_sms", 132)
    sms_list = sorted({min(int(s), device_sms) for s in cfg["sms"]})
    check = not cfg["no_check"]
    rows: list[dict] = []
    if cfg["dry_run_cpu"]:
        transport = "reference"
    elif cfg["transport"] == "ipc":
        from ep_core.transports.ipc import make_transport

        transport = make_transport(cfg["memory"])
    else:
        transport = "nccl"
    info["ceiling"] = measure_ceilings(ctx) if rank == 0 else None
    ctx.boot.barrier()
    epr = NUM_EXPERTS // n
    for tokens in cfg["tokens"]:
        t_cfg = time.time()
        routing = [rank_routing(r, tokens, cfg["seed"], dev) for r in range(n)]
        counts = pair_counts([i for i, _ in routing], n)  # counts[s][d]
        idx, w = routing[rank]
        try:
            buf = EPBuffer(
                ctx.boot,
                transport=transport,
                num_max_tokens_per_rank=tokens,
                hidden=HIDDEN,
                num_topk=TOPK,
                num_experts=NUM_EXPERTS,
                num_gpu_timeout_secs=60,
                num_cpu_timeout_secs=300,
            )
        except EPConfigError as e:
            if cfg["transport"] == "nccl":
                info["skipped"] = f"transport nccl unavailable: {e}"
                return rows, info
            raise
        ref_comb = None
        try:
            for dtype in cfg["dtypes"]:
                fp8 = dtype == "fp8"
                elem, packs = (1, HIDDEN // SF_BLOCK) if fp8 else (2, 0)
                row_bytes = HIDDEN * elem + packs * 4
                d_tok = ep_layout.make_dispatch_token_layout(HIDDEN, elem, packs, TOPK).get_num_bytes()
                c_tok = ep_layout.make_combine_token_layout(HIDDEN, TOPK).get_num_bytes()
                x, sf = rank_data(rank, tokens, fp8, cfg["seed"], dev)
                x_arg = (x, sf) if fp8 else x
                ref_me = None
                if check:
                    t0 = time.time()
                    xs_np = []
                    for r in range(n):
                        xr, sfr = (x, sf) if r == rank else rank_data(r, tokens, fp8, cfg["seed"], dev)
                        xs_np.append((to_numpy(xr), to_numpy(sfr)) if fp8 else to_numpy(xr))
                        del xr, sfr
                    ref = reference.dispatch(
                        xs_np,
                        [to_numpy(i) for i, _ in routing],
                        [to_numpy(ww) for _, ww in routing],
                        num_experts=NUM_EXPERTS,
                        num_max_tokens_per_rank=tokens,
                    )
                    del xs_np
                    ref_me = ref[rank]
                    if not fp8:
                        ys = [scale_expert_output_numpy(o.recv_x, d) for d, o in enumerate(ref)]
                        ref_comb = reference.combine(
                            ys, [o.handle for o in ref], topk_weights=[o.recv_topk_weights for o in ref]
                        )[rank]
                        del ys
                    del ref
                    info.setdefault("reference_s", {})[f"T{tokens}/{dtype}"] = round(time.time() - t0, 2)
                recv_tokens = sum(counts[s][rank] for s in range(n))
                remote_recv = recv_tokens - counts[rank][rank]
                for sms in sms_list:
                    # 1. check (CPU-synced dispatch; its handle also serves the combine timing)
                    res = buf.dispatch(
                        x_arg,
                        idx,
                        w,
                        num_experts=NUM_EXPERTS,
                        num_sms=sms,
                        do_cpu_sync=True,
                        allocator=ctx.pool.use("check"),
                        stream=ctx.stream_arg(),
                    )
                    if not ctx.cpu:
                        torch.cuda.synchronize()
                    if int(res.handle.num_recv_tokens) != recv_tokens:
                        raise RuntimeError(
                            f"rank {rank}: received {res.handle.num_recv_tokens} tokens, the routing says "
                            f"{recv_tokens}"
                        )
                    d_check = "not checked"
                    if ref_me is not None:
                        d_check = _check_msg(
                            compare_dispatch(output_to_reference(res), ref_me, canonical=True)
                        )

                    # 2. timed dispatch (no CPU sync: worst-case shapes, nothing waits on the host)
                    def disp(sms=sms, buf=buf, x_arg=x_arg, idx=idx, w=w):
                        buf.dispatch(
                            x_arg,
                            idx,
                            w,
                            num_experts=NUM_EXPERTS,
                            num_sms=sms,
                            do_cpu_sync=False,
                            allocator=ctx.pool.use("disp"),
                            stream=ctx.stream_arg(),
                        )

                    ms, host_ms = ctx.time_op(disp, cfg["iters"], cfg["warmup"])
                    rows.append(
                        _row(
                            tokens,
                            dtype,
                            "dispatch",
                            sms,
                            rank,
                            ms,
                            host_ms,
                            recv_tokens * row_bytes,
                            (remote_recv if not ctx.single_gpu else recv_tokens) * d_tok,
                            d_check,
                        )
                    )
                    if fp8:
                        continue
                    # 3. combine: check once, then time (bf16 expert outputs = scaled received tokens)
                    y = scale_expert_output_torch(res.recv_x, rank)
                    comb = buf.combine(
                        y,
                        res.handle,
                        res.recv_topk_weights,
                        num_sms=sms,
                        allocator=ctx.pool.use("check-comb"),
                        stream=ctx.stream_arg(),
                    )
                    c_check = "not checked"
                    if ref_comb is not None:
                        if not ctx.cpu:
                            torch.cuda.synchronize()
                        c_check = _check_msg(
                            compare_combine(comb.combined_x, comb.combined_topk_weights, ref_comb)
                        )

                    def comb_fn(sms=sms, y=y, res=res, buf=buf):
                        buf.combine(
                            y,
                            res.handle,
                            res.recv_topk_weights,
                            num_sms=sms,
                            allocator=ctx.pool.use("comb"),
                            stream=ctx.stream_arg(),
                        )

                    ms, host_ms = ctx.time_op(comb_fn, cfg["iters"], cfg["warmup"])
                    rows.append(
                        _row(
                            tokens,
                            "bf16",
                            "combine",
                            sms,
                            rank,
                            ms,
                            host_ms,
                            recv_tokens * HIDDEN * 2,
                            (remote_recv if not ctx.single_gpu else recv_tokens) * c_tok,
                            c_check,
                        )
                    )
                    del y, comb, res
                ctx.pool.drop("")
                # 4. NCCL all_to_all baseline of the same rows
                if ctx.nccl_group is not None and not cfg["no_nccl_baseline"]:
                    rows.extend(nccl_baseline(ctx, tokens, dtype, x, sf, idx, counts, row_bytes, epr))
                elif rank == 0 and not cfg["no_nccl_baseline"]:
                    info["nccl_baseline"] = f"skipped: {ctx.nccl_reason}"
                del x, sf, x_arg
                if not ctx.cpu:
                    torch.cuda.empty_cache()
        finally:
            buf.destroy()
        info.setdefault("config_s", {})[f"T{tokens}"] = round(time.time() - t_cfg, 1)
        del routing
    return rows, info


def _row(tokens, dtype, op, sms, rank, ms, host_ms, logical_bytes, link_bytes, check) -> dict:
    return {
        "tokens": tokens,
        "dtype": dtype,
        "op": op,
        "sms": sms,
        "rank": rank,
        "time_ms": ms,
        "host_ms": host_ms,
        "logical_bytes": int(logical_bytes),
        "link_bytes": int(link_bytes),
        "check": check,
    }


def nccl_baseline(ctx, tokens, dtype, x, sf, idx, counts, row_bytes, epr) -> list[dict]:
    """torch.distributed all_to_all_single (NCCL) of this rank's (token, destination) rows: dispatch direction with
    the dispatch dtype's bytes (data + scales); for bf16 also the combine direction (bf16 rows back)."""
    import torch
    import torch.distributed as dist

    n, rank = ctx.size, ctx.rank
    hit = torch.zeros(tokens, n, dtype=torch.bool, device=ctx.device)
    hit.scatter_(1, (idx // epr).clamp_min(0), True)
    tok = hit.t().nonzero(as_tuple=True)[1]  # (destination, token) pairs ordered by destination, then token
    payload = x.view(torch.uint8).reshape(tokens, -1)
    if sf is not None:
        payload = torch.cat([payload, sf.view(torch.uint8).reshape(tokens, -1)], dim=1)
    assert payload.shape[1] == row_bytes
    send = payload.index_select(0, tok).contiguous()
    in_splits = [counts[rank][d] for d in range(n)]
    out_splits = [counts[s][rank] for s in range(n)]
    recv = torch.empty(sum(out_splits), row_bytes, dtype=torch.uint8, device=ctx.device)
    it, wu = ctx.cfg["iters"], ctx.cfg["warmup"]

    def a2a():
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=ctx.nccl_group)

    ms, host_ms = ctx.time_op(a2a, it, wu)
    remote = sum(out_splits) - counts[rank][rank]
    rows = [
        _row(tokens, dtype, "nccl_a2a_dispatch", 0, rank, ms, host_ms, recv.numel(), remote * row_bytes, "-")
    ]
    if dtype == "bf16":
        back = torch.empty(sum(in_splits), HIDDEN * 2, dtype=torch.uint8, device=ctx.device)
        fwd = recv[:, : HIDDEN * 2].contiguous()

        def a2a_back():
            dist.all_to_all_single(back, fwd, in_splits, out_splits, group=ctx.nccl_group)

        ms, host_ms = ctx.time_op(a2a_back, it, wu)
        remote_back = sum(in_splits) - counts[rank][rank]
        rows.append(
            _row(
                tokens,
                "bf16",
                "nccl_a2a_combine",
                0,
                rank,
                ms,
                host_ms,
                fwd.numel(),
                remote_back * HIDDEN * 2,
                "-",
            )
        )
    return rows


def _rank_entry(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    code = 1
    ctx = RankContext(cfg, rank)
    try:
        rows, info = run_rank(ctx)
        gathered = ctx.boot.allgather(pickle.dumps((rows, info)))
        code = 0
        if rank == 0:
            code = report(cfg, [pickle.loads(b) for b in gathered])
        ctx.boot.barrier()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        if rank == 0:
            Path(cfg["status"]).write_text(str(code))
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# report (rank 0)


def aggregate(per_rank: list[tuple[list[dict], dict]], ceiling_gbs: float) -> list[dict]:
    groups: dict = {}
    for rows, _ in per_rank:
        for r in rows:
            groups.setdefault((r["tokens"], r["dtype"], r["op"], r["sms"]), []).append(r)
    out = []
    order = {"dispatch": 0, "combine": 1, "nccl_a2a_dispatch": 2, "nccl_a2a_combine": 3}
    for key in sorted(groups, key=lambda k: (k[0], k[1], order.get(k[2], 9), k[3])):
        rs = sorted(groups[key], key=lambda r: r["rank"])
        gbs = [r["logical_bytes"] / (r["time_ms"] * 1e-3) / 1e9 for r in rs]
        link = [r["link_bytes"] / (r["time_ms"] * 1e-3) / 1e9 for r in rs]
        fails = [f"rank {r['rank']}: {r['check']}" for r in rs if r["check"].startswith("FAIL")]
        checks = {r["check"] for r in rs}
        out.append(
            {
                "tokens": key[0],
                "dtype": key[1],
                "op": key[2],
                "sms": key[3],
                "ranks": len(rs),
                "time_ms_median_max_rank": max(r["time_ms"] for r in rs),
                "time_ms_per_rank": [r["time_ms"] for r in rs],
                "host_ms_per_rank": [r["host_ms"] for r in rs],
                "logical_gbs_mean": statistics.fmean(gbs),
                "logical_gbs_min": min(gbs),
                "logical_gbs_per_rank": gbs,
                "link_gbs_mean": statistics.fmean(link),
                "link_util_mean": statistics.fmean(link) / ceiling_gbs
                if ceiling_gbs == ceiling_gbs
                else None,
                "logical_bytes_per_rank": [r["logical_bytes"] for r in rs],
                "check": "; ".join(fails)
                if fails
                else ("ok" if checks == {"ok"} else "/".join(sorted(checks))),
                "host_bound": any(r["host_ms"] > SLEEP_MS for r in rs),
            }
        )
    return out


def report(cfg: dict, per_rank: list[tuple[list[dict], dict]]) -> int:
    args = argparse.Namespace(
        **{k: cfg[k] for k in ("nprocs", "transport", "memory", "share_gpu", "dry_run_cpu")}
    )
    infos = [i for _, i in per_rank]
    skipped = next((i["skipped"] for i in infos if i.get("skipped")), None)
    if skipped:
        print(f"bench_ep_multiproc: SKIPPED ({skipped})")
        return 0
    ceiling = infos[0]["ceiling"]
    cgbs = float(ceiling["gbs"])
    agg = aggregate(per_rank, cgbs)
    n = cfg["nprocs"]
    mode = "shared GPU 0" if cfg["share_gpu"] else "one GPU per process"
    if cfg["dry_run_cpu"]:
        transport = "reference (CPU dry run)"
    else:
        transport = cfg["transport"] + (f" ({cfg['memory']} buffers)" if cfg["transport"] == "ipc" else "")
    title = (
        f"EP{n} ({mode}), transport {transport}, hidden {HIDDEN}, top-{TOPK} of {NUM_EXPERTS}, "
        f"device {infos[0].get('device_name', 'cpu')}"
    )
    print("\n" + title)
    print(f"copy ceiling: {ceiling['kind']}: {cgbs:.0f} GB/s", end="")
    if "d2d_read_write_gbs" in ceiling:
        print(f" (D2D copy on GPU 0: {ceiling['d2d_read_write_gbs']:.0f} GB/s read + write)", end="")
    print()
    for k in ("logical_dispatch", "logical_combine", "link_util", "aggregate"):
        print(f"  {k}: {FORMULAS[k]}")
    for i in infos:
        if i.get("nccl_baseline"):
            print(f"  NCCL all_to_all baseline: {i['nccl_baseline']}")
    print(
        "\n| T | dtype | op | SMs | ms (max rank) | logical GB/s (mean) | slowest rank GB/s | link util | check |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for a in agg:
        util = "-" if a["link_util_mean"] is None else f"{100 * a['link_util_mean']:.1f}%"
        flag = " (host-bound)" if a["host_bound"] and not cfg["dry_run_cpu"] else ""
        print(
            f"| {a['tokens']} | {a['dtype']} | {a['op']} | {a['sms'] or '-'} | {a['time_ms_median_max_rank']:.3f}"
            f"{flag} | {a['logical_gbs_mean']:.1f} | {a['logical_gbs_min']:.1f} | {util} | {a['check']} |"
        )
    print("\npublished (reference/peers.md section 2; other hardware):")
    for name, op, sms, gbs in PUBLISHED:
        print(f"  {name}: {op} {gbs:.0f} GB/s" + (f" at {sms} SMs" if sms else ""))
    failed = [a for a in agg if "FAIL" in a["check"]]
    result = {
        "title": title,
        "config": {
            k: cfg[k] for k in ("nprocs", "transport", "memory", "share_gpu", "tokens", "sms", "dtypes")
        }
        | {
            "iters": cfg["iters"],
            "warmup": cfg["warmup"],
            "hidden": HIDDEN,
            "num_experts": NUM_EXPERTS,
            "topk": TOPK,
            "seed": cfg["seed"],
            "sleep_ms": SLEEP_MS,
            "flush_bytes": FLUSH_BYTES,
        },
        "formulas": FORMULAS,
        "ceiling": ceiling,
        "published": [dict(zip(("name", "op", "sms", "gbs"), p)) for p in PUBLISHED],
        "ranks": infos,
        "rows": agg,
        "raw": [r for rows, _ in per_rank for r in rows],
        "checks_failed": len(failed),
    }
    out = Path(cfg["out"])
    stem = result_stem(args)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(f"json: {out / (stem + '.json')}")
    plot(agg, title, ceiling, out / f"{stem}.png")
    if failed:
        print(f"bench_ep_multiproc: {len(failed)} configurations FAILED the bitwise check", file=sys.stderr)
        return 1
    return 0


def plot(agg: list[dict], title: str, ceiling: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no plot: {e}")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    series: dict = {}
    for a in agg:
        if a["op"] in ("dispatch", "combine"):
            series.setdefault((a["op"], a["dtype"], a["tokens"]), []).append(a)
    for (op, dtype, tokens), pts in sorted(series.items()):
        pts = sorted(pts, key=lambda a: a["sms"])
        label = f"{op} {dtype} T={tokens}"
        line = axes[0].plot(
            [a["sms"] for a in pts], [a["logical_gbs_mean"] for a in pts], marker="o", label=label
        )
        if pts[0]["link_util_mean"] is not None:
            axes[1].plot(
                [a["sms"] for a in pts],
                [100 * a["link_util_mean"] for a in pts],
                marker="o",
                label=label,
                color=line[0].get_color(),
            )
    for a in agg:
        if a["op"].startswith("nccl") and a["tokens"] == max(x["tokens"] for x in agg):
            axes[0].axhline(a["logical_gbs_mean"], ls="--", lw=0.8, color="gray")
            axes[0].annotate(
                f"NCCL a2a {a['op'][9:]} {a['dtype']}: {a['logical_gbs_mean']:.0f}",
                (8, a["logical_gbs_mean"]),
                fontsize=6,
                color="gray",
            )
    for _name, op, sms, gbs in PUBLISHED:
        if sms:
            axes[0].scatter([sms], [gbs], marker="*" if op == "dispatch" else "x", color="black", zorder=5)
        else:
            axes[0].axhline(gbs, ls=":", lw=0.8, color="black")
    axes[0].annotate(
        "published: * DeepEP V2 dispatch, x combine (SM100); dotted: V1 H800", (8, 10), fontsize=7
    )
    axes[0].set_title(title, fontsize=7)
    axes[0].set_xlabel("SMs per rank")
    axes[0].set_ylabel("logical GB/s per rank (DeepEP convention)")
    axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    axes[1].set_title(f"link utilisation vs {ceiling['kind']} ({ceiling['gbs']:.0f} GB/s)", fontsize=7)
    axes[1].set_xlabel("SMs per rank")
    axes[1].set_ylabel("% of copy ceiling")
    axes[1].set_xscale("log", base=2)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
