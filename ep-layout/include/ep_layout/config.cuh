// SPDX-License-Identifier: Apache-2.0
/// \file config.cuh
/// \brief Portability macros and fixed-width integer types of ep-layout.
///
/// Every ep-layout header includes this one first. The same code builds with a host C++17 compiler (g++, clang),
/// with nvcc (host and device passes) and with NVRTC (no host standard library available there).
#pragma once

// ---------------------------------------------------------------------------------------------------------------------
// Compiler detection
// ---------------------------------------------------------------------------------------------------------------------

/// 1 when the translation unit is compiled by a CUDA compiler (nvcc, clang-cuda or NVRTC), else 0.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define EP_LAYOUT_CUDACC 1
#else
#define EP_LAYOUT_CUDACC 0
#endif

/// `__forceinline__ __host__ __device__` under a CUDA compiler, plain `inline` otherwise (CuTe / NCCL style).
/// Every layout function carries it, so it may be called from host code, device code and constant expressions.
#if EP_LAYOUT_CUDACC
#define EP_LAYOUT_HOST_DEVICE __forceinline__ __host__ __device__
#else
#define EP_LAYOUT_HOST_DEVICE inline
#endif

// ---------------------------------------------------------------------------------------------------------------------
// Fixed-width integers (NVRTC-safe)
// ---------------------------------------------------------------------------------------------------------------------

#if defined(__CUDACC_RTC__)
// NVRTC has no <cstdint>; the builtin types have the widths we need on every CUDA target.
namespace ep_layout {
using int8_t = signed char;
using uint8_t = unsigned char;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long long;
using uint64_t = unsigned long long;
}  // namespace ep_layout
#else
#include <cstdint>
namespace ep_layout {
using std::int32_t;
using std::int64_t;
using std::int8_t;
using std::uint32_t;
using std::uint64_t;
using std::uint8_t;
}  // namespace ep_layout
#endif

namespace ep_layout {
static_assert(sizeof(int32_t) == 4 && sizeof(uint32_t) == 4, "ep_layout: int32_t must be 4 bytes");
static_assert(sizeof(int64_t) == 8 && sizeof(uint64_t) == 8, "ep_layout: int64_t must be 8 bytes");
static_assert(sizeof(void*) == 8, "ep_layout: only 64-bit targets are supported");
}  // namespace ep_layout

/// `static_assert` that a type may be passed by value to a kernel and mirrored byte for byte in Python.
/// Uses the compiler builtin, so no <type_traits> is needed (NVRTC-safe).
#define EP_LAYOUT_ASSERT_TRIVIAL(T, num_bytes)                                              \
    static_assert(__is_trivially_copyable(T), #T " must be trivially copyable");          \
    static_assert(__is_standard_layout(T), #T " must be standard layout");                \
    static_assert(sizeof(T) == (num_bytes), #T " changed size: bump EP_LAYOUT_VERSION_MAJOR")
