// SPDX-License-Identifier: Apache-2.0
/// \file token_layout.cuh
/// \brief `ep_layout::TokenLayout`: the bytes of one token as it travels between ranks.
///
/// A token is `[hidden | sf | metadata | mbarrier?]`; every part starts on a 32-byte boundary (`kNumTMAAlignBytes`)
/// and is padded to it, so the whole token is one TMA / RDMA payload:
///
///   part       offset (bytes)                     size (bytes)                      content
///   hidden     0                                  align(num_hidden_bytes, 32)       the activations, opaque bytes
///   sf         align(hidden, 32)                  align(num_sf_bytes, 32)           scale packs, opaque 4-byte values
///   metadata   sf_offset + align(sf, 32)          align(metadata, 32)               see below
///   mbarrier   metadata_offset + align(meta, 32)  32 (8 used)                       shared-memory staging only
///
/// metadata = K int32 top-k expert ids, then K float32 top-k weights; with `with_metadata` also one int32 source token
/// index (global: `src_rank * M + src_token`) and K int32 linked-list indices:
///
///   topk_idx        metadata_offset               4*K
///   topk_weights    metadata_offset + 4*K         4*K
///   src_token_idx   metadata_offset + 8*K         4          (with_metadata only)
///   linked_list_idx metadata_offset + 8*K + 4     4*K        (with_metadata only)
///
/// Dispatch tokens are `TokenLayout(hidden * elem_size, num_sf_packs * 4, K, true)`, combine tokens
/// `TokenLayout(hidden * 2, 0, K, false)`. Example (hidden 7168 bf16, K = 8): dispatch 14,464 B (14,496 B with the
/// mbarrier), combine 14,400 B. The mbarrier is only appended for shared-memory staging copies
/// (`get_num_bytes<true>()`); tokens in global (symmetric) memory never carry it.
///
/// Preconditions (checked by `is_valid()`, by the Python mirror, never on device): `num_hidden_bytes > 0` and a
/// multiple of 32, `num_sf_bytes >= 0` and a multiple of 4, `0 <= num_topk <= kNumMaxTopk`.
/// All methods are host + device and `constexpr`; the struct is trivially copyable (pass it by value to kernels).
#pragma once

#include "config.cuh"
#include "math.cuh"

namespace ep_layout {

/// Largest supported top-k (K). `K = 0` is sized as `kNumMaxTopk` by the size hint.
static constexpr int32_t kNumMaxTopk = 32;

/// Bytes an mbarrier occupies (a `uint64_t`); the token reserves `align(8, 32) = 32` bytes for it.
static constexpr int32_t kNumMBarrierBytes = 8;

/// Parts of a token, in memory order. `kEnd` is the token size without the mbarrier.
enum class TokenField : int32_t {
    kHidden = 0,
    kSF = 1,
    kTopkIdx = 2,
    kTopkWeights = 3,
    kSrcTokenIdx = 4,
    kLinkedListIdx = 5,
    kMBarrier = 6,
    kEnd = 7,
};

struct TokenLayout {
    int32_t num_hidden_bytes;  ///< bytes of the hidden part before alignment (hidden * element size)
    int32_t num_sf_bytes;      ///< bytes of the scale packs before alignment (num_packs * 4), 0 without scales
    int32_t num_topk;          ///< K: number of top-k lanes carried in the metadata
    bool with_metadata;        ///< also carry the source token index and K linked-list indices

    TokenLayout() = default;

    EP_LAYOUT_HOST_DEVICE constexpr TokenLayout(int32_t num_hidden_bytes, int32_t num_sf_bytes, int32_t num_topk,
                                                bool with_metadata)
        : num_hidden_bytes(num_hidden_bytes),
          num_sf_bytes(num_sf_bytes),
          num_topk(num_topk),
          with_metadata(with_metadata) {}

