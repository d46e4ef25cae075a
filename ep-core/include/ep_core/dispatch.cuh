// SPDX-License-Identifier: Apache-2.0
/// \file dispatch.cuh
/// \brief Direct-mode dispatch kernel (one launch per rank, every peer load/store reachable).
///
/// Roles, in order (every block takes part in each phase; a grid barrier separates phases):
///  0. guard   a block that finds this rank's abort flag raised leaves at once (timeout.cuh, failure rule).
///  1. count   (deterministic, non-cached only): per-destination and per-expert bitmaps over source tokens.
///  2. entry   block 0 meets every rank (peers are done with their receive regions), then a grid barrier.
///  3. prefix  (deterministic only): exclusive popcount prefix of every bitmap word -> slots without atomics.
///  4. send    each warp is a channel taking tokens by stride: route (dedup per destination rank, master lane =
///             highest lane), claim the slot (atomic / prefix / cached), store [hidden | sf | metadata] into
///             every destination's region [own rank][slot] with 16-byte stores, count in shared memory.
///  5. publish the block that arrives last at the grid counter (all stores done, system fence; the others leave):
///             per-expert counts to each destination's workspace, then the per-rank count with release
///             (`kCountValidFlag | count`: nonzero = arrived).
///  6. receive the same block waits for every source's count (acquire), writes the handle's prefix sums, resets the
///             receive words. Completion of the launch therefore means every token for this rank has arrived.
#pragma once

#include "barrier.cuh"
#include "token.cuh"
#include "zero_copy_rows.cuh"

