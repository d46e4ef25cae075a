// SPDX-License-Identifier: Apache-2.0
/// \file dispatch_epilogue.cuh
/// \brief Copy epilogue of a dispatch: receive region -> the user's outputs. Reads only this rank's buffer.
///
/// One warp per received row (rows of region r = tokens sent by rank r, in slot order). Non-expand: row i of
/// recv_x is received token i. Expand: one row per (token, local expert), expert e's rows start at
/// sum_{e'<e} align(count_e', A); the row inside the expert comes from an atomic cursor (default), from the
/// per-(source, expert) prefix sent by the source (deterministic) or from the handle's metadata (cached).
/// Zero padding rows are written after the data rows. The true row count is always read on the device
/// (psum_rank[N-1]), so the same launch serves CPU-sync and no-sync calls. A block that finds this rank's abort
/// flag raised (the dispatch before it failed: its counts are not valid) leaves at once (timeout.cuh, failure rule).
/// A null `recv_x` (non-expanded, no scales, not cached, direct mode: `DispatchLaunch.finish_dispatch`'s lending
/// epilogue) copies no row: it reads only the tails of the peers' rows and writes this rank's own rows' hidden part
/// into their region slots from x, so that the region holds every received row whole (ep_torch lends it).
/// Every other output is written as usual.
/// It may be launched with programmatic dependent launch after the dispatch (the dispatch releases it when its
/// blocks are done sending); it then waits for the dispatch to complete before reading anything.
/// Hybrid mode (`kNumScaleupRanks < kNumRanks`): the regions are the same, walked in region order (source rank
/// s = j * S_u + g for g = 0..S_u-1, then j), through the per-source prefix the dispatch left in the scratch; a
/// deterministic dispatch walks them in rank order instead, so that its rows are sorted by the source token's global
/// index `s * M + t` (DeepEP's deterministic order, as direct mode's), and a cached dispatch walks them in the order
/// of its handle's rows (`hybrid_rows_by_source`).
#pragma once

#include "dispatch.cuh"

namespace ep_core {

/// Hybrid words of the scratch (hybrid.cuh `hybrid_psum_src`): the per-source prefix in region order.
EP_CORE_DEVICE const int32_t* epilogue_psum_src(const Scratch& sc) {
    return reinterpret_cast<const int32_t*>(sc.prefix() +
                                            static_cast<int64_t>(sc.num_ranks + sc.num_experts) * sc.num_words);
}

/// Hybrid: whether this epilogue walks the sources in rank order, and `by_rank` = the per-source inclusive prefix in
/// rank order (from `psum`, the region-order one). One thread. A new handle's order is the call's (deterministic:
/// rank order). A cached dispatch must repeat its handle's order (the combine reads row i through the handle's
/// metadata row i), which the call's flags do not tell (a kernel-level caller may pass `deterministic` to one and not
/// the other), so it is read from the handle: both orders keep each source's rows together, in slot order, so they
/// differ first at the first nonempty source s (in rank order) whose rank-order start p differs from its region-order
/// start; the handle is in rank order iff its row p comes from s and row p - 1 does not (in region order, a row p of s
/// is past s's first row, so row p - 1 is s's too).
template <int kNumRanks, int kNumScaleupRanks, int kMetaCols>
EP_CORE_DEVICE bool hybrid_rows_by_source(const OpArgs& args, const int* psum, int* by_rank, bool cached, bool det,
                                          int64_t M) {
    constexpr int kNodes = kNumRanks / kNumScaleupRanks;
    int acc = 0, probe_src = -1, probe_row = 0;
    for (int s = 0; s < kNumRanks; ++s) {
        const int w = (s % kNumScaleupRanks) * kNodes + s / kNumScaleupRanks;  // s's position in region order
        const int count = psum[w] - (w > 0 ? psum[w - 1] : 0);
        if (probe_src < 0 && count > 0 && psum[w] - count != acc) {
            probe_src = s;
            probe_row = acc;
        }
        acc += count;
        by_rank[s] = acc;
    }
    if (!cached)
        return det;
    if (probe_src < 0)
        return false;  // the two orders place every row alike
    const int32_t* meta = args.src_metadata;
    const bool first = static_cast<int>(meta[static_cast<int64_t>(probe_row) * kMetaCols] / M) == probe_src;
    return first && (probe_row == 0 ||
                     static_cast<int>(meta[static_cast<int64_t>(probe_row - 1) * kMetaCols] / M) != probe_src);
}

/// `kOwnRowsFromX`: rows this rank sent to itself hold only their tail in the region (dispatch.cuh
/// `kDirectOwnRowsTailOnly`); their hidden part is read from `args.x` at the source token the tail names.
template <int kNumRanks, int kNumTopk, int kHiddenBytes, int kNumSfPacks, int kNumWarps, typename Transport,
          int kNumScaleupRanks = kNumRanks, bool kOwnRowsFromX = false>
EP_CORE_DEVICE void dispatch_epilogue_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, kNumSfPacks, kNumTopk, true>;
    __shared__ int s_abort;
    __shared__ int s_psum[kNumRanks];
    __shared__ int s_by_rank[kNumRanks];  // hybrid: the rank-order prefix
    __shared__ int s_rank_order;          // hybrid: the sources are walked in rank order
    __shared__ int s_start[256];
    __shared__ int s_count[256];
    __shared__ int s_scan[kWarpSize];
    __shared__ __align__(8) uint64_t s_bars[kNumWarps];
    extern __shared__ __align__(128) uint8_t ep_dyn_smem[];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int rank = static_cast<int>(args.rank);
    const bool cached = (args.flags & kFlagCached) != 0;
    const bool det = !cached && (args.flags & kFlagDeterministic) != 0;
    const bool expand = (args.flags & kFlagExpand) != 0;
    const int64_t A = args.expert_alignment;
    const Scratch sc(args.scratch, kNumRanks, num_experts, M);
    constexpr int kMetaCols = kNumTopk + 2;

