#!/usr/bin/env python3
"""What a given number of SMs can copy on this GPU: the ceiling of an SM-frugal dispatch or combine (issue 17).

ep's kernels move tokens with bulk (TMA) copies through a shared-memory slot per warp: a load into the slot, then a
store out of it. At few SMs per rank the copy rate follows what each SM can move, not the device's bandwidth. This
measures that rate with the same pattern, stripped of everything else: rows of one token (14336 bytes, hidden 7168
bf16; 7424 bytes for FP8), copied from one buffer to another by persistent blocks, one per SM, every warp's lane 0
running a ring of `depth` slots of `chunk` bytes (the next row's load issued while this row's store still reads its
slot), and next to it a plain register copy (16-byte loads, `unroll` in flight per lane). Rates are read + write GB/s
of the best of 5 timed runs, per kernel and per SM, and as a fraction of a device-wide `cudaMemcpy` of the same bytes
(the ceiling `bench_ep.py` measures).

The fan-out rows (kernel "fanout") copy like the dispatch's send: each row is loaded once and stored `fanout` times,
copy f into region f of a destination `fanout` times the source's size (regions 235 MB apart, so every store goes
to other pages; a token of top-8 of 256 experts at EP8 goes to about 5.25 ranks). They report read and write GB/s
apart: if an SM's write rate stays near 48-50 GB/s (what the FP8 dispatch send wrote per SM at 8 SMs per rank, and
DeepEP's `sm_write_gbs`) whatever the fan-out, a send on few SMs is at that limit; if it grows with the fan-out,
an SM can write faster and the send is short of it. The stores go to this GPU's memory, not over NVLink. The
register fan-out rows (kernel "regfan") do the same through the load/store units (16-byte vectors, no shared memory):
if they write faster per SM than the bulk stores, the dispatch's send has a lever in how it stores.

    python benchmarks/bench_sm_copy.py --out OUTDIR [--sms 32,64,128] [--fanout 1,2,4,5,8]

Writes OUTDIR/bench_sm_copy.json. Needs torch and an NVIDIA GPU (sm_90); without one it prints "skipped".
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

SRC = r"""
#include <cstdint>
#define DEV __device__ __forceinline__
DEV uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
DEV void mb_init(uint64_t* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(b)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
DEV void mb_expect(uint64_t* b, uint32_t n) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory");
}
DEV void mb_wait(uint64_t* b, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}"
                 ::"r"(sa(b)), "r"(parity) : "memory");
}
DEV void bulk_load(void* s, const void* g, uint32_t n, uint64_t* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(s)), "l"(g), "r"(n), "r"(sa(b)) : "memory");
}
DEV void bulk_store(void* g, const void* s, uint32_t n) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g), "r"(sa(s)), "r"(n)
                 : "memory");
}
DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
extern __shared__ __align__(128) uint8_t smem[];

