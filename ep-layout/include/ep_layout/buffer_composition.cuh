// SPDX-License-Identifier: Apache-2.0
/// \file buffer_composition.cuh
/// \brief How the dispatch and combine buffers are laid out in the GPU part of the symmetric buffer, direct and
///        hybrid, and the buffer size hint. Sizing (host) and kernels (device) use the same structs, so they cannot
///        disagree.
///
/// Notation: N ranks, S_u scale-up ranks (one NVLink / LSA domain), S_o = N / S_u scale-out domains, M = max tokens
/// per rank, K = top-k, D = dispatch token bytes, Cb = combine token bytes (no mbarrier), amr =
/// allow_multiple_reduction, nvl = is_scaleup_nvlink (every scale-up peer is reachable by load/store). Offsets are
/// relative to the start of the GPU buffer (right after the 2 MiB-aligned workspace). Parts follow each other in the
/// order listed, with no padding (every token size is a multiple of 32 bytes).
///
/// Direct (S_o == 1):
///   dispatch: recv [N][M] D | send [nvl ? 0 : 1][M] D
///   combine:  recv [slots(N)][M] Cb | send [nvl ? 0 : N][M * (amr ? 1 : K)] Cb
/// Hybrid (S_o > 1):
///   dispatch: scaleup_recv [S_u][S_o*M] D | scaleout_send [1][M] D | scaleout_recv [S_o][M + 1280] D
///   combine:  scaleup_recv [slots(S_u)][S_o*M] Cb | scaleout_recv [slots(S_o)][M] Cb
///             | scaleout_send [S_o][(amr ? 1 : K) * (M + 1280)] Cb
/// with slots(R) = (amr && R <= K) ? R : K (the "rank layout" when amr && R <= K, else the "top-k layout", one slot per
/// lane indexed by the master lane). 1280 = kNumMaxHybridChannels bounds C * ceil(M / C) <= M + C - 1.
///
/// Size hint = align(max(dispatch, combine), 2 MiB) with D = TokenLayout(hidden * elem, packs * 4, K, true),
/// Cb = TokenLayout(hidden * 2, 0, K, false), K = 0 sized as 32, elem = fp8 ? 1 : 2, packs = fp8 ? ceil(hidden/32) : 0.
/// Example: EP8 (one NVLink node), M = 4096, hidden 7168, K = 8, bf16 -> 452 MiB (FP8 450 MiB, K = 0 462 MiB).
/// The hint excludes the workspace and the CPU bytes: the symmetric allocation is
/// `[workspace (2 MiB aligned) | GPU buffer (hint) | CPU buffer]`.
#pragma once

#include "buffer_layout.cuh"
#include "config.cuh"
#include "math.cuh"
#include "token_layout.cuh"

namespace ep_layout {

/// Channels bounding the hybrid scale-out receive padding: 8 channels per SM x 160 SMs. Distinct from the workspace
/// limit `kNumMaxChannels` (1024).
static constexpr int32_t kNumMaxHybridChannels = 1280;

/// The logical rank arrangement.
struct Topology {
    int32_t num_ranks;          ///< N
    int32_t num_scaleup_ranks;  ///< S_u, divides N; S_u == N means direct mode
    bool is_scaleup_nvlink;     ///< peers of a scale-up domain are reachable by load/store (no staging send buffer)

    Topology() = default;
    EP_LAYOUT_HOST_DEVICE constexpr Topology(int32_t num_ranks, int32_t num_scaleup_ranks, bool is_scaleup_nvlink = true)
        : num_ranks(num_ranks), num_scaleup_ranks(num_scaleup_ranks), is_scaleup_nvlink(is_scaleup_nvlink) {}

