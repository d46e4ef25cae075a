// SPDX-License-Identifier: Apache-2.0
/// \file direct_xnode.cuh
/// \brief Direct mode across nodes (`allow_hybrid_mode=False` with several nodes of `kNumNodeRanks` ranks: ranks
/// r / kNumNodeRanks form a node), as DeepEP's direct mode when the scale-up is not NVLink.
///
/// The kernels are direct mode's (dispatch.cuh, combine.cuh: same roles, slots, handle, receive layout, reduction
/// order of SPEC §3), with one change: a peer of another node is not load/store reachable, so everything this rank
/// writes there goes through the scale-out put of scaleout.cuh (there is no forwarding: every remote rank is its
/// own scale-out peer), and peers of this node are reached by load/store as in direct mode:
///  - dispatch: a token's bytes for a remote destination go to `so.dst(...)` (emulated: the destination's region
///    `[own rank][slot]` itself; gin: this rank's send stage `[token]`, one copy whatever the number of remote
///    destinations, then one put per destination); the expert counts by `put_value`, then the rank count by a
///    `signal` (put-then-signal: the count arrives after the tokens and expert counts of this rank);
///  - combine: a row for a remote source goes to `so.dst(...)` (gin: send stage `[src rank][lane][src token]`,
///    DeepEP's `[N][M * (amr ? 1 : K)]`) and is put to the source's slot `[own rank | lane][src token]`;
///  - barriers: `hybrid_barrier` (signals to ranks of other nodes under gin; the plain cross-rank barrier when
///    every rank is reachable).
/// The copy epilogue is direct mode's (N regions, one per source rank).
///
/// Regions (gin only beyond direct mode's; mirrored by `ep_core.kernels.plan` through ep_layout's direct buffers
/// with `is_scaleup_nvlink=False`): dispatch `[recv N x M | send M]` of dispatch tokens; combine `[recv slots x M |
/// send N x M * (amr ? 1 : K)]` of combine tokens, slots = N (rank layout) or K.
#pragma once

#include "combine.cuh"
#include "dispatch.cuh"
#include "hybrid.cuh"
#include "scaleout.cuh"

namespace ep_core {

template <int kNumRanks, int kNumNodeRanks, int kNumTopk, int kHiddenBytes, int kNumSfPacks, int kNumWarps,
          typename Transport, template <typename> class ScaleoutT>
EP_CORE_DEVICE void direct_xnode_dispatch_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, kNumSfPacks, kNumTopk, true>;
    using Scaleout = ScaleoutT<Transport>;
    constexpr int kNvl = kNumNodeRanks;
    static_assert(kNumTopk >= 1 && kNumTopk <= 32, "top-k must be in [1, 32]");
    static_assert(kNumRanks >= 1 && kNumRanks <= ep_layout::kNumMaxRanks, "too many ranks");
    static_assert(kNumRanks % kNvl == 0 && kNumRanks / kNvl >= 2, "direct mode across nodes needs >= 2 nodes");

    __shared__ int s_abort;
    __shared__ int s_sent[kNumRanks];
    __shared__ int s_expert[ep_layout::kNumMaxExperts];
    __shared__ int s_start[256];
    __shared__ int s_scan[kWarpSize];
    __shared__ __align__(8) uint64_t s_bars[kNumWarps];
    __shared__ uint8_t* s_peer_recv[PeerPointers<kNumNodeRanks, Transport>::kTableSize];
    extern __shared__ __align__(128) uint8_t ep_dyn_smem[];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_threads = blockDim.x;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int64_t T = args.num_tokens;
    const int rank = static_cast<int>(args.rank);
    const int node = rank / kNvl;
    const int node_base = node * kNvl;
    const bool cached = (args.flags & kFlagCached) != 0;
    const bool det = !cached && (args.flags & kFlagDeterministic) != 0;
    const bool expand = (args.flags & kFlagExpand) != 0;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
    const Workspace& ws = sync.ws;
    const Scratch& sc = sync.sc;
    const Scaleout so(args, sync.tr);
    const int W = sc.num_words;
    uint32_t* bits = sc.bits();
    uint32_t* prefix = sc.prefix();

