// SPDX-License-Identifier: Apache-2.0
/// \file combine.cuh
/// \brief Direct-mode combine kernel: send every received row back to its source slot, meet every rank, then
/// reduce on the home rank in the exact order of SPEC §3.
///
/// Roles, in order (grid barriers between phases):
///  0. guard   a block that finds this rank's abort flag raised leaves at once (timeout.cuh, failure rule).
///  1. entry   block 0 meets every rank (peers are done reading their regions: the same bytes hold dispatch tokens),
///             then a grid barrier; none with one rank.
///  2. send    warp per received token i: slot on the source = [rank layout ? own rank : master lane][src token]
///             (expand without multiple reduction: one slot per lane). Expand with multiple reduction sums the
///             token's rows first (fp32, ascending lane, one bf16 rounding; a single row is sent as is).
///  3. exit    every block arrives (system fence), the last one meets every rank for the grid, every block waits
///             for every rank (all rows have landed): `grid_cross_rank_barrier`, one hop instead of three.
///  4. reduce  warp per own token t: acc = bias0, + bias1, then the operands in ascending order of their
///             representative (highest) lane, in fp32, one bf16 rounding; combined weights gathered per lane.
/// Split launch (prefer_overlap_with_compute=False, DirectRank.combine): `kFlagCombineSendOnly` runs roles 0-3 on the
/// op's SMs and leaves; `kFlagCombineReduceOnly`, launched after it on the same stream on a wider grid, runs roles
/// 0 and 4 (the rows and local references it reads were complete when the send-only launch completed).
/// With dynamic shared memory (KernelConfig.combine_dynamic_smem_bytes: one row per warp), rows that are copied as
/// they are go through bulk copies (load into the warp's slot, store from it) and the reduction stages its terms
/// there by bulk copies (`warp_staged_sum`); the arithmetic and its order are the same, so are the bits.
/// Zero-copy (`kZeroCopy`, entry point `ep_combine_zero_copy_impl`; direct mode, non-expanded handles): every rank's
/// rows already sit in its combine buffer (the first rows of its receive region, in its received order, written
/// there by the caller instead of passed as `comb_x`). Role 1 first publishes where each source's rows start
/// (`Workspace::combine_row_base`, the handle's prefix), roles 2-3 are skipped (nothing moves), the reduce reads each
/// operand from its rank's buffer at that base plus the slot the dispatch gave the token (`dst_slot`), and a last
/// `grid_cross_rank_barrier` keeps every buffer unchanged until all ranks have read it. One pass over the rows
/// instead of two; the same operands in the same order, so the same bits.
#pragma once

#include <cuda_bf16.h>

#include "barrier.cuh"
#include "token.cuh"

namespace ep_core {

/// fp32 accumulator of 8 bf16 values (one 16-byte vector).
struct Acc8 {
    float v[8];

