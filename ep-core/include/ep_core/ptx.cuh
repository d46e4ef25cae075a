// SPDX-License-Identifier: Apache-2.0
/// \file ptx.cuh
/// \brief Memory-model primitives (acquire/release at system scope: peers may be other GPUs) and vector accesses.
#pragma once

#include "config.cuh"

namespace ep_core::ptx {

EP_CORE_DEVICE int32_t ld_acquire_sys(const int32_t* p) {
    int32_t v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

EP_CORE_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

EP_CORE_DEVICE uint32_t ld_acquire_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

EP_CORE_DEVICE int32_t ld_relaxed_sys(const int32_t* p) {
    int32_t v;
    asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

EP_CORE_DEVICE void st_release_sys(int32_t* p, int32_t v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

EP_CORE_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_CORE_DEVICE void st_relaxed_sys(int32_t* p, int32_t v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

EP_CORE_DEVICE void red_add_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_CORE_DEVICE void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

/// 16-byte read of input data that no one writes during the kernel (non-coherent path, no L1 allocation).
EP_CORE_DEVICE uint4 ld_nc_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/// 16-byte read of data that peers wrote before an acquire in this launch (L2, never a stale L1 line).
EP_CORE_DEVICE uint4 ld_cg_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

EP_CORE_DEVICE void st_v4(void* p, const uint4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/// Streaming 16-byte store (output written once, not re-read by this kernel).
EP_CORE_DEVICE void st_cs_v4(void* p, const uint4& v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

EP_CORE_DEVICE int64_t clock() { return clock64(); }

}  // namespace ep_core::ptx