namespace ep_core {

/// Local fast path: a token's copy for this rank itself carries only its tail ([sf | metadata]) into the own
/// receive region; the copy epilogue reads the hidden part from `args.x` (its launch has the dispatch's x), so the
/// rows a rank keeps cost no 14 KB store and reload. kernels.cuh passes this to the direct-mode epilogue; the
/// hybrid and cross-node dispatches store whole tokens and their epilogues read whole tokens.
static constexpr bool kDirectOwnRowsTailOnly = true;

/// Per-token routing of one warp: lane k < K holds lane k's expert.
struct Route {
    int expert;   ///< global expert id, -1 if none
    int dst;      ///< destination rank, or a unique negative value for invalid lanes
    bool valid;
    bool master;  ///< highest lane of its destination rank
};

/// Report invalid input (expert id out of range, duplicate expert) without aborting the operation; the first report
/// also sets the host-mapped word `host_error[1]`, so the host raises it at its next call even without a sync.
EP_CORE_DEVICE void report_input_error(const OpArgs& args, const Scratch& sc, ErrorKind kind, int64_t token, int lane,
                                       int64_t value) {
    int64_t* rec = sc.input_error();
    if (atomicCAS(reinterpret_cast<unsigned long long*>(rec), 0ull, static_cast<unsigned long long>(kind)) == 0ull) {
        rec[1] = token;
        rec[2] = lane;
        rec[3] = value;
        if (args.host_error != nullptr)
            ptx::st_relaxed_sys(args.host_error + 1, static_cast<int32_t>(kind));
    }
}

/// `send`: the call of the send phase, which routes every token exactly once; it also stores the lane's routing
/// word, as read, into the new handle's copy (`OpArgs::topk_idx_copy`, when there is one).
template <int kNumTopk>
EP_CORE_DEVICE Route route_token(const OpArgs& args, const Scratch& sc, int64_t t, int lane, int num_experts,
                                 int experts_per_rank, bool report, bool send = false) {
    int64_t e = -1;
    if (lane < kNumTopk) {
        const int64_t i = t * kNumTopk + lane;
        void* const copy = send ? args.topk_idx_copy : nullptr;
        if (args.flags & kFlagTopkIdx32) {
            const int32_t v = static_cast<const int32_t*>(args.topk_idx)[i];
            if (copy != nullptr)
                static_cast<int32_t*>(copy)[i] = v;
            e = v;
        } else {
            e = static_cast<const int64_t*>(args.topk_idx)[i];
            if (copy != nullptr)
                static_cast<int64_t*>(copy)[i] = e;
        }
    }
    Route r;
    r.valid = e >= 0;
    if (r.valid && e >= num_experts) {
        if (report)
            report_input_error(args, sc, ErrorKind::kInvalidExpert, t, lane, e);
        r.valid = false;
    }
    r.expert = r.valid ? static_cast<int>(e) : -1;
    r.dst = r.valid ? r.expert / experts_per_rank : -1 - lane;
    const uint32_t same_dst = __match_any_sync(kFullMask, r.dst);
    r.master = r.valid && (31 - __clz(same_dst)) == lane;
    if (report) {
        const uint32_t same_expert = __match_any_sync(kFullMask, r.valid ? r.expert : -1 - lane);
        if (r.valid && __popc(same_expert) > 1 && (31 - __clz(same_expert)) == lane)
            report_input_error(args, sc, ErrorKind::kDuplicateExpert, t, lane, r.expert);
    }
    return r;
}

/// Lanes per token of the count phase: top-k rounded up to a power of two, so that 32 / lanes tokens share a warp.
template <int kNumTopk>
static constexpr int kCountLanes =
    kNumTopk <= 1 ? 1 : (kNumTopk <= 2 ? 2 : (kNumTopk <= 4 ? 4 : (kNumTopk <= 8 ? 8 : (kNumTopk <= 16 ? 16 : 32))));

/// Count phase of a deterministic dispatch: the bitmaps of (destination rank, token) and (expert, token), and the
/// input checks of `route_token` (invalid and duplicate experts). A warp takes kWarpSize / kCountLanes tokens at a
/// time (group g = lane / kCountLanes, top-k lane = lane % kCountLanes), two such units per round with both units'
/// loads issued first: the phase is a chain of top-k loads, which this shortens 2 x 32 / kCountLanes times. The
/// bits are the same as one token per warp: a lane's dedup (master = highest lane of its destination) and duplicate
/// check see only its own token's lanes (the match keys carry the group).
template <int kNumRanks, int kNumTopk>
EP_CORE_DEVICE void count_bitmaps(const OpArgs& args, const Scratch& sc, uint32_t* bits, int W, int64_t T,
                                  int global_warp, int num_global_warps, int lane, int num_experts, int epr) {
    constexpr int kLanes = kCountLanes<kNumTopk>;
    constexpr int kGroup = kWarpSize / kLanes;
    const int g = lane / kLanes;
    const int k = lane % kLanes;
    const int64_t num_units = (T + kGroup - 1) / kGroup;
    for (int64_t u0 = global_warp; u0 < num_units; u0 += 2 * static_cast<int64_t>(num_global_warps)) {
        int64_t e[2];
        int64_t t[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            t[j] = (u0 + j * static_cast<int64_t>(num_global_warps)) * kGroup + g;
            e[j] = -1;
            if (k < kNumTopk && t[j] < T) {
                const int64_t i = t[j] * kNumTopk + k;
                e[j] = topk_id(args, i);
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            bool valid = e[j] >= 0;
            if (valid && e[j] >= num_experts) {
                report_input_error(args, sc, ErrorKind::kInvalidExpert, t[j], k, e[j]);
                valid = false;
            }
            const int expert = valid ? static_cast<int>(e[j]) : -1;
            const int dst = valid ? expert / epr : -1;
            // keys unique per group: valid lanes by (group, destination) / (group, expert), the others by lane
            const uint32_t same_dst = __match_any_sync(kFullMask, valid ? g * kNumRanks + dst : -1 - lane);
            const uint32_t same_expert = __match_any_sync(kFullMask, valid ? g * num_experts + expert : -1 - lane);
            if (valid && __popc(same_expert) > 1 && (31 - __clz(same_expert)) == lane)
                report_input_error(args, sc, ErrorKind::kDuplicateExpert, t[j], k, expert);
            if (!valid)
                continue;
            const uint32_t bit = 1u << (t[j] & 31);
            const int64_t word = t[j] >> 5;
            if ((31 - __clz(same_dst)) == lane)
                atomicOr(bits + static_cast<int64_t>(dst) * W + word, bit);
            atomicOr(bits + static_cast<int64_t>(kNumRanks + expert) * W + word, bit);
        }
    }
}

/// Prefix phase of a deterministic dispatch: the exclusive popcount prefix of every bitmap word, one warp per row
/// (`num_rows` rows of `W` words: the destination ranks, then the experts), so that the send phase finds a token's
/// slot as `prefix[word] + popc(bits[word] & below)` without atomics.
EP_CORE_DEVICE void bitmap_prefix(const uint32_t* bits, uint32_t* prefix, int W, int64_t T, int num_rows,
                                  int global_warp, int num_global_warps, int lane) {
    const int words = static_cast<int>((T + 31) / 32);
    for (int row = global_warp; row < num_rows; row += num_global_warps) {
        int carry = 0;
        for (int base = 0; base < words; base += kWarpSize) {
            const int w = base + lane;
            const uint32_t v = w < words ? bits[static_cast<int64_t>(row) * W + w] : 0u;
            const int c = __popc(v);
            const int incl = warp_inclusive_scan(c, lane);
            if (w < words)
                prefix[static_cast<int64_t>(row) * W + w] = carry + incl - c;
            carry += __shfl_sync(kFullMask, incl, kWarpSize - 1);
        }
    }
}

/// What the send phase decides for one lane of a routed token (`claim_token`).
struct Claim {
    int slot;      ///< master lane: the token's slot in its destination's region [own rank]; else -1
    int position;  ///< deterministic, valid lane: the token's index among the expert's tokens from this rank; else -1
    float weight;  ///< the lane's top-k weight (0 without weights)
};

/// The send phase's bookkeeping of one routed token (`r`, from `route_token`): the master lane's slot (cached: from
/// the handle; deterministic: from the bitmap prefix; else an atomic on the destination's send counter), the block's
/// counts per destination (`s_sent`) and per expert (`s_expert`), the new handle's slot record (`args.dst_slot`),
/// the deterministic expert position and the lane's weight. The hybrid and cross-node dispatches call it; direct
/// mode's send loop has the same steps written out (as a call the compiler schedules that loop differently, and its
/// machine code is the measured one: scripts/sass_diff.py tells the two apart): change both together.
template <int kNumRanks, int kNumTopk>
EP_CORE_DEVICE Claim claim_token(const OpArgs& args, const Scratch& sc, const Route& r, int64_t t, int lane, int rank,
                                 int64_t M, bool cached, bool det, const uint32_t* bits, const uint32_t* prefix, int W,
                                 int* s_sent, int* s_expert) {
    const int64_t word = t >> 5;
    const uint32_t below = (1u << (t & 31)) - 1u;
    int slot = -1;
    if (r.master) {
        if (cached) {
            slot = static_cast<int>(args.dst_slot[t * kNumTopk + lane] - static_cast<int64_t>(rank) * M);
        } else if (det) {
            const int64_t at = static_cast<int64_t>(r.dst) * W + word;
            slot = static_cast<int>(prefix[at]) + __popc(bits[at] & below);
        } else {
            slot = atomicAdd(sc.send_slot() + r.dst, 1);
        }
        atomicAdd(&s_sent[r.dst], 1);
    }
    if (!cached && lane < kNumTopk)
        args.dst_slot[t * kNumTopk + lane] = r.master ? static_cast<int32_t>(rank * M + slot) : -1;
    if (!cached && r.valid)
        atomicAdd(&s_expert[r.expert], 1);
    int position = -1;
    if (det && r.valid) {
        const int64_t at = static_cast<int64_t>(kNumRanks + r.expert) * W + word;
        position = static_cast<int>(prefix[at]) + __popc(bits[at] & below);
    }
    const float weight =
        (lane < kNumTopk && args.topk_weights != nullptr) ? args.topk_weights[t * kNumTopk + lane] : 0.0f;
    return Claim{slot, position, weight};
}

/// Stage the token's tail [sf | top-k ids | weights | positions | source id] in the warp's shared slot `buf` (the
/// hidden part arrives there by bulk load). A lane of an invalid expert stores -1, as the receivers expect.
template <typename Tok>
EP_CORE_DEVICE void stage_tail(uint8_t* buf, const OpArgs& args, const uint32_t* sf, int64_t t, int lane, int expert,
                               float weight, int position, int rank, int64_t M) {
    if constexpr (Tok::kNumSfPacks > 0) {
        for (int p = lane; p < Tok::kNumSfPacks; p += kWarpSize)
            reinterpret_cast<uint32_t*>(buf + Tok::kSfOffset)[p] =
                sf[t * args.sf_stride0 + static_cast<int64_t>(p) * args.sf_stride1];
    }
    if (lane < Tok::kNumTopk) {
        reinterpret_cast<int32_t*>(buf + Tok::kTopkIdxOffset)[lane] = expert;
        reinterpret_cast<float*>(buf + Tok::kWeightsOffset)[lane] = weight;
        reinterpret_cast<int32_t*>(buf + Tok::kPositionOffset)[lane] = position;
    }
    if (lane == 0)
        *reinterpret_cast<int32_t*>(buf + Tok::kSrcIdxOffset) = static_cast<int32_t>(rank * M + t);
}

/// After the send loop: the block's counts per destination rank and per expert into the grid's totals (scratch).
EP_CORE_DEVICE void flush_block_counts(const Scratch& sc, const int* s_sent, const int* s_expert, int num_ranks,
                                       int num_experts, bool cached, int num_threads) {
    __syncthreads();
    for (int i = threadIdx.x; i < num_ranks; i += num_threads)
        if (s_sent[i] != 0)
            atomicAdd(sc.sent_total() + i, s_sent[i]);
    if (!cached)
        for (int i = threadIdx.x; i < num_experts; i += num_threads)
            if (s_expert[i] != 0)
                atomicAdd(sc.expert_total() + i, s_expert[i]);
}

/// Receive phase: wait (acquire, under the timeout) for every source rank's count word of this rank's workspace,
/// keep the count in `s_sent[src]` and reset the word for the next operation. A wait that fails raises the abort
/// flag (its diagnostic recorded) and sets `*s_abort`.
template <int kNumRanks, typename Transport>
EP_CORE_DEVICE void wait_source_counts(const OpArgs& args, SyncContext<Transport>& sync, int* s_sent, int* s_abort,
                                       int num_threads) {
    const Workspace& ws = sync.ws;
    for (int src = threadIdx.x; src < kNumRanks; src += num_threads) {
        uint64_t* word_ptr = ws.recv_rank_count() + src;
        uint64_t seen = 0;
        const bool ok = wait_until(
            args, ws, kTagDispatchCounts, src, ep_layout::WorkspaceLayout::kRankCountRecvOffset + 8 * src,
            static_cast<int64_t>(kCountValidFlag),
            [&] {
                seen = ptx::ld_acquire_sys(word_ptr);
                return static_cast<int64_t>(seen);
            },
            [&](int64_t v) { return v != 0; }, [&] { sync.raise_abort(); });
        if (ok) {
            s_sent[src] = static_cast<int>(seen & 0xffffffffull);
            *word_ptr = 0;
        } else {
            *s_abort = 1;
        }
    }
}

/// The handle's prefix sum over source ranks of the received token counts (`s_sent`), by thread 0.
template <int kNumRanks>
EP_CORE_DEVICE void write_rank_psum(const OpArgs& args, const int* s_sent) {
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int src = 0; src < kNumRanks; ++src) {
            acc += s_sent[src];
            args.psum_rank[src] = acc;
        }
    }
}

