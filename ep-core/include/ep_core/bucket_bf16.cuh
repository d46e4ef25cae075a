// SPDX-License-Identifier: Apache-2.0
/// \file bucket_bf16.cuh
/// \brief `BucketBuffer.reduce_scatter(comm_precision="bf16")` on the GPU (host side: `ep_core.bucket_bf16`).
///
/// DeepEP 2.5's bf16 reduce-scatter: each sender rounds the float32 shards other ranks own to bf16 in place, so the
/// wire carries bf16; each owner adds the peers' bf16 to its own float32 shard. Two kernels, queued between the
/// copy-engine backend's two stream barriers (every src packed before anyone reads; every read done before anyone
/// overwrites: bounded waits of `ep_core.signal_wait`), so neither kernel waits on anything itself:
///  - `ep_bucket_bf16_pack` (sender, local memory): every shard `q != rank` of every entry becomes its stochastically
///    rounded bf16, packed tile by tile: element `j` of the shard goes to bf16 slot `(j / tile) * 2 * tile + j % tile`
///    (the front half of its tile's bytes; DeepEP's chunk layout, `tile` fp32 elements a chunk). One block a tile,
///    in steps of `kBlockThreads * 8` elements: a step's stores land on bytes whose fp32 values every thread already
///    read (one barrier a step between the loads and the stores).
///  - `ep_bucket_bf16_reduce` (owner, reads the peers over NVLink): element `j` of shard `rank` becomes, in fp32,
///    its own value + peer `rank-1`'s bf16 + peer `rank-2`'s + ... (cyclic), times the scale unless it is 1.0f.
///
/// Stochastic rounding (`ep_core.bf16.stochastic_bits`, bit for bit): the float4 `i` of the whole tensor hashes its
/// four fp32 bit patterns and `i` into two words; element `k` adds the 16 bits `(k < 2 ? h1 : h2) >> (16 * (k & 1))`
/// to its bits and keeps the top 16 (carries into infinity, no saturation); NaN gives 0x7FFF. Integer arithmetic
/// (no `cvt.rs`, which is sm_100 only), so g++ runs the same functions (`bucket_bf16_emu.cpp`).
///
/// Entries (`int64 [E][2]`): the tensor's byte offset in the data region and `m`, its elements a shard (a multiple of
/// 8). `bases[q]`: rank q's data region as mapped here. Every thread moves 8 elements a step: 16-byte vectors where
/// the tensor is 16-byte aligned (a shard of 8k fp32 keeps that alignment, and so does its packed bf16), else one
/// 4-byte word at a time. Every rank's base is assumed 16-byte aligned (allocations are), so one test on this
/// rank's address decides for the peers too.
#pragma once

#include <cstdint>
#if !defined(__CUDACC__)
#include <cstring>
#endif

#if defined(__CUDACC__)
#define EP_BF16_DEVICE __device__ __forceinline__
#else
#define EP_BF16_DEVICE inline  // the host emulation of the tests runs these functions
#endif