// Lane 0 of every warp copies its rows (round robin over the grid's warps) in pieces of `chunk` bytes through a
// ring of `depth` slots: piece k lands in slot k % depth; before loading piece k + ahead, the store that last read
// that slot has finished reading it (wait_group.read 1: all but the newest store; 0 with one slot). Each piece is
// stored `fanout` times, copy f into region f of dst (rows * row_bytes each), in one bulk group, so the waits hold.
extern "C" __global__ void tma_ring(const uint8_t* src, uint8_t* dst, long long rows, int row_bytes, int depth,
                                    int chunk, int fanout) {
    __shared__ __align__(8) uint64_t bars[32 * 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane != 0)
        return;
    uint64_t* bar = bars + warp * 16;
    uint8_t* slots = smem + static_cast<size_t>(warp) * depth * chunk;
    for (int s = 0; s < depth; ++s)
        mb_init(bar + s);
    const long long gw = static_cast<long long>(blockIdx.x) * nw + warp, ngw = static_cast<long long>(gridDim.x) * nw;
    const int pieces = (row_bytes + chunk - 1) / chunk;
    const long long my_rows = gw < rows ? (rows - 1 - gw) / ngw + 1 : 0;
    const long long n = my_rows * pieces, region = rows * row_bytes;
    auto at = [&](long long k, long long& off, int& len) {
        const long long r = gw + (k / pieces) * ngw;
        const int p = static_cast<int>(k % pieces);
        off = r * row_bytes + static_cast<long long>(p) * chunk;
        len = min(chunk, row_bytes - p * chunk);
    };
    auto load = [&](long long k) {
        long long off;
        int len;
        at(k, off, len);
        const int s = static_cast<int>(k % depth);
        mb_expect(bar + s, len);
        bulk_load(slots + static_cast<size_t>(s) * chunk, src + off, len, bar + s);
    };
    const int ahead = depth > 1 ? depth - 1 : 1;
    uint32_t parity = 0;
    for (long long k = 0; k < ahead && k < n; ++k)
        load(k);
    for (long long k = 0; k < n; ++k) {
        const int s = static_cast<int>(k % depth);
        long long off;
        int len;
        at(k, off, len);
        mb_wait(bar + s, (parity >> s) & 1u);
        parity ^= 1u << s;
        for (int f = 0; f < fanout; ++f)
            bulk_store(dst + f * region + off, slots + static_cast<size_t>(s) * chunk, len);
        bulk_commit();
        if (depth > 1)
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        else
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        if (k + ahead < n)
            load(k + ahead);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Every warp copies its rows by 16-byte register loads and stores, 4 in flight per lane.
extern "C" __global__ void reg_copy(const uint8_t* src, uint8_t* dst, long long rows, int row_bytes) {
    constexpr int kUnroll = 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const long long gw = static_cast<long long>(blockIdx.x) * nw + warp, ngw = static_cast<long long>(gridDim.x) * nw;
    const int vecs = row_bytes / 16;
    for (long long r = gw; r < rows; r += ngw) {
        const uint4* s = reinterpret_cast<const uint4*>(src + r * row_bytes);
        uint4* d = reinterpret_cast<uint4*>(dst + r * row_bytes);
        for (int i0 = lane; i0 < vecs; i0 += 32 * kUnroll) {
            uint4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i0 + u * 32 < vecs)
                    v[u] = __ldg(s + i0 + u * 32);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i0 + u * 32 < vecs)
                    d[i0 + u * 32] = v[u];
        }
    }
}

// The fan-out by registers: every warp loads `kUnroll` 16-byte vectors per lane of its row and stores them `fanout`
// times (copy f into region f of dst) before the next ones, no shared memory: whether an SM writes faster through
// its load/store units than through bulk (TMA) stores when each row goes to several places. (bench_placement.py's
// kernel runs the same body.)
__device__ __forceinline__ void fan_out_rows(const uint8_t* src, uint8_t* dst, long long rows, int row_bytes,
                                             int fanout) {
    constexpr int kUnroll = 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const long long gw = static_cast<long long>(blockIdx.x) * nw + warp, ngw = static_cast<long long>(gridDim.x) * nw;
    const int vecs = row_bytes / 16;
    const long long region = rows * row_bytes;
    for (long long r = gw; r < rows; r += ngw) {
        const uint4* s = reinterpret_cast<const uint4*>(src + r * row_bytes);
        for (int i0 = lane; i0 < vecs; i0 += 32 * kUnroll) {
            uint4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i0 + u * 32 < vecs)
                    v[u] = __ldg(s + i0 + u * 32);
            for (int f = 0; f < fanout; ++f) {
                uint4* d = reinterpret_cast<uint4*>(dst + f * region + r * row_bytes);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i0 + u * 32 < vecs)
                        d[i0 + u * 32] = v[u];
            }
        }
    }
}