/// Each local expert's received tokens, summed over the sources' published counts, into `s_expert`, and their
/// count aligned to `A` into `s_start` (`write_expert_layout` scans it): one 64-bit division per thread, not a
/// serial chain of `epr` of them in thread 0.
template <int kNumRanks>
EP_CORE_DEVICE void sum_expert_counts(const Workspace& ws, int* s_expert, int* s_start, int epr, int64_t A,
                                      int num_threads) {
    for (int j = threadIdx.x; j < epr; j += num_threads) {
        int total = 0;
        for (int src = 0; src < kNumRanks; ++src)
            total += static_cast<int>(ws.recv_expert_count()[src * epr + j] & 0xffffffffull);
        s_expert[j] = total;
        s_start[j] = static_cast<int>(align_up<int64_t>(total, A));
    }
}

/// The handle's expert layout from `sum_expert_counts`: expert starts by a block scan of the aligned counts, the
/// counts and prefix sums, the cumulative statistics, the copy epilogue's cursors and per-(source, expert) bases;
/// the received per-expert count words are reset for the next operation.
template <int kNumRanks>
EP_CORE_DEVICE void write_expert_layout(const OpArgs& args, const Workspace& ws, const Scratch& sc,
                                        const int* s_expert, int* s_start, int* s_scan, int epr, int64_t A,
                                        bool expand, int num_threads) {
    block_exclusive_scan(s_start, epr, s_scan);
    for (int j = threadIdx.x; j < epr; j += num_threads) {
        const int count = s_expert[j];
        const int start = s_start[j];
        args.unaligned_expert[j] = count;
        args.psum_expert[j] = expand ? start + count : start + static_cast<int>(align_up<int64_t>(count, A));
        if (args.cum_stats != nullptr)
            atomicAdd(args.cum_stats + j, count);
        sc.expert_cursor()[j] = start;
        sc.expert_start()[j] = start;
        int running = start;
        for (int src = 0; src < kNumRanks; ++src) {
            uint64_t* c = ws.recv_expert_count() + src * epr + j;
            sc.expert_src_base()[src * epr + j] = running;
            running += static_cast<int>(*c & 0xffffffffull);
            *c = 0;
        }
    }
}

