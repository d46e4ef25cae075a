"""ep-jit benchmark: cold compile, warm-cache load, and per-launch host overhead against baselines.

    python ep-jit/benchmarks/bench_jit.py [--out DIR] [--launches N]

Measures, on the current GPU (or compile-only with --arch when there is none):
  * cold compile of a realistic templated kernel (nvcc; NVRTC too when its library is found),
  * warm-cache load: compile() that hits the disk cache (key hashing + checksum), load (cuLibraryLoadData)
    + function lookup, and the in-process memo hit,
  * launch overhead, median us per launch over batches of back-to-back launches of an empty kernel:
    ep_jit Kernel.launch (wrappers; torch tensors), the raw cuda.bindings cuLaunchKernelEx floor,
    CuPy RawKernel and a torch op (x.add_(1) on a 1-element tensor) when those are installed.
Prints a markdown table (paste into benchmarks/RESULTS.md) and writes bench_jit.json / bench_jit.md to --out.
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

import ep_jit

REALISTIC = r"""
#include <cuda/std/cstdint>

namespace bench {

using cuda::std::int64_t;
using cuda::std::uint32_t;

constexpr int kWarpSize = 32;

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A dispatch-like kernel: each warp takes tokens by stride, finds the distinct destination ranks of
// its top-k experts, counts them, and copies the token (int4 vectors) into every destination's slot.
template <int kHiddenBytes, int kTopK, int kNumRanks, int kNumWarps>
__global__ void __launch_bounds__(kNumWarps * kWarpSize)
dispatch_like(const int4* __restrict__ x, const int64_t* __restrict__ topk_idx, int4* __restrict__ out,
              int* __restrict__ rank_counts, int num_tokens, int experts_per_rank, int slots_per_rank) {
  static_assert(kHiddenBytes % sizeof(int4) == 0, "hidden must be a multiple of 16 bytes");
  constexpr int kVecs = kHiddenBytes / sizeof(int4);
  __shared__ int block_counts[kNumRanks];
  __shared__ int4 staging[kNumWarps][kVecs > 256 ? 256 : kVecs];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int r = threadIdx.x; r < kNumRanks; r += blockDim.x) block_counts[r] = 0;
  __syncthreads();
  for (int t = blockIdx.x * kNumWarps + warp; t < num_tokens; t += gridDim.x * kNumWarps) {
    uint32_t mask = 0;
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      int64_t e = topk_idx[(int64_t)t * kTopK + k];
      if (e >= 0) mask |= 1u << (int)(e / experts_per_rank);
    }
#pragma unroll
    for (int r = 0; r < kNumRanks; ++r) {
      if (!(mask & (1u << r))) continue;
      int slot = 0;
      if (lane == 0) slot = atomicAdd(&rank_counts[r], 1);
      slot = __shfl_sync(0xffffffffu, slot, 0) % slots_per_rank;
      if (lane == 0) atomicAdd(&block_counts[r], 1);
      int4* dst = out + ((int64_t)r * slots_per_rank + slot) * kVecs;
      const int4* src = x + (int64_t)t * kVecs;
#pragma unroll 4
      for (int v = lane; v < kVecs; v += kWarpSize) {
        int4 val = __ldg(src + v);
        if (v < 256) staging[warp][v] = val;
        dst[v] = val;
      }
    }
    int n = warp_sum(__popc(mask) * (lane == 0));
    (void)n;
  }
  __syncthreads();
}