extern "C" __global__ void reg_fanout(const uint8_t* src, uint8_t* dst, long long rows, int row_bytes, int fanout) {
    fan_out_rows(src, dst, rows, row_bytes, fanout);
}
"""

BUFFER_BYTES = 16384 * 14336  # 235 MB per buffer: far past L2
SMEM_LIMIT = 220 * 1024
# (row bytes, warps, depth, chunk): ep's slot per warp (one token, whole), fewer warps, rings of pieces; FP8 rows
TMA_CASES = [
    (14336, 15, 1, 14336),
    (14336, 8, 1, 14336),
    (14336, 4, 1, 14336),
    (14336, 7, 2, 14336),
    (14336, 15, 2, 7168),
    (14336, 15, 4, 3584),
    (14336, 7, 8, 3584),
    (14336, 32, 2, 3072),
    (7424, 16, 1, 7424),
    (7424, 28, 1, 7424),
    (7424, 14, 2, 7424),
    (7424, 7, 4, 7424),
]
# (row bytes, warps, depth) of the fan-out rows, whole rows per slot: bf16 with ep's 15 warps (16 slots of 14336
# bytes do not fit), FP8 with the dispatch's 16; and two slots, the next row's load under this row's stores
FANOUT_CASES = [(14336, 15, 1), (14336, 7, 2), (7424, 16, 1), (7424, 14, 2)]
REG_WARPS = (16, 32)
# (row bytes, warps) of the register fan-out rows
REG_FANOUT_CASES = [(14336, 16), (14336, 32), (7424, 16)]


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--sms", type=_int_list, default=[32, 64, 128], help="blocks (one per SM) per run")
    ap.add_argument(
        "--fanout",
        type=_int_list,
        default=[1, 2, 4, 5, 8],
        help="stores per loaded row of the fan-out rows ('' for none; the largest sizes a destination of that many "
        "235 MB buffers)",
    )
    args = ap.parse_args(argv)
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"bench_sm_copy: skipped ({e})")
        return 0
    import ep_jit

    torch.cuda.init()
    mod = ep_jit.load(ep_jit.compile(SRC, name="bench_sm_copy"))
    tma, reg, reg_fan = mod.function("tma_ring"), mod.function("reg_copy"), mod.function("reg_fanout")
    src = torch.ones(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fan_dst = torch.empty(max(args.fanout, default=0) * BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def best_ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return min(times)

    ceiling = 2 * BUFFER_BYTES / best_ms(lambda: dst.copy_(src)) / 1e6
    print(f"device copy (torch copy_, read + write): {ceiling:.0f} GB/s")
    rows_out = []

    def record(kind: str, sms: int, ms: float, nbytes: int, **cols) -> None:
        # nbytes read, written once (`fanout` times in a fan-out row)
        read, write = nbytes / ms / 1e6, cols.get("fanout", 1) * nbytes / ms / 1e6
        gbs = read + write
        row = {
            "kernel": kind,
            "sms": sms,
            **cols,
            "gbs": gbs,
            "gbs_per_sm": gbs / sms,
            "frac_ceiling": gbs / ceiling,
        }
        desc = " ".join(f"{k}={v}" for k, v in cols.items())
        line = f"{kind:8s} sms={sms:3d} {desc:44s} {gbs:7.0f} GB/s {gbs / sms:6.1f} per SM {100 * gbs / ceiling:5.1f}%"
        if "fanout" in cols:
            row |= {"read_gbs": read, "write_gbs": write}
            line += f"  read {read / sms:5.1f} write {write / sms:5.1f} per SM"
        rows_out.append(row)
        print(line)

    def tma_ms(sms: int, out, row_bytes: int, warps: int, depth: int, chunk: int, fanout: int) -> float:
        words = [
            src,
            out,
            ep_jit.int64(BUFFER_BYTES // row_bytes),
            ep_jit.int32(row_bytes),
            ep_jit.int32(depth),
            ep_jit.int32(chunk),
            ep_jit.int32(fanout),
        ]
        return best_ms(
            functools.partial(tma.launch, sms, warps * 32, words, shared_mem=warps * depth * chunk)
        )

    for sms in args.sms:
        for row_bytes, warps, depth, chunk in TMA_CASES:
            smem = warps * depth * chunk
            if smem > SMEM_LIMIT:
                continue
            ms = tma_ms(sms, dst, row_bytes, warps, depth, chunk, 1)
            nbytes = BUFFER_BYTES // row_bytes * row_bytes
            record("tma", sms, ms, nbytes, row=row_bytes, warps=warps, depth=depth, chunk=chunk)
        for row_bytes, warps, depth in FANOUT_CASES:
            for fanout in args.fanout:
                ms = tma_ms(sms, fan_dst, row_bytes, warps, depth, row_bytes, fanout)
                nbytes = BUFFER_BYTES // row_bytes * row_bytes
                record("fanout", sms, ms, nbytes, row=row_bytes, warps=warps, depth=depth, fanout=fanout)
        for warps in REG_WARPS:
            rows = BUFFER_BYTES // 14336
            run = functools.partial(
                reg.launch, sms, warps * 32, [src, dst, ep_jit.int64(rows), ep_jit.int32(14336)]
            )
            record("register", sms, best_ms(run), rows * 14336, row=14336, warps=warps, unroll=4)
        for row_bytes, warps in REG_FANOUT_CASES:
            rows = BUFFER_BYTES // row_bytes
            for fanout in args.fanout:
                words = [src, fan_dst, ep_jit.int64(rows), ep_jit.int32(row_bytes), ep_jit.int32(fanout)]
                run = functools.partial(reg_fan.launch, sms, warps * 32, words)
                record(
                    "regfan", sms, best_ms(run), rows * row_bytes, row=row_bytes, warps=warps, fanout=fanout
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "copy_ceiling_gbs": ceiling,
        "rows": rows_out,
    }
    (out / "bench_sm_copy.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
