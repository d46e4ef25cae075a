// SPDX-License-Identifier: Apache-2.0
/// \file math.cuh
/// \brief Integer helpers shared by the layouts: alignment, ceil division, pointer advance.
#pragma once

#include "config.cuh"

namespace ep_layout {

/// Alignment of every part of a token and of every buffer in bytes (TMA needs 16; DeepEP uses 32).
static constexpr int32_t kNumTMAAlignBytes = 32;

/// Granularity of the symmetric allocation: the workspace and every size hint are rounded up to it.
static constexpr int64_t kNumSymmetricAlignBytes = int64_t(2) * 1024 * 1024;

/// `ceil(a / b)` for `a >= 0`, `b > 0`.
template <typename T>
EP_LAYOUT_HOST_DEVICE constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

/// `ceil(a / b) * b` for `a >= 0`, `b > 0`: the smallest multiple of `b` not below `a`.
template <typename T>
EP_LAYOUT_HOST_DEVICE constexpr T align(T a, T b) {
    return ceil_div(a, b) * b;
}

template <typename T>
EP_LAYOUT_HOST_DEVICE constexpr T min_of(T a, T b) {
    return a < b ? a : b;
}

template <typename T>
EP_LAYOUT_HOST_DEVICE constexpr T max_of(T a, T b) {
    return a > b ? a : b;
}

/// `ptr` advanced by `num_bytes` bytes, reinterpreted as `T*`. Null stays null only if `num_bytes == 0`.
template <typename T = void>
EP_LAYOUT_HOST_DEVICE T* advance_ptr(void* ptr, int64_t num_bytes) {
    return static_cast<T*>(static_cast<void*>(static_cast<uint8_t*>(ptr) + num_bytes));
}

/// Const overload of `advance_ptr`.
template <typename T = void>
EP_LAYOUT_HOST_DEVICE const T* advance_ptr(const void* ptr, int64_t num_bytes) {
    return static_cast<const T*>(static_cast<const void*>(static_cast<const uint8_t*>(ptr) + num_bytes));
}

}  // namespace ep_layout