    // 0. guard
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
    // load/store peers: this node's ranks only, indexed by local rank (global rank node_base + i)
    if constexpr (PeerPointers<kNumNodeRanks, Transport>::kCached) {
        for (int p = threadIdx.x; p < kNvl; p += num_threads)
            s_peer_recv[p] = sync.tr.sym_ptr(recv_region, node_base + p);
    }
    __syncthreads();
    if (s_abort != 0)
        return;
    auto local_peer = [&](int d) -> uint8_t* {
        if constexpr (PeerPointers<kNumNodeRanks, Transport>::kCached)
            return s_peer_recv[d - node_base];
        else
            return sync.tr.sym_ptr(recv_region, d);
    };

    const int global_warp = blockIdx.x * kNumWarps + warp;
    const int num_global_warps = gridDim.x * kNumWarps;

    // 1. count (deterministic): direct mode's bitmaps and input checks
    if (det)
        count_bitmaps<kNumRanks, kNumTopk>(args, sc, bits, W, T, global_warp, num_global_warps, lane, num_experts,
                                           epr);

    // 2. entry barrier (every rank of every node)
    if (blockIdx.x == 0 && !hybrid_barrier<kNvl>(sync, so, kTagDispatchEntry, true))
        return;
    if (!sync.grid_sync())
        return;

    // 3. prefix (deterministic)
    if (det) {
        bitmap_prefix(bits, prefix, W, T, kNumRanks + num_experts, global_warp, num_global_warps, lane);
        if (!sync.grid_sync())
            return;
    }

    // 4. send: this node's destinations by load/store, the others through the scale-out put
    const uint8_t* const x = static_cast<const uint8_t*>(args.x);
    const uint32_t* const sf = static_cast<const uint32_t*>(args.sf);
    uint8_t* const send_stage = recv_region + static_cast<int64_t>(kNumRanks) * M * Tok::kNumBytes;
    for (int64_t t = global_warp; t < T; t += num_global_warps) {
        const Route r = route_token<kNumTopk>(args, sc, t, lane, num_experts, epr, !det, true);
        const Claim c = claim_token<kNumRanks, kNumTopk>(args, sc, r, t, lane, rank, M, cached, det, bits, prefix, W,
                                                         s_sent, s_expert);

        const bool remote = r.master && r.dst / kNvl != node;
        const int64_t tok_off = (static_cast<int64_t>(rank) * M + c.slot) * static_cast<int64_t>(Tok::kNumBytes);
        uint8_t* const stage_row = send_stage + t * static_cast<int64_t>(Tok::kNumBytes);
        uint8_t* my_dst = nullptr;
        if (r.master)
            my_dst = remote ? so.dst(recv_region + tok_off, r.dst, stage_row) : local_peer(r.dst) + tok_off;
        // staged (gin): the token's bytes are the same for every remote destination: one lane stores them once
        const uint32_t remote_mask = __ballot_sync(kFullMask, remote);
        const int stager = remote_mask != 0 ? __ffs(remote_mask) - 1 : -1;
        const bool store = r.master && (!remote || !Scaleout::kStaged || lane == stager);

        ptx::bulk_wait_read();
        __syncwarp();
        if (lane == 0) {
            ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
            ptx::bulk_load(slot_buf, x + t * args.x_stride, Tok::kHiddenBytes, bar);
        }
        stage_tail<Tok>(slot_buf, args, sf, t, lane, r.expert, c.weight, c.position, rank, M);
        ptx::fence_async_shared();
        __syncwarp();
        ptx::mbarrier_wait(bar, phase);
        phase ^= 1u;
        if (store) {
            ptx::bulk_store(my_dst, slot_buf, Tok::kNumBytes);
            ptx::bulk_commit();
        }
        if constexpr (Scaleout::kStaged) {
            if (remote_mask != 0) {
                if (lane == stager)
                    ptx::bulk_wait_all();
                __syncwarp();
                if (remote)
                    so.commit(recv_region + tok_off, stage_row, Tok::kNumBytes, r.dst);
            }
        }
    }
    ptx::bulk_wait_all();