/// Zero-copy dispatch, block 0 between the count and the send phase (all its threads call it): this rank's count
/// for each destination (the popcount of its bitmap row) into that destination's `dispatch_src_count[rank]`, the
/// entry barrier, then for each destination the sum of the counts of the sources before this rank, i.e. where its
/// rows start there, into the scratch's send counters (unused by deterministic slots; the publishing block resets
/// them). The grid barrier after the prefix phase hands them to the other blocks. False after a failed wait.
template <int kNumRanks, typename Transport>
EP_CORE_DEVICE bool zero_copy_row_bases(SyncContext<Transport>& sync, const uint32_t* bits, int W, int warp,
                                        int lane) {
    if constexpr (kNumRanks == 1) {
        return true;  // the only source: its rows start at 0, and the counters are zero between operations
    } else {
        const int rank = static_cast<int>(sync.args.rank);
        const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
        for (int d = warp; d < kNumRanks; d += num_warps) {
            uint32_t count = 0;
            for (int w = lane; w < W; w += kWarpSize)
                count += __popc(bits[static_cast<int64_t>(d) * W + w]);
            count = __reduce_add_sync(kFullMask, count);
            if (lane == 0)
                *reinterpret_cast<volatile uint64_t*>(sync.tr.sym_ptr(sync.ws.dispatch_src_count(), d) + rank) = count;
        }
        // the barrier's release (after a block barrier) carries the counts written above
        if (!sync.cross_rank_barrier(kTagDispatchEntry, true))
            return false;
        for (int d = warp; d < kNumRanks; d += num_warps) {
            uint32_t before = 0;
            for (int src = lane; src < rank; src += kWarpSize)
                before += static_cast<uint32_t>(
                    *reinterpret_cast<const volatile uint64_t*>(sync.tr.sym_ptr(sync.ws.dispatch_src_count(), d) + src));
            before = __reduce_add_sync(kFullMask, before);
            if (lane == 0)
                sync.sc.send_slot()[d] = static_cast<int32_t>(before);
        }
        return true;
    }
}