    /// True when the preconditions above hold (host-side validation; the arithmetic does not depend on it).
    EP_LAYOUT_HOST_DEVICE constexpr bool is_valid() const {
        return num_hidden_bytes > 0 && num_hidden_bytes % kNumTMAAlignBytes == 0 && num_sf_bytes >= 0 &&
               num_sf_bytes % 4 == 0 && num_topk >= 0 && num_topk <= kNumMaxTopk;
    }

    // -----------------------------------------------------------------------------------------------------------------
    // Sizes (bytes)
    // -----------------------------------------------------------------------------------------------------------------

    /// Unaligned metadata bytes: `K * (4 + 4) + (with_metadata ? (1 + K) * 4 : 0)`.
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_num_metadata_bytes() const {
        return num_topk * (4 + 4) + (with_metadata ? (1 + num_topk) * 4 : 0);
    }

    /// Byte offset of `field` from the start of the token. The one function all offsets come from.
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_offset(TokenField field) const {
        const int32_t sf = align(num_hidden_bytes, kNumTMAAlignBytes);
        const int32_t metadata = sf + align(num_sf_bytes, kNumTMAAlignBytes);
        const int32_t end = metadata + align(get_num_metadata_bytes(), kNumTMAAlignBytes);
        switch (field) {
            case TokenField::kHidden: return 0;
            case TokenField::kSF: return sf;
            case TokenField::kTopkIdx: return metadata;
            case TokenField::kTopkWeights: return metadata + num_topk * 4;
            case TokenField::kSrcTokenIdx: return metadata + num_topk * 8;
            case TokenField::kLinkedListIdx: return metadata + num_topk * 8 + 4;
            case TokenField::kMBarrier: return end;
            default: return end;
        }
    }

    /// Bytes of one token: `align(hidden,32) + align(sf,32) + align(metadata,32) [+ align(8,32) = 32]`.
    /// `kWithMBarrier`: add the shared-memory mbarrier slot. `T`: result type (e.g. `int64_t` for byte math).
    template <bool kWithMBarrier = false, typename T = int>
    EP_LAYOUT_HOST_DEVICE constexpr T get_num_bytes() const {
        return static_cast<T>(get_offset(TokenField::kEnd) +
                              (kWithMBarrier ? align(kNumMBarrierBytes, kNumTMAAlignBytes) : 0));
    }

    /// Runtime-flag variant of `get_num_bytes` (host sizing code), in bytes.
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes(bool with_mbarrier) const {
        return with_mbarrier ? get_num_bytes<true, int64_t>() : get_num_bytes<false, int64_t>();
    }

    // -----------------------------------------------------------------------------------------------------------------
    // Offsets within a token (bytes)
    // -----------------------------------------------------------------------------------------------------------------

    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_hidden_offset() const { return get_offset(TokenField::kHidden); }
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_sf_offset() const { return get_offset(TokenField::kSF); }
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_metadata_offset() const { return get_offset(TokenField::kTopkIdx); }
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_topk_idx_offset() const { return get_offset(TokenField::kTopkIdx); }
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_topk_weights_offset() const {
        return get_offset(TokenField::kTopkWeights);
    }
    /// Only meaningful with `with_metadata`.
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_src_token_idx_offset() const {
        return get_offset(TokenField::kSrcTokenIdx);
    }
    /// Only meaningful with `with_metadata`.
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_linked_list_idx_offset() const {
        return get_offset(TokenField::kLinkedListIdx);
    }
    /// Only meaningful for shared-memory staging (`get_num_bytes<true>()` bytes per token).
    EP_LAYOUT_HOST_DEVICE constexpr int32_t get_mbarrier_offset() const { return get_offset(TokenField::kMBarrier); }

    // -----------------------------------------------------------------------------------------------------------------
    // Pointers, given the token's base pointer (global or shared memory)
    // -----------------------------------------------------------------------------------------------------------------

