// SPDX-License-Identifier: Apache-2.0
/// \file config.cuh
/// \brief Portability macros and fixed-width integers of the ep-core kernels (nvcc and NVRTC).
#pragma once

#if defined(__CUDACC_RTC__)
namespace ep_core {
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long long;
using uint64_t = unsigned long long;
}  // namespace ep_core
#else
#include <cstdint>
namespace ep_core {
using std::int32_t;
using std::int64_t;
using std::uint32_t;
using std::uint64_t;
}  // namespace ep_core
#endif

/// Device-only inline helper.
#define EP_CORE_DEVICE __device__ __forceinline__

namespace ep_core {

static constexpr int kWarpSize = 32;
static constexpr uint32_t kFullMask = 0xffffffffu;

/// Alignment of every part of a token (TMA needs 16 bytes; the layouts use 32, as ep_layout::kNumTMAAlignBytes).
static constexpr int kTokenAlignBytes = 32;

template <typename T>
EP_CORE_DEVICE constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

template <typename T>
__host__ __device__ constexpr T align_up(T a, T b) {
    return (a + b - 1) / b * b;
}

template <typename T>
__host__ __device__ constexpr T const_min(T a, T b) {
    return a < b ? a : b;
}

/// Compile-time index for `unroll<N>(f)`: `f(Index<0>{}) ... f(Index<N-1>{})`, so the body can use the index as a
/// template argument (an immediate offset) where `#pragma unroll` gives only a runtime value.
template <int V>
struct Index {
    static constexpr int value = V;
};

template <int I, int N>
struct Unroller {
    template <typename F>
    static EP_CORE_DEVICE void run(F& f) {
        f(Index<I>{});
        Unroller<I + 1, N>::run(f);
    }
};

template <int N>
struct Unroller<N, N> {
    template <typename F>
    static EP_CORE_DEVICE void run(F&) {}
};

template <int N, typename F>
EP_CORE_DEVICE void unroll(F&& f) {
    Unroller<0, N>::run(f);
}

}  // namespace ep_core