template __global__ void dispatch_like<14336, 8, 8, 16>(const int4*, const int64_t*, int4*, int*, int, int, int);
template __global__ void dispatch_like<7168, 8, 8, 16>(const int4*, const int64_t*, int4*, int*, int, int, int);
template __global__ void dispatch_like<4096, 6, 16, 8>(const int4*, const int64_t*, int4*, int*, int, int, int);

}  // namespace bench
"""

EMPTY = r"""
struct Cfg { int a[8]; };
extern "C" __global__ void empty5(const float* a, const float* b, float* c, int n, int m) {
  if (n < 0 && threadIdx.x == 0) c[0] = a[0] + b[0] + m;
}
extern "C" __global__ void empty6s(const float* a, const float* b, float* c, int n, int m, Cfg cfg) {
  if (n < 0 && threadIdx.x == 0) c[0] = a[0] + b[0] + m + cfg.a[3];
}
"""


def _median_us_per_launch(launch, sync, launches: int, batch: int = 200) -> float:
    for _ in range(min(batch, 50)):  # warm up (layouts, configs, lazy loading)
        launch()
    sync()
    per = []
    for _ in range(max(1, launches // batch)):
        t0 = time.perf_counter()
        for _ in range(batch):
            launch()
        per.append((time.perf_counter() - t0) / batch * 1e6)
        sync()
    return statistics.median(per)


def _timeit(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for bench_jit.json and bench_jit.md")
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--arch", default=None, help="target arch when there is no GPU (e.g. sm_90a)")
    opts = ap.parse_args()

    rows: list[tuple[str, str, str]] = []  # (what, value, note)
    data: dict[str, float | str] = {}

    try:
        from ep_jit._driver import current_arch, driver

        driver()
        arch = current_arch()
        have_gpu = True
    except ep_jit.NoDeviceError as e:
        have_gpu = False
        arch = opts.arch or "sm_90a"
        print(f"[bench_jit] no GPU ({e}); compile measurements only, for {arch}", file=sys.stderr)
    data["arch"] = arch

    with (
        tempfile.TemporaryDirectory(prefix="ep-jit-bench-") as tmp,
        ep_jit._env.scope(EPKIT_JIT_CACHE_DIR=tmp),
    ):
        _measure(arch, have_gpu, opts.launches, rows, data)

    md = ["| measurement | value | note |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(md)
    print(f"\nep-jit benchmark ({arch})\n")
    print(text)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "bench_jit.json").write_text(json.dumps(data, indent=2))
        (opts.out / "bench_jit.md").write_text(f"## ep-jit ({arch})\n\n{text}\n")
    return 0


_WARM_CHILD = r"""
import sys, time
t0 = time.perf_counter()
import ep_jit
t1 = time.perf_counter()
src = open(sys.argv[1]).read()
art = ep_jit.compile(src, name="dispatch_like", arch=sys.argv[2])
t2 = time.perf_counter()
assert art.from_cache
try:
    kernel = ep_jit.load(art).function(art.kernel_names[0])
    t3 = time.perf_counter()
except ep_jit.NoDeviceError:
    t3 = float("nan")
