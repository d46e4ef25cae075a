// SPDX-License-Identifier: Apache-2.0
/// \file hybrid.cuh
/// \brief Hybrid-mode dispatch and combine (EP across nodes of `kNumScaleupRanks` ranks: ranks r / S_u form a node).
///
/// A token crosses to another node at most once per destination node, rail-aligned (to the rank with the same
/// local index `rank % S_u`), as one scale-out message; that rail peer (the forwarder) fans it out over load/store
/// inside its node. The final landing layout is direct mode's: destination d's receive region `[src rank][slot]`
/// with the slot chosen by the source (atomic / deterministic prefix / cached), so the copy epilogue is direct
/// mode's walking the sources in region order (`s % S_u`, then `s`; deterministic: in rank order, DeepEP's order
/// by the source token's global index; cached: in its handle's order), and the handle is direct mode's with S_u
/// region prefix sums (`psum_rank`).
///
/// Dispatch roles (grid barriers between phases):
///  0-3. guard, count, entry barrier (every rank of every node), prefix: as direct mode.
///  4. send     warp per token: slots per destination rank as direct mode; lanes grouped by destination node, the
///              highest lane of each node group puts ONE message [token | K destination slots] to the rail peer
///              of that node, into its scale-out receive region [source node][node slot] (node slot: atomic).
///  5. signal   block 0: per destination node, the count block (messages' rank counts and expert counts of that
///              node's ranks) is put, then one signal `kCountValidFlag | messages` (put-then-signal).
///  6. forward  every block waits for every source node's signal (timeout: `kTagScaleoutSignal`), then warp per
///              message: the token is stored at every destination rank of this node that it targets (master lane
///              of that rank: the slot word is set), at `[source rank][slot]`; its metadata (source id, K expert
///              ids) goes to the handle's `token_metadata_at_forward` for combine.
///  7. publish  block 0: per (source rank on this rail, destination rank of this node) the expert counts, then the
///              rank count with release, into the destination's workspace: every (s, d) has exactly one forwarder.
///  8. receive  block 0: as direct mode (every rank's count word), then the S_u region prefix sums (handle) and a
///              per-source prefix in region order (scratch, for the copy epilogue).
///
/// Combine roles: entry barrier; each rank d writes its level-1 row of (s, t) (the caller's row, or with multiple
/// reduction the local sum of the expanded rows; per lane without it) into the stage of the forwarder
/// `p = node(d) * S_u + s % S_u` (a peer of d's node), slot [lane at d][node(s)][t]; barrier (`kTagCombineForward`);
/// each forwarder sums, per forwarded token, the operands of its node in ascending lane order (fp32, one bf16
/// rounding; representative = highest lane of the node) and puts the partial to the source's final region at slot
/// [rep lane][t]; without multiple reduction it relays every operand unchanged to its own lane slot; exit barrier;
/// the source reduces its operands (one per destination node, or per rank / lane without multiple reduction) in
/// ascending representative-lane order after the biases, as `ep_core.reference.combine` with `num_scaleup_ranks`.
#pragma once

#include "combine.cuh"
#include "dispatch.cuh"
#include "scaleout.cuh"

namespace ep_core {

/// Byte offsets of the hybrid regions inside one rank's receive area (`OpArgs::recv_region`); mirrored by
/// `ep_core.kernels.plan.HybridRegions`. Dispatch and combine reuse the same bytes (every operation begins with a
/// barrier of every rank).
///
/// Dispatch: `[tokens N x M | messages S_o x M | count blocks S_o | gin: send stage S_o x M | gin: count stage S_o]`.
/// Combine:  `[stage K x S_o x M | final K x M | gin: send stage S_o x K x M]` of combine tokens.
template <int kNumRanks, int kNumScaleupRanks, int kNumTopk>
struct HybridRegions {
    static constexpr int kNodes = kNumRanks / kNumScaleupRanks;
    uint8_t* base;
    int64_t M;
    int64_t tok_bytes;   ///< dispatch token
    int64_t msg_bytes;   ///< dispatch token + K int32 slots (32-aligned)
    int64_t cnt_bytes;   ///< count block: S_u rank counts + S_u * epr expert counts (int32, 32-aligned)
    int64_t comb_bytes;  ///< combine token

