// SPDX-License-Identifier: Apache-2.0
/// \file args.cuh
/// \brief `OpArgs`: the one by-value kernel parameter of every ep-core kernel, its mode flags, and the maps of the
/// symmetric workspace (cross-rank words) and of the rank-private scratch.
///
/// `OpArgs` is mirrored byte for byte by `ep_core.kernels._args` (every field is 8 bytes, in this order).
/// Pointers that an operation does not use are null. Element strides are in elements, not bytes.
#pragma once

#include <ep_layout/ep_layout.cuh>

#include "config.cuh"

namespace ep_core {

/// Mode bits of `OpArgs::flags`.
enum OpFlags : int64_t {
    kFlagExpand = 1 << 0,         ///< expand layout (one row per (token, local expert))
    kFlagCached = 1 << 1,         ///< cached dispatch: slots from the handle, no counting
    kFlagDeterministic = 1 << 2,  ///< slots and expanded rows from prefix sums (order by source token)
    kFlagZeroPadding = 1 << 3,    ///< zero the expand padding rows (x, scales, weights)
    kFlagSfColMajor = 1 << 4,     ///< output scales are column-major (strides given in sf_out_stride_*)
    kFlagTopkIdx32 = 1 << 5,      ///< top-k ids are int32 (default int64)
    kFlagMultipleReduction = 1 << 6,  ///< combine: reduce a token's expanded rows locally first
    kFlagRankLayout = 1 << 7,     ///< combine: receive slots per source rank (else per top-k lane)
    kFlagSkipScaleoutSignal = 1 << 8,  ///< hybrid dispatch, tests only: this rank never signals its rail peers
    kFlagCombineWeights = 1 << 9,  ///< combine: the call sends weights back (set on every rank alike, even one whose
                                   ///< weights array is empty, so a forwarder never judges by its own pointer)
    kFlagCombineSendOnly = 1 << 10,    ///< direct combine: entry, send and exit only (the reduce is launched apart)
    kFlagCombineReduceOnly = 1 << 11,  ///< direct combine: the reduce only, after a send-only launch on the stream
    kFlagCombineZeroCopy = 1 << 12,    ///< direct combine from the ranks' combine buffers (`ep_combine_zero_copy_impl`)
    kFlagDispatchZeroCopy = 1 << 13,   ///< direct dispatch into the outputs in place (`ep_dispatch_zero_copy_impl`)
};

/// Error kinds are ep_layout::ErrorKind (values pinned; the host decodes them).
using ErrorKind = ep_layout::ErrorKind;

/// Wait tags (diagnostics only).
enum WaitTag : int32_t {
    kTagGridBarrier = 1,
    kTagDispatchEntry = 2,
    kTagDispatchCounts = 3,
    kTagCombineEntry = 4,
    kTagCombineExit = 5,
    kTagScaleoutSignal = 6,  ///< hybrid dispatch: a forwarder waits for a source node's put-then-signal
    kTagCombineForward = 7,  ///< hybrid combine: every rank's level-1 rows have reached their forwarders
    kTagCombineRead = 8,     ///< zero-copy combine: every rank has read what it needs from its peers' buffers
};

struct OpArgs {
    // --- buffers of this rank
    void* workspace;         ///< own symmetric workspace (the `Workspace` map), peers reach it through sym_ptr
    void* recv_region;       ///< own symmetric receive region (dispatch tokens, then combine tokens)
    void* scratch;           ///< rank-private device scratch (the `Scratch` map), zero between operations
    const uint64_t* peer_bases;  ///< ipc: device table [num_ranks] of every rank's symmetric base
    void* own_base;          ///< ipc: this rank's symmetric base (sym_ptr = peer_base + (p - own_base))
    void* nccl_window;       ///< nccl: ncclWindow_t of the symmetric buffer (null for ipc)
    // --- sizes
    int64_t rank;
    int64_t num_tokens;        ///< tokens of this rank (dispatch source, combine destination)
    int64_t num_max_tokens;    ///< M
    int64_t num_experts;       ///< E
    int64_t expert_alignment;  ///< A
    int64_t flags;             ///< OpFlags
    int64_t timeout_cycles;    ///< clock64 budget of every wait
    // --- dispatch inputs
    const void* x;           ///< [T, hidden] rows of kHiddenBytes (row stride x_stride bytes)
    int64_t x_stride;
    const void* sf;          ///< [T, P] 4-byte packs or null
    int64_t sf_stride0;
    int64_t sf_stride1;
    const void* topk_idx;    ///< [T, K] int64 (int32 with kFlagTopkIdx32), negative = none
    const float* topk_weights;  ///< [T, K] or null
    // --- handle (written by a non-cached dispatch, read otherwise)
    int32_t* dst_slot;       ///< [T, K]: at master lanes own_rank*M + slot, else -1
    int32_t* psum_rank;      ///< [N] inclusive prefix of received rows per source rank
    int32_t* psum_expert;    ///< [epr] non-expand: inclusive aligned psum; expand: start_e + count_e
    int32_t* unaligned_expert;  ///< [epr] true counts
    int32_t* cum_stats;      ///< [epr] optional cumulative stats (atomicAdd of true counts)
    int32_t* src_metadata;   ///< [R, K+2]
    // --- dispatch outputs (copy epilogue)
    void* recv_x;            ///< [rows, hidden]
    void* recv_sf;           ///< [rows, P] with strides below (elements)
    int64_t sf_out_stride0;
    int64_t sf_out_stride1;
    int64_t* recv_topk_idx;  ///< [R, K] (non-expand)
    float* recv_topk_weights;  ///< [R, K] non-expand, [rows] expand
    int64_t num_out_rows;    ///< rows allocated in recv_x (bounds padding writes)
    // --- combine
    const void* comb_x;      ///< [rows, hidden] bf16
    const float* comb_weights;  ///< [R, K] non-expand or [rows] expand, or null
    const void* bias0;       ///< [T, hidden] bf16 or null
    const void* bias1;
    void* combined_x;        ///< [T, hidden] bf16
    float* combined_weights; ///< [T, K] or null
    // --- hybrid mode (hybrid.cuh)
    int32_t* fwd_meta;       ///< handle's token_metadata_at_forward [S_o, M + 1, K + 1] (row 0: [count, ...])
    const void* nccl_devcomm;  ///< gin scale-out: device copy of the ncclDevComm (null otherwise)
    // --- failure report to the host (timeout.cuh `publish_failure`)
    int32_t* host_error;     ///< page-locked host words mapped into the device, or null: [0] abort kind (sticky
                             ///< until the host resets the rank), [1] kind of the first invalid-input report
    // --- collective safety (barrier.cuh `cross_rank_barrier`)
    uint64_t envelope;       ///< (op kind << 56) | (sequence number & 0xffffff) << 32 | configuration digest; every
                             ///< rank of one operation must pass the same value (0 = not checked)
    // --- the new handle's copy of the routing (`do_handle_copy`)
    void* topk_idx_copy;     ///< [T, K] of topk_idx's dtype, or null: a non-cached dispatch's send phase stores
                             ///< every lane's routing word there as it reads it (no copy of its own on the stream)
};

static_assert(sizeof(OpArgs) == 44 * 8, "OpArgs changed: update ep_core.kernels._args");

/// Element `i` of the call's top-k ids (`OpArgs::topk_idx`): int32 or int64, as `kFlagTopkIdx32` says.
EP_CORE_DEVICE int64_t topk_id(const OpArgs& args, int64_t i) {
    if (args.flags & kFlagTopkIdx32)
        return static_cast<const int32_t*>(args.topk_idx)[i];
    return static_cast<const int64_t*>(args.topk_idx)[i];
}

/// View of this rank's symmetric workspace (ep_layout::WorkspaceLayout): the words that peers write.
/// - barrier arrivals: one uint64 at the start of the barrier-signal region, bumped by every rank per barrier
///   (monotonic; the barrier epoch lives in the rank-private scratch);
/// - envelopes: uint64 [kNumMaxRanks] at byte 4096 of the barrier-signal region (which has 32 KiB; the arrivals
///   use its first 8 bytes): `[src]` is the `OpArgs::envelope` that rank src entered its last checked barrier with.
///   Like the arrivals, these words keep their last value between operations (they are compared, never waited on).
/// - combine row bases: uint64 [kNumMaxRanks] at byte 16384 of the same region (zero-copy combine), kept likewise;
/// - dispatch source counts: uint64 [kNumMaxRanks] at byte 24576 (zero-copy dispatch), kept likewise.
/// - error record: `abort_flag` is the flag every wait watches (the first failure claims it by CAS);
/// - rank / expert count receive areas: int64 `kCountValidFlag | count` written by each source (0 = not arrived),
///   experts source-major `[src * epr + local expert]`; reset to 0 by the receiver.
struct Workspace {
    uint8_t* base;