    /// S_o = N / S_u.
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_num_scaleout_ranks() const { return num_ranks / num_scaleup_ranks; }
    /// Hybrid mode iff more than one scale-out domain.
    EP_LAYOUT_HOST_DEVICE constexpr bool is_hybrid() const { return get_num_scaleout_ranks() > 1; }
    EP_LAYOUT_HOST_DEVICE constexpr bool is_valid() const {
        return num_ranks >= 1 && num_scaleup_ranks >= 1 && num_ranks % num_scaleup_ranks == 0;
    }
};

EP_LAYOUT_ASSERT_TRIVIAL(Topology, 12);

/// Combine uses the "rank layout" (one receive slot per source rank) iff `amr && num_ranks <= num_topk`.
EP_LAYOUT_HOST_DEVICE constexpr bool combine_uses_rank_layout(int32_t num_ranks, int32_t num_topk, bool amr) {
    return amr && num_ranks <= num_topk;
}

/// Receive slots per token of a combine: `num_ranks` in the rank layout, `num_topk` otherwise.
EP_LAYOUT_HOST_DEVICE constexpr int32_t get_combine_num_recv_slots(int32_t num_ranks, int32_t num_topk, bool amr) {
    return combine_uses_rank_layout(num_ranks, num_topk, amr) ? num_ranks : num_topk;
}

// ---------------------------------------------------------------------------------------------------------------------
// Direct
// ---------------------------------------------------------------------------------------------------------------------

/// Direct dispatch: `recv` at 0 (`[N][M]`: region r receives from rank r), then `send` (`[1][M]` staging, only
/// without NVLink; `num_ranks == 0` otherwise).
struct DirectDispatchBuffers {
    BufferLayout<false> recv;
    BufferLayout<false> send;

    DirectDispatchBuffers() = default;
    EP_LAYOUT_HOST_DEVICE constexpr DirectDispatchBuffers(const TokenLayout& token, const Topology& topology,
                                                          int32_t num_max_tokens_per_rank)
        : recv(token, topology.num_ranks, num_max_tokens_per_rank),
          send(token, topology.is_scaleup_nvlink ? 0 : 1, num_max_tokens_per_rank) {}

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_recv_offset() const { return 0; }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_send_offset() const { return recv.get_num_bytes(); }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes() const { return get_send_offset() + send.get_num_bytes(); }

    /// The parts with their `base` pointers set, given the start of the GPU buffer.
    EP_LAYOUT_HOST_DEVICE DirectDispatchBuffers with_base(void* gpu_buffer) const {
        DirectDispatchBuffers r = *this;
        r.recv.base = advance_ptr(gpu_buffer, get_recv_offset());
        r.send.base = advance_ptr(gpu_buffer, get_send_offset());
        return r;
    }
};

/// Direct combine: `recv` at 0 (`[slots(N)][M]`), then `send` (`[N][M * (amr ? 1 : K)]`, only without NVLink).
struct DirectCombineBuffers {
    BufferLayout<false> recv;
    BufferLayout<false> send;

    DirectCombineBuffers() = default;
    EP_LAYOUT_HOST_DEVICE constexpr DirectCombineBuffers(const TokenLayout& token, const Topology& topology,
                                                         int32_t num_max_tokens_per_rank, bool amr)
        : recv(token, get_combine_num_recv_slots(topology.num_ranks, token.num_topk, amr), num_max_tokens_per_rank),
          send(token, topology.is_scaleup_nvlink ? 0 : topology.num_ranks,
               num_max_tokens_per_rank * (amr ? 1 : token.num_topk)) {}

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_recv_offset() const { return 0; }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_send_offset() const { return recv.get_num_bytes(); }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes() const { return get_send_offset() + send.get_num_bytes(); }

    EP_LAYOUT_HOST_DEVICE DirectCombineBuffers with_base(void* gpu_buffer) const {
        DirectCombineBuffers r = *this;
        r.recv.base = advance_ptr(gpu_buffer, get_recv_offset());
        r.send.base = advance_ptr(gpu_buffer, get_send_offset());
        return r;
    }
};

// ---------------------------------------------------------------------------------------------------------------------
// Hybrid
// ---------------------------------------------------------------------------------------------------------------------

/// Hybrid dispatch: `scaleup_recv` `[S_u][S_o*M]`, `scaleout_send` `[1][M]`, `scaleout_recv` `[S_o][M + 1280]`.
struct HybridDispatchBuffers {
    BufferLayout<false> scaleup_recv;
    BufferLayout<false> scaleout_send;
    BufferLayout<false> scaleout_recv;