    // launched with programmatic dependent launch, this grid may start while the dispatch runs: nothing the
    // dispatch writes (abort flag, counts, receive region) is read before it has completed
    ptx::griddep_wait();
    EP_PHASE_FIRST(kPhaseEpilogue, kEpStart);
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, Workspace{static_cast<uint8_t*>(args.workspace)}) ? 1 : 0;
    __syncthreads();
    if (s_abort != 0)
        return;
    if (lane == 0)
        ptx::mbarrier_init(&s_bars[warp], 1);
    uint8_t* const buf = ep_dyn_smem + warp * Tok::kSmemSlotBytes;
    uint64_t* const bar = &s_bars[warp];
    uint32_t phase = 0;
    constexpr bool kHybrid = kNumScaleupRanks < kNumRanks;
    constexpr int kNodes = kNumRanks / kNumScaleupRanks;
    for (int i = threadIdx.x; i < kNumRanks; i += blockDim.x)
        s_psum[i] = kHybrid ? epilogue_psum_src(sc)[i] : args.psum_rank[i];
    if (expand) {
        // expert starts: aligned counts in parallel, then a block scan (not a serial chain of epr 64-bit divisions)
        for (int j = threadIdx.x; j < epr; j += blockDim.x) {
            const int count = args.unaligned_expert[j];
            s_count[j] = count;
            s_start[j] = static_cast<int>(align_up<int64_t>(count, A));
        }
        block_exclusive_scan(s_start, epr, s_scan);
    }
    __syncthreads();
    if constexpr (kHybrid) {
        if (threadIdx.x == 0)
            s_rank_order = hybrid_rows_by_source<kNumRanks, kNumScaleupRanks, kMetaCols>(args, s_psum, s_by_rank,
                                                                                       cached, det, M) ? 1 : 0;
        __syncthreads();
        if (s_rank_order != 0) {
            for (int i = threadIdx.x; i < kNumRanks; i += blockDim.x)
                s_psum[i] = s_by_rank[i];
            __syncthreads();
        }
    }
    EP_PHASE_MARK(kPhaseEpilogue, kEpSetup);
    const int64_t R = s_psum[kNumRanks - 1];
    const int global_warp = work_warp_index(warp, kNumWarps);
    const int num_global_warps = gridDim.x * kNumWarps;
    const uint8_t* const region = static_cast<const uint8_t*>(args.recv_region);
    uint8_t* const recv_x = static_cast<uint8_t*>(args.recv_x);
    uint32_t* const recv_sf = static_cast<uint32_t*>(args.recv_sf);

    for (int64_t i = global_warp; i < R; i += num_global_warps) {
        // source region: first r with psum[r] > i
        int lo = 0, hi = kNumRanks - 1;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (s_psum[mid] > i)
                hi = mid;
            else
                lo = mid + 1;
        }
        const int src_rank = kHybrid && s_rank_order == 0 ? (lo % kNodes) * kNumScaleupRanks + lo / kNodes : lo;
        const int64_t slot = i - (lo > 0 ? s_psum[lo - 1] : 0);
        const uint8_t* gtok = region + (src_rank * M + slot) * static_cast<int64_t>(Tok::kNumBytes);
        // the whole token into this warp's shared slot (free once the previous row's stores have read it); a row
        // this rank kept: its tail from the region, then its hidden part from x at the source token it names
        ptx::bulk_wait_read();
        ptx::fence_async_shared();
        __syncwarp();
        if (kOwnRowsFromX && kNumRanks == 1 && cached) {
            // a lone rank's cached dispatch launches no dispatch kernel (DirectRank.epilogue_only): the row's tail
            // is staged here from the call's inputs exactly as the dispatch would have staged it, for the source
            // token the handle's metadata names (rank 0: the source id is the token)
            const int64_t t = args.src_metadata[i * kMetaCols];
            if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
                ptx::bulk_load(buf, static_cast<const uint8_t*>(args.x) + t * args.x_stride, Tok::kHiddenBytes, bar);
            }
            if constexpr (Tok::kNumSfPacks > 0) {
                const uint32_t* const sf = static_cast<const uint32_t*>(args.sf);
                for (int p = lane; p < Tok::kNumSfPacks; p += kWarpSize)
                    reinterpret_cast<uint32_t*>(buf + Tok::kSfOffset)[p] =
                        sf[t * args.sf_stride0 + static_cast<int64_t>(p) * args.sf_stride1];
            }
            if (lane < kNumTopk) {
                const int64_t e = topk_id(args, t * kNumTopk + lane);
                reinterpret_cast<int32_t*>(buf + Tok::kTopkIdxOffset)[lane] =
                    e >= 0 && e < num_experts ? static_cast<int>(e) : -1;
                reinterpret_cast<float*>(buf + Tok::kWeightsOffset)[lane] =
                    args.topk_weights != nullptr ? args.topk_weights[t * kNumTopk + lane] : 0.0f;
                reinterpret_cast<int32_t*>(buf + Tok::kPositionOffset)[lane] = -1;
            }
            if (lane == 0)
                *reinterpret_cast<int32_t*>(buf + Tok::kSrcIdxOffset) = static_cast<int32_t>(t);
            __syncwarp();
        } else if (kOwnRowsFromX && src_rank == rank && cached) {
            // a cached dispatch's handle names the row's source token (its metadata, written by the dispatch that
            // made the handle): the tail and the hidden part load together, not one after the other
            constexpr int kTail = Tok::kNumBytes - Tok::kHiddenBytes;
            if (lane == 0) {
                const int64_t t = args.src_metadata[i * kMetaCols] - rank * M;
                ptx::mbarrier_arrive_expect_tx(bar, Tok::kNumBytes);
                ptx::bulk_load(buf + Tok::kHiddenBytes, gtok + Tok::kHiddenBytes, kTail, bar);
                ptx::bulk_load(buf, static_cast<const uint8_t*>(args.x) + t * args.x_stride, Tok::kHiddenBytes, bar);
            }
        } else if (kOwnRowsFromX && src_rank == rank) {
            constexpr int kTail = Tok::kNumBytes - Tok::kHiddenBytes;
            if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(bar, kTail);
                ptx::bulk_load(buf + Tok::kHiddenBytes, gtok + Tok::kHiddenBytes, kTail, bar);
            }
            ptx::mbarrier_wait(bar, phase);
            phase ^= 1u;
            const int64_t t = *reinterpret_cast<const int32_t*>(buf + Tok::kSrcIdxOffset) - rank * M;
            if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
                ptx::bulk_load(buf, static_cast<const uint8_t*>(args.x) + t * args.x_stride, Tok::kHiddenBytes, bar);
            }
        } else if (lane == 0 && recv_x == nullptr) {
            // a lending epilogue (below): the hidden part stays where it is, only the tail is read
            constexpr int kTail = Tok::kNumBytes - Tok::kHiddenBytes;
            ptx::mbarrier_arrive_expect_tx(bar, kTail);
            ptx::bulk_load(buf + Tok::kHiddenBytes, gtok + Tok::kHiddenBytes, kTail, bar);
        } else if (lane == 0) {
            ptx::mbarrier_arrive_expect_tx(bar, Tok::kNumBytes);
            ptx::bulk_load(buf, gtok, Tok::kNumBytes, bar);
        }
        ptx::mbarrier_wait(bar, phase);
        phase ^= 1u;
        const uint8_t* tok = buf;

        int expert = -1, position = -1;
        float weight = 0.0f;
        if (lane < kNumTopk) {
            expert = reinterpret_cast<const int32_t*>(tok + Tok::kTopkIdxOffset)[lane];
            weight = reinterpret_cast<const float*>(tok + Tok::kWeightsOffset)[lane];
            position = reinterpret_cast<const int32_t*>(tok + Tok::kPositionOffset)[lane];
        }
        const int src_idx = *reinterpret_cast<const int32_t*>(tok + Tok::kSrcIdxOffset);
        const bool local = expert >= 0 && expert / epr == rank;
        const int local_expert = local ? expert - rank * epr : -1;
        const uint32_t local_mask = __ballot_sync(kFullMask, local);
        const int master = local_mask != 0 ? 31 - __clz(local_mask) : 0;
        int32_t* meta = args.src_metadata + i * kMetaCols;

        if (!expand) {
            // `recv_x` null: a lending epilogue (ep_torch's `borrow_recv`; non-expanded bf16, no scales, direct mode,
            // not cached): the rows stay in the region, where a rank's own row gets its hidden part from x
            uint8_t* const dst = recv_x != nullptr ? recv_x + i * static_cast<int64_t>(Tok::kHiddenBytes)
                                 : (kOwnRowsFromX && src_rank == rank) ? const_cast<uint8_t*>(gtok)
                                                                       : nullptr;
            if (lane == 0 && dst != nullptr) {
                ptx::bulk_store(dst, buf, Tok::kHiddenBytes);
                ptx::bulk_commit();
            }
            if constexpr (Tok::kNumSfPacks > 0) {
                for (int p = lane; p < Tok::kNumSfPacks; p += kWarpSize)
                    recv_sf[i * args.sf_out_stride0 + p * args.sf_out_stride1] =
                        reinterpret_cast<const uint32_t*>(tok + Tok::kSfOffset)[p];
            }
            if (lane < kNumTopk) {
                args.recv_topk_idx[i * kNumTopk + lane] = local_expert;
                if (args.recv_topk_weights != nullptr)
                    args.recv_topk_weights[i * kNumTopk + lane] = weight;
                if (!cached)
                    meta[2 + lane] = -1;
            }
        } else {
            int row = -1;
            if (local) {
                if (cached)
                    row = meta[2 + lane];
                else if (det)
                    row = sc.expert_src_base()[src_rank * epr + local_expert] + position;
                else
                    row = atomicAdd(sc.expert_cursor() + local_expert, 1);
                ptx::bulk_store(recv_x + row * static_cast<int64_t>(Tok::kHiddenBytes), buf, Tok::kHiddenBytes);
                ptx::bulk_commit();
            }
            if constexpr (Tok::kNumSfPacks > 0) {
                for (uint32_t m = local_mask; m != 0; m &= m - 1) {
                    const int64_t r = __shfl_sync(kFullMask, row, __ffs(m) - 1);
                    for (int p = lane; p < Tok::kNumSfPacks; p += kWarpSize)
                        recv_sf[r * args.sf_out_stride0 + p * args.sf_out_stride1] =
                            reinterpret_cast<const uint32_t*>(tok + Tok::kSfOffset)[p];
                }
            }
            if (local && args.recv_topk_weights != nullptr)
                args.recv_topk_weights[row] = weight;
            if (!cached && lane < kNumTopk)
                meta[2 + lane] = row;
        }
        if (!cached && lane == 0) {
            meta[0] = src_idx;
            meta[1] = src_rank * kNumTopk + master;
        }
    }

    EP_PHASE_MARK(kPhaseEpilogue, kEpCopyB0);
    ptx::bulk_wait_all();