/// Zero-copy dispatch, send phase: for each destination of token `t` (its master lanes; `row` is the token's row
/// there at the master lane), the lanes store that row's top-k ids (local expert or -1), weights, scale packs and
/// the two metadata words straight into the destination's arrays (zero_copy_rows.cuh), as the copy epilogue would
/// have written them. The hidden part goes by the caller's bulk store.
template <typename Tok, typename Peers>
EP_CORE_DEVICE void zero_copy_row_tail(const ZeroCopyRows& z, const OpArgs& args, const Peers& peer_recv,
                                       const uint32_t* sf, const Route& r, int64_t row, int64_t t, int lane, int rank,
                                       int epr, int64_t M, float weight) {
    constexpr int K = Tok::kNumTopk;
    // the token's scale packs, loaded once for all its destinations
    constexpr int kPacksPerLane = (Tok::kNumSfPacks + kWarpSize - 1) / kWarpSize;
    uint32_t packs[kPacksPerLane > 0 ? kPacksPerLane : 1];
#pragma unroll
    for (int i = 0; i < kPacksPerLane; ++i) {
        const int p = lane + i * kWarpSize;
        packs[i] = p < Tok::kNumSfPacks ? sf[t * args.sf_stride0 + static_cast<int64_t>(p) * args.sf_stride1] : 0u;
    }
    for (uint32_t masters = __ballot_sync(kFullMask, r.master); masters != 0; masters &= masters - 1) {
        const int m = __ffs(masters) - 1;
        const int d = __shfl_sync(kFullMask, r.dst, m);
        const int64_t at = __shfl_sync(kFullMask, row, m);
        uint8_t* const region = peer_recv[d];
        if (lane < K) {
            reinterpret_cast<int64_t*>(region + z.topk_idx_offset())[at * K + lane] =
                r.dst == d ? r.expert - d * epr : -1;
            if (args.topk_weights != nullptr)
                reinterpret_cast<float*>(region + z.weights_offset())[at * K + lane] = weight;
        }
        if (lane == 0)
            reinterpret_cast<int2*>(region + z.meta_offset())[at] =
                make_int2(static_cast<int>(rank * M + t), rank * K + m);
#pragma unroll
        for (int i = 0; i < kPacksPerLane; ++i) {
            const int p = lane + i * kWarpSize;
            if (p < Tok::kNumSfPacks)
                reinterpret_cast<uint32_t*>(region + z.sf_offset())[at * Tok::kNumSfPacks + p] = packs[i];
        }
    }
}

/// Zero-copy dispatch, receiving block after every source's count: the handle's metadata [rows, K + 2] from the
/// two words each source left per row (columns 2.. are -1 in the non-expanded layout), since the handle outlives
/// the region. After `write_rank_psum` (the row count). One block does it for every received row, so it is shaped
/// for bytes in flight: a warp takes kChunks groups of 32 rows, loads all their words first (one coalesced load
/// each), then stores each group's 32 * (K + 2) consecutive int32s, every lane every 32nd. (An element per thread,
/// each store waiting for its own load, cost a few hundred microseconds at T=4096 on one block.)
template <int kNumRanks, int kNumTopk>
EP_CORE_DEVICE void zero_copy_metadata(const ZeroCopyRows& z, const OpArgs& args, const uint8_t* region,
                                       int num_threads) {
    constexpr int kCols = kNumTopk + 2;
    constexpr int kChunks = 4;
    __syncthreads();
    const int64_t rows = args.psum_rank[kNumRanks - 1];
    const int2* const meta = reinterpret_cast<const int2*>(region + z.meta_offset());
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    const int64_t step = static_cast<int64_t>(num_threads / kWarpSize) * kWarpSize * kChunks;
    for (int64_t base = static_cast<int64_t>(threadIdx.x / kWarpSize) * kWarpSize * kChunks; base < rows;
         base += step) {
        int2 m[kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const int64_t row = base + c * kWarpSize + lane;
            m[c] = row < rows ? __ldcg(meta + row) : make_int2(-1, -1);  // peers' stores, acquired with their counts
        }
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const int64_t first = base + c * kWarpSize;
            const int64_t n = rows - first;  // rows of this group (<= 0: none; uniform over the warp)
            int32_t* const out = args.src_metadata + first * kCols;
#pragma unroll
            for (int j = lane; j < kWarpSize * kCols; j += kWarpSize) {
                const int r = j / kCols;
                const int col = j - r * kCols;
                const int sid = __shfl_sync(kFullMask, m[c].x, r);
                const int slot = __shfl_sync(kFullMask, m[c].y, r);
                if (r < n)
                    out[j] = col == 0 ? sid : (col == 1 ? slot : -1);
            }
        }
    }
}

