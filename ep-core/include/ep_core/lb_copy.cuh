// SPDX-License-Identifier: Apache-2.0
/// \file lb_copy.cuh
/// \brief DeepEP 2.5's redundant-expert load balancing over symmetric memory (host side: `ep_core.lb_copy`).
///
/// Every rank's LB region lives in a symmetric allocation that every rank has mapped; the host turns the redundancy
/// mapping into address tables (peers' addresses as mapped in this process), so the kernels only move bytes:
///  - `ep_lb_copy` (prefetch, a push): task `t` of `tasks [T][3]` (int64: dst, src, bytes) copies `bytes` from
///    `src` (this rank's expert weights, any device memory) to `dst` (a slot of a peer's LB region, or this rank's).
///  - `ep_lb_reduce` (reduce_grads, a pull): entry `e` of `table [E][3]` (int64: dst, first, count) adds, into
///    the `hidden` fp32 at `dst` (one of this rank's expert gradient rows), the rows at `srcs[first .. first +
///    count)` (`srcs` = `table + 3 * E`: peers' LB slots), in that order, one fp32 add each: the host lists them in
///    ascending (LSA rank, slot) order, so the result is bitwise the sequential sum of `ep_core.load_balance`.
///  - `ep_lb_barrier` (one block): every rank stores `value` into word `rank` of every peer's sync words and waits
///    until each peer's word in its own is >= `value`. Launched before the copy (no rank writes into a slot, or
///    reads one, before every peer's stream reached the call) and after it (no rank leaves, and so reuses its
///    slots, before every peer's reads and writes landed). Values grow by call (the host's generation counter).
///
/// Bytes move in 16-byte vectors, eight in flight per thread, grid-stride within each task (a task's bytes are
/// spread over the whole grid); a task whose addresses or size are not 16-byte multiples moves byte by byte (fp32
/// by fp32 for a reduce). The waits are bounded by `timeout_ms` (%globaltimer); the first that expires records
/// (1, rank, peer, tag) in the host-mapped word `herr [4]`; every kernel checks `herr[0]` at entry and does
/// nothing once it is raised (the host raises `EPTimeoutError` at its next call, sticky).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EP_LB_DEVICE __device__ __forceinline__
#else
#define EP_LB_DEVICE inline  // the host emulation of the tests (lb_copy_emu.cpp) runs the span functions
#endif

namespace ep_core::lb {

constexpr int kBlockThreads = 512;
constexpr int kUnroll = 8;  // 16-byte vectors in flight per thread: 64 KiB a block of 512 threads

/// Copy `nbytes` from `src` to `dst`: thread `tid` of `nthreads` takes vectors tid, tid + nthreads, ...
EP_LB_DEVICE void copy_span(uint8_t* dst, const uint8_t* src, int64_t nbytes, int64_t tid, int64_t nthreads) {
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) != 0 || (nbytes & 15) != 0) {
        for (int64_t i = tid; i < nbytes; i += nthreads)
            dst[i] = src[i];
        return;
    }
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const int64_t n = nbytes >> 4;
    int64_t i = tid;
    for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            v[u] = s[i + u * nthreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            d[i + u * nthreads] = v[u];
    }
    for (; i < n; i += nthreads)
        d[i] = s[i];
}

/// `dst [hidden]` += `srcs[0]`, then `srcs[1]`, ... (`count` rows of `hidden` fp32), one fp32 add each, in order.
EP_LB_DEVICE void reduce_span(float* dst, const uint64_t* srcs, int64_t count, int64_t hidden, int64_t tid,
                              int64_t nthreads) {
    bool vec = (reinterpret_cast<uintptr_t>(dst) & 15u) == 0 && (hidden & 3) == 0;
    for (int64_t c = 0; c < count; ++c)
        vec = vec && (srcs[c] & 15u) == 0;
    if (!vec) {
        for (int64_t i = tid; i < hidden; i += nthreads) {
            float acc = dst[i];
            for (int64_t c = 0; c < count; ++c)
                acc += reinterpret_cast<const float*>(srcs[c])[i];
            dst[i] = acc;
        }
        return;
    }
    float4* d = reinterpret_cast<float4*>(dst);
    const int64_t n = hidden >> 2;
    for (int64_t i = tid; i < n; i += kUnroll * nthreads) {
        float4 acc[kUnroll] = {};
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * nthreads < n)
                acc[u] = d[i + u * nthreads];
        for (int64_t c = 0; c < count; ++c) {
            const float4* s = reinterpret_cast<const float4*>(srcs[c]);
            float4 v[kUnroll] = {};
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * nthreads < n)
                    v[u] = s[i + u * nthreads];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                acc[u].x += v[u].x;
                acc[u].y += v[u].y;
                acc[u].z += v[u].z;
                acc[u].w += v[u].w;
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * nthreads < n)
                d[i + u * nthreads] = acc[u];
    }
}