#if EP_PHASE_ON
    __syncthreads();
    EP_PHASE_LAST(kPhaseEpilogue, kEpCopyLast);
#endif

    // zero padding (expand): rows [start_e + count_e, start_e + align(count_e, A))
    if (expand && (args.flags & kFlagZeroPadding) != 0) {
        for (int j = 0; j < epr; ++j) {
            const int64_t count = s_count[j];
            const int64_t pads = align_up<int64_t>(count, A) - count;
            for (int64_t p = global_warp; p < pads; p += num_global_warps) {
                const int64_t r = s_start[j] + count + p;
                if (r >= args.num_out_rows)
                    break;
                warp_zero<Tok::kHiddenBytes>(recv_x + r * static_cast<int64_t>(Tok::kHiddenBytes), lane);
                if constexpr (Tok::kNumSfPacks > 0) {
                    for (int q = lane; q < Tok::kNumSfPacks; q += kWarpSize)
                        recv_sf[r * args.sf_out_stride0 + q * args.sf_out_stride1] = 0u;
                }
                if (lane == 0 && args.recv_topk_weights != nullptr)
                    args.recv_topk_weights[r] = 0.0f;
            }
        }
    }
#if EP_PHASE_ON
    __syncthreads();
    EP_PHASE_LAST(kPhaseEpilogue, kEpEnd);
#endif
}

}  // namespace ep_core
