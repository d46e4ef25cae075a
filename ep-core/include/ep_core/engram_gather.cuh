// SPDX-License-Identifier: Apache-2.0
/// \file engram_gather.cuh
/// \brief Engram fetch on one node: gather `rows` entries of `entry_bytes` each from their owners' storage (host NUMA
/// memory mapped into this process, or peers' GPU memory) into a contiguous `[rows, entry_bytes]` output.
///
/// One warp per row (grid-stride over the rows); each lane keeps `kUnroll` vector loads in flight before it stores
/// them, so a block of 16 warps has 16 x 32 x kUnroll x kVec bytes outstanding: what reads over PCIe/C2C from host
/// memory need to approach the link's bandwidth (a plain gather with one load per thread leaves most of the
/// link idle). Loads are non-coherent (`ld.global.nc`: the storage does not change while fetches run, engram_write
/// is a collective with barriers) and bypass L1. Entry `g` lives on rank `g / entries_per_rank`, row
/// `g % entries_per_rank` of that rank's storage (`bases[rank] + row * entry_bytes`); an id outside
/// `[0, num_ranks * entries_per_rank)` yields a zero row (the host does not check GPU indices).
#pragma once

#include <cstdint>

namespace ep_core::engram {

template <int kVec>
struct Vec;
template <>
struct Vec<16> {
    using T = int4;
};
template <>
struct Vec<8> {
    using T = int2;
};
template <>
struct Vec<4> {
    using T = int;
};
template <>
struct Vec<1> {
    using T = unsigned char;
};

template <typename T>
__device__ __forceinline__ T ld_nc(const T* p) {
    return __ldg(p);
}

template <int kVec, int kUnroll>
__device__ __forceinline__ void gather(const uint64_t* __restrict__ bases, const int* __restrict__ indices,
                                       uint8_t* __restrict__ out, long long rows, long long entries_per_rank,
                                       int num_ranks, long long entry_bytes) {
    using T = typename Vec<kVec>::T;
    const int lane = threadIdx.x & 31;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long num_warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long chunks = entry_bytes / kVec;
    const long long total = entries_per_rank * num_ranks;
    for (long long row = warp; row < rows; row += num_warps) {
        const long long g = indices[row];
        T* dst = reinterpret_cast<T*>(out + row * entry_bytes);
        if (g < 0 || g >= total) {
            for (long long c = lane; c < chunks; c += 32)
                dst[c] = T{};
            continue;
        }
        const long long owner = g / entries_per_rank;
        const T* src = reinterpret_cast<const T*>(bases[owner] + (g - owner * entries_per_rank) * entry_bytes);
        long long c = lane;
        for (; c + 32 * (kUnroll - 1) < chunks; c += 32 * kUnroll) {
            T v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                v[u] = ld_nc(src + c + 32 * u);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                dst[c + 32 * u] = v[u];
        }
        for (; c < chunks; c += 32)
            dst[c] = ld_nc(src + c);
    }
}

}  // namespace ep_core::engram

#define EP_ENGRAM_GATHER(VEC)                                                                                     \
    extern "C" __global__ void __launch_bounds__(512)                                                             \
        ep_engram_gather_##VEC(const uint64_t* bases, const int* indices, uint8_t* out, long long rows,         \
                               long long entries_per_rank, int num_ranks, long long entry_bytes) {                \
        ep_core::engram::gather<VEC, 4>(bases, indices, out, rows, entries_per_rank, num_ranks, entry_bytes);    \
    }

EP_ENGRAM_GATHER(16)
EP_ENGRAM_GATHER(8)
EP_ENGRAM_GATHER(4)
EP_ENGRAM_GATHER(1)
