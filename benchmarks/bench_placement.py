#!/usr/bin/env python3
"""Where a few-SM kernel's blocks land, and what that costs it (issue 17: the rank spread of the loopback).

`profile_ops.py --phases` shows the loopback's ranks sending at different rates, the same rank slowest in every
replay. This asks whether the placement of a kernel's blocks on the GPU explains it, without ep's kernels: N
"ranks" each launch a fan-out copy (each row loaded once into registers, stored `fanout` times, as a dispatch's
send) of B blocks on their own stream, one block per SM, back to back as the loopback launches its ranks; each
block records its SM (`%smid`) and its start and end (`%globaltimer`). Printed per rank: its SMs, its time
(first block's start to last block's end, median of the runs) and its write rate per SM. Then the same kernel
alone on the idle GPU (how one rank per GPU would place it), and both again with clusters of 2 blocks (DeepEP
launches its kernels with cluster dimension 2).

    python benchmarks/bench_placement.py --out OUTDIR [--ranks 8] [--blocks 8] [--fanout 5]

Writes OUTDIR/bench_placement.json. Needs torch and an NVIDIA GPU (sm_90); without one it prints "skipped".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sm_copy  # (its register fan-out kernel body)

# bench_sm_copy.py's register fan-out (`fan_out_rows`), timed and placed: out[block] = {smid, start ns, end ns}
SRC = (
    bench_sm_copy.SRC
    + r"""
extern "C" __global__ void placed_fanout(const uint8_t* src, uint8_t* dst, long long rows, int row_bytes, int fanout,
                                         unsigned long long* out) {
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    fan_out_rows(src, dst, rows, row_bytes, fanout);
    __syncthreads();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0) {
        unsigned smid;
        asm("mov.u32 %0, %%smid;" : "=r"(smid));
        out[3 * blockIdx.x] = smid;
        out[3 * blockIdx.x + 1] = t0;
        out[3 * blockIdx.x + 2] = t1;
    }
}
"""
)

ROW_BYTES = 7424  # an FP8 dispatch token
ROWS = 4096  # a rank's tokens at T=4096
THREADS = 512
# one block per SM: more dynamic shared memory than half an SM's (the kernel uses none of it)
SHARED_MEM = 120 * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=8, help="blocks (SMs) per rank")
    ap.add_argument("--fanout", type=int, default=5)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"bench_placement: skipped ({e})")
        return 0
    import ep_jit

    torch.cuda.init()
    kernel = ep_jit.load(ep_jit.compile(SRC, name="bench_placement")).function("placed_fanout")
    n, b = args.ranks, args.blocks
    srcs = [torch.ones(ROWS * ROW_BYTES, dtype=torch.uint8, device="cuda") for _ in range(n)]
    dsts = [torch.empty(args.fanout * ROWS * ROW_BYTES, dtype=torch.uint8, device="cuda") for _ in range(n)]
    outs = [torch.zeros(3 * b, dtype=torch.int64, device="cuda") for _ in range(n)]
    streams = [torch.cuda.Stream() for _ in range(n)]
    written = args.fanout * ROWS * ROW_BYTES

    def run(ranks: int, cluster: int | None):
        """Per rank: (SM ids, us) of the median run."""
        per_rank: list[list[tuple[list[int], float]]] = [[] for _ in range(ranks)]
        for _ in range(args.runs + 1):  # the first run warms up
            torch.cuda.synchronize()
            for r in range(ranks):
                words = [
                    srcs[r],
                    dsts[r],
                    ep_jit.int64(ROWS),
                    ep_jit.int32(ROW_BYTES),
                    ep_jit.int32(args.fanout),
                ]
                kernel.launch(
                    b,
                    THREADS,
                    [*words, outs[r]],
                    shared_mem=SHARED_MEM,
                    stream=streams[r],
                    cluster_dim=cluster,
                )
            torch.cuda.synchronize()
            for r in range(ranks):
                rec = outs[r].view(b, 3).tolist()
                sms = sorted(int(x[0]) for x in rec)
                us = (max(x[2] for x in rec) - min(x[1] for x in rec)) / 1e3
                per_rank[r].append((sms, us))
        result = []
        for r, samples in enumerate(per_rank):
            samples = samples[1:]
            us = statistics.median(s[1] for s in samples)
            result.append(
                {"rank": r, "sms": samples[-1][0], "us": us, "write_gbs_per_sm": written / us / 1e3 / b}
            )
        return result

    rows = []
    for cluster in (None, 2):
        for ranks in (n, 1):
            label = f"{ranks} rank{'s' if ranks > 1 else ''} x {b} blocks" + (
                f", clusters of {cluster}" if cluster else ""
            )
            res = run(ranks, cluster)
            print(f"== {label}")
            for r in res:
                print(
                    f"   rank {r['rank']}: {r['us']:8.1f} us  {r['write_gbs_per_sm']:5.1f} GB/s written per SM  SMs {r['sms']}"
                )
            rows.append(
                {"ranks": ranks, "blocks": b, "cluster": cluster, "fanout": args.fanout, "per_rank": res}
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    (out / "bench_placement.json").write_text(
        json.dumps({"device": props.name, "sms": props.multi_processor_count, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
