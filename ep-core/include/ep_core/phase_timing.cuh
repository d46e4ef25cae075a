// SPDX-License-Identifier: Apache-2.0
/// \file phase_timing.cuh
/// \brief Optional phase-timing instrument (issue 17): %globaltimer stamps at the phase boundaries of dispatch,
/// its copy epilogue and combine, in a module global that `benchmarks/profile_ops.py --phases` reads.
///
/// Off unless the JIT defines EP_CORE_PHASE_TIMING (ep_core.kernels._source does when the environment variable
/// EP_CORE_PHASE_TIMING=1 is set): every macro below then expands to nothing, so the kernels are unchanged.
///
/// Layout: `ep_core_phase_ts[rank][kernel][slot]` (uint64 nanoseconds, ranks >= kPhaseMaxRanks are not
/// recorded). The reader zeroes it before each replay. Kinds of stamp:
///  - `EP_PHASE_MARK(k, slot)`: thread 0 of block 0 stores the time (the serial path most phases run on);
///  - `EP_PHASE_FIRST(k, slot)`: the first block to get there (CAS from 0), e.g. the kernel's start;
///  - `EP_PHASE_LAST(k, slot)`: the last block to get there (atomicMax), e.g. the end of a parallel phase;
///  - grid barriers (barrier.cuh) stamp their last arrival at kPhaseGridLast + n and block 0's exit at
///    kPhaseGridExit + n, n = the barrier's number in the launch (1-based).
#pragma once

#include "config.cuh"

namespace ep_core {

enum PhaseKernel : int { kPhaseDispatch = 0, kPhaseEpilogue = 1, kPhaseCombine = 2, kPhaseNumKernels = 3 };

static constexpr int kPhaseMaxRanks = 8;
static constexpr int kPhaseSlots = 32;
static constexpr int kPhaseGridLast = 16;  ///< + barrier number: the last block's arrival
static constexpr int kPhaseGridExit = 24;  ///< + barrier number: block 0 leaves the barrier
static constexpr int kPhaseEnd = 15;       ///< every kernel: the last block leaves (grid_exit)

/// Slots of the dispatch kernel (profile_ops.py mirrors the names).
enum DispatchPhase : int {
    kDpStart = 0,        ///< first block starts
    kDpSetup = 1,        ///< block 0: guard, shared init and peer table done
    kDpCount = 2,        ///< block 0: count bitmaps done (deterministic)
    kDpEntry = 3,        ///< block 0: cross-rank entry barrier done
    kDpPrefix = 4,       ///< block 0: prefix done (deterministic)
    kDpSendB0 = 5,       ///< block 0: its send loop issued
    kDpFlush = 6,        ///< block 0: bulk stores complete, counts flushed
    kDpExpertPub = 7,    ///< publisher (last block): per-expert counts stored to every destination
    kDpRankPub = 8,      ///< publisher: per-rank counts released
    kDpRecv = 9,         ///< publisher: every source's count seen
    kDpHandle = 10,      ///< publisher: handle written
    kDpSendLast = 11,    ///< last block: send loop and flush done
    kDpEnd = kPhaseEnd,         ///< last block leaves
};

/// Slots of the copy epilogue.
enum EpiloguePhase : int {
    kEpStart = 0,     ///< first block starts
    kEpSetup = 1,     ///< block 0: psum / expert starts loaded
    kEpCopyB0 = 2,    ///< block 0: row loop issued
    kEpCopyLast = 3,  ///< last block: rows done (bulk stores complete)
    kEpEnd = kPhaseEnd,      ///< last block leaves (padding done)
};

/// Slots of the combine kernel.
enum CombinePhase : int {
    kCbStart = 0,     ///< first block starts
    kCbSetup = 1,     ///< block 0: guard and peer table done
    kCbEntry = 2,     ///< block 0: cross-rank entry barrier done
    kCbSendB0 = 3,    ///< block 0: its rows sent
    kCbExit = 4,      ///< block 0: cross-rank exit barrier done
    kCbReduceB0 = 5,  ///< block 0: its tokens reduced
    kCbSendLast = 11, ///< last block: rows sent
    kCbReduceLast = 12,  ///< last block: tokens reduced
    kCbEnd = kPhaseEnd,      ///< last block leaves
};

}  // namespace ep_core

#if defined(EP_CORE_PHASE_TIMING) && EP_CORE_PHASE_TIMING

/// Global namespace, so the symbol is unmangled (cuLibraryGetGlobal "ep_core_phase_ts").
__device__ unsigned long long ep_core_phase_ts[ep_core::kPhaseMaxRanks * ep_core::kPhaseNumKernels *
                                               ep_core::kPhaseSlots];

namespace ep_core::phase {

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned long long* slot(long long rank, int kernel, int s) {
    if (rank < 0 || rank >= kPhaseMaxRanks || kernel < 0 || s < 0 || s >= kPhaseSlots)
        return nullptr;
    return ep_core_phase_ts + (rank * kPhaseNumKernels + kernel) * kPhaseSlots + s;
}

__device__ __forceinline__ void mark(long long rank, int kernel, int s) {
    if (unsigned long long* p = slot(rank, kernel, s))
        *reinterpret_cast<volatile unsigned long long*>(p) = now();
}

__device__ __forceinline__ void first(long long rank, int kernel, int s) {
    if (unsigned long long* p = slot(rank, kernel, s))
        atomicCAS(p, 0ull, now());
}

__device__ __forceinline__ void last(long long rank, int kernel, int s) {
    if (unsigned long long* p = slot(rank, kernel, s))
        atomicMax(p, now());
}

}  // namespace ep_core::phase

#define EP_PHASE_ON 1
/// Thread 0 of block 0 stamps `slot` of kernel `k` (any thread may call it; only that one writes).
#define EP_PHASE_MARK(k, s)                                   \
    do {                                                      \
        if (blockIdx.x == 0 && threadIdx.x == 0)              \
            ::ep_core::phase::mark(args.rank, (k), (s));      \
    } while (0)
/// Thread 0 of the calling block stamps `slot` (for work that one block, not always block 0, does).
#define EP_PHASE_STAMP(k, s)                                  \
    do {                                                      \
        if (threadIdx.x == 0)                                 \
            ::ep_core::phase::mark(args.rank, (k), (s));      \
    } while (0)
/// Thread 0 of the first block to get here stamps `slot`.
#define EP_PHASE_FIRST(k, s)                                  \
    do {                                                      \
        if (threadIdx.x == 0)                                 \
            ::ep_core::phase::first(args.rank, (k), (s));     \
    } while (0)
/// Thread 0 of every block raises `slot` to its time: the last block's time stays.
#define EP_PHASE_LAST(k, s)                                   \
    do {                                                      \
        if (threadIdx.x == 0)                                 \
            ::ep_core::phase::last(args.rank, (k), (s));      \
    } while (0)

#else

#define EP_PHASE_ON 0
#define EP_PHASE_MARK(k, s) \
    do {                    \
    } while (0)
#define EP_PHASE_STAMP(k, s) \
    do {                     \
    } while (0)
#define EP_PHASE_FIRST(k, s) \
    do {                     \
    } while (0)
#define EP_PHASE_LAST(k, s) \
    do {                    \
    } while (0)

#endif