    EP_CORE_DEVICE void set(const uint4& u) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
    EP_CORE_DEVICE void add(const uint4& u) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] += __uint_as_float(w[k] << 16);
            v[2 * k + 1] += __uint_as_float(w[k] & 0xffff0000u);
        }
    }
    EP_CORE_DEVICE uint4 to_bf16() const {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
            w[k] = *reinterpret_cast<const uint32_t*>(&h);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

/// Warp-wide ordered sum of bf16 rows: the rows are named by the lanes set in `mask`, summed in ascending lane
/// order (each lane holding its row pointer in `my_src`); optional biases come first. Writes bf16 to `dst`.
/// `s_ops` is this warp's shared scratch of 32 pointers. `kPeerData`: rows were written by peers in this launch
/// (L2 loads) rather than being kernel inputs.
///
/// Latency: each lane owns kPos 16-byte positions at a time (stride 32 vectors) and loads them for kOpBatch
/// operands before adding, so one memory round trip covers kPos x kOpBatch vectors instead of one position's
/// operands. Every element still sees bias0, bias1, then the operands in ascending order, in fp32, one rounding:
/// the same bits as a position-at-a-time loop.
template <int kBytes, bool kPeerData>
EP_CORE_DEVICE void warp_ordered_sum(const uint8_t* my_src, uint32_t mask, const uint8_t* bias0, const uint8_t* bias1,
                                     uint8_t* dst, const uint8_t** s_ops, int lane) {
    constexpr int kVecs = kBytes / 16;
    constexpr int kPos = 4;
    constexpr int kOpBatch = 2;  // 4 x 2 vectors in flight per lane: the most that fits 128 registers unspilled
    constexpr int kStride = kWarpSize * 16;  // bytes between a lane's positions
    if (mask & (1u << lane))
        s_ops[__popc(mask & ((1u << lane) - 1u))] = my_src;
    __syncwarp();
    const int num_ops = __popc(mask);
#pragma unroll 1
    for (int i0 = lane; i0 < kVecs; i0 += kWarpSize * kPos) {
        const int64_t off = static_cast<int64_t>(i0) * 16;
        Acc8 acc[kPos];
        bool have = false;
        if (bias0 != nullptr) {
            const uint8_t* p = bias0 + off;
            uint4 b[kPos];
            unroll<kPos>([&](auto u) {
                if (i0 + u.value * kWarpSize < kVecs)
                    b[u.value] = ptx::ld_nc_v4_at<u.value * kStride>(p);
            });
#pragma unroll
            for (int u = 0; u < kPos; ++u)
                acc[u].set(b[u]);
            have = true;
        }
        if (bias1 != nullptr) {
            const uint8_t* p = bias1 + off;
            uint4 b[kPos];
            unroll<kPos>([&](auto u) {
                if (i0 + u.value * kWarpSize < kVecs)
                    b[u.value] = ptx::ld_nc_v4_at<u.value * kStride>(p);
            });
#pragma unroll
            for (int u = 0; u < kPos; ++u) {
                if (have)
                    acc[u].add(b[u]);
                else
                    acc[u].set(b[u]);
            }
            have = true;
        }
#pragma unroll 1
        for (int base = 0; base < num_ops; base += kOpBatch) {
            uint4 v[kOpBatch][kPos];
#pragma unroll
            for (int j = 0; j < kOpBatch; ++j) {
                if (base + j < num_ops) {
                    const uint8_t* p = s_ops[base + j] + off;
                    unroll<kPos>([&](auto u) {
                        if (i0 + u.value * kWarpSize < kVecs)
                            v[j][u.value] = kPeerData ? ptx::ld_cg_v4_at<u.value * kStride>(p)
                                                      : ptx::ld_nc_v4_at<u.value * kStride>(p);
                    });
                }
            }
#pragma unroll
            for (int j = 0; j < kOpBatch; ++j) {
                if (base + j < num_ops) {
#pragma unroll
                    for (int u = 0; u < kPos; ++u) {
                        if (have)
                            acc[u].add(v[j][u]);
                        else
                            acc[u].set(v[j][u]);
                    }
                    have = true;
                }
            }
        }
        uint8_t* const q = dst + off;
        unroll<kPos>([&](auto u) {
            if (i0 + u.value * kWarpSize < kVecs)
                ptx::st_v4_at<u.value * kStride>(q, have ? acc[u.value].to_bf16() : make_uint4(0, 0, 0, 0));
        });
    }
    __syncwarp();
}

/// Bytes of one warp's shared-memory slot in the staged combine (ep_core.kernels.plan
/// `KernelConfig.combine_dynamic_smem_bytes` gives the launch kNumWarps of them, or none).
template <int kBytes>
__host__ __device__ constexpr int combine_slot_bytes() {
    return align_up(kBytes, 128);
}

/// `warp_ordered_sum` staged through this warp's shared-memory slot: the terms (bias0, bias1, then the operand rows
/// in ascending lane order) are brought in by bulk copies, chunk by chunk (a chunk of every term fills the slot),
/// then summed from shared memory exactly as `warp_ordered_sum` does: first term widened, the others added in order
/// in fp32, one bf16 rounding; no term: zeros. Far more bytes in flight per warp than registers allow (a 7168-wide
/// row with one term is one round trip instead of seven). Returns false, having done nothing, when a chunk of
/// every term cannot fit the slot (more than kSlot / 16 terms); the caller then uses `warp_ordered_sum`.
/// `phase`: the warp's mbarrier parity, flipped per chunk.
/// `kSlotBytes`: the slot's size (a row's by default; a part of a row may use the whole slot).
template <int kBytes, int kSlotBytes = combine_slot_bytes<kBytes>()>
EP_CORE_DEVICE bool warp_staged_sum(const uint8_t* my_src, uint32_t mask, const uint8_t* bias0, const uint8_t* bias1,
                                    uint8_t* dst, const uint8_t** s_ops, uint8_t* slot, uint64_t* bar,
                                    uint32_t& phase, int lane) {
    constexpr int kSlot = kSlotBytes;
    const int nb = (bias0 != nullptr ? 1 : 0) + (bias1 != nullptr ? 1 : 0);
    const int num_ops = __popc(mask);
    const int terms = nb + num_ops;
    if (terms * 16 > kSlot)
        return false;
    if (mask & (1u << lane))
        s_ops[__popc(mask & ((1u << lane) - 1u))] = my_src;
    __syncwarp();
    if (terms == 0) {
        warp_zero<kBytes>(dst, lane);
        return true;
    }
    auto term = [&](int j) -> const uint8_t* {
        if (j < nb)
            return j == 0 ? (bias0 != nullptr ? bias0 : bias1) : bias1;
        return s_ops[j - nb];
    };
    int n = (terms * kBytes + kSlot - 1) / kSlot;
    int chunk = align_up((kBytes + n - 1) / n, 16);
    while (terms * chunk > kSlot) {
        ++n;
        chunk = align_up((kBytes + n - 1) / n, 16);
    }
#pragma unroll 1
    for (int c0 = 0; c0 < kBytes; c0 += chunk) {
        const int bytes = const_min(chunk, kBytes - c0);
        // the previous chunk's shared reads are done before the bulk copies overwrite the slot
        ptx::fence_async_shared();
        __syncwarp();
        if (lane == 0) {
            ptx::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(terms * bytes));
            for (int j = 0; j < terms; ++j)
                ptx::bulk_load(slot + j * chunk, term(j) + c0, static_cast<uint32_t>(bytes), bar);
        }
        ptx::mbarrier_wait(bar, phase);
        phase ^= 1u;
#pragma unroll 1
        for (int i = lane; i < bytes / 16; i += kWarpSize) {
            Acc8 acc;
            acc.set(ptx::ld_shared_v4(slot + i * 16));
            for (int j = 1; j < terms; ++j)
                acc.add(ptx::ld_shared_v4(slot + j * chunk + i * 16));
            ptx::st_v4(dst + c0 + static_cast<int64_t>(i) * 16, acc.to_bf16());
        }
    }
    __syncwarp();
    return true;
}