    HybridDispatchBuffers() = default;
    EP_LAYOUT_HOST_DEVICE constexpr HybridDispatchBuffers(const TokenLayout& token, const Topology& topology,
                                                          int32_t num_max_tokens_per_rank)
        : scaleup_recv(token, topology.num_scaleup_ranks, topology.get_num_scaleout_ranks() * num_max_tokens_per_rank),
          scaleout_send(token, 1, num_max_tokens_per_rank),
          scaleout_recv(token, topology.get_num_scaleout_ranks(), num_max_tokens_per_rank + kNumMaxHybridChannels) {}

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleup_recv_offset() const { return 0; }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleout_send_offset() const { return scaleup_recv.get_num_bytes(); }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleout_recv_offset() const {
        return get_scaleout_send_offset() + scaleout_send.get_num_bytes();
    }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes() const {
        return get_scaleout_recv_offset() + scaleout_recv.get_num_bytes();
    }

    EP_LAYOUT_HOST_DEVICE HybridDispatchBuffers with_base(void* gpu_buffer) const {
        HybridDispatchBuffers r = *this;
        r.scaleup_recv.base = advance_ptr(gpu_buffer, get_scaleup_recv_offset());
        r.scaleout_send.base = advance_ptr(gpu_buffer, get_scaleout_send_offset());
        r.scaleout_recv.base = advance_ptr(gpu_buffer, get_scaleout_recv_offset());
        return r;
    }
};

/// Hybrid combine: `scaleup_recv` `[slots(S_u)][S_o*M]`, `scaleout_recv` `[slots(S_o)][M]`,
/// `scaleout_send` `[S_o][(amr ? 1 : K) * (M + 1280)]`.
struct HybridCombineBuffers {
    BufferLayout<false> scaleup_recv;
    BufferLayout<false> scaleout_recv;
    BufferLayout<false> scaleout_send;

    HybridCombineBuffers() = default;
    EP_LAYOUT_HOST_DEVICE constexpr HybridCombineBuffers(const TokenLayout& token, const Topology& topology,
                                                         int32_t num_max_tokens_per_rank, bool amr)
        : scaleup_recv(token, get_combine_num_recv_slots(topology.num_scaleup_ranks, token.num_topk, amr),
                       topology.get_num_scaleout_ranks() * num_max_tokens_per_rank),
          scaleout_recv(token, get_combine_num_recv_slots(topology.get_num_scaleout_ranks(), token.num_topk, amr),
                        num_max_tokens_per_rank),
          scaleout_send(token, topology.get_num_scaleout_ranks(),
                        (amr ? 1 : token.num_topk) * (num_max_tokens_per_rank + kNumMaxHybridChannels)) {}

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleup_recv_offset() const { return 0; }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleout_recv_offset() const { return scaleup_recv.get_num_bytes(); }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_scaleout_send_offset() const {
        return get_scaleout_recv_offset() + scaleout_recv.get_num_bytes();
    }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes() const {
        return get_scaleout_send_offset() + scaleout_send.get_num_bytes();
    }