    // flush the block's counts
    flush_block_counts(sc, s_sent, s_expert, kNumRanks, num_experts, cached, num_threads);

    // 5. publish (after every block's stores and puts): expert counts, then the rank count (release / signal)
    if (!sync.grid_sync())
        return;
    if (det) {
        const int64_t total = static_cast<int64_t>(kNumRanks + num_experts) * W;
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * num_threads + threadIdx.x; i < total;
             i += static_cast<int64_t>(gridDim.x) * num_threads)
            bits[i] = 0u;
    }
    if (blockIdx.x == 0) {
        if (!cached) {
            for (int i = threadIdx.x; i < num_experts; i += num_threads) {
                const int d = i / epr;
                uint64_t* word = ws.recv_expert_count() + rank * epr + (i % epr);
                const uint64_t v = kCountValidFlag | static_cast<uint32_t>(sc.expert_total()[i]);
                if (d / kNvl == node)
                    *sync.tr.sym_ptr(word, d) = v;
                else
                    so.put_value(word, v, d);
                sc.expert_total()[i] = 0;
            }
        }
        __syncthreads();
        if (threadIdx.x < kNumRanks)
            ptx::fence_sys();
        // tests only: this node "never sends" (its ranks skip the counts of remote destinations)
        const bool skip = (args.flags & kFlagSkipScaleoutSignal) != 0;
        for (int d = threadIdx.x; d < kNumRanks; d += num_threads) {
            const uint64_t v = kCountValidFlag | static_cast<uint32_t>(sc.sent_total()[d]);
            uint64_t* word = ws.recv_rank_count() + rank;
            if (d / kNvl == node)
                ptx::st_release_sys(sync.tr.sym_ptr(word, d), v);
            else if (!skip)
                so.signal(word, v, d);  // the word is zero before (reset by its receiver): the add stores v
            sc.sent_total()[d] = 0;
            sc.send_slot()[d] = 0;
        }

        // 6. receive: wait for every source's count, then write the handle (as direct mode)
        wait_source_counts<kNumRanks>(args, sync, s_sent, &s_abort, num_threads);
        __syncthreads();
        if (s_abort != 0)
            return;
        if (!cached) {  // direct mode's handle: expert starts by a block scan of the aligned counts
            const int64_t A = args.expert_alignment;
            sum_expert_counts<kNumRanks>(ws, s_expert, s_start, epr, A, num_threads);
            write_rank_psum<kNumRanks>(args, s_sent);
            write_expert_layout<kNumRanks>(args, ws, sc, s_expert, s_start, s_scan, epr, A, expand, num_threads);
        }
    }
    sync.grid_exit();
}

template <int kNumRanks, int kNumNodeRanks, int kNumTopk, int kHiddenBytes, int kNumWarps, typename Transport,
          template <typename> class ScaleoutT>
