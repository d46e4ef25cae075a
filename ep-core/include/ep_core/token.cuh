// SPDX-License-Identifier: Apache-2.0
/// \file token.cuh
/// \brief Compile-time shape of one token in a receive region, and warp-wide copy helpers.
///
/// The byte math is ep_layout's TokenLayout (SPEC §4): `[hidden | sf | metadata]`, each part aligned to 32 bytes;
/// metadata = K int32 expert ids, K float weights and, with metadata, one int32 source index plus K int32 words
/// (DeepEP's linked-list indices; direct mode uses them for the per-(source, expert) position in deterministic
/// mode). The host computes the same numbers through the ep_layout Python mirror and checks them (plan.py).
#pragma once

#include <ep_layout/ep_layout.cuh>

#include "ptx.cuh"

namespace ep_core {

template <int kHiddenBytes_, int kNumSfPacks_, int kNumTopk_, bool kWithMetadata>
struct TokenShape {
    static constexpr int kHiddenBytes = kHiddenBytes_;
    static constexpr int kNumSfPacks = kNumSfPacks_;
    static constexpr int kNumTopk = kNumTopk_;
    static_assert(kHiddenBytes % kTokenAlignBytes == 0, "hidden bytes must be a multiple of 32");
    static constexpr ep_layout::TokenLayout kLayout{kHiddenBytes, kNumSfPacks * 4, kNumTopk, kWithMetadata};
    static constexpr int kNumBytes = static_cast<int>(kLayout.get_num_bytes(false));
    static constexpr int kSfOffset = kLayout.get_sf_offset();
    static constexpr int kTopkIdxOffset = kLayout.get_topk_idx_offset();
    static constexpr int kWeightsOffset = kLayout.get_topk_weights_offset();
    static constexpr int kSrcIdxOffset = kLayout.get_src_token_idx_offset();
    static constexpr int kPositionOffset = kLayout.get_linked_list_idx_offset();
    /// Bytes of one warp's shared-memory token slot (bulk copies stage whole tokens there).
    static constexpr int kSmemSlotBytes = align_up(kNumBytes, 128);
};

/// Number of destinations a warp stores one loaded chunk to before loading the next chunk.
static constexpr int kFanout = 8;

/// Warp-wide copy of `kBytes` (multiple of 16) from `src` to up to kFanout destinations `dst[0..n)`.
/// Each lane keeps `kUnroll` 16-byte loads in flight; every loaded chunk is stored to every destination.
/// `kPeerData`: `src` was written by peers during this launch (L2 loads, never the non-coherent path).
template <int kBytes, int kUnroll = 8, bool kPeerData = false>
EP_CORE_DEVICE void warp_copy_fanout(const uint8_t* src, uint8_t* const (&dst)[kFanout], int n, int lane) {
    static_assert(kBytes % 16 == 0, "row bytes must be a multiple of 16");
    constexpr int kVecs = kBytes / 16;
#pragma unroll 1
    for (int base = 0; base < kVecs; base += kWarpSize * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * kWarpSize + lane;
            if (i < kVecs)
                v[u] = kPeerData ? ptx::ld_cg_v4(src + static_cast<int64_t>(i) * 16)
                                 : ptx::ld_nc_v4(src + static_cast<int64_t>(i) * 16);
        }
#pragma unroll
        for (int d = 0; d < kFanout; ++d) {
            if (d < n) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = base + u * kWarpSize + lane;
                    if (i < kVecs)
                        ptx::st_v4(dst[d] + static_cast<int64_t>(i) * 16, v[u]);
                }
            }
        }
    }
}

/// Copy `src` (kBytes) to the destination pointer held by every lane set in `mask` (warp-uniform mask).
template <int kBytes, bool kPeerData = false>
EP_CORE_DEVICE void warp_copy_to_lanes(const uint8_t* src, uint8_t* my_dst, uint32_t mask, int lane) {
    while (mask != 0) {
        uint8_t* dst[kFanout];
        int n = 0;
#pragma unroll
        for (int j = 0; j < kFanout; ++j) {
            const int m = mask != 0 ? __ffs(mask) - 1 : 0;
            dst[j] = reinterpret_cast<uint8_t*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), m));
            if (mask != 0) {
                mask &= mask - 1;
                n = j + 1;
            }
        }
        warp_copy_fanout<kBytes, 8, kPeerData>(src, dst, n, lane);
    }
}

/// Warp-wide zero fill of `kBytes` (multiple of 16).
template <int kBytes>
EP_CORE_DEVICE void warp_zero(uint8_t* dst, int lane) {
    constexpr int kVecs = kBytes / 16;
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int i = lane; i < kVecs; i += kWarpSize)
        ptx::st_v4(dst + static_cast<int64_t>(i) * 16, z);
}

/// Inclusive warp prefix sum.
EP_CORE_DEVICE int warp_inclusive_scan(int v, int lane) {
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
        const int u = __shfl_up_sync(kFullMask, v, d);
        if (lane >= d)
            v += u;
    }
    return v;
}

/// This warp's index in the grid's work order (units: tokens, rows). Off: block-major, `block * warps + warp`.
/// `EP_CORE_WARP_MAJOR` (JIT switch, ep_core.kernels._source; issue 17; the JIT build always defines it, on by default;
/// undefined here: off): warp-major, `warp * blocks + block`, so a partial last round (units not a multiple of the
/// grid's warps: EP8 decode at 8 SMs has 128 tokens for 120 warps) falls on one warp of each of several SMs instead of
/// on the first warps of block 0, whose one SM would carry all of the tail's bulk traffic. Each unit's work, and so
/// every output byte, does not depend on the warp doing it.
EP_CORE_DEVICE int work_warp_index(int warp, int num_warps) {
#if defined(EP_CORE_WARP_MAJOR) && EP_CORE_WARP_MAJOR
    (void)num_warps;
    return warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
#else
    return static_cast<int>(blockIdx.x) * num_warps + warp;
#endif
}

/// In-place exclusive prefix sum of `v[0..n)` (shared memory, written by any thread before the call) by the whole
/// block: every thread calls it (it holds block barriers; blockDim.x is a multiple of 32). Thread i sums a contiguous
/// chunk, the chunk sums are scanned across the block, then each thread rewrites its chunk: the same integers as a
/// serial loop, with a dependency chain of about n / blockDim.x instead of n. `s_warp`: shared scratch of 32 ints.
EP_CORE_DEVICE void block_exclusive_scan(int* v, int n, int* s_warp) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int lo = const_min(n, static_cast<int>(threadIdx.x) * per);
    const int hi = const_min(n, lo + per);
    __syncthreads();  // v complete; s_warp free
    int local = 0;
    for (int j = lo; j < hi; ++j)
        local += v[j];
    const int incl = warp_inclusive_scan(local, lane);
    if (lane == kWarpSize - 1)
        s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < num_warps ? s_warp[lane] : 0;
        const int wi = warp_inclusive_scan(w, lane);
        __syncwarp();
        if (lane < num_warps)
            s_warp[lane] = wi - w;  // exclusive prefix of the warp totals
    }
    __syncthreads();
    int run = s_warp[warp] + incl - local;
    for (int j = lo; j < hi; ++j) {
        const int c = v[j];
        v[j] = run;
        run += c;
    }
    __syncthreads();  // the prefix complete for every thread; s_warp reusable
}

}  // namespace ep_core
