// SPDX-License-Identifier: Apache-2.0
/// \file buffer_layout.cuh
/// \brief `ep_layout::BufferLayout`: a dense `[num_ranks][num_tokens_per_rank]` array of tokens.
///
/// Byte offset of token `t` of rank region `r`: `(r * num_tokens_per_rank + t) * token_bytes`, with
/// `token_bytes = token_layout.get_num_bytes<kWithMBarrier>()`. Views:
///   - `get_rank_buffer(r)`: the region of rank `r` (a BufferLayout with one rank, same tokens per rank);
///   - `get_token_buffer(i)`: token `i` counted from the view's base (`i = r * num_tokens_per_rank + t` on a full
///     buffer, `t` on a rank view);
///   - `get_channel_buffer(c, T)`: base shifted by `c * T` tokens, per-rank stride unchanged, so channel `c` owns the
///     slots `[c*T, (c+1)*T)` inside every rank region. Sizes reported by a channel view are those of its parent.
/// Offsets are host + device and `constexpr`; pointers need a base (`with_base`). `kWithMBarrier` is for
/// shared-memory staging buffers only; buffers in symmetric memory use `BufferLayout<false>`.
#pragma once

#include "config.cuh"
#include "math.cuh"
#include "token_layout.cuh"

namespace ep_layout {

template <bool kWithMBarrier = false>
struct BufferLayout {
    TokenLayout token_layout;     ///< the token every slot holds
    int32_t num_ranks;            ///< number of rank regions (0 makes an empty buffer)
    int32_t num_tokens_per_rank;  ///< slots per rank region (the per-rank stride, in tokens)
    void* base;                   ///< start of the buffer (nullptr: offsets only)

    BufferLayout() = default;

    EP_LAYOUT_HOST_DEVICE constexpr BufferLayout(const TokenLayout& token_layout, int32_t num_ranks,
                                                 int32_t num_tokens_per_rank, void* base = nullptr)
        : token_layout(token_layout), num_ranks(num_ranks), num_tokens_per_rank(num_tokens_per_rank), base(base) {}

    // -----------------------------------------------------------------------------------------------------------------
    // Sizes (bytes)
    // -----------------------------------------------------------------------------------------------------------------

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes_per_token() const {
        return token_layout.template get_num_bytes<kWithMBarrier, int64_t>();
    }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes_per_rank() const {
        return get_num_bytes_per_token() * num_tokens_per_rank;
    }
    /// `num_ranks * num_tokens_per_rank * token_bytes`.
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_num_bytes() const { return get_num_bytes_per_rank() * num_ranks; }

    // -----------------------------------------------------------------------------------------------------------------
    // Offsets from `base` (bytes)
    // -----------------------------------------------------------------------------------------------------------------

    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_rank_offset(int32_t rank) const {
        return get_num_bytes_per_rank() * rank;
    }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_token_offset(int32_t rank, int32_t token) const {
        return get_rank_offset(rank) + get_num_bytes_per_token() * token;
    }
    EP_LAYOUT_HOST_DEVICE constexpr int64_t get_channel_offset(int32_t channel, int32_t num_tokens_per_channel) const {
        return get_num_bytes_per_token() * (int64_t(channel) * num_tokens_per_channel);
    }

    // -----------------------------------------------------------------------------------------------------------------
    // Views and pointers (need `base`)
    // -----------------------------------------------------------------------------------------------------------------

    /// The same layout starting at `new_base`.
    EP_LAYOUT_HOST_DEVICE constexpr BufferLayout with_base(void* new_base) const {
        return BufferLayout(token_layout, num_ranks, num_tokens_per_rank, new_base);
    }
    /// Region of rank `rank`: one rank, same tokens per rank.
    EP_LAYOUT_HOST_DEVICE BufferLayout get_rank_buffer(int32_t rank) const {
        return BufferLayout(token_layout, 1, num_tokens_per_rank, advance_ptr(base, get_rank_offset(rank)));
    }
    /// Channel view: base advanced by `channel * num_tokens_per_channel` tokens, stride and sizes unchanged.
    EP_LAYOUT_HOST_DEVICE BufferLayout get_channel_buffer(int32_t channel, int32_t num_tokens_per_channel) const {
        return BufferLayout(token_layout, num_ranks, num_tokens_per_rank,
                            advance_ptr(base, get_channel_offset(channel, num_tokens_per_channel)));
    }
    template <int32_t kNumTokensPerChannel>
    EP_LAYOUT_HOST_DEVICE BufferLayout get_channel_buffer(int32_t channel) const {
        return get_channel_buffer(channel, kNumTokensPerChannel);
    }
    /// Token `token_idx` counted from `base` in token strides.
    template <typename T = void>
    EP_LAYOUT_HOST_DEVICE T* get_token_buffer(int64_t token_idx) const {
        return advance_ptr<T>(base, get_num_bytes_per_token() * token_idx);
    }
    /// Token `token` of rank region `rank`.
    template <typename T = void>
    EP_LAYOUT_HOST_DEVICE T* get_token_ptr(int32_t rank, int32_t token) const {
        return advance_ptr<T>(base, get_token_offset(rank, token));
    }
    /// First byte after the buffer (where the next buffer of a composition starts).
    template <typename T = void>
    EP_LAYOUT_HOST_DEVICE T* get_end_ptr() const {
        return advance_ptr<T>(base, get_num_bytes());
    }
};

EP_LAYOUT_ASSERT_TRIVIAL(BufferLayout<false>, 32);
EP_LAYOUT_ASSERT_TRIVIAL(BufferLayout<true>, 32);

}  // namespace ep_layout