    EP_CORE_DEVICE HybridRegions(void* b, int64_t m, int epr, int64_t tok, int64_t comb)
        : base(static_cast<uint8_t*>(b)), M(m), tok_bytes(tok),
          msg_bytes(tok + align_up<int64_t>(4 * kNumTopk, kTokenAlignBytes)),
          cnt_bytes(align_up<int64_t>(4 * (kNumScaleupRanks + static_cast<int64_t>(kNumScaleupRanks) * epr),
                                      kTokenAlignBytes)),
          comb_bytes(comb) {}

    EP_CORE_DEVICE uint8_t* messages() const { return base + static_cast<int64_t>(kNumRanks) * M * tok_bytes; }
    EP_CORE_DEVICE uint8_t* message(int node, int64_t q) const {
        return messages() + (node * M + q) * msg_bytes;
    }
    EP_CORE_DEVICE int32_t* counts(int node) const {
        return reinterpret_cast<int32_t*>(messages() + kNodes * M * msg_bytes + node * cnt_bytes);
    }
    EP_CORE_DEVICE uint8_t* send_stage(int node, int64_t q) const {
        return reinterpret_cast<uint8_t*>(counts(kNodes)) + (node * M + q) * msg_bytes;
    }
    EP_CORE_DEVICE int32_t* count_stage(int node) const {
        return reinterpret_cast<int32_t*>(send_stage(kNodes, 0) + node * cnt_bytes);
    }