    EP_LAYOUT_HOST_DEVICE HybridCombineBuffers with_base(void* gpu_buffer) const {
        HybridCombineBuffers r = *this;
        r.scaleup_recv.base = advance_ptr(gpu_buffer, get_scaleup_recv_offset());
        r.scaleout_recv.base = advance_ptr(gpu_buffer, get_scaleout_recv_offset());
        r.scaleout_send.base = advance_ptr(gpu_buffer, get_scaleout_send_offset());
        return r;
    }
};

EP_LAYOUT_ASSERT_TRIVIAL(DirectDispatchBuffers, 64);
EP_LAYOUT_ASSERT_TRIVIAL(DirectCombineBuffers, 64);
EP_LAYOUT_ASSERT_TRIVIAL(HybridDispatchBuffers, 96);
EP_LAYOUT_ASSERT_TRIVIAL(HybridCombineBuffers, 96);

// ---------------------------------------------------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------------------------------------------------

/// Bytes of the dispatch buffers (direct or hybrid by `topology.is_hybrid()`); `token` is the dispatch token.
EP_LAYOUT_HOST_DEVICE constexpr int64_t dispatch_buffer_bytes(const TokenLayout& token, const Topology& topology,
                                                              int32_t num_max_tokens_per_rank) {
    return topology.is_hybrid() ? HybridDispatchBuffers(token, topology, num_max_tokens_per_rank).get_num_bytes()
                                : DirectDispatchBuffers(token, topology, num_max_tokens_per_rank).get_num_bytes();
}

/// Bytes of the combine buffers (direct or hybrid); `token` is the combine token (its `num_topk` is K).
EP_LAYOUT_HOST_DEVICE constexpr int64_t combine_buffer_bytes(const TokenLayout& token, const Topology& topology,
                                                             int32_t num_max_tokens_per_rank, bool amr = true) {
    return topology.is_hybrid() ? HybridCombineBuffers(token, topology, num_max_tokens_per_rank, amr).get_num_bytes()
                                : DirectCombineBuffers(token, topology, num_max_tokens_per_rank, amr).get_num_bytes();
}

/// Scale packs of an FP8 token: one 4-byte pack per 32 hidden elements, `ceil(hidden / 32)`.
EP_LAYOUT_HOST_DEVICE constexpr int32_t get_num_fp8_sf_packs(int32_t hidden) { return ceil_div(hidden, 32); }

/// K used for sizing: `K == 0` (unknown) is sized as `kNumMaxTopk`.
EP_LAYOUT_HOST_DEVICE constexpr int32_t get_sizing_num_topk(int32_t num_topk) {
    return num_topk == 0 ? kNumMaxTopk : num_topk;
}

/// Dispatch token used for sizing: bf16 or FP8 (+ ceil(hidden/32) scale packs), metadata on.
EP_LAYOUT_HOST_DEVICE constexpr TokenLayout get_sizing_dispatch_token(int32_t hidden, int32_t num_topk, bool use_fp8) {
    return make_dispatch_token_layout(hidden, use_fp8 ? 1 : 2, use_fp8 ? get_num_fp8_sf_packs(hidden) : 0,
                                      get_sizing_num_topk(num_topk));
}

/// Combine token used for sizing: bf16, no scales, metadata off.
EP_LAYOUT_HOST_DEVICE constexpr TokenLayout get_sizing_combine_token(int32_t hidden, int32_t num_topk) {
    return make_combine_token_layout(hidden, get_sizing_num_topk(num_topk));
}

/// Buffer size hint (bytes of the GPU buffer, workspace and CPU bytes excluded):
/// `align(max(dispatch_buffer_bytes, combine_buffer_bytes), 2 MiB)`.
EP_LAYOUT_HOST_DEVICE constexpr int64_t size_hint_bytes(const Topology& topology, int32_t num_max_tokens_per_rank,
                                                        int32_t hidden, int32_t num_topk, bool use_fp8 = false,
                                                        bool amr = true) {
    return align(max_of(dispatch_buffer_bytes(get_sizing_dispatch_token(hidden, num_topk, use_fp8), topology,
                                              num_max_tokens_per_rank),
                        combine_buffer_bytes(get_sizing_combine_token(hidden, num_topk), topology,
                                             num_max_tokens_per_rank, amr)),
                 kNumSymmetricAlignBytes);
}

// Worked examples (behaviour doc §2.4): EP8 on one NVLink node, M = 4096, hidden 7168, K = 8.
static_assert(size_hint_bytes(Topology(8, 8), 4096, 7168, 8) == int64_t(452) << 20, "bf16 size hint");
static_assert(size_hint_bytes(Topology(8, 8), 4096, 7168, 8, true) == int64_t(450) << 20, "fp8 size hint");
static_assert(size_hint_bytes(Topology(8, 8), 4096, 7168, 0) == int64_t(462) << 20, "K = 0 size hint");

}  // namespace ep_layout
