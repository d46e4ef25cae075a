// SPDX-License-Identifier: Apache-2.0
/// \file barrier.cuh
/// \brief Grid barrier (blocks of one launch) and cross-rank barrier (every rank's launch), both built on
/// `wait_until`. Every block of a grid must be resident at once. A rank alone on its GPU launches dispatch and combine
/// cooperatively (the driver guarantees it, even next to compute kernels of other streams); ranks that share a GPU
/// (loopback domain, processes on one GPU) launch plainly and the host checks that all their grids fit the device
/// together (`ep_core.kernels.plan.check_coresident` / `check_occupancy`).
#pragma once

#include "phase_timing.cuh"
#include "timeout.cuh"
#include "transport.cuh"

namespace ep_core {

template <typename Transport>
struct SyncContext {
    const OpArgs& args;
    Workspace ws;
    Scratch sc;
    Transport tr;
    int num_ranks;
    uint32_t grid_phase;  ///< grid barriers passed in this launch (same count in every block)
    int* s_abort;         ///< shared word: 1 once this block saw a failed wait
#if EP_PHASE_ON
    int phase_kernel = -1;  ///< phase_timing.cuh: which kernel's grid-barrier slots to stamp (-1: none)
#endif

    /// Raise the abort flag on every rank (best effort: CAS 0 -> kPeerAbort, so a rank's own record survives).
    EP_CORE_DEVICE void raise_abort() const {
        for (int p = 0; p < num_ranks; ++p)
            atomicCAS_system(tr.sym_ptr(ws.abort_flag(), p), 0, static_cast<int32_t>(ErrorKind::kPeerAbort));
    }

    /// All threads of every block call this; returns false (in every thread of the block) after a failed wait.
    /// `system_fence`: each block's arrival is preceded by a system-scope fence, so its writes to peers are visible
    /// system-wide before anyone past the barrier signals a peer. Without it (a GPU-scope fence, ~0.7 us less per
    /// barrier on the H200), only for barriers whose blocks wrote nothing since the last system-scope ordering
    /// that a peer must see through this barrier (entry barriers: block 0's cross-rank acquire is ordered before the
    /// other blocks' peer writes either way).
    EP_CORE_DEVICE bool grid_sync(bool system_fence = true) {
        __syncthreads();
        ++grid_phase;
        if (threadIdx.x == 0 && *s_abort == 0) {
            if (system_fence)
                ptx::fence_sys();
            else
                ptx::fence_gpu();
#if EP_PHASE_ON
            if (atomicAdd(sc.grid_arrive(), 1u) + 1u == grid_phase * gridDim.x)
                phase::mark(args.rank, phase_kernel, kPhaseGridLast + static_cast<int>(grid_phase));
#else
            atomicAdd(sc.grid_arrive(), 1u);
#endif
            const int64_t target = static_cast<int64_t>(grid_phase) * gridDim.x;
            uint32_t* counter = sc.grid_arrive();
            // twice the budget: when block 0 is late because it waits on a peer (entry barrier), its own wait
            // times out first and its record names the peer wait, not this barrier
            const bool ok = wait_until(
                args, ws, kTagGridBarrier, -1, grid_phase, target,
                [&] { return static_cast<int64_t>(ptx::ld_acquire_gpu(counter)); },
                [&](int64_t v) { return v >= target; }, [&] { raise_abort(); }, 2);
            if (!ok)
                *s_abort = 1;
#if EP_PHASE_ON
            if (blockIdx.x == 0)
                phase::mark(args.rank, phase_kernel, kPhaseGridExit + static_cast<int>(grid_phase));
#endif
        }
        __syncthreads();
        return *s_abort == 0;
    }