    EP_CORE_DEVICE int64_t stage_offset(int lane, int node, int64_t t) const {
        return ((static_cast<int64_t>(lane) * kNodes + node) * M + t) * comb_bytes;
    }
    EP_CORE_DEVICE int64_t final_offset(int lane, int64_t t) const {
        return (static_cast<int64_t>(kNumTopk) * kNodes * M + lane * M + t) * comb_bytes;
    }
    EP_CORE_DEVICE int64_t comb_send_offset(int node, int lane, int64_t t) const {
        return (static_cast<int64_t>(kNumTopk) * (kNodes + 1) * M + (static_cast<int64_t>(node) * kNumTopk + lane) * M +
                t) *
               comb_bytes;
    }
};

/// Hybrid words of the rank-private scratch, after direct mode's (`plan.scratch_bytes` adds 8 * N bytes):
/// int32 per-source inclusive prefix in region order [N], then node-slot counters [S_o] (zero between operations).
EP_CORE_DEVICE int32_t* hybrid_psum_src(const Scratch& sc) {
    return reinterpret_cast<int32_t*>(sc.prefix() + static_cast<int64_t>(sc.num_ranks + sc.num_experts) * sc.num_words);
}
EP_CORE_DEVICE int32_t* hybrid_node_slot(const Scratch& sc) { return hybrid_psum_src(sc) + sc.num_ranks; }

/// Scale-out signal words of the workspace: uint64 [source node], `kCountValidFlag | messages`, reset by the receiver.
EP_CORE_DEVICE uint64_t* scaleout_signals(const Workspace& ws) {
    return reinterpret_cast<uint64_t*>(ws.base + ep_layout::WorkspaceLayout::kScaleoutRankCountRecvOffset);
}

/// The cross-rank barrier of the kernels of several nodes (barrier.cuh `cross_rank_barrier`). With a load/store
/// scale-out (emulated: every rank reachable) it is that barrier itself, over every rank. With GIN, peers of other
/// nodes get this rank's envelope by `put_value` and its arrival by a `signal` add on their arrival word (strong
/// signals: the envelope put lands first); peers of this node as in direct mode. Only this node's abort flags can be
/// raised (remote ranks then time out on their own).
///
/// `kRailOnly` (hybrid mode): under GIN each rank meets only the ranks it exchanges data with, its node and its rail
/// (the ranks of the same local index, `p % S_u == rank % S_u`): every byte a hybrid kernel puts to another node goes
/// to a rail peer, so "every writer into my regions has arrived" needs no other rank, and the GIN device communicator
/// can use a RAIL connection (DeepEP's scale-up + rail scale-out barrier). The node and the rail are cliques (every
/// member meets every other), and each has its own arrival word (node: `barrier_arrivals`, rail: the word after
/// it), so neither count can pass an epoch before all of its members arrived (one shared count could: a rail peer
/// already in the next epoch would stand in for a node peer still missing). The envelopes are checked over the
/// same peers. Direct mode across nodes puts to every rank and keeps the full barrier (FULL connection).
template <int kNumScaleupRanks, bool kRailOnly = false, typename Transport, typename Scaleout>
EP_CORE_DEVICE bool hybrid_barrier(SyncContext<Transport>& sync, const Scaleout& so, int32_t tag,
                                   bool check_envelope = false) {
    if constexpr (!Scaleout::kStaged) {
        return sync.cross_rank_barrier(tag, check_envelope);
    } else {
        const OpArgs& args = sync.args;
        const Workspace& ws = sync.ws;
        const int num_ranks = sync.num_ranks;
        __syncthreads();
        const uint64_t epoch = *sync.sc.barrier_epoch() + 1;
        __syncthreads();
        if (threadIdx.x == 0)
            *sync.sc.barrier_epoch() = epoch;
        const int rank = static_cast<int>(args.rank);
        const int node = rank / kNumScaleupRanks;
        const int local = rank % kNumScaleupRanks;
        // rail-only: this node's ranks (node word) and one rank per other node (rail word)
        auto meets = [&](int p) { return !kRailOnly || p / kNumScaleupRanks == node || p % kNumScaleupRanks == local; };
        uint64_t* const node_word = ws.barrier_arrivals();
        uint64_t* const remote_word = kRailOnly ? ws.barrier_arrivals() + 1 : node_word;
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            if (!check_envelope)
                break;
            if (!meets(p))
                continue;
            if (p / kNumScaleupRanks == node)
                *reinterpret_cast<volatile uint64_t*>(sync.tr.sym_ptr(ws.envelopes(), p) + rank) = args.envelope;
            else
                so.put_value(ws.envelopes() + rank, args.envelope, p);
        }
        if (threadIdx.x < num_ranks)
            ptx::fence_sys();
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            if (!meets(p))
                continue;
            if (p / kNumScaleupRanks == node)
                ptx::red_add_release_sys(sync.tr.sym_ptr(node_word, p), 1ull);
            else
                so.signal(remote_word, 1ull, p);
        }
        if (threadIdx.x == 0 && *sync.s_abort == 0) {
            const int num_nodes = num_ranks / kNumScaleupRanks;
            // full: every rank on one word; rail-only: the node clique, then the rail clique (this rank excluded)
            const int64_t counts[2] = {kRailOnly ? kNumScaleupRanks : num_ranks, kRailOnly ? num_nodes - 1 : 0};
            uint64_t* const words[2] = {node_word, remote_word};
            for (int w = 0; w < 2 && *sync.s_abort == 0; ++w) {
                if (counts[w] == 0)
                    continue;
                const int64_t target = static_cast<int64_t>(epoch) * counts[w];
                uint64_t* counter = words[w];
                const bool ok = wait_until(
                    args, ws, tag, -1, static_cast<int64_t>(epoch), target,
                    [&] { return static_cast<int64_t>(ptx::ld_acquire_sys(counter)); },
                    [&](int64_t v) { return v >= target; }, [&] { sync.raise_abort(); });
                if (!ok)
                    *sync.s_abort = 1;
            }
        }
        __syncthreads();
        if (check_envelope && *sync.s_abort == 0)
            sync.check_envelopes(tag, meets);  // over the same peers
        return *sync.s_abort == 0;
    }
}

template <int kNumRanks, int kNumScaleupRanks, int kNumTopk, int kHiddenBytes, int kNumSfPacks, int kNumWarps,
          typename Transport, template <typename> class ScaleoutT>