    EP_CORE_DEVICE uint64_t* barrier_arrivals() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kBarrierSignalsOffset);
    }
    EP_CORE_DEVICE uint64_t* envelopes() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kBarrierSignalsOffset + kEnvelopesOffset);
    }
    static constexpr int64_t kEnvelopesOffset = 4096;
    static_assert(kEnvelopesOffset + 8 * ep_layout::kNumMaxRanks <=
                      ep_layout::WorkspaceLayout::kBarrierSignalsNumElems * 4,
                  "the envelopes must fit the barrier-signal region");
    /// Zero-copy combine: `[src]` is the first row of this rank's combine buffer that holds a token of rank src (the
    /// handle's prefix over sources), published before the entry barrier and read by src after it. Like the
    /// envelopes, kept between operations (read only after the barrier that follows each publication).
    EP_CORE_DEVICE uint64_t* combine_row_base() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kBarrierSignalsOffset +
                                           kCombineRowBaseOffset);
    }
    static constexpr int64_t kCombineRowBaseOffset = 16384;
    static_assert(kCombineRowBaseOffset >= kEnvelopesOffset + 8 * ep_layout::kNumMaxRanks &&
                      kCombineRowBaseOffset + 8 * ep_layout::kNumMaxRanks <=
                          ep_layout::WorkspaceLayout::kBarrierSignalsNumElems * 4,
                  "the combine row bases must fit the barrier-signal region after the envelopes");
    /// Zero-copy dispatch: `[src]` is the number of tokens rank src sends to this rank in the current operation,
    /// written by src before the entry barrier; a source reads the words of the sources before it after the barrier
    /// (where its rows start). Kept between operations like the words above: a source writes the next operation's
    /// count only after its previous operation, which every rank's reads of the last count preceded.
    EP_CORE_DEVICE uint64_t* dispatch_src_count() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kBarrierSignalsOffset +
                                           kDispatchSrcCountOffset);
    }
    static constexpr int64_t kDispatchSrcCountOffset = 24576;
    static_assert(kDispatchSrcCountOffset >= kCombineRowBaseOffset + 8 * ep_layout::kNumMaxRanks &&
                      kDispatchSrcCountOffset + 8 * ep_layout::kNumMaxRanks <=
                          ep_layout::WorkspaceLayout::kBarrierSignalsNumElems * 4,
                  "the dispatch source counts must fit the barrier-signal region after the combine row bases");
    EP_CORE_DEVICE ep_layout::ErrorRecord* error_record() const {
        return reinterpret_cast<ep_layout::ErrorRecord*>(base + ep_layout::WorkspaceLayout::kErrorRecordOffset);
    }
    EP_CORE_DEVICE int32_t* abort_flag() const { return &error_record()->abort_flag; }
    EP_CORE_DEVICE uint64_t* recv_rank_count() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kRankCountRecvOffset);
    }
    EP_CORE_DEVICE uint64_t* recv_expert_count() const {
        return reinterpret_cast<uint64_t*>(base + ep_layout::WorkspaceLayout::kExpertCountRecvOffset);
    }
};