print(f"{t1 - t0} {t2 - t1} {t3 - t2}")
"""


def _measure(arch: str, have_gpu: bool, launches: int, rows, data) -> None:
    # --- cold compiles ---------------------------------------------------------------------------
    ep_jit.clear_memo()
    t0 = time.perf_counter()
    art = ep_jit.compile(REALISTIC, name="dispatch_like", arch=arch)
    cold = time.perf_counter() - t0
    assert not art.from_cache
    data["cold_compile_nvcc_s"] = cold
    regs = {k: v.get("registers") for k, v in art.meta["resources"].items()}
    rows.append(
        (
            "cold compile, realistic templated kernel (3 instantiations), nvcc",
            f"{cold:.2f} s",
            f"regs {sorted(regs.values())}",
        )
    )
    try:
        ep_jit.clear_memo()
        t0 = time.perf_counter()
        ep_jit.compile(REALISTIC, name="dispatch_like", arch=arch, backend="nvrtc")
        cold_rtc = time.perf_counter() - t0
        data["cold_compile_nvrtc_s"] = cold_rtc
        rows.append(("cold compile, same kernel, NVRTC", f"{cold_rtc:.2f} s", ""))
    except ep_jit.JitError as e:
        rows.append(("cold compile, NVRTC", "n/a", str(e).splitlines()[0][:80]))

    # --- warm cache --------------------------------------------------------------------------------
    def disk_hit():
        ep_jit.clear_memo()
        a = ep_jit.compile(REALISTIC, name="dispatch_like", arch=arch)
        assert a.from_cache

    warm = _timeit(disk_hit, 20)
    data["warm_compile_hit_ms"] = warm * 1e3
    rows.append(
        (
            "compile() disk-cache hit (key hash + checksum)",
            f"{warm * 1e3:.2f} ms",
            "new process's first call",
        )
    )
    src_file = Path(ep_jit._env.cache_dir()) / "bench_src.cu"
    src_file.write_text(REALISTIC)
    samples = []
    for _ in range(5):
        proc = subprocess.run(
            [sys.executable, "-c", _WARM_CHILD, str(src_file), arch],
            capture_output=True,
            text=True,
            check=True,
        )
        samples.append([float(v) for v in proc.stdout.split()])
    imp, hit, load = (statistics.median(col) for col in zip(*samples))
    data["new_process_import_ms"] = imp * 1e3
    data["new_process_compile_hit_ms"] = hit * 1e3
    data["new_process_load_ms"] = load * 1e3
    rows.append(("new process: import ep_jit", f"{imp * 1e3:.1f} ms", "median of 5 processes"))
    rows.append(
        ("new process: first compile() (disk hit, incl. nvcc --version)", f"{hit * 1e3:.1f} ms", "warm cache")
    )
    if load == load:
        rows.append(("new process: load + function (context creation included)", f"{load * 1e3:.1f} ms", ""))
    ep_jit.compile(REALISTIC, name="dispatch_like", arch=arch)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        ep_jit.compile(REALISTIC, name="dispatch_like", arch=arch)
    memo = (time.perf_counter() - t0) / n
    data["memo_hit_us"] = memo * 1e6
    rows.append(("compile() in-process memo hit", f"{memo * 1e6:.2f} us", "no hashing, no file I/O"))

    if have_gpu:
        from ep_jit._module import Module

        def load_fresh():
            m = Module(art.cubin_path)
            m.function(art.kernel_names[0])
            m.unload()

        load_s = _timeit(load_fresh, 20)
        data["warm_load_ms"] = load_s * 1e3
        rows.append(("load (cuLibraryLoadData) + function()", f"{load_s * 1e3:.2f} ms", "warm cache"))
        total = warm + load_s
        data["warm_total_ms"] = total * 1e3
        rows.append(("warm start total: compile() hit + load + function", f"{total * 1e3:.2f} ms", ""))

        # --- launch overhead ---------------------------------------------------------------------------
        from ep_jit._driver import driver

        _launch_rows(driver(), arch, launches, rows, data)


def _launch_rows(drv, arch: str, launches: int, rows, data) -> None:
    mod = ep_jit.load(ep_jit.compile(EMPTY, name="empty", arch=arch))
    k5 = mod.function("empty5")
    k6 = mod.function("empty6s")

    def ok(res):
        assert not res[0], res
        return res[1] if len(res) == 2 else res[1:]

    buf = int(ok(drv.cuMemAlloc(1 << 20)))
    stream = ok(drv.cuStreamCreate(1))
    sh = int(stream)

    def sync():
        ok((drv.cuStreamSynchronize(stream)[0], None))

    pa, pb, pc = ep_jit.pointer(buf), ep_jit.pointer(buf + 4096), ep_jit.pointer(buf + 8192)

    def ep5():
        k5.launch(1, 32, [pa, pb, pc, ep_jit.int32(1), ep_jit.int32(2)], stream=sh)

    us = _median_us_per_launch(ep5, sync, launches)
    data["launch_ep_jit_us"] = us
    rows.append(
        (
            "launch: ep_jit Kernel.launch, 5 args (3 ptr + 2 int32 wrappers)",
            f"{us:.2f} us",
            "median per launch",
        )
    )

    def ep_attrs():
        k5.launch(2, 32, [pa, pb, pc, ep_jit.int32(1), ep_jit.int32(2)], stream=sh, cluster_dim=2, pdl=True)

    us = _median_us_per_launch(ep_attrs, sync, launches)
    data["launch_ep_jit_cluster_pdl_us"] = us
    rows.append(("launch: ep_jit with cluster_dim=2 and pdl=True", f"{us:.2f} us", "launch attributes"))

    cfg_bytes = bytes(32)

    def ep6():
        k6.launch(
            1, 32, [pa, pb, pc, ep_jit.int32(1), ep_jit.int32(2), ep_jit.struct(cfg_bytes, 4)], stream=sh
        )

    us = _median_us_per_launch(ep6, sync, launches)
    data["launch_ep_jit_struct_us"] = us
    rows.append(("launch: ep_jit, 6 args incl. a 32-byte struct by value", f"{us:.2f} us", ""))

    # raw binding floor: a pre-packed parameter buffer and a pre-built config
    from ep_jit._args import ArgLayout, fast_signature

    sig, vals = fast_signature([pa, pb, pc, ep_jit.int32(1), ep_jit.int32(2)])
    layout = ArgLayout(sig)
    pbuf, addr = layout.shared()
    layout.pack(pbuf, vals)
    cfg = k5._configs[(1, 32, 0, sh, False, None, False)][0]
    func = k5._func
    launch_ex = drv.cuLaunchKernelEx

    def raw():
        launch_ex(cfg, func, addr, 0)

    us = _median_us_per_launch(raw, sync, launches)
    data["launch_raw_binding_us"] = us
    rows.append(
        (
            "launch: raw cuda.bindings cuLaunchKernelEx (prebuilt config + params)",
            f"{us:.2f} us",
            "floor of the binding",
        )
    )

    try:
        import torch

        if torch.cuda.is_available():
            ts = torch.cuda.ExternalStream(sh)
            x = torch.zeros(1, device="cuda")
            a = torch.zeros(1024, device="cuda")
            b = torch.zeros(1024, device="cuda")
            c = torch.zeros(1024, device="cuda")

            def ep_t():
                k5.launch(1, 32, [a, b, c, ep_jit.int32(1), ep_jit.int32(2)], stream=sh)

            us = _median_us_per_launch(ep_t, sync, launches)
            data["launch_ep_jit_torch_tensors_us"] = us
            rows.append(("launch: ep_jit with torch tensors passed directly", f"{us:.2f} us", ""))

            x.add_(1)
            with torch.cuda.stream(ts):
                us = _median_us_per_launch(lambda: x.add_(1), sync, launches)
            data["launch_torch_add_us"] = us
            rows.append(
                (
                    f"baseline: torch {torch.__version__} x.add_(1) on 1 element",
                    f"{us:.2f} us",
                    "torch op dispatch + launch",
                )
            )
    except Exception as e:  # not installed, or no CUDA build
        rows.append(("baseline: torch", "n/a", f"{type(e).__name__}: {e}"[:80]))

    try:
        import cupy as cp
        import numpy as np

        ck = cp.RawKernel(EMPTY, "empty5")
        ca = cp.zeros(1024, dtype=cp.float32)
        cb = cp.zeros(1024, dtype=cp.float32)
        cc = cp.zeros(1024, dtype=cp.float32)
        cs = cp.cuda.ExternalStream(sh)
        n1, n2 = np.int32(1), np.int32(2)
        with cs:

            def cupy_launch():
                ck((1,), (32,), (ca, cb, cc, n1, n2))

            us = _median_us_per_launch(cupy_launch, sync, launches)
        data["launch_cupy_rawkernel_us"] = us
        rows.append((f"baseline: CuPy {cp.__version__} RawKernel, same kernel and args", f"{us:.2f} us", ""))
    except Exception as e:  # not installed, or its NVRTC is missing
        rows.append(("baseline: CuPy RawKernel", "n/a", f"{type(e).__name__}: {e}"[:80]))

    drv.cuStreamDestroy(stream)
    drv.cuMemFree(buf)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