EP_CORE_DEVICE void hybrid_dispatch_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, kNumSfPacks, kNumTopk, true>;
    using Scaleout = ScaleoutT<Transport>;
    constexpr int kSu = kNumScaleupRanks;
    constexpr int kNodes = kNumRanks / kSu;
    using Reg = HybridRegions<kNumRanks, kSu, kNumTopk>;
    constexpr int kMsgBytes = Tok::kNumBytes + align_up(4 * kNumTopk, kTokenAlignBytes);
    constexpr int kSlotBytes = align_up(kMsgBytes, 128);
    static_assert(kNumTopk >= 1 && kNumTopk <= 32, "top-k must be in [1, 32]");
    static_assert(kNumRanks % kSu == 0 && kNodes >= 2, "hybrid mode needs S_u to divide N, with >= 2 nodes");
    static_assert(kNodes <= kWarpSize * kNumWarps, "one waiting thread per source node");

    __shared__ int s_abort;
    __shared__ int s_sent[kNumRanks];
    __shared__ int s_expert[ep_layout::kNumMaxExperts];
    __shared__ int s_start[256];
    __shared__ int s_scan[kWarpSize];
    __shared__ int s_fwd[kNodes];
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
    const int node = rank / kSu;
    const int local = rank % kSu;
    const bool cached = (args.flags & kFlagCached) != 0;
    const bool det = !cached && (args.flags & kFlagDeterministic) != 0;
    const bool expand = (args.flags & kFlagExpand) != 0;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
    const Workspace& ws = sync.ws;
    const Scratch& sc = sync.sc;
    const Scaleout so(args, sync.tr);
    const Reg reg(args.recv_region, M, epr, Tok::kNumBytes, 0);
    const int W = sc.num_words;
    uint32_t* bits = sc.bits();
    uint32_t* prefix = sc.prefix();
    int32_t* const node_slot = hybrid_node_slot(sc);

    // 0. guard
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, ws) ? 1 : 0;
    if (lane == 0)
        ptx::mbarrier_init(&s_bars[warp], 1);
    uint8_t* const slot_buf = ep_dyn_smem + warp * kSlotBytes;
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

    const int global_warp = blockIdx.x * kNumWarps + warp;
    const int num_global_warps = gridDim.x * kNumWarps;

    // 1. count (deterministic): direct mode's bitmaps and input checks
    if (det)
        count_bitmaps<kNumRanks, kNumTopk>(args, sc, bits, W, T, global_warp, num_global_warps, lane, num_experts,
                                           epr);

    // 2. entry barrier (every rank of every node)
    if (blockIdx.x == 0 && !hybrid_barrier<kSu, true>(sync, so, kTagDispatchEntry, true))
        return;
    if (!sync.grid_sync())
        return;

    // 3. prefix (deterministic)
    if (det) {
        bitmap_prefix(bits, prefix, W, T, kNumRanks + num_experts, global_warp, num_global_warps, lane);
        if (!sync.grid_sync())
            return;
    }

    // 4. send: one message per (token, destination node), to the rail peer of that node
    const uint8_t* const x = static_cast<const uint8_t*>(args.x);
    const uint32_t* const sf = static_cast<const uint32_t*>(args.sf);
    for (int64_t t = global_warp; t < T; t += num_global_warps) {
        const Route r = route_token<kNumTopk>(args, sc, t, lane, num_experts, epr, !det, true);
        const Claim c = claim_token<kNumRanks, kNumTopk>(args, sc, r, t, lane, rank, M, cached, det, bits, prefix, W,
                                                         s_sent, s_expert);

        // node groups: the highest lane of each destination node sends the one message of that node
        const int dnode = r.valid ? r.dst / kSu : -1 - lane;
        const uint32_t same_node = __match_any_sync(kFullMask, dnode);
        const bool node_master = r.valid && (31 - __clz(same_node)) == lane;
        const int peer = r.valid ? dnode * kSu + local : 0;
        uint8_t* msg_local = nullptr;
        uint8_t* msg_stage = nullptr;
        uint8_t* msg_dst = nullptr;
        if (node_master) {
            const int q = atomicAdd(node_slot + dnode, 1);
            msg_local = reg.message(node, q);  // on the peer: [source node = this node][q]
            msg_stage = reg.send_stage(dnode, q);
            msg_dst = so.dst(msg_local, peer, msg_stage);
        }

        ptx::bulk_wait_read();
        __syncwarp();
        if (lane == 0) {
            ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
            ptx::bulk_load(slot_buf, x + t * args.x_stride, Tok::kHiddenBytes, bar);
        }
        stage_tail<Tok>(slot_buf, args, sf, t, lane, r.expert, c.weight, c.position, rank, M);
        if (lane < kNumTopk)  // the message's destination slots, after the token
            reinterpret_cast<int32_t*>(slot_buf + Tok::kNumBytes)[lane] = r.master ? c.slot : -1;
        ptx::fence_async_shared();
        __syncwarp();
        ptx::mbarrier_wait(bar, phase);
        phase ^= 1u;
        if (node_master) {
            ptx::bulk_store(msg_dst, slot_buf, kMsgBytes);
            ptx::bulk_commit();
            if constexpr (Scaleout::kStaged) {
                ptx::bulk_wait_all();
                so.commit(msg_local, msg_stage, kMsgBytes, peer);
            }
        }
    }
    ptx::bulk_wait_all();

    flush_block_counts(sc, s_sent, s_expert, kNumRanks, num_experts, cached, num_threads);

    // 5. signal: count block, then put-then-signal per destination node
    if (!sync.grid_sync())
        return;
    if (det) {
        const int64_t total = static_cast<int64_t>(kNumRanks + num_experts) * W;
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * num_threads + threadIdx.x; i < total;
             i += static_cast<int64_t>(gridDim.x) * num_threads)
            bits[i] = 0u;
    }
    const int cnt_words = kSu + kSu * epr;
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < kNodes * cnt_words; i += num_threads) {
            const int j = i / cnt_words;
            const int w = i % cnt_words;
            const int v = w < kSu ? sc.sent_total()[j * kSu + w]
                                  : (cached ? 0 : sc.expert_total()[j * kSu * epr + (w - kSu)]);
            *so.dst(reg.counts(node) + w, j * kSu + local, reg.count_stage(j) + w) = v;
        }
        __syncthreads();
        if (threadIdx.x < kNodes)
            ptx::fence_sys();
        const bool skip = (args.flags & kFlagSkipScaleoutSignal) != 0;
        for (int j = threadIdx.x; j < kNodes; j += num_threads) {
            const int peer = j * kSu + local;
            if constexpr (Scaleout::kStaged)
                so.commit(reg.counts(node), reg.count_stage(j), reg.cnt_bytes, peer);
            if (!skip)
                so.signal(scaleout_signals(ws) + node, kCountValidFlag | static_cast<uint32_t>(node_slot[j]), peer);
            node_slot[j] = 0;
        }
        __syncthreads();
        for (int d = threadIdx.x; d < kNumRanks; d += num_threads) {
            sc.sent_total()[d] = 0;
            sc.send_slot()[d] = 0;
        }
        if (!cached)
            for (int i = threadIdx.x; i < num_experts; i += num_threads)
                sc.expert_total()[i] = 0;
    }

    // 6. forward: wait for every source node, then fan each message out inside this node
    for (int j = threadIdx.x; j < kNodes; j += num_threads) {
        uint64_t* word_ptr = scaleout_signals(ws) + j;
        uint64_t seen = 0;
        const bool ok = wait_until(
            args, ws, kTagScaleoutSignal, j * kSu + local,
            ep_layout::WorkspaceLayout::kScaleoutRankCountRecvOffset + 8 * j, static_cast<int64_t>(kCountValidFlag),
            [&] {
                seen = ptx::ld_acquire_sys(word_ptr);
                return static_cast<int64_t>(seen);
            },
            [&](int64_t v) { return v != 0; }, [&] { sync.raise_abort(); });
        if (ok)
            s_fwd[j] = static_cast<int>(seen & 0xffffffffull);
        else
            s_abort = 1;
    }
    __syncthreads();
    if (s_abort != 0)
        return;
    int64_t num_msgs = 0;
    for (int j = 0; j < kNodes; ++j)
        num_msgs += s_fwd[j];
    const int64_t fwd_stride = (M + 1) * (kNumTopk + 1);
    for (int64_t f = global_warp; f < num_msgs; f += num_global_warps) {
        int j = 0;
        int64_t q = f;
        while (q >= s_fwd[j]) {
            q -= s_fwd[j];
            ++j;
        }
        const uint8_t* msg = reg.message(j, q);
        int expert = -1, slot = -1;
        if (lane < kNumTopk) {
            expert = __ldcg(reinterpret_cast<const int*>(msg + Tok::kTopkIdxOffset) + lane);
            slot = __ldcg(reinterpret_cast<const int*>(msg + Tok::kNumBytes) + lane);
        }
        const int src_idx = __ldcg(reinterpret_cast<const int*>(msg + Tok::kSrcIdxOffset));
        const int64_t src_rank = src_idx / M;
        const int d = expert >= 0 ? expert / epr : -1;
        const bool target = expert >= 0 && d / kSu == node && slot >= 0;
        uint8_t* my_dst = target ? peer_recv[d] + (src_rank * M + slot) * static_cast<int64_t>(Tok::kNumBytes) : nullptr;
        warp_copy_to_lanes<Tok::kNumBytes, true>(msg, my_dst, __ballot_sync(kFullMask, target), lane);
        int32_t* fwd = args.fwd_meta + j * fwd_stride + (1 + q) * (kNumTopk + 1);
        if (lane == 0)
            fwd[0] = src_idx;
        if (lane < kNumTopk)
            fwd[1 + lane] = expert;
    }

    // 7. publish per (source rank on this rail, destination rank of this node), after every block's stores
    if (!sync.grid_sync())
        return;
    if (blockIdx.x == 0) {
        for (int j = threadIdx.x; j < kNodes; j += num_threads) {
            scaleout_signals(ws)[j] = 0;
            args.fwd_meta[j * fwd_stride] = s_fwd[j];
        }
        if (!cached) {
            for (int i = threadIdx.x; i < kNodes * kSu * epr; i += num_threads) {
                const int j = i / (kSu * epr);
                const int w = i % (kSu * epr);
                const int s = j * kSu + local;
                const int d = node * kSu + w / epr;
                const int v = __ldcg(reg.counts(j) + kSu + w);
                sync.tr.sym_ptr(ws.recv_expert_count(), d)[s * epr + (w % epr)] =
                    kCountValidFlag | static_cast<uint32_t>(v);
            }
        }
        __syncthreads();
        if (threadIdx.x < kNodes * kSu)
            ptx::fence_sys();
        for (int i = threadIdx.x; i < kNodes * kSu; i += num_threads) {
            const int j = i / kSu;
            const int s = j * kSu + local;
            const int d = node * kSu + i % kSu;
            const int v = __ldcg(reg.counts(j) + i % kSu);
            ptx::st_release_sys(sync.tr.sym_ptr(ws.recv_rank_count(), d) + s,
                                kCountValidFlag | static_cast<uint32_t>(v));
        }

        // 8. receive: as direct mode, then the region prefix sums
        wait_source_counts<kNumRanks>(args, sync, s_sent, &s_abort, num_threads);
        __syncthreads();
        if (s_abort != 0)
            return;
        if (threadIdx.x == 0) {
            int32_t* psum_src = hybrid_psum_src(sc);
            int acc = 0;
            for (int g = 0; g < kSu; ++g) {
                for (int j = 0; j < kNodes; ++j) {
                    acc += s_sent[j * kSu + g];
                    psum_src[g * kNodes + j] = acc;
                }
                if (!cached)
                    args.psum_rank[g] = acc;
            }
        }
        if (!cached) {
            const int64_t A = args.expert_alignment;
            sum_expert_counts<kNumRanks>(ws, s_expert, s_start, epr, A, num_threads);
            write_expert_layout<kNumRanks>(args, ws, sc, s_expert, s_start, s_scan, epr, A, expand, num_threads);
        }
    }
    sync.grid_exit();
}