/// Zero-copy (`kZeroCopy`, entry point `ep_dispatch_zero_copy_impl`; direct mode, non-expanded, deterministic): the
/// send phase stores every output in its final place in the destination's receive region (zero_copy_rows.cuh), so
/// no copy epilogue runs. That needs each token's row before it is sent: after the count phase, block 0 publishes
/// this rank's token count for each destination (`Workspace::dispatch_src_count`) before the entry barrier, and
/// after it sums, per destination, the counts of the sources before this rank (where its rows start there) into
/// the scratch's send counters, which deterministic mode leaves unused. The receiving block copies the two metadata
/// columns of its rows into the handle, which must outlive the region.
template <int kNumRanks, int kNumTopk, int kHiddenBytes, int kNumSfPacks, int kNumWarps, typename Transport,
          bool kZeroCopy = false>
EP_CORE_DEVICE void dispatch_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, kNumSfPacks, kNumTopk, true>;
    static_assert(kNumTopk >= 1 && kNumTopk <= 32, "top-k must be in [1, 32]");
    static_assert(kNumRanks >= 1 && kNumRanks <= ep_layout::kNumMaxRanks, "too many ranks");

    __shared__ int s_abort;
    __shared__ int s_sent[kNumRanks];
    __shared__ int s_expert[ep_layout::kNumMaxExperts];
    __shared__ int s_start[256];
    __shared__ int s_scan[kWarpSize];
    __shared__ __align__(8) uint64_t s_bars[kNumWarps];
    __shared__ uint8_t* s_peer_recv[PeerPointers<kNumRanks, Transport>::kTableSize];
    extern __shared__ __align__(128) uint8_t ep_dyn_smem[];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_threads = blockDim.x;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int64_t T = args.num_tokens;
    const int rank = static_cast<int>(args.rank);
    const bool cached = (args.flags & kFlagCached) != 0;
    const bool det = kZeroCopy || (!cached && (args.flags & kFlagDeterministic) != 0);
    const bool expand = !kZeroCopy && (args.flags & kFlagExpand) != 0;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
#if EP_PHASE_ON
    sync.phase_kernel = kPhaseDispatch;