EP_CORE_DEVICE void direct_xnode_combine_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, 0, kNumTopk, false>;
    using Scaleout = ScaleoutT<Transport>;
    constexpr int kNvl = kNumNodeRanks;
    constexpr int kMetaCols = kNumTopk + 2;
    static_assert(kNumRanks % kNvl == 0 && kNumRanks / kNvl >= 2, "direct mode across nodes needs >= 2 nodes");
    __shared__ int s_abort;
    __shared__ const uint8_t* s_ops[kNumWarps][kWarpSize];
    __shared__ uint8_t* s_peer_region[PeerPointers<kNumNodeRanks, Transport>::kTableSize];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int64_t T = args.num_tokens;
    const int rank = static_cast<int>(args.rank);
    const int node = rank / kNvl;
    const int node_base = node * kNvl;
    const bool expand = (args.flags & kFlagExpand) != 0;
    const bool amr = (args.flags & kFlagMultipleReduction) != 0;
    const bool rank_layout = (args.flags & kFlagRankLayout) != 0;
    const bool lane_level = expand && !amr;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
    const Scaleout so(args, sync.tr);
    // 0. guard
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, sync.ws) ? 1 : 0;
    uint8_t* const region = static_cast<uint8_t*>(args.recv_region);
    if constexpr (PeerPointers<kNumNodeRanks, Transport>::kCached) {
        for (int p = threadIdx.x; p < kNvl; p += blockDim.x)
            s_peer_region[p] = sync.tr.sym_ptr(region, node_base + p);
    }
    __syncthreads();
    if (s_abort != 0)
        return;
    auto local_peer = [&](int s) -> uint8_t* {
        if constexpr (PeerPointers<kNumNodeRanks, Transport>::kCached)
            return s_peer_region[s - node_base];
        else
            return sync.tr.sym_ptr(region, s);
    };

    // 1. entry
    if (blockIdx.x == 0 && !hybrid_barrier<kNvl>(sync, so, kTagCombineEntry, true))
        return;
    if (!sync.grid_sync())
        return;

    const int global_warp = blockIdx.x * kNumWarps + warp;
    const int num_global_warps = gridDim.x * kNumWarps;
    const uint8_t* const x = static_cast<const uint8_t*>(args.comb_x);
    const int64_t R = args.psum_rank[kNumRanks - 1];
    // gin send stage: after the receive slots of both layouts' largest (K >= min(N, K)), [src][lane][token]
    const int64_t recv_slots = rank_layout ? kNumRanks : kNumTopk;
    uint8_t* const send_stage = region + recv_slots * M * Tok::kNumBytes;
    const int64_t stage_per_rank = M * (amr ? 1 : kNumTopk);

    // 2. send: this node's sources by load/store, the others through the scale-out put
    for (int64_t i = global_warp; i < R; i += num_global_warps) {
        const int32_t* meta = args.src_metadata + i * kMetaCols;
        const int m0 = meta[0], m1 = meta[1];
        const int src_rank = static_cast<int>(m0 / M);
        const int64_t src_token = m0 % M;
        const int master = m1 % kNumTopk;
        const bool remote = src_rank / kNvl != node;
        uint8_t* const src_region = remote ? nullptr : local_peer(src_rank);
        auto slot_off = [&](int slot) { return (slot * M + src_token) * static_cast<int64_t>(Tok::kNumBytes); };
        auto stage_of = [&](int l) {
            return send_stage + (src_rank * stage_per_rank + (lane_level ? l * M : 0) + src_token) *
                                    static_cast<int64_t>(Tok::kNumBytes);
        };
        // where this row's bytes for slot `slot` go (stage lane `l`), and the put that follows (remote only)
        auto target = [&](int slot, int l) {
            return remote ? so.dst(region + slot_off(slot), src_rank, stage_of(l)) : src_region + slot_off(slot);
        };
        auto put = [&](int slot, int l) {
            if constexpr (Scaleout::kStaged) {
                if (remote) {
                    __syncwarp();
                    if (lane == 0) {
                        ptx::fence_sys();  // the warp's stores (ordered by the warp barrier) before the put reads
                        so.commit(region + slot_off(slot), stage_of(l), Tok::kNumBytes, src_rank);
                    }
                }
            }
        };
        if (!expand) {
            const int slot = rank_layout ? rank : master;
            uint8_t* dst = target(slot, 0);
            uint8_t* dsts[kFanout] = {dst};
            warp_copy_fanout<Tok::kHiddenBytes>(x + i * static_cast<int64_t>(Tok::kHiddenBytes), dsts, 1, lane);
            if (args.comb_weights != nullptr && lane < kNumTopk)
                reinterpret_cast<float*>(dst + Tok::kWeightsOffset)[lane] = args.comb_weights[i * kNumTopk + lane];
            put(slot, 0);
        } else {
            const int row = lane < kNumTopk ? meta[2 + lane] : -1;
            const uint32_t rows = __ballot_sync(kFullMask, row >= 0);
            const uint8_t* my_src = row >= 0 ? x + static_cast<int64_t>(row) * Tok::kHiddenBytes : nullptr;
            if (amr) {
                const int slot = rank_layout ? rank : master;
                uint8_t* dst = target(slot, 0);
                if (__popc(rows) == 1) {
                    const uint8_t* src = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), __ffs(rows) - 1));
                    uint8_t* dsts[kFanout] = {dst};
                    warp_copy_fanout<Tok::kHiddenBytes>(src, dsts, 1, lane);
                } else {
                    warp_ordered_sum<Tok::kHiddenBytes, false>(my_src, rows, nullptr, nullptr, dst, s_ops[warp], lane);
                }
                if (args.comb_weights != nullptr && lane < kNumTopk)
                    reinterpret_cast<float*>(dst + Tok::kWeightsOffset)[lane] =
                        row >= 0 ? args.comb_weights[row] : 0.0f;
                put(slot, 0);
            } else {
                for (uint32_t m = rows; m != 0; m &= m - 1) {
                    const int l = __ffs(m) - 1;
                    const uint8_t* src = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), l));
                    uint8_t* dsts[kFanout] = {target(l, l)};
                    warp_copy_fanout<Tok::kHiddenBytes>(src, dsts, 1, lane);
                    put(l, l);
                }
            }
        }
    }

    // 3. exit: every rank's rows have landed here
    if (!sync.grid_sync())
        return;
    if (blockIdx.x == 0 && !hybrid_barrier<kNvl>(sync, so, kTagCombineExit))
        return;
    if (!sync.grid_sync())
        return;

    // 4. reduce (direct mode's order: operands per rank, or per lane without multiple reduction)
    uint8_t* const out = static_cast<uint8_t*>(args.combined_x);
    const uint8_t* const bias0 = static_cast<const uint8_t*>(args.bias0);
    const uint8_t* const bias1 = static_cast<const uint8_t*>(args.bias1);
    for (int64_t t = global_warp; t < T; t += num_global_warps) {
        int64_t e = -1;
        if (lane < kNumTopk)
            e = topk_id(args, t * kNumTopk + lane);
        const bool valid = e >= 0 && e < num_experts;
        const int dst_rank = valid ? static_cast<int>(e) / epr : -1 - lane;
        const uint32_t same = __match_any_sync(kFullMask, dst_rank);
        const int master = 31 - __clz(same);
        const bool is_operand = lane_level ? valid : (valid && master == lane);
        const uint32_t operands = __ballot_sync(kFullMask, is_operand);
        auto slot_of = [&](int l) { return lane_level ? l : (rank_layout ? dst_rank : l); };
        const uint8_t* my_src =
            is_operand ? region + (slot_of(lane) * M + t) * static_cast<int64_t>(Tok::kNumBytes) : nullptr;
        const int64_t row_off = t * static_cast<int64_t>(Tok::kHiddenBytes);
        warp_ordered_sum<Tok::kHiddenBytes, true>(my_src, operands, bias0 != nullptr ? bias0 + row_off : nullptr,
                                                   bias1 != nullptr ? bias1 + row_off : nullptr, out + row_off,
                                                   s_ops[warp], lane);
        if (args.combined_weights != nullptr && lane < kNumTopk) {
            float w = 0.0f;
            if (valid) {
                const int owner = lane_level ? lane : (rank_layout ? dst_rank : master);
                const uint8_t* tok = region + (owner * M + t) * static_cast<int64_t>(Tok::kNumBytes);
                w = *reinterpret_cast<const volatile float*>(tok + Tok::kWeightsOffset + 4 * lane);
            }
            args.combined_weights[t * kNumTopk + lane] = w;
        }
    }
    sync.grid_exit();
}

}  // namespace ep_core