/// Column parts of one token's reduction, a JIT switch (`EP_CORE_COMBINE_REDUCE_PARTS`, ep_core.kernels._source;
/// issue 17; the JIT build always defines it, by default 4 where the row splits into 4 whole 16-byte vectors, else
/// 1; undefined here: 1): 1 reduces whole rows, one token per warp. With P > 1, when the grid has fewer warps W than
/// tokens T but T <= P x W (decode: EP8 at 8 SMs is 120 warps for 128 tokens, so 8 warps reduce a second token
/// alone, a latency-bound tail as long as the first round), the unit of work is (token, part of its columns): T x P
/// units over W warps, ceil(T P / W) / P row-times instead of ceil(T / W). Every element still sums the same terms
/// in the same order (the parts only choose which warp does which columns): the same bits.
#ifdef EP_CORE_COMBINE_REDUCE_PARTS
constexpr int kCombineReduceParts = EP_CORE_COMBINE_REDUCE_PARTS;
#else
constexpr int kCombineReduceParts = 1;
#endif

/// Local rows by reference, a JIT switch (`EP_CORE_COMBINE_LOCAL_REF`, ep_core.kernels._source; issue 17; the JIT build
/// always defines it, on by default; undefined here: off): off copies every row that is sent as it is into its slot on
/// the source, also when the source is this rank. On: a row whose source token is on this rank (every row at EP1) and
/// that is sent as it is (not expanded, or expanded without multiple reduction: one row per lane) leaves only its
/// address (8 bytes at the slot's start; the weights as before); the reduce of that operand (dst rank == own rank, same
/// two layouts) reads the address and sums the caller's row itself. The terms, their order and the arithmetic are
/// unchanged: the same bits, without the 14 KB store and reload per such row (EP1: the whole send phase's traffic; EP8:
/// about 1/8 of it).
#ifdef EP_CORE_COMBINE_LOCAL_REF
constexpr bool kCombineLocalRef = EP_CORE_COMBINE_LOCAL_REF != 0;
#else
constexpr bool kCombineLocalRef = false;
#endif