    /// All threads of every block call this where a grid barrier would be followed by work of one block only:
    /// each block arrives (after a system fence, as in `grid_sync`) and nobody waits. Returns true in every thread
    /// of the block that arrived last, which has then acquired every block's writes before their arrival; the
    /// others return false and may leave (they must not touch what the last block works on). No wait: nothing to
    /// time out.
    /// `system_fence` as in `grid_sync` (false only where no block wrote anything a peer GPU must see).
    EP_CORE_DEVICE bool grid_arrive_is_last(bool system_fence = true) {
        __shared__ int s_last;
        __syncthreads();
        ++grid_phase;
        if (threadIdx.x == 0) {
            int last = 0;
            if (*s_abort == 0) {
                if (system_fence)
                    ptx::fence_sys();
                else
                    ptx::fence_gpu();
                if (atomicAdd(sc.grid_arrive(), 1u) + 1u == grid_phase * gridDim.x) {
                    ptx::fence_gpu();  // with the read above: acquire of every block's fenced arrival
                    last = 1;
#if EP_PHASE_ON
                    phase::mark(args.rank, phase_kernel, kPhaseGridLast + static_cast<int>(grid_phase));
#endif
                }
            }
            s_last = last;
        }
        __syncthreads();
        return s_last != 0;
    }

    /// `grid_sync(); if (block 0) cross_rank_barrier(tag); grid_sync();` in one step, with the same ordering:
    /// every block arrives at the grid counter (after a system fence), the block that arrives last arrives at
    /// every rank for the whole grid (the arrivals of `cross_rank_barrier`, same epoch and counters), and every
    /// block waits for every rank's arrival itself. Two hops fewer than the three barriers (no wait for block 0 to
    /// learn of the last block, none for the other blocks to learn of block 0). All threads of every block call it;
    /// returns false (in every thread of the block) after a failed wait. No envelope check.
    EP_CORE_DEVICE bool grid_cross_rank_barrier(int32_t tag) {
        __shared__ int s_last;
        __shared__ uint64_t s_epoch;
        __syncthreads();
        ++grid_phase;
        if (threadIdx.x == 0) {
            int last = 0;
            if (*s_abort == 0) {
                // read before arriving: the last block writes the new epoch only after every block's arrival
                const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(sc.barrier_epoch()) + 1;
                s_epoch = epoch;
                ptx::fence_sys();
                if (atomicAdd(sc.grid_arrive(), 1u) + 1u == grid_phase * gridDim.x) {
                    ptx::fence_gpu();  // with the read above: acquire of every block's fenced arrival
                    *sc.barrier_epoch() = epoch;
                    last = 1;
#if EP_PHASE_ON
                    phase::mark(args.rank, phase_kernel, kPhaseGridLast + static_cast<int>(grid_phase));
#endif
                }
            }
            s_last = last;
        }
        __syncthreads();
        if (s_last != 0) {
            // as in cross_rank_barrier: a release per rank (cumulative over the block, ordered by the barrier above)
            for (int p = threadIdx.x; p < num_ranks; p += blockDim.x)
                ptx::red_add_release_sys(tr.sym_ptr(ws.barrier_arrivals(), p), 1ull);
        }
        if (threadIdx.x == 0 && *s_abort == 0) {
            const uint64_t epoch = s_epoch;
            const int64_t target = static_cast<int64_t>(epoch) * num_ranks;
            uint64_t* counter = ws.barrier_arrivals();
            const bool ok = wait_until(
                args, ws, tag, -1, static_cast<int64_t>(epoch), target,
                [&] { return static_cast<int64_t>(ptx::ld_acquire_sys(counter)); },
                [&](int64_t v) { return v >= target; }, [&] { raise_abort(); });
            if (!ok)
                *s_abort = 1;
#if EP_PHASE_ON
            if (blockIdx.x == 0)
                phase::mark(args.rank, phase_kernel, kPhaseGridExit + static_cast<int>(grid_phase));
#endif
        }
        __syncthreads();
        return *s_abort == 0;
    }

