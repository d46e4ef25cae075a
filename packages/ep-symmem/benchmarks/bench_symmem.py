"""Allocation + exchange time of ep_symmem for N ranks as processes on one host (FileBootstrap).

    python packages/ep-symmem/benchmarks/bench_symmem.py --ranks 4 [--sizes 1024:0,256:256] [--iters 10] [--out DIR]

Each rank, per iteration: create (cuMemCreate + map + access), export (fds), allgather of descriptors,
import_peers (pidfd_getfd + import + map of N-1 peers), the closing allgather, close. Prints median / max over
iterations of the slowest rank per step, in milliseconds; --out writes bench_symmem.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = ("create", "export", "allgather", "import", "finish", "exchange", "close")


def _worker(args: argparse.Namespace) -> None:
    import ep_symmem as sm

    b = sm.FileBootstrap(args.dir, args.rank, args.ranks, timeout=300)
    out = []
    for spec in args.sizes.split(","):
        gpu_mib, host_mib = (int(x) for x in spec.split(":"))
        rows = []
        for it in range(args.iters + 1):  # iteration 0 warms up
            b.barrier()
            t0 = time.perf_counter()
            buf = sm.SymmetricAllocation.create(gpu_mib << 20, host_mib << 20)
            t1 = time.perf_counter()
            desc = buf.export()
            t2 = time.perf_counter()
            descs = b.allgather(desc)
            t3 = time.perf_counter()
            buf.import_peers(descs, b.rank)
            t4 = time.perf_counter()
            b.allgather(b"")
            buf.release_exported_fds()
            t5 = time.perf_counter()
            b.barrier()
            t6 = time.perf_counter()
            buf.close()
            t7 = time.perf_counter()
            if it:
                ms = [1e3 * x for x in (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t1, t7 - t6)]
                rows.append(dict(zip(STEPS, ms)))
        out.append({"gpu_mib": gpu_mib, "host_mib": host_mib, "rows": rows})
    b.cleanup()
    print("RESULT " + json.dumps({"rank": args.rank, "configs": out}), flush=True)


def _parent(args: argparse.Namespace) -> int:
    import ep_symmem as sm

    info = sm.device_info(0)
    with tempfile.TemporaryDirectory(prefix="bench_symmem_") as tmp:
        cmd = [sys.executable, __file__, "--worker", "--dir", tmp, "--ranks", str(args.ranks)]
        cmd += ["--sizes", args.sizes, "--iters", str(args.iters)]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for r in range(args.ranks)
        ]
        outs = [p.communicate(timeout=540) for p in procs]
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            print(f"rank {rank} failed:\n{err}", file=sys.stderr)
            return 1
        results.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
    summary = []
    print(
        f"ep_symmem allocation + exchange, {args.ranks} processes on {info.name} (driver {info.driver_version})"
    )
    print(f"{'GPU MiB':>8} {'host MiB':>8}  " + "  ".join(f"{s + ' ms':>17}" for s in STEPS))
    for c, config in enumerate(results[0]["configs"]):
        per_step = {}
        for step in STEPS:
            # Slowest rank per iteration, then median / max over iterations.
            worst = [max(r["configs"][c]["rows"][i][step] for r in results) for i in range(args.iters)]
            per_step[step] = {"median": statistics.median(worst), "max": max(worst)}
        summary.append({"gpu_mib": config["gpu_mib"], "host_mib": config["host_mib"], "steps": per_step})
        cells = "  ".join(f"{per_step[s]['median']:8.2f} /{per_step[s]['max']:7.2f}" for s in STEPS)
        print(f"{config['gpu_mib']:>8} {config['host_mib']:>8}  {cells}")
    print(
        "(median / max over iterations of the slowest rank; exchange = export + allgather + import + finish)"
    )
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "ranks": args.ranks,
            "iters": args.iters,
            "device": info.name,
            "pid": os.getpid(),
            "configs": summary,
        }
        (out_dir / "bench_symmem.json").write_text(json.dumps(record, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="1024:0,256:256", help="comma list of GPU_MiB:host_MiB")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    return _parent(args)


if __name__ == "__main__":
    sys.exit(main())
