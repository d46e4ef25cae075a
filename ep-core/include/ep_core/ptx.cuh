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

EP_CORE_DEVICE void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

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

/// `ld_nc_v4` / `ld_cg_v4` of `p + kOff` with the offset as an immediate (unrolled loops keep one address register
/// per row instead of one per access).
template <int kOff>
EP_CORE_DEVICE uint4 ld_nc_v4_at(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4+%5];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "n"(kOff));
    return v;
}

template <int kOff>
EP_CORE_DEVICE uint4 ld_cg_v4_at(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4+%5];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "n"(kOff)
                 : "memory");
    return v;
}

template <int kOff>
EP_CORE_DEVICE void st_v4_at(void* p, const uint4& v) {
    asm volatile("st.global.v4.u32 [%0+%1], {%2, %3, %4, %5};" ::"l"(p), "n"(kOff), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
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

/// Programmatic dependent launch (sm_90+). `griddep_wait`: wait until the grid this one was launched to overlap
/// with (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) has completed and its writes are visible.
/// `griddep_launch_dependents`: this block no longer holds the dependent grid back. Both are no-ops for a
/// kernel launched without the attribute (or with no dependent).
EP_CORE_DEVICE void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

EP_CORE_DEVICE void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Bulk (TMA) copies between global and shared memory, completed on an mbarrier (loads) or a bulk group (stores).
// Sizes and addresses are multiples of 16 bytes.

EP_CORE_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

/// Bytes of dynamic shared memory this launch was given (kernels with an optional shared-memory path check it).
EP_CORE_DEVICE uint32_t dynamic_smem_size() {
    uint32_t v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

/// 16-byte read of shared memory (data a bulk load completed on an mbarrier the reader waited for).
EP_CORE_DEVICE uint4 ld_shared_v4(const void* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_addr(p))
                 : "memory");
    return v;
}

/// Order this thread's earlier generic-proxy accesses (acquired peer data) before its later bulk copies of global
/// memory.
EP_CORE_DEVICE void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

EP_CORE_DEVICE void mbarrier_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

EP_CORE_DEVICE void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

EP_CORE_DEVICE void mbarrier_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

/// Global -> shared bulk copy, completing `bytes` of transaction on `bar`.
EP_CORE_DEVICE void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(smem_dst)),
        "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

/// Shared -> global bulk copy in the issuing thread's current bulk group.
EP_CORE_DEVICE void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
                 "r"(smem_addr(smem_src)), "r"(bytes)
                 : "memory");
}

EP_CORE_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/// Wait until this thread's bulk stores have finished reading shared memory.
EP_CORE_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

/// Wait until this thread's bulk stores are complete (written), then order them before later generic accesses.
EP_CORE_DEVICE void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/// Order this thread's generic shared-memory accesses before later async-proxy (bulk) accesses.
EP_CORE_DEVICE void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace ep_core::ptx