    /// All threads of ONE block call this: every rank arrives (after a system fence), then waits for all ranks.
    /// With `check_envelope`, each rank first leaves its `OpArgs::envelope` in every peer's workspace (ordered
    /// before its arrival by the same thread's fence and release), and after the barrier compares every rank's
    /// envelope with its own: a peer in another operation, at another sequence number or with another
    /// configuration is recorded (kEnvelopeMismatch, naming the peer and both envelopes) and stops this launch at
    /// once, instead of pairing data of different calls. The check is symmetric: when envelopes differ, every rank
    /// sees some peer that differs from it, so every rank records its own error (no abort needs to be raised).
    EP_CORE_DEVICE bool cross_rank_barrier(int32_t tag, bool check_envelope = false) {
        __syncthreads();
        const uint64_t epoch = *sc.barrier_epoch() + 1;
        __syncthreads();
        if (threadIdx.x == 0)
            *sc.barrier_epoch() = epoch;
        // one system fence per arriving thread (the block's writes, ordered by the barrier above, become visible
        // before its first arrival); each arrival is a release, so a fence before every later one is redundant.
        // (The release already fences; the explicit fence is kept here because the hybrid kernels, which meet
        // through this barrier, were verified with it; the direct-only barriers below do without.)
        const int rank = static_cast<int>(args.rank);
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x)
            if (check_envelope)
                *reinterpret_cast<volatile uint64_t*>(tr.sym_ptr(ws.envelopes(), p) + rank) = args.envelope;
        if (threadIdx.x < num_ranks)
            ptx::fence_sys();
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x)
            ptx::red_add_release_sys(tr.sym_ptr(ws.barrier_arrivals(), p), 1ull);
        if (threadIdx.x == 0 && *s_abort == 0) {
            const int64_t target = static_cast<int64_t>(epoch) * num_ranks;
            uint64_t* counter = ws.barrier_arrivals();
            const bool ok = wait_until(
                args, ws, tag, -1, static_cast<int64_t>(epoch), target,
                [&] { return static_cast<int64_t>(ptx::ld_acquire_sys(counter)); },
                [&](int64_t v) { return v >= target; }, [&] { raise_abort(); });
            if (!ok)
                *s_abort = 1;
        }
        __syncthreads();
        if (check_envelope && *s_abort == 0)
            check_envelopes(tag, [](int) { return true; });
        return *s_abort == 0;
    }

    /// The envelope check after an entry barrier: every rank `meets(src)` names left its envelope in this rank's
    /// workspace before arriving; one that differs from this rank's own is recorded (kEnvelopeMismatch, naming the
    /// peer and both envelopes) and the failure published, and every thread of the block sees `*s_abort` set. All
    /// threads of the barrier's block call it.
    template <typename Meets>
    EP_CORE_DEVICE void check_envelopes(int32_t tag, Meets meets) {
        for (int src = threadIdx.x; src < num_ranks; src += blockDim.x) {
            if (!meets(src))
                continue;
            const uint64_t seen = *reinterpret_cast<volatile uint64_t*>(ws.envelopes() + src);
            if (seen != args.envelope) {
                record_error(ws, ErrorKind::kEnvelopeMismatch, args.rank, src, tag,
                             ep_layout::WorkspaceLayout::kBarrierSignalsOffset + Workspace::kEnvelopesOffset + 8 * src,
                             static_cast<int64_t>(seen), static_cast<int64_t>(args.envelope), -1, -1);
                *s_abort = 1;
            }
        }
        __syncthreads();
        if (*s_abort != 0 && threadIdx.x == 0)
            publish_failure(args, ws);
    }

    /// Every block calls this once as its last action: the last block out resets the grid barrier counters.
    EP_CORE_DEVICE void grid_exit() {
        __syncthreads();
#if EP_PHASE_ON
        if (threadIdx.x == 0)
            phase::last(args.rank, phase_kernel, kPhaseEnd);
#endif
        if (threadIdx.x == 0 && *s_abort == 0) {
            if (atomicAdd(sc.grid_exit(), 1u) == gridDim.x - 1) {
                *sc.grid_arrive() = 0;
                *sc.grid_exit() = 0;
            }
        }
    }
};

}  // namespace ep_core