template <int kNumRanks, int kNumTopk, int kHiddenBytes, int kNumWarps, typename Transport, bool kZeroCopy = false>
EP_CORE_DEVICE void combine_impl(const OpArgs& args) {
    using Tok = TokenShape<kHiddenBytes, 0, kNumTopk, false>;
    constexpr int kMetaCols = kNumTopk + 2;
    __shared__ int s_abort;
    __shared__ const uint8_t* s_ops[kNumWarps][kWarpSize];
    __shared__ uint8_t* s_peer_region[PeerPointers<kNumRanks, Transport>::kTableSize];
    __shared__ __align__(8) uint64_t s_bars[kNumWarps];
    extern __shared__ __align__(128) uint8_t ep_dyn_smem[];

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(args.num_experts);
    const int epr = num_experts / kNumRanks;
    const int64_t M = args.num_max_tokens;
    const int64_t T = args.num_tokens;
    const int rank = static_cast<int>(args.rank);
    const bool expand = (args.flags & kFlagExpand) != 0;
    const bool amr = (args.flags & kFlagMultipleReduction) != 0;
    const bool rank_layout = (args.flags & kFlagRankLayout) != 0;
    const bool lane_level = expand && !amr;
    const bool reduce_only = (args.flags & kFlagCombineReduceOnly) != 0;

    SyncContext<Transport> sync{args, Workspace{static_cast<uint8_t*>(args.workspace)},
                                Scratch(args.scratch, kNumRanks, num_experts, M), Transport(args), kNumRanks, 0u,
                                &s_abort};
#if EP_PHASE_ON
    sync.phase_kernel = kPhaseCombine;
#endif
    EP_PHASE_FIRST(kPhaseCombine, kCbStart);
    // 0. guard: an earlier failure left the abort flag raised -> publish it and leave (outputs untouched)
    if (threadIdx.x == 0)
        s_abort = entry_aborted(args, sync.ws) ? 1 : 0;
    uint8_t* const region = static_cast<uint8_t*>(args.recv_region);
    const PeerPointers<kNumRanks, Transport> peer_region{s_peer_region, sync.tr, region};
    peer_region.fill();
    // staged path (bulk copies through one shared slot per warp) when the launch gave the shared memory
    constexpr int kSlot = combine_slot_bytes<Tok::kHiddenBytes>();
    // (zero-copy: the register path, whose loads read peers' memory the way they read this rank's)
    const bool staged = !kZeroCopy && ptx::dynamic_smem_size() >= static_cast<uint32_t>(kNumWarps * kSlot);
    uint8_t* const slot_buf = ep_dyn_smem + warp * kSlot;
    uint64_t* const bar = &s_bars[warp];
    uint32_t phase = 0;
    if (staged && lane == 0)
        ptx::mbarrier_init(bar, 1);
    __syncthreads();
    if (s_abort != 0)
        return;
    EP_PHASE_MARK(kPhaseCombine, kCbSetup);

    const int global_warp = work_warp_index(warp, kNumWarps);
    const int num_global_warps = gridDim.x * kNumWarps;
    if (!reduce_only) {  // roles 1-3 (a reduce-only launch follows a send-only one that ran them)
        // 1. entry (one rank alone: no peer reads its region, its own epilogue is stream-ordered: no barrier)
        if constexpr (kNumRanks > 1) {
            if constexpr (kZeroCopy) {
                // where each source's rows start in this rank's buffer, for that source to read after the barrier
                if (blockIdx.x == 0)
                    for (int src = threadIdx.x; src < kNumRanks; src += blockDim.x)
                        sync.ws.combine_row_base()[src] = src == 0 ? 0 : static_cast<uint64_t>(args.psum_rank[src - 1]);
            }
            if (blockIdx.x == 0 && !sync.cross_rank_barrier(kTagCombineEntry, true))
                return;
            EP_PHASE_MARK(kPhaseCombine, kCbEntry);
            if (!sync.grid_sync(false))  // nothing written yet
                return;
        }

        if constexpr (!kZeroCopy) {  // roles 2-3 (zero-copy: the rows stay where they are)
            const uint8_t* const x = static_cast<const uint8_t*>(args.comb_x);
            const int64_t R = args.psum_rank[kNumRanks - 1];

            // a row as it is to one destination: bulk load into the slot, bulk store from it (staged), else by
            // registers
            auto send_row = [&](const uint8_t* src, uint8_t* dst) {
                if (staged) {
                    // the slot is free once the previous row's store has read it (and, after a staged sum, once the
                    // lanes' shared reads are ordered before the bulk copy's writes)
                    ptx::bulk_wait_read();
                    ptx::fence_async_shared();
                    __syncwarp();
                    if (lane == 0) {
                        ptx::mbarrier_arrive_expect_tx(bar, Tok::kHiddenBytes);
                        ptx::bulk_load(slot_buf, src, Tok::kHiddenBytes, bar);
                    }
                    ptx::mbarrier_wait(bar, phase);
                    phase ^= 1u;
                    if (lane == 0) {
                        ptx::bulk_store(dst, slot_buf, Tok::kHiddenBytes);
                        ptx::bulk_commit();
                    }
                } else {
                    uint8_t* dsts[kFanout] = {dst};
                    warp_copy_fanout<Tok::kHiddenBytes>(src, dsts, 1, lane);
                }
            };

            // 2. send
            for (int64_t i = global_warp; i < R; i += num_global_warps) {
                const int32_t* meta = args.src_metadata + i * kMetaCols;
                const int m0 = meta[0], m1 = meta[1];
                const int src_rank = static_cast<int>(m0 / M);
                const int64_t src_token = m0 % M;
                const int master = m1 % kNumTopk;
                uint8_t* const src_region = peer_region[src_rank];
                auto slot_ptr = [&](int slot) {
                    return src_region + (slot * M + src_token) * static_cast<int64_t>(Tok::kNumBytes);
                };
                // a local row (kCombineLocalRef): its address in the slot instead of its bytes
                auto send_or_refer = [&](const uint8_t* src, uint8_t* dst) {
                    if (kCombineLocalRef && src_rank == rank) {
                        if (lane == 0)
                            *reinterpret_cast<const uint8_t**>(dst) = src;
                    } else {
                        send_row(src, dst);
                    }
                };
                if (!expand) {
                    uint8_t* dst = slot_ptr(rank_layout ? rank : master);
                    send_or_refer(x + i * static_cast<int64_t>(Tok::kHiddenBytes), dst);
                    if (args.comb_weights != nullptr && lane < kNumTopk)
                        reinterpret_cast<float*>(dst + Tok::kWeightsOffset)[lane] =
                            args.comb_weights[i * kNumTopk + lane];
                } else {
                    const int row = lane < kNumTopk ? meta[2 + lane] : -1;
                    const uint32_t rows = __ballot_sync(kFullMask, row >= 0);
                    const uint8_t* my_src = row >= 0 ? x + static_cast<int64_t>(row) * Tok::kHiddenBytes : nullptr;
                    if (amr) {
                        uint8_t* dst = slot_ptr(rank_layout ? rank : master);
                        if (__popc(rows) == 1) {
                            const uint8_t* src = reinterpret_cast<const uint8_t*>(
                                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), __ffs(rows) - 1));
                            send_row(src, dst);
                        } else {
                            bool done = false;
                            if (staged) {
                                ptx::bulk_wait_read();  // the slot is free once the previous row's store has read it
                                __syncwarp();
                                done = warp_staged_sum<Tok::kHiddenBytes>(my_src, rows, nullptr, nullptr, dst,
                                                                          s_ops[warp], slot_buf, bar, phase, lane);
                            }
                            if (!done)
                                warp_ordered_sum<Tok::kHiddenBytes, false>(my_src, rows, nullptr, nullptr, dst,
                                                                           s_ops[warp], lane);
                        }
                        if (args.comb_weights != nullptr && lane < kNumTopk)
                            reinterpret_cast<float*>(dst + Tok::kWeightsOffset)[lane] =
                                row >= 0 ? args.comb_weights[row] : 0.0f;
                    } else {
                        for (uint32_t m = rows; m != 0; m &= m - 1) {
                            const int l = __ffs(m) - 1;
                            const uint8_t* src = reinterpret_cast<const uint8_t*>(
                                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), l));
                            send_or_refer(src, slot_ptr(l));
                        }
                    }
                }
            }

            // 3. exit: every rank's rows have landed here (this warp's bulk stores complete before its block arrives)
            ptx::bulk_wait_all();
            EP_PHASE_MARK(kPhaseCombine, kCbSendB0);
            EP_PHASE_LAST(kPhaseCombine, kCbSendLast);
            if constexpr (kNumRanks == 1) {
                if (!sync.grid_sync(false))  // one rank: the rows came from its own blocks, to its own memory
                    return;
            } else {
                if (!sync.grid_cross_rank_barrier(kTagCombineExit))
                    return;
            }
            if (args.flags & kFlagCombineSendOnly) {
                sync.grid_exit();
                return;
            }
        }
    }  // !reduce_only
    EP_PHASE_MARK(kPhaseCombine, kCbExit);

    // 4. reduce (staged: the rows peers wrote, acquired above, are read by bulk copies: order the acquire first)
    if (staged)
        ptx::fence_async_global();
    uint8_t* const out = static_cast<uint8_t*>(args.combined_x);
    const uint8_t* const bias0 = static_cast<const uint8_t*>(args.bias0);
    const uint8_t* const bias1 = static_cast<const uint8_t*>(args.bias1);
    constexpr int kParts = kCombineReduceParts;
    static_assert(kParts >= 1 && Tok::kHiddenBytes % (16 * kParts) == 0, "reduce parts: whole 16-byte vectors");
    constexpr int kPartBytes = Tok::kHiddenBytes / kParts;
    // split only for a tail: more tokens than warps, at most kParts per warp, not a whole number of rounds
    const bool split = kParts > 1 && num_global_warps < T && T <= kParts * static_cast<int64_t>(num_global_warps) &&
                       T % num_global_warps != 0;
    const int64_t num_units = split ? T * kParts : T;
    for (int64_t u = global_warp; u < num_units; u += num_global_warps) {
        const int64_t t = split ? u / kParts : u;
        const int part = split ? static_cast<int>(u % kParts) : 0;
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
        if constexpr (kZeroCopy) {
            // one operand per destination rank (non-expanded), at its master lane: the token's row in that rank's
            // buffer, its base for this rank plus the slot the dispatch gave the token there
            if (is_operand) {
                const int64_t slot = args.dst_slot[t * kNumTopk + lane] - static_cast<int64_t>(rank) * M;
                int64_t base = 0;
                if constexpr (kNumRanks > 1)
                    base = static_cast<int64_t>(*reinterpret_cast<const volatile uint64_t*>(
                        sync.tr.sym_ptr(sync.ws.combine_row_base(), dst_rank) + rank));
                my_src = peer_region[dst_rank] + (base + slot) * static_cast<int64_t>(Tok::kHiddenBytes);
            }
        }
        if constexpr (kCombineLocalRef && !kZeroCopy) {
            // this rank's own row was left by reference (send phase, same rule): its address, written before the
            // exit barrier by a block of this grid
            if (is_operand && dst_rank == rank && !(expand && amr))
                my_src = reinterpret_cast<const uint8_t*>(*reinterpret_cast<const volatile uint64_t*>(my_src));
        }
        const int64_t row_off = t * static_cast<int64_t>(Tok::kHiddenBytes);
        const uint8_t* const b0 = bias0 != nullptr ? bias0 + row_off : nullptr;
        const uint8_t* const b1 = bias1 != nullptr ? bias1 + row_off : nullptr;
        if constexpr (kParts > 1) {
            if (split) {
                // this unit's columns [part x kPartBytes, + kPartBytes) of every term (the whole slot stages them)
                const int64_t po = static_cast<int64_t>(part) * kPartBytes;
                const uint8_t* const src_p = my_src != nullptr ? my_src + po : nullptr;
                const uint8_t* const b0_p = b0 != nullptr ? b0 + po : nullptr;
                const uint8_t* const b1_p = b1 != nullptr ? b1 + po : nullptr;
                uint8_t* const dst_p = out + row_off + po;
                if (!staged || !warp_staged_sum<kPartBytes, kSlot>(src_p, operands, b0_p, b1_p, dst_p, s_ops[warp],
                                                                   slot_buf, bar, phase, lane))
                    warp_ordered_sum<kPartBytes, true>(src_p, operands, b0_p, b1_p, dst_p, s_ops[warp], lane);
            }
        }
        if (!split) {
            if (!staged || !warp_staged_sum<Tok::kHiddenBytes>(my_src, operands, b0, b1, out + row_off,
                                                               s_ops[warp], slot_buf, bar, phase, lane))
                warp_ordered_sum<Tok::kHiddenBytes, true>(my_src, operands, b0, b1, out + row_off, s_ops[warp],
                                                          lane);
        }
        if (!kZeroCopy && args.combined_weights != nullptr && part == 0 && lane < kNumTopk) {
            float w = 0.0f;
            if (valid) {
                const int owner = lane_level ? lane : (rank_layout ? dst_rank : master);
                const uint8_t* tok = region + (owner * M + t) * static_cast<int64_t>(Tok::kNumBytes);
                w = *reinterpret_cast<const volatile float*>(tok + Tok::kWeightsOffset + 4 * lane);
            }
            args.combined_weights[t * kNumTopk + lane] = w;
        }
    }
#if EP_PHASE_ON
    __syncthreads();
    EP_PHASE_MARK(kPhaseCombine, kCbReduceB0);
    EP_PHASE_LAST(kPhaseCombine, kCbReduceLast);
#endif
    if constexpr (kZeroCopy && kNumRanks > 1) {
        // 5. (zero-copy) every rank has read its operands: the buffers are their owners' again
        if (!sync.grid_cross_rank_barrier(kTagCombineRead))
            return;
    }
    sync.grid_exit();
}

}  // namespace ep_core