    template <typename T = uint8_t>
    EP_LAYOUT_HOST_DEVICE T* get_hidden_ptr(void* token) const {
        return advance_ptr<T>(token, get_hidden_offset());
    }
    template <typename T = uint8_t>
    EP_LAYOUT_HOST_DEVICE const T* get_hidden_ptr(const void* token) const {
        return advance_ptr<T>(token, get_hidden_offset());
    }
    /// Scale packs: opaque 4-byte values (float32 or packed ue8m0 int32).
    template <typename T = uint32_t>
    EP_LAYOUT_HOST_DEVICE T* get_sf_ptr(void* token) const {
        return advance_ptr<T>(token, get_sf_offset());
    }
    template <typename T = uint32_t>
    EP_LAYOUT_HOST_DEVICE const T* get_sf_ptr(const void* token) const {
        return advance_ptr<T>(token, get_sf_offset());
    }
    EP_LAYOUT_HOST_DEVICE int32_t* get_topk_idx_ptr(void* token) const {
        return advance_ptr<int32_t>(token, get_topk_idx_offset());
    }
    EP_LAYOUT_HOST_DEVICE const int32_t* get_topk_idx_ptr(const void* token) const {
        return advance_ptr<int32_t>(token, get_topk_idx_offset());
    }
    EP_LAYOUT_HOST_DEVICE float* get_topk_weights_ptr(void* token) const {
        return advance_ptr<float>(token, get_topk_weights_offset());
    }
    EP_LAYOUT_HOST_DEVICE const float* get_topk_weights_ptr(const void* token) const {
        return advance_ptr<float>(token, get_topk_weights_offset());
    }
    EP_LAYOUT_HOST_DEVICE int32_t* get_src_token_idx_ptr(void* token) const {
        return advance_ptr<int32_t>(token, get_src_token_idx_offset());
    }
    EP_LAYOUT_HOST_DEVICE const int32_t* get_src_token_idx_ptr(const void* token) const {
        return advance_ptr<int32_t>(token, get_src_token_idx_offset());
    }
    EP_LAYOUT_HOST_DEVICE int32_t* get_linked_list_idx_ptr(void* token) const {
        return advance_ptr<int32_t>(token, get_linked_list_idx_offset());
    }
    EP_LAYOUT_HOST_DEVICE const int32_t* get_linked_list_idx_ptr(const void* token) const {
        return advance_ptr<int32_t>(token, get_linked_list_idx_offset());
    }
    /// The mbarrier of a shared-memory staged token (8 bytes, 8-aligned).
    EP_LAYOUT_HOST_DEVICE uint64_t* get_mbarrier_ptr(void* token) const {
        return advance_ptr<uint64_t>(token, get_mbarrier_offset());
    }
};

EP_LAYOUT_ASSERT_TRIVIAL(TokenLayout, 16);

/// Dispatch token: `TokenLayout(hidden * elem_size, num_sf_packs * 4, K, with_metadata = true)`.
EP_LAYOUT_HOST_DEVICE constexpr TokenLayout make_dispatch_token_layout(int32_t hidden, int32_t elem_size,
                                                                        int32_t num_sf_packs, int32_t num_topk) {
    return TokenLayout(hidden * elem_size, num_sf_packs * 4, num_topk, true);
}

/// Combine token: `TokenLayout(hidden * 2, 0, K, with_metadata = false)` (bf16 hidden, no scales).
EP_LAYOUT_HOST_DEVICE constexpr TokenLayout make_combine_token_layout(int32_t hidden, int32_t num_topk) {
    return TokenLayout(hidden * 2, 0, num_topk, false);
}

// Worked examples of SPEC §4 (hidden 7168 bf16, K = 8).
static_assert(make_dispatch_token_layout(7168, 2, 0, 8).get_num_bytes() == 14464, "dispatch token");
static_assert(make_dispatch_token_layout(7168, 2, 0, 8).get_num_bytes<true>() == 14496, "dispatch token + mbarrier");
static_assert(make_combine_token_layout(7168, 8).get_num_bytes() == 14400, "combine token");

}  // namespace ep_layout