#endif
    EP_PHASE_FIRST(kPhaseDispatch, kDpStart);
    const Workspace& ws = sync.ws;
    const Scratch& sc = sync.sc;
    const int W = sc.num_words;
    uint32_t* bits = sc.bits();
    uint32_t* prefix = sc.prefix();

    // 0. guard: an earlier failure left the abort flag raised -> publish it and leave (outputs untouched)
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, ws) ? 1 : 0;
    if (lane == 0)
        ptx::mbarrier_init(&s_bars[warp], 1);
    uint8_t* const slot_buf = ep_dyn_smem + warp * Tok::kSmemSlotBytes;
    uint64_t* const bar = &s_bars[warp];
    uint32_t phase = 0;
    for (int i = threadIdx.x; i < kNumRanks; i += num_threads)
        s_sent[i] = 0;
    for (int i = threadIdx.x; i < num_experts; i += num_threads)
        s_expert[i] = 0;
    uint8_t* const recv_region = static_cast<uint8_t*>(args.recv_region);
    const PeerPointers<kNumRanks, Transport> peer_recv{s_peer_recv, sync.tr, recv_region};
    peer_recv.fill();
    __syncthreads();
    if (s_abort != 0)
        return;
    EP_PHASE_MARK(kPhaseDispatch, kDpSetup);

    const int global_warp = work_warp_index(warp, kNumWarps);
    const int num_global_warps = gridDim.x * kNumWarps;

    // 1. count (deterministic): bitmaps of (destination rank, token) and (expert, token)
    if (det)
        count_bitmaps<kNumRanks, kNumTopk>(args, sc, bits, W, T, global_warp, num_global_warps, lane, num_experts,
                                           epr);

    // 2. entry barrier: peers have finished with their receive regions. One rank alone has no peer (its own
    // earlier kernels are stream-ordered) and could only compare its envelope with itself: no barrier, and a
    // grid barrier only where the prefix needs the complete bitmaps.
    EP_PHASE_MARK(kPhaseDispatch, kDpCount);
    if constexpr (kZeroCopy) {
        // the counts come from the complete bitmaps; block 0 meets the ranks with them while the others start on
        // the prefix
        if (!sync.grid_sync(false))
            return;
        if (blockIdx.x == 0 && !zero_copy_row_bases<kNumRanks>(sync, bits, W, warp, lane))
            return;
    } else if constexpr (kNumRanks > 1) {
        if (blockIdx.x == 0 && !sync.cross_rank_barrier(kTagDispatchEntry, true))
            return;
    }
    EP_PHASE_MARK(kPhaseDispatch, kDpEntry);
    if (!kZeroCopy && (kNumRanks > 1 || det)) {
        if (!sync.grid_sync(false))  // only local bitmaps written so far
            return;
    }

    // 3. prefix (deterministic): exclusive popcount prefix per bitmap row
    if (det) {
        bitmap_prefix(bits, prefix, W, T, kNumRanks + num_experts, global_warp, num_global_warps, lane);
        EP_PHASE_MARK(kPhaseDispatch, kDpPrefix);
        if (!sync.grid_sync(false))  // local prefix only
            return;
    }

    // 4. send
    const uint8_t* const x = static_cast<const uint8_t*>(args.x);
    const uint32_t* const sf = static_cast<const uint32_t*>(args.sf);
    // a rank alone sends every token only to itself, whose copy is the tail (kDirectOwnRowsTailOnly): the hidden
    // part is never loaded (the copy epilogue reads it from x). Zero-copy rows are whole: no epilogue runs.
    constexpr bool kLoadHidden = kZeroCopy || !(kDirectOwnRowsTailOnly && kNumRanks == 1);
    const ZeroCopyRows zrows{kNumRanks * M, Tok::kHiddenBytes, Tok::kNumSfPacks, kNumTopk};
    for (int64_t t = global_warp; t < T; t += num_global_warps) {
        // the hidden part's bulk load first: it depends on nothing below, so routing (the top-k loads, the slot's
        // atomic or handle read) runs while it is in flight. The slot is free once the warp's previous bulk
        // stores have read it.
        ptx::bulk_wait_read();
        __syncwarp();
        if (kLoadHidden && lane == 0) {
            ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
            ptx::bulk_load(slot_buf, x + t * args.x_stride, Tok::kHiddenBytes, bar);
        }
        const Route r = route_token<kNumTopk>(args, sc, t, lane, num_experts, epr, !det, true);
        // claim_token's steps, written out (its comment says why)
        const int64_t word = t >> 5;
        const uint32_t below = (1u << (t & 31)) - 1u;
        int slot = -1;
        if (r.master) {
            if (cached) {
                slot = static_cast<int>(args.dst_slot[t * kNumTopk + lane] - static_cast<int64_t>(rank) * M);
            } else if (det) {
                const int64_t at = static_cast<int64_t>(r.dst) * W + word;
                slot = static_cast<int>(prefix[at]) + __popc(bits[at] & below);
            } else {
                slot = atomicAdd(sc.send_slot() + r.dst, 1);
            }
            atomicAdd(&s_sent[r.dst], 1);
        }
        if (!cached && lane < kNumTopk)
            args.dst_slot[t * kNumTopk + lane] = r.master ? static_cast<int32_t>(rank * M + slot) : -1;
        if (!cached && r.valid)
            atomicAdd(&s_expert[r.expert], 1);
        int position = -1;
        if (det && r.valid) {
            const int64_t at = static_cast<int64_t>(kNumRanks + r.expert) * W + word;
            position = static_cast<int>(prefix[at]) + __popc(bits[at] & below);
        }
        const float weight =
            (lane < kNumTopk && args.topk_weights != nullptr) ? args.topk_weights[t * kNumTopk + lane] : 0.0f;

        if constexpr (kZeroCopy) {
            // the outputs in place: the lanes store each destination's row of ids, weights, scales and metadata,
            // the master lane the hidden part once it has landed in the slot
            const int64_t row = r.master ? sc.send_slot()[r.dst] + static_cast<int64_t>(slot) : -1;
            zero_copy_row_tail<Tok>(zrows, args, peer_recv, sf, r, row, t, lane, rank, epr, M, weight);
            ptx::mbarrier_wait(bar, phase);
            phase ^= 1u;
            if (r.master) {
                ptx::bulk_store(peer_recv[r.dst] + row * Tok::kHiddenBytes, slot_buf, Tok::kHiddenBytes);
                ptx::bulk_commit();
            }
            continue;
        }
        uint8_t* my_dst = nullptr;
        if (r.master)
            my_dst = peer_recv[r.dst] +
                     (static_cast<int64_t>(rank) * M + slot) * static_cast<int64_t>(Tok::kNumBytes);

        // stage [hidden | sf | metadata] in this warp's shared slot: the hidden part by the bulk load above, the
        // rest by the lanes
        stage_tail<Tok>(slot_buf, args, sf, t, lane, r.expert, weight, position, rank, M);
        ptx::fence_async_shared();
        __syncwarp();
        if constexpr (kLoadHidden) {
            ptx::mbarrier_wait(bar, phase);
            phase ^= 1u;
        }
        // one bulk store per destination rank, issued by the master lane of that rank (this rank's own copy:
        // the tail only, kDirectOwnRowsTailOnly)
        if (r.master) {
            if (kDirectOwnRowsTailOnly && r.dst == rank)
                ptx::bulk_store(my_dst + Tok::kHiddenBytes, slot_buf + Tok::kHiddenBytes,
                                Tok::kNumBytes - Tok::kHiddenBytes);
            else
                ptx::bulk_store(my_dst, slot_buf, Tok::kNumBytes);
            ptx::bulk_commit();
        }
    }
    EP_PHASE_MARK(kPhaseDispatch, kDpSendB0);
    ptx::bulk_wait_all();

    // flush the block's counts
    flush_block_counts(sc, s_sent, s_expert, kNumRanks, num_experts, cached, num_threads);