/// Every copy task over the whole grid (`tid`/`nthreads`: this thread's index in the grid and the grid's size).
EP_LB_DEVICE void copy_tasks(const int64_t* tasks, int num_tasks, int64_t tid, int64_t nthreads) {
    for (int t = 0; t < num_tasks; ++t) {
        const int64_t* task = tasks + 3 * t;
        copy_span(reinterpret_cast<uint8_t*>(task[0]), reinterpret_cast<const uint8_t*>(task[1]), task[2], tid,
                  nthreads);
    }
}

/// Every reduce entry over the whole grid.
EP_LB_DEVICE void reduce_table(const int64_t* table, int num_entries, int64_t hidden, int64_t tid, int64_t nthreads) {
    const uint64_t* srcs = reinterpret_cast<const uint64_t*>(table + 3 * num_entries);
    for (int e = 0; e < num_entries; ++e) {
        const int64_t* entry = table + 3 * e;
        reduce_span(reinterpret_cast<float*>(entry[0]), srcs + entry[1], entry[2], hidden, tid, nthreads);
    }
}

#if defined(__CUDACC__)
EP_LB_DEVICE bool aborted(const int* herr) {
    return *reinterpret_cast<const volatile int*>(herr) != 0;
}

EP_LB_DEVICE uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

EP_LB_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_LB_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

/// One thread per block reads the abort word; true when the block must leave without touching anything.
EP_LB_DEVICE bool block_aborted(const int* herr) {
    __shared__ int flag;
    if (threadIdx.x == 0)
        flag = aborted(herr) ? 1 : 0;
    __syncthreads();
    return flag != 0;
}
#endif

}  // namespace ep_core::lb

#if defined(__CUDACC__)
/// `sync [N]`: every rank's sync words (int64 [N]) as mapped here; thread p signals rank p and waits for rank p.
extern "C" __global__ void __launch_bounds__(1024)
    ep_lb_barrier(const uint64_t* sync, int rank, int num_ranks, int value, int timeout_ms, int* herr, int tag) {
    using namespace ep_core::lb;
    if (block_aborted(herr))
        return;
    const int p = static_cast<int>(threadIdx.x);
    __threadfence_system();  // the stream's earlier writes (the copy kernel's stores into peers) before the signal
    if (p < num_ranks) {
        st_release_sys(reinterpret_cast<uint64_t*>(sync[p]) + rank, static_cast<uint64_t>(value));
        const uint64_t* mine = reinterpret_cast<const uint64_t*>(sync[rank]) + p;
        const uint64_t start = now_ns();
        const uint64_t budget = static_cast<uint64_t>(timeout_ms) * 1000000ull;
        for (uint32_t iter = 0; ld_acquire_sys(mine) < static_cast<uint64_t>(value); ++iter) {
            if ((iter & 63u) != 63u)
                continue;
            if (aborted(herr))
                break;
            if (now_ns() - start > budget) {
                if (atomicCAS_system(herr, 0, 1) == 0) {
                    volatile int* h = herr;
                    h[1] = rank;
                    h[2] = p;
                    h[3] = tag;
                    __threadfence_system();
                }
                break;
            }
        }
    }
    __syncthreads();
    __threadfence_system();
}

extern "C" __global__ void __launch_bounds__(ep_core::lb::kBlockThreads)
    ep_lb_copy(const int64_t* tasks, int num_tasks, const int* herr) {
    using namespace ep_core::lb;
    if (block_aborted(herr))
        return;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    copy_tasks(tasks, num_tasks, tid, static_cast<int64_t>(gridDim.x) * blockDim.x);
}

extern "C" __global__ void __launch_bounds__(ep_core::lb::kBlockThreads)
    ep_lb_reduce(const int64_t* table, int num_entries, int hidden, const int* herr) {
    using namespace ep_core::lb;
    if (block_aborted(herr))
        return;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    reduce_table(table, num_entries, hidden, tid, static_cast<int64_t>(gridDim.x) * blockDim.x);
}
#endif