static constexpr uint64_t kCountValidFlag = static_cast<uint64_t>(ep_layout::kCountValidFlag);

/// Rank-private scratch: the workspace's reserved region when it is large enough, else a separate allocation.
/// Offsets depend on (N, E, M); `ep_core.kernels.plan.scratch_bytes` mirrors the size.
/// Counters and bitmaps are zero between operations (the kernel that used them resets them).
struct Scratch {
    uint8_t* base;
    int num_ranks, num_experts, num_local_experts, num_words;

    EP_CORE_DEVICE Scratch(void* p, int n, int e, int64_t m)
        : base(static_cast<uint8_t*>(p)), num_ranks(n), num_experts(e), num_local_experts(e / n),
          num_words(static_cast<int>((m + 31) / 32)) {}

    EP_CORE_DEVICE uint32_t* grid_arrive() const { return reinterpret_cast<uint32_t*>(base); }
    EP_CORE_DEVICE uint32_t* grid_exit() const { return reinterpret_cast<uint32_t*>(base + 4); }
    EP_CORE_DEVICE uint64_t* barrier_epoch() const { return reinterpret_cast<uint64_t*>(base + 8); }
    /// Invalid-input report (not an abort): int64 {ErrorKind, token, lane, value}; first report wins via `kind`.
    EP_CORE_DEVICE int64_t* input_error() const { return reinterpret_cast<int64_t*>(base + 16); }
    EP_CORE_DEVICE int32_t* send_slot() const { return reinterpret_cast<int32_t*>(base + 64); }
    EP_CORE_DEVICE int32_t* sent_total() const { return send_slot() + num_ranks; }
    EP_CORE_DEVICE int32_t* expert_total() const { return sent_total() + num_ranks; }
    EP_CORE_DEVICE int32_t* expert_cursor() const { return expert_total() + num_experts; }
    EP_CORE_DEVICE int32_t* expert_start() const { return expert_cursor() + num_local_experts; }
    EP_CORE_DEVICE int32_t* expert_src_base() const { return expert_start() + num_local_experts; }
    /// Bitmaps over source tokens: rows [0, N) per destination rank, rows [N, N+E) per global expert.
    EP_CORE_DEVICE uint32_t* bits() const {
        return reinterpret_cast<uint32_t*>(expert_src_base() + num_experts);
    }
    EP_CORE_DEVICE uint32_t* prefix() const {
        return bits() + static_cast<int64_t>(num_ranks + num_experts) * num_words;
    }
};

}  // namespace ep_core