#if EP_PHASE_ON
    __syncthreads();
    EP_PHASE_MARK(kPhaseDispatch, kDpFlush);
    EP_PHASE_LAST(kPhaseDispatch, kDpSendLast);
#endif

    // 5. publish (after every block's stores): the block that arrives last does it, the others leave at once.
    // A copy epilogue launched with programmatic dependent launch may start now (it waits for this grid to
    // complete before reading): its launch overlaps the publish and receive phase, on the SMs the others free.
    ptx::griddep_launch_dependents();
    if (sync.grid_arrive_is_last(kNumRanks > 1)) {  // one rank: every store went to its own memory
        if (det) {
            const int64_t total = static_cast<int64_t>(kNumRanks + num_experts) * W;
            for (int64_t i = threadIdx.x; i < total; i += num_threads)
                bits[i] = 0u;
        }
        if (!cached) {
            for (int i = threadIdx.x; i < num_experts; i += num_threads) {
                const int d = i / epr;
                sync.tr.sym_ptr(ws.recv_expert_count(), d)[rank * epr + (i % epr)] =
                    kCountValidFlag | static_cast<uint32_t>(sc.expert_total()[i]);
                sc.expert_total()[i] = 0;
            }
        }
        __syncthreads();
        EP_PHASE_STAMP(kPhaseDispatch, kDpExpertPub);
        if constexpr (kNumRanks == 1) {
            // one rank: its count is its own (this block acquired every block's flush): no release, no wait
            if (threadIdx.x == 0) {
                s_sent[0] = sc.sent_total()[0];
                sc.sent_total()[0] = 0;
                sc.send_slot()[0] = 0;
            }
        } else {
            // each count is a system-scope release, cumulative over the block's expert-count stores (ordered by
            // the barrier above): no separate fence before it
            for (int d = threadIdx.x; d < kNumRanks; d += num_threads) {
                const int count = sc.sent_total()[d];
                ptx::st_release_sys(sync.tr.sym_ptr(ws.recv_rank_count(), d) + rank,
                                    kCountValidFlag | static_cast<uint32_t>(count));
                sc.sent_total()[d] = 0;
                sc.send_slot()[d] = 0;
            }
        }
        EP_PHASE_STAMP(kPhaseDispatch, kDpRankPub);

        // 6. receive: wait for every source's count, then write the handle
        if constexpr (kNumRanks > 1)
            wait_source_counts<kNumRanks>(args, sync, s_sent, &s_abort, num_threads);
        __syncthreads();
        if (s_abort != 0)
            return;
        EP_PHASE_STAMP(kPhaseDispatch, kDpRecv);
        if (!cached) {
            const int64_t A = args.expert_alignment;
            sum_expert_counts<kNumRanks>(ws, s_expert, s_start, epr, A, num_threads);
            write_rank_psum<kNumRanks>(args, s_sent);
            write_expert_layout<kNumRanks>(args, ws, sc, s_expert, s_start, s_scan, epr, A, expand, num_threads);
        }
        if constexpr (kZeroCopy)
            zero_copy_metadata<kNumRanks, kNumTopk>(zrows, args, recv_region, num_threads);
#if EP_PHASE_ON
        __syncthreads();
        EP_PHASE_STAMP(kPhaseDispatch, kDpHandle);
#endif
    }
    sync.grid_exit();
}

}  // namespace ep_core