namespace ep_core::bucket_bf16 {

#if defined(__CUDACC__)
using Words4 = uint4;  // a 16-byte vector
#else
struct alignas(16) Words4 {
    uint32_t x, y, z, w;
};
#endif

constexpr int kBlockThreads = 512;
constexpr int kGroup = 8;  // elements a thread a step: two float4 in, one 16-byte bf16 vector out
constexpr int kPeerBatch = 8;  // peers whose loads a thread keeps in flight at once

/// Float4 `quad` of the tensor (fp32 bits `b`) stochastically rounded (file doc): bf16 pairs, element 2k low.
EP_BF16_DEVICE void round_quad(const uint32_t* b, uint32_t quad, uint32_t* pairs) {
    uint32_t h = quad + b[0] * 0x5671D42Bu + b[1] * 0x9995E499u + b[2] * 0xACE1B8A5u + b[3] * 0xE153538Du;
    h ^= h >> 23;
    h *= 0x7FEB352Du;
    h ^= h >> 16;
    uint32_t rnd[2] = {h * 0x846CA68Bu, h * 0xD35A2D97u};
    uint32_t out[4];
    for (int k = 0; k < 4; ++k) {  // a non-NaN's bits + 0xFFFF stay below 2^32 (-inf is 0xFF800000)
        const uint32_t r = ((rnd[k / 2] ^ (rnd[k / 2] >> 11)) >> (16 * (k & 1))) & 0xFFFFu;
        out[k] = (b[k] & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FFFu : (b[k] + r) >> 16;
    }
    pairs[0] = out[0] | (out[1] << 16), pairs[1] = out[2] | (out[3] << 16);
}

/// Where element `j` of a shard sits in its packed bf16 (in bf16 units from the shard's start).
EP_BF16_DEVICE int64_t packed_slot(int64_t j, int64_t tile) {
    return (j / tile) * 2 * tile + j % tile;
}

/// `kWords` 4-byte words from `src` to `dst`: 16-byte vectors when `vec` (both 16-byte aligned), else one by one.
template <int kWords>
EP_BF16_DEVICE void copy_words(uint32_t* dst, const uint32_t* src, bool vec) {
    if (vec) {
        for (int i = 0; i < kWords / 4; ++i)
            reinterpret_cast<Words4*>(dst)[i] = reinterpret_cast<const Words4*>(src)[i];
    } else {
        for (int i = 0; i < kWords; ++i)
            dst[i] = src[i];
    }
}

EP_BF16_DEVICE float as_float(uint32_t u) {
#if defined(__CUDACC__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

EP_BF16_DEVICE uint32_t as_bits(float f) {
#if defined(__CUDACC__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

/// Pack, the load half: the 8 elements at `j` of shard `q` (of `m`) of the tensor at `x`, rounded (4 bf16 pairs).
EP_BF16_DEVICE void pack_load(const uint32_t* x, int64_t q, int64_t m, int64_t j, bool vec, uint32_t* pairs) {
    alignas(16) uint32_t v[kGroup];
    copy_words<kGroup>(v, x + q * m + j, vec);
    const uint32_t quad = static_cast<uint32_t>((q * m + j) >> 2);  // DeepEP's index: uint32 (wraps past 2^34)
    round_quad(v, quad, pairs);
    round_quad(v + 4, quad + 1, pairs + 2);
}

/// Pack, the store half: those 8 bf16 into their packed slot of the shard.
EP_BF16_DEVICE void pack_store(uint32_t* x, int64_t q, int64_t m, int64_t j, int64_t tile, bool vec,
                               const uint32_t* pairs) {
    copy_words<kGroup / 2>(x + q * m + packed_slot(j, tile) / 2, pairs, vec);
}

/// Reduce: the 8 elements at `j` of shard `rank` of the entry at `off` (`bases[q] + off` on rank q) += the packed
/// bf16 of ranks `rank-1, rank-2, ...` (cyclic), in that order, then times `scale` when `with_scale`.
EP_BF16_DEVICE void reduce_group(const int64_t* bases, int64_t off, int64_t m, int rank, int num_ranks, int64_t j,
                                 int64_t tile, bool vec, bool with_scale, float scale) {
    uint32_t* own = reinterpret_cast<uint32_t*>(bases[rank] + off) + rank * m + j;
    alignas(16) uint32_t v[kGroup];
    copy_words<kGroup>(v, own, vec);
    float acc[kGroup];
    for (int k = 0; k < kGroup; ++k)
        acc[k] = as_float(v[k]);
    for (int p0 = 1; p0 < num_ranks; p0 += kPeerBatch) {  // a batch's loads in flight together, added in order
        alignas(16) uint32_t pairs[kPeerBatch][kGroup / 2];
#pragma unroll
        for (int i = 0; i < kPeerBatch; ++i) {
            const int q = (rank - p0 - i + 2 * num_ranks) % num_ranks;
            const uint32_t* peer = reinterpret_cast<const uint32_t*>(bases[q] + off) + rank * m;
            if (p0 + i < num_ranks)
                copy_words<kGroup / 2>(pairs[i], peer + packed_slot(j, tile) / 2, vec);
        }
#pragma unroll
        for (int i = 0; i < kPeerBatch; ++i)
            for (int k = 0; k < kGroup && p0 + i < num_ranks; ++k)
                acc[k] = acc[k] + as_float(k & 1 ? pairs[i][k / 2] & 0xFFFF0000u : pairs[i][k / 2] << 16);
    }
    for (int k = 0; k < kGroup; ++k)
        v[k] = as_bits(with_scale ? acc[k] * scale : acc[k]);
    copy_words<kGroup>(own, v, vec);
}

/// Tile `t` of the pack's numbering (entry by entry, shards `rank+1, rank+2, ...`, tiles): its entry (or
/// `num_entries` past the end), shard and first element.
EP_BF16_DEVICE int pack_tile(const int64_t* entries, int num_entries, int rank, int num_ranks, int64_t tile,
                             int64_t t, int* q, int64_t* start) {
    for (int e = 0; e < num_entries; ++e) {
        const int64_t m = entries[2 * e + 1], tiles = (m + tile - 1) / tile;
        if (t < (num_ranks - 1) * tiles) {
            *q = (rank + 1 + static_cast<int>(t / tiles)) % num_ranks;
            *start = (t % tiles) * tile;
            return e;
        }
        t -= (num_ranks - 1) * tiles;
    }
    return num_entries;
}

}  // namespace ep_core::bucket_bf16

#if defined(__CUDACC__)
/// `entries [E][2]` (offset, m), `base`: this rank's data region; one block a tile, grid-stride over all tiles.
extern "C" __global__ void __launch_bounds__(ep_core::bucket_bf16::kBlockThreads)
    ep_bucket_bf16_pack(const int64_t* entries, int num_entries, uint8_t* base, int rank, int num_ranks, int tile) {
    using namespace ep_core::bucket_bf16;
    constexpr int64_t kStep = static_cast<int64_t>(kBlockThreads) * kGroup;
    int q = 0;
    int64_t start = 0;
    for (int64_t t = blockIdx.x;; t += gridDim.x) {
        const int e = pack_tile(entries, num_entries, rank, num_ranks, tile, t, &q, &start);
        if (e == num_entries)
            break;
        const int64_t off = entries[2 * e], m = entries[2 * e + 1];
        const int64_t end = start + tile < m ? start + tile : m;
        uint32_t* x = reinterpret_cast<uint32_t*>(base + off);
        const bool vec = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
        for (int64_t s = start; s < end; s += kStep) {
            const int64_t j = s + threadIdx.x * kGroup;
            alignas(16) uint32_t pairs[kGroup / 2];
            if (j < end)
                pack_load(x, q, m, j, vec, pairs);
            __syncthreads();  // every load of this step before any store (a step's stores overwrite read bytes)
            if (j < end)
                pack_store(x, q, m, j, tile, vec, pairs);
        }
    }
}

/// `bases [N]`: every rank's data region as mapped here; `scale_bits`: the fp32 scale's bits (1.0f: no multiply).
extern "C" __global__ void __launch_bounds__(ep_core::bucket_bf16::kBlockThreads)
    ep_bucket_bf16_reduce(const int64_t* entries, int num_entries, const int64_t* bases, int rank, int num_ranks,
                          int tile, int scale_bits) {
    using namespace ep_core::bucket_bf16;
    const bool with_scale = static_cast<uint32_t>(scale_bits) != 0x3F800000u;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int e = 0; e < num_entries; ++e) {
        const int64_t off = entries[2 * e], m = entries[2 * e + 1];
        const bool vec = ((bases[rank] + off) & 15) == 0;
        for (int64_t g = tid; g < m / kGroup; g += nthreads)
            reduce_group(bases, off, m, rank, num_ranks, g * kGroup, tile, vec, with_scale,
                         __int_as_float(scale_bits));
    }
}
#endif