template <int kNumRanks, int kNumScaleupRanks, int kNumTopk, int kHiddenBytes, int kNumWarps, typename Transport,
          template <typename> class ScaleoutT>
EP_CORE_DEVICE void hybrid_combine_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, 0, kNumTopk, false>;
    using Scaleout = ScaleoutT<Transport>;
    constexpr int kSu = kNumScaleupRanks;
    constexpr int kNodes = kNumRanks / kSu;
    constexpr int kMetaCols = kNumTopk + 2;
    static_assert(kNumRanks % kSu == 0 && kNodes >= 2, "hybrid mode needs S_u to divide N, with >= 2 nodes");
    __shared__ int s_abort;
    __shared__ int s_fwd[kNodes];
    __shared__ const uint8_t* s_ops[kNumWarps][kWarpSize];
    __shared__ uint8_t* s_peer_region[PeerPointers<kNumRanks, Transport>::kTableSize];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int64_t T = args.num_tokens;
    const int rank = static_cast<int>(args.rank);
    const int node = rank / kSu;
    const bool expand = (args.flags & kFlagExpand) != 0;
    const bool amr = (args.flags & kFlagMultipleReduction) != 0;
    const bool lane_level = expand && !amr;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
    const Scaleout so(args, sync.tr);
    const HybridRegions<kNumRanks, kSu, kNumTopk> reg(args.recv_region, M, epr, 0, Tok::kNumBytes);
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, sync.ws) ? 1 : 0;
    uint8_t* const region = static_cast<uint8_t*>(args.recv_region);
    const PeerPointers<kNumRanks, Transport> peer_region{s_peer_region, sync.tr, region};
    peer_region.fill();
    for (int j = threadIdx.x; j < kNodes; j += blockDim.x)
        s_fwd[j] = args.fwd_meta[j * (M + 1) * (kNumTopk + 1)];
    __syncthreads();
    if (s_abort != 0)
        return;

    // 1. entry
    if (blockIdx.x == 0 && !hybrid_barrier<kSu, true>(sync, so, kTagCombineEntry, true))
        return;
    if (!sync.grid_sync())
        return;

    const int global_warp = blockIdx.x * kNumWarps + warp;
    const int num_global_warps = gridDim.x * kNumWarps;
    const uint8_t* const x = static_cast<const uint8_t*>(args.comb_x);
    const int64_t R = args.psum_rank[kSu - 1];

    // 2. level 1: every received row to the stage of its forwarder (a rank of this node)
    for (int64_t i = global_warp; i < R; i += num_global_warps) {
        const int32_t* meta = args.src_metadata + i * kMetaCols;
        const int m0 = meta[0], m1 = meta[1];
        const int src_rank = static_cast<int>(m0 / M);
        const int64_t src_token = m0 % M;
        const int master = m1 % kNumTopk;
        uint8_t* const fwd_region = peer_region[node * kSu + src_rank % kSu];
        auto stage_ptr = [&](int l) { return fwd_region + reg.stage_offset(l, src_rank / kSu, src_token); };
        if (!expand) {
            uint8_t* dst = stage_ptr(master);
            uint8_t* dsts[kFanout] = {dst};
            warp_copy_fanout<Tok::kHiddenBytes>(x + i * static_cast<int64_t>(Tok::kHiddenBytes), dsts, 1, lane);
            if (args.comb_weights != nullptr && lane < kNumTopk)
                reinterpret_cast<float*>(dst + Tok::kWeightsOffset)[lane] = args.comb_weights[i * kNumTopk + lane];
        } else {
            const int row = lane < kNumTopk ? meta[2 + lane] : -1;
            const uint32_t rows = __ballot_sync(kFullMask, row >= 0);
            const uint8_t* my_src = row >= 0 ? x + static_cast<int64_t>(row) * Tok::kHiddenBytes : nullptr;
            if (amr) {
                uint8_t* dst = stage_ptr(master);
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
            } else {
                for (uint32_t m = rows; m != 0; m &= m - 1) {
                    const int l = __ffs(m) - 1;
                    const uint8_t* src = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), l));
                    uint8_t* dsts[kFanout] = {stage_ptr(l)};
                    warp_copy_fanout<Tok::kHiddenBytes>(src, dsts, 1, lane);
                }
            }
        }
    }

    // 3. every stage of this node is complete
    if (!sync.grid_sync())
        return;
    if (blockIdx.x == 0 && !hybrid_barrier<kSu, true>(sync, so, kTagCombineForward))
        return;
    if (!sync.grid_sync())
        return;

    // 4. forward: level 2 per node (or relay), put to the source's final region [rep lane][token]
    int64_t num_fwd = 0;
    for (int j = 0; j < kNodes; ++j)
        num_fwd += s_fwd[j];
    const int64_t fwd_stride = (M + 1) * (kNumTopk + 1);
    for (int64_t f = global_warp; f < num_fwd; f += num_global_warps) {
        int j = 0;
        int64_t q = f;
        while (q >= s_fwd[j]) {
            q -= s_fwd[j];
            ++j;
        }
        const int32_t* fwd = args.fwd_meta + j * fwd_stride + (1 + q) * (kNumTopk + 1);
        const int src_idx = fwd[0];
        const int src_rank = static_cast<int>(src_idx / M);
        const int64_t t = src_idx % M;
        const int e = lane < kNumTopk ? fwd[1 + lane] : -1;
        const int d = e >= 0 ? e / epr : -1;
        const bool mine = e >= 0 && d / kSu == node;
        const uint32_t same_rank = __match_any_sync(kFullMask, mine ? d : -1 - lane);
        const int master = 31 - __clz(same_rank);
        const bool is_master = mine && master == lane;
        const uint32_t mine_mask = __ballot_sync(kFullMask, mine);
        const int rep = mine_mask != 0 ? 31 - __clz(mine_mask) : 0;
        const uint8_t* my_stage = mine ? region + reg.stage_offset(lane_level ? lane : master, j, t) : nullptr;
        auto out_stage = [&](int l) { return region + reg.comb_send_offset(j, l, t); };
        auto out_ptr = [&](int l) {
            return so.dst(region + reg.final_offset(l, t), src_rank, out_stage(l));
        };
        // the call's flag, not this rank's pointer: a rank that received nothing passes an empty (null) weights array
        const bool with_weights = !lane_level && (args.flags & kFlagCombineWeights) != 0;
        uint32_t outs = 0;  // final slots written (committed below)
        if (amr) {
            const uint32_t ops = __ballot_sync(kFullMask, is_master);
            uint8_t* dst = out_ptr(rep);
            warp_ordered_sum<Tok::kHiddenBytes, true>(is_master ? my_stage : nullptr, ops, nullptr, nullptr, dst,
                                                       s_ops[warp], lane);
            outs = 1u << rep;
        } else {
            const uint32_t ops = __ballot_sync(kFullMask, lane_level ? mine : is_master);
            for (uint32_t m = ops; m != 0; m &= m - 1) {
                const int l = __ffs(m) - 1;
                const uint8_t* src = reinterpret_cast<const uint8_t*>(
                    __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_stage), l));
                uint8_t* dsts[kFanout] = {out_ptr(l)};
                warp_copy_fanout<Tok::kHiddenBytes, 8, true>(src, dsts, 1, lane);
            }
            outs = ops;
        }
        if (with_weights && mine) {
            const uint8_t* owner = region + reg.stage_offset(master, j, t);
            const float w = *reinterpret_cast<const volatile float*>(owner + Tok::kWeightsOffset + 4 * lane);
            reinterpret_cast<float*>(out_ptr(rep) + Tok::kWeightsOffset)[lane] = w;
        }
        if constexpr (Scaleout::kStaged) {
            __syncwarp();
            if (lane < kNumTopk && ((outs >> lane) & 1u))
                so.commit(region + reg.final_offset(lane, t), out_stage(lane), Tok::kNumBytes, src_rank);
        }
    }

    // 5. exit: every partial has landed at its source
    if (!sync.grid_sync())
        return;
    if (blockIdx.x == 0 && !hybrid_barrier<kSu, true>(sync, so, kTagCombineExit))
        return;
    if (!sync.grid_sync())
        return;

    // 6. reduce at the source: operands per destination node (rank / lane without multiple reduction)
    uint8_t* const out = static_cast<uint8_t*>(args.combined_x);
    const uint8_t* const bias0 = static_cast<const uint8_t*>(args.bias0);
    const uint8_t* const bias1 = static_cast<const uint8_t*>(args.bias1);
    for (int64_t t = global_warp; t < T; t += num_global_warps) {
        int64_t e = -1;
        if (lane < kNumTopk)
            e = topk_id(args, t * kNumTopk + lane);
        const bool valid = e >= 0 && e < num_experts;
        const int dst_rank = valid ? static_cast<int>(e) / epr : -1 - lane;
        const int dst_node = valid ? dst_rank / kSu : -1 - lane;
        const int rank_master = 31 - __clz(__match_any_sync(kFullMask, dst_rank));
        const int node_rep = 31 - __clz(__match_any_sync(kFullMask, dst_node));
        const bool is_operand = lane_level ? valid : (valid && (amr ? node_rep : rank_master) == lane);
        const uint32_t operands = __ballot_sync(kFullMask, is_operand);
        const uint8_t* my_src = is_operand ? region + reg.final_offset(lane, t) : nullptr;
        const int64_t row_off = t * static_cast<int64_t>(Tok::kHiddenBytes);
        warp_ordered_sum<Tok::kHiddenBytes, true>(my_src, operands, bias0 != nullptr ? bias0 + row_off : nullptr,
                                                   bias1 != nullptr ? bias1 + row_off : nullptr, out + row_off,
                                                   s_ops[warp], lane);
        if (args.combined_weights != nullptr && lane < kNumTopk) {
            float w = 0.0f;
            if (valid) {
                const uint8_t* tok = region + reg.final_offset(node_rep, t);
                w = *reinterpret_cast<const volatile float*>(tok + Tok::kWeightsOffset + 4 * lane);
            }
            args.combined_weights[t * kNumTopk + lane] = w;
        }
    }
    sync.grid_exit();
}

}  // namespace ep_core
