// SPDX-License-Identifier: Apache-2.0
/// \file workspace_layout.cuh
/// \brief `ep_layout::WorkspaceLayout`: the fixed-size control region at the start of every rank's symmetric buffer.
///
/// The workspace does not depend on the configuration (ranks, experts, hidden, K, channels), so one symmetric buffer
/// serves every setting. It is sized by the limits below and placed first in the symmetric allocation:
/// `[workspace (get_num_aligned_bytes() = 14 MiB) | GPU buffer | CPU buffer]`.
///
/// INVARIANT: every byte of the workspace is zero between operations (the allocator zeroes it once; every kernel
/// returns what it used to zero before it exits). The only exception is `error_record` after a failed operation:
/// the host reads it, raises, and zeroes it before the buffer is used again.
///
/// Regions (each starts on a 128-byte boundary, in this order; offsets come from `workspace_region_offset`).
/// "local" = written and read by the owning rank's own kernels; "peer" = written by other ranks through symmetric
/// (peer / LSA / GIN) pointers, read by the owner.
///
///  region                        type     elements                        index / encoding, writers -> readers
///  barrier_signals               int32    8 phases x 1024 ranks           [phase * kNumMaxRanks + src_rank]; peers
///                                                                         add (system-scope release), owner waits
///                                                                         and subtracts what it consumed.
///  notify_reduction              int64    1024 + 2048                     cross-SM reduction of the notify warps:
///                                                                         [dst_rank], then [kNumMaxRanks + expert];
///                                                                         (num_sms_arrived << 32) | count; local.
///  rank_count_send               int64    1024                            [dst_rank] tokens this rank sends to
///                                                                         dst_rank (staging before publishing); local.
///  rank_count_recv               int64    1024                            [src_rank] tokens src_rank sends here;
///                                                                         peer -> owner. Encoded (1 << 32) | count
///                                                                         (kCountValidFlag) so 0 = not arrived.
///  expert_count_send             int64    2048                            [global expert] tokens this rank sends to
///                                                                         each expert; local.
///  expert_count_recv             int64    2048                            [src_rank * experts_per_rank +
///                                                                         local_expert] (N * epr = E <= 2048);
///                                                                         peer -> owner, kCountValidFlag-encoded.
///  scaleout_rank_count_send      int64    1024                            hybrid: as rank_count_send, scale-out.
///  scaleout_rank_count_recv      int64    1024                            hybrid: as rank_count_recv, scale-out.
///  scaleout_expert_count_send    int64    2048                            hybrid: as expert_count_send, scale-out.
///  scaleout_expert_count_recv    int64    2048                            hybrid: as expert_count_recv, scale-out.
///  sender_slot_counters          int32    1024                            [dst_rank] atomic slot allocation of the
///                                                                         sending warps; local.
///  scaleout_sender_slot_counters int32    1024                            hybrid: [dst scale-out rank]; local.
///  error_record                  ErrorRecord (64 B) x 1                   abort flag + diagnostic; any rank's
///                                                                         kernels (own or peer) -> host. First
///                                                                         writer wins (CAS on abort_flag).
///  channel_tails                 int32    1024 channels x 1024 ranks      [channel * num_ranks + rank] (dense with
///                                                                         the actual rank count; needs channels *
///                                                                         ranks <= 1024 * 1024) tokens written so
///                                                                         far; peer (sender) -> owner (receiver).
///                                                                         Dispatch and combine both use it.
///  scaleout_channel_tails        int64    1024 channels x 1024 ranks      hybrid: [channel * S_o + so_rank],
///                                                                         (finish_flag << 32) | tail; peer -> owner.
///  reserved                      uint8    the rest up to 14 MiB           for later features and kernel-private
///                                          (1,933,184 B, >= 1 MiB)        scratch: ep-core kernels may carve it up
///                                                                         (document the carve-up there); zero
///                                                                         between operations like the rest.
///
/// The regions fill exactly kNumWorkspaceBytes = 14 MiB (a multiple of the 2 MiB symmetric granularity): `reserved`
/// takes what the others leave. New regions are carved from `reserved` (minor version bump, no existing byte moves);
/// anything else that moves a byte bumps EP_LAYOUT_VERSION_MAJOR.
#pragma once

#include "config.cuh"
#include "math.cuh"

namespace ep_layout {

// ---------------------------------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------------------------------

static constexpr int32_t kNumMaxRanks = 1024;
static constexpr int32_t kNumMaxExperts = 2048;
static constexpr int32_t kNumMaxExpertsPerRank = 256;
/// Workspace channel limit (per-channel tails). Distinct from `kNumMaxHybridChannels` (1280).
static constexpr int32_t kNumMaxChannels = 1024;
/// Barrier phases: independent barriers that may be in flight one after another without resetting in between.
static constexpr int32_t kNumBarrierPhases = 8;
/// Bytes of the whole workspace (fixed); the `reserved` region takes what the other regions leave.
static constexpr int64_t kNumWorkspaceBytes = int64_t(14) << 20;
/// Every region starts on a multiple of this many bytes.
static constexpr int64_t kNumWorkspaceRegionAlignBytes = 128;
/// Count words are written as `kCountValidFlag | count` so that zero means "not arrived yet".
static constexpr int64_t kCountValidFlag = int64_t(1) << 32;

// ---------------------------------------------------------------------------------------------------------------------
// Error record
// ---------------------------------------------------------------------------------------------------------------------

/// What went wrong; values are pinned (the host decodes them).
enum class ErrorKind : int32_t {
    kNone = 0,             ///< healthy
    kTimeout = 1,          ///< a wait on a peer exceeded its cycle budget
    kPeerAbort = 2,        ///< this rank stopped because a peer aborted
    kInvalidExpert = 3,    ///< an expert id >= num_experts
    kDuplicateExpert = 4,  ///< the same expert twice in one token
    kCapacity = 5,         ///< a buffer or output capacity would be exceeded
    kEnvelopeMismatch = 6, ///< a peer entered another operation (kind, sequence number or configuration digest)
};

/// The diagnostic a kernel leaves before it traps or returns early. 64 bytes, 8-aligned.
struct ErrorRecord {
    int32_t abort_flag;  ///< ErrorKind of the first failure (0 = healthy); claimed by CAS from 0, fields written after
    int32_t rank;        ///< rank whose kernel recorded the failure
    int32_t peer_rank;   ///< rank waited on (timeout) or -1
    int32_t tag;         ///< wait / check site, kernel-defined (ep-core documents its tags)
    int64_t counter;     ///< what was waited on: byte offset of the word in the symmetric buffer, or kernel index
    int64_t value;       ///< last value observed (timeout) or the offending value (invalid input)
    int64_t expected;    ///< value waited for (timeout) or the bound violated (invalid input)
    int32_t token_idx;   ///< offending token or -1
    int32_t lane;        ///< offending top-k lane or -1
    int64_t reserved[2];
};

EP_LAYOUT_ASSERT_TRIVIAL(ErrorRecord, 64);

// Field offsets of ErrorRecord, mirrored in Python (`ep_layout.ERROR_RECORD_FIELDS`).
static constexpr int32_t kErrorRecordAbortFlagOffset = 0;
static constexpr int32_t kErrorRecordRankOffset = 4;
static constexpr int32_t kErrorRecordPeerRankOffset = 8;
static constexpr int32_t kErrorRecordTagOffset = 12;
static constexpr int32_t kErrorRecordCounterOffset = 16;
static constexpr int32_t kErrorRecordValueOffset = 24;
static constexpr int32_t kErrorRecordExpectedOffset = 32;
static constexpr int32_t kErrorRecordTokenIdxOffset = 40;
static constexpr int32_t kErrorRecordLaneOffset = 44;

// ---------------------------------------------------------------------------------------------------------------------
// Regions
// ---------------------------------------------------------------------------------------------------------------------

/// Workspace regions in memory order.
enum class WorkspaceRegion : int32_t {
    kBarrierSignals = 0,
    kNotifyReduction,
    kRankCountSend,
    kRankCountRecv,
    kExpertCountSend,
    kExpertCountRecv,
    kScaleoutRankCountSend,
    kScaleoutRankCountRecv,
    kScaleoutExpertCountSend,
    kScaleoutExpertCountRecv,
    kSenderSlotCounters,
    kScaleoutSenderSlotCounters,
    kErrorRecord,
    kChannelTails,
    kScaleoutChannelTails,
    kReserved,
    kNumRegions,
};

/// Bytes of one element of `region`.
EP_LAYOUT_HOST_DEVICE constexpr int64_t workspace_region_elem_bytes(WorkspaceRegion region) {
    switch (region) {
        case WorkspaceRegion::kBarrierSignals: return 4;
        case WorkspaceRegion::kNotifyReduction: return 8;
        case WorkspaceRegion::kRankCountSend: return 8;
        case WorkspaceRegion::kRankCountRecv: return 8;
        case WorkspaceRegion::kExpertCountSend: return 8;
        case WorkspaceRegion::kExpertCountRecv: return 8;
        case WorkspaceRegion::kScaleoutRankCountSend: return 8;
        case WorkspaceRegion::kScaleoutRankCountRecv: return 8;
        case WorkspaceRegion::kScaleoutExpertCountSend: return 8;
        case WorkspaceRegion::kScaleoutExpertCountRecv: return 8;
        case WorkspaceRegion::kSenderSlotCounters: return 4;
        case WorkspaceRegion::kScaleoutSenderSlotCounters: return 4;
        case WorkspaceRegion::kErrorRecord: return int64_t(sizeof(ErrorRecord));
        case WorkspaceRegion::kChannelTails: return 4;
        case WorkspaceRegion::kScaleoutChannelTails: return 8;
        case WorkspaceRegion::kReserved: return 1;
        default: return 0;
    }
}

EP_LAYOUT_HOST_DEVICE constexpr int64_t workspace_region_offset(WorkspaceRegion region);

/// Number of elements of `region`.
EP_LAYOUT_HOST_DEVICE constexpr int64_t workspace_region_num_elems(WorkspaceRegion region) {
    switch (region) {
        case WorkspaceRegion::kBarrierSignals: return int64_t(kNumBarrierPhases) * kNumMaxRanks;
        case WorkspaceRegion::kNotifyReduction: return kNumMaxRanks + kNumMaxExperts;
        case WorkspaceRegion::kRankCountSend: return kNumMaxRanks;
        case WorkspaceRegion::kRankCountRecv: return kNumMaxRanks;
        case WorkspaceRegion::kExpertCountSend: return kNumMaxExperts;
        case WorkspaceRegion::kExpertCountRecv: return kNumMaxExperts;
        case WorkspaceRegion::kScaleoutRankCountSend: return kNumMaxRanks;
        case WorkspaceRegion::kScaleoutRankCountRecv: return kNumMaxRanks;
        case WorkspaceRegion::kScaleoutExpertCountSend: return kNumMaxExperts;
        case WorkspaceRegion::kScaleoutExpertCountRecv: return kNumMaxExperts;
        case WorkspaceRegion::kSenderSlotCounters: return kNumMaxRanks;
        case WorkspaceRegion::kScaleoutSenderSlotCounters: return kNumMaxRanks;
        case WorkspaceRegion::kErrorRecord: return 1;
        case WorkspaceRegion::kChannelTails: return int64_t(kNumMaxChannels) * kNumMaxRanks;
        case WorkspaceRegion::kScaleoutChannelTails: return int64_t(kNumMaxChannels) * kNumMaxRanks;
        case WorkspaceRegion::kReserved: return kNumWorkspaceBytes - workspace_region_offset(WorkspaceRegion::kReserved);
        default: return 0;
    }
}

/// Bytes of `region` (elements x element bytes, before the next region's alignment).
EP_LAYOUT_HOST_DEVICE constexpr int64_t workspace_region_num_bytes(WorkspaceRegion region) {
    return workspace_region_elem_bytes(region) * workspace_region_num_elems(region);
}

/// Byte offset of `region` from the workspace base: the one function every workspace offset comes from.
/// `WorkspaceRegion::kNumRegions` gives the end of the last region.
EP_LAYOUT_HOST_DEVICE constexpr int64_t workspace_region_offset(WorkspaceRegion region) {
    int64_t offset = 0;
    for (int32_t i = 0; i < static_cast<int32_t>(region); ++i)
        offset = align(offset + workspace_region_num_bytes(static_cast<WorkspaceRegion>(i)),
                       kNumWorkspaceRegionAlignBytes);
    return offset;
}

/// Bytes of the `reserved` region (1,933,184).
static constexpr int64_t kNumReservedBytes = workspace_region_num_bytes(WorkspaceRegion::kReserved);

/// View of one rank's workspace. Trivially copyable; pass by value. Offsets are `static constexpr`; pointers need
/// `base` (the workspace start of the rank whose workspace is addressed: own or a peer's symmetric pointer).
struct WorkspaceLayout {
    void* base;

    // clang-format off
    static constexpr int64_t kBarrierSignalsOffset = workspace_region_offset(WorkspaceRegion::kBarrierSignals);
    static constexpr int64_t kNotifyReductionOffset = workspace_region_offset(WorkspaceRegion::kNotifyReduction);
    static constexpr int64_t kRankCountSendOffset = workspace_region_offset(WorkspaceRegion::kRankCountSend);
    static constexpr int64_t kRankCountRecvOffset = workspace_region_offset(WorkspaceRegion::kRankCountRecv);
    static constexpr int64_t kExpertCountSendOffset = workspace_region_offset(WorkspaceRegion::kExpertCountSend);
    static constexpr int64_t kExpertCountRecvOffset = workspace_region_offset(WorkspaceRegion::kExpertCountRecv);
    static constexpr int64_t kScaleoutRankCountSendOffset = workspace_region_offset(WorkspaceRegion::kScaleoutRankCountSend);
    static constexpr int64_t kScaleoutRankCountRecvOffset = workspace_region_offset(WorkspaceRegion::kScaleoutRankCountRecv);
    static constexpr int64_t kScaleoutExpertCountSendOffset = workspace_region_offset(WorkspaceRegion::kScaleoutExpertCountSend);
    static constexpr int64_t kScaleoutExpertCountRecvOffset = workspace_region_offset(WorkspaceRegion::kScaleoutExpertCountRecv);
    static constexpr int64_t kSenderSlotCountersOffset = workspace_region_offset(WorkspaceRegion::kSenderSlotCounters);
    static constexpr int64_t kScaleoutSenderSlotCountersOffset = workspace_region_offset(WorkspaceRegion::kScaleoutSenderSlotCounters);
    static constexpr int64_t kErrorRecordOffset = workspace_region_offset(WorkspaceRegion::kErrorRecord);
    static constexpr int64_t kChannelTailsOffset = workspace_region_offset(WorkspaceRegion::kChannelTails);
    static constexpr int64_t kScaleoutChannelTailsOffset = workspace_region_offset(WorkspaceRegion::kScaleoutChannelTails);
    static constexpr int64_t kReservedOffset = workspace_region_offset(WorkspaceRegion::kReserved);
    // Element counts (units as in the table above).
    static constexpr int64_t kBarrierSignalsNumElems = workspace_region_num_elems(WorkspaceRegion::kBarrierSignals);
    static constexpr int64_t kNotifyReductionNumElems = workspace_region_num_elems(WorkspaceRegion::kNotifyReduction);
    static constexpr int64_t kRankCountSendNumElems = workspace_region_num_elems(WorkspaceRegion::kRankCountSend);
    static constexpr int64_t kRankCountRecvNumElems = workspace_region_num_elems(WorkspaceRegion::kRankCountRecv);
    static constexpr int64_t kExpertCountSendNumElems = workspace_region_num_elems(WorkspaceRegion::kExpertCountSend);
    static constexpr int64_t kExpertCountRecvNumElems = workspace_region_num_elems(WorkspaceRegion::kExpertCountRecv);
    static constexpr int64_t kScaleoutRankCountSendNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutRankCountSend);
    static constexpr int64_t kScaleoutRankCountRecvNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutRankCountRecv);
    static constexpr int64_t kScaleoutExpertCountSendNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutExpertCountSend);
    static constexpr int64_t kScaleoutExpertCountRecvNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutExpertCountRecv);
    static constexpr int64_t kSenderSlotCountersNumElems = workspace_region_num_elems(WorkspaceRegion::kSenderSlotCounters);
    static constexpr int64_t kScaleoutSenderSlotCountersNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutSenderSlotCounters);
    static constexpr int64_t kErrorRecordNumElems = workspace_region_num_elems(WorkspaceRegion::kErrorRecord);
    static constexpr int64_t kChannelTailsNumElems = workspace_region_num_elems(WorkspaceRegion::kChannelTails);
    static constexpr int64_t kScaleoutChannelTailsNumElems = workspace_region_num_elems(WorkspaceRegion::kScaleoutChannelTails);
    static constexpr int64_t kReservedNumElems = workspace_region_num_elems(WorkspaceRegion::kReserved);
    /// End of the last region (bytes actually used).
    static constexpr int64_t kNumBytes = workspace_region_offset(WorkspaceRegion::kNumRegions);
    /// Bytes the workspace occupies in the symmetric allocation (2 MiB aligned): the GPU buffer starts here.
    static constexpr int64_t kNumAlignedBytes = align(kNumBytes, kNumSymmetricAlignBytes);
    // clang-format on

    WorkspaceLayout() = default;
    EP_LAYOUT_HOST_DEVICE constexpr explicit WorkspaceLayout(void* base) : base(base) {}

    EP_LAYOUT_HOST_DEVICE static constexpr int64_t get_num_bytes() { return kNumBytes; }
    EP_LAYOUT_HOST_DEVICE static constexpr int64_t get_num_aligned_bytes() { return kNumAlignedBytes; }
    EP_LAYOUT_HOST_DEVICE static constexpr int64_t get_offset(WorkspaceRegion region) {
        return workspace_region_offset(region);
    }
    EP_LAYOUT_HOST_DEVICE static constexpr int64_t get_num_elems(WorkspaceRegion region) {
        return workspace_region_num_elems(region);
    }

    /// Start of `region` as `T*`.
    template <typename T>
    EP_LAYOUT_HOST_DEVICE T* get_region_ptr(WorkspaceRegion region) const {
        return advance_ptr<T>(base, workspace_region_offset(region));
    }

    // Pointers to each region (element type as documented above).
    EP_LAYOUT_HOST_DEVICE int32_t* get_barrier_signals_ptr() const { return advance_ptr<int32_t>(base, kBarrierSignalsOffset); }
    /// Signal slot that `src_rank` bumps for barrier `phase`.
    EP_LAYOUT_HOST_DEVICE int32_t* get_barrier_signal_ptr(int32_t phase, int32_t src_rank) const {
        return get_barrier_signals_ptr() + (int64_t(phase) * kNumMaxRanks + src_rank);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_notify_reduction_ptr() const { return advance_ptr<int64_t>(base, kNotifyReductionOffset); }
    /// Expert part of the notify reduction: slot `kNumMaxRanks + expert`.
    EP_LAYOUT_HOST_DEVICE int64_t* get_notify_expert_reduction_ptr() const {
        return get_notify_reduction_ptr() + kNumMaxRanks;
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_rank_count_send_ptr() const { return advance_ptr<int64_t>(base, kRankCountSendOffset); }
    EP_LAYOUT_HOST_DEVICE int64_t* get_rank_count_recv_ptr() const { return advance_ptr<int64_t>(base, kRankCountRecvOffset); }
    EP_LAYOUT_HOST_DEVICE int64_t* get_expert_count_send_ptr() const { return advance_ptr<int64_t>(base, kExpertCountSendOffset); }
    EP_LAYOUT_HOST_DEVICE int64_t* get_expert_count_recv_ptr() const { return advance_ptr<int64_t>(base, kExpertCountRecvOffset); }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_rank_count_send_ptr() const {
        return advance_ptr<int64_t>(base, kScaleoutRankCountSendOffset);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_rank_count_recv_ptr() const {
        return advance_ptr<int64_t>(base, kScaleoutRankCountRecvOffset);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_expert_count_send_ptr() const {
        return advance_ptr<int64_t>(base, kScaleoutExpertCountSendOffset);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_expert_count_recv_ptr() const {
        return advance_ptr<int64_t>(base, kScaleoutExpertCountRecvOffset);
    }
    EP_LAYOUT_HOST_DEVICE int32_t* get_sender_slot_counters_ptr() const {
        return advance_ptr<int32_t>(base, kSenderSlotCountersOffset);
    }
    EP_LAYOUT_HOST_DEVICE int32_t* get_scaleout_sender_slot_counters_ptr() const {
        return advance_ptr<int32_t>(base, kScaleoutSenderSlotCountersOffset);
    }
    EP_LAYOUT_HOST_DEVICE ErrorRecord* get_error_record_ptr() const { return advance_ptr<ErrorRecord>(base, kErrorRecordOffset); }
    EP_LAYOUT_HOST_DEVICE int32_t* get_channel_tails_ptr() const { return advance_ptr<int32_t>(base, kChannelTailsOffset); }
    /// Tail of (channel, rank) with the dense index `channel * num_ranks + rank`.
    EP_LAYOUT_HOST_DEVICE int32_t* get_channel_tail_ptr(int32_t channel, int32_t rank, int32_t num_ranks) const {
        return get_channel_tails_ptr() + (int64_t(channel) * num_ranks + rank);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_channel_tails_ptr() const {
        return advance_ptr<int64_t>(base, kScaleoutChannelTailsOffset);
    }
    EP_LAYOUT_HOST_DEVICE int64_t* get_scaleout_channel_tail_ptr(int32_t channel, int32_t so_rank,
                                                                 int32_t num_scaleout_ranks) const {
        return get_scaleout_channel_tails_ptr() + (int64_t(channel) * num_scaleout_ranks + so_rank);
    }
    EP_LAYOUT_HOST_DEVICE uint8_t* get_reserved_ptr() const { return advance_ptr<uint8_t>(base, kReservedOffset); }
};

EP_LAYOUT_ASSERT_TRIVIAL(WorkspaceLayout, 8);

static_assert(WorkspaceLayout::kNumBytes == kNumWorkspaceBytes, "the regions fill the workspace exactly");
static_assert(WorkspaceLayout::kNumAlignedBytes == kNumWorkspaceBytes, "workspace is 14 MiB in the symmetric buffer");
static_assert(WorkspaceLayout::kReservedOffset == 12746880, "a region moved: bump EP_LAYOUT_VERSION_MAJOR");
static_assert(kNumReservedBytes >= (int64_t(1) << 20), "keep at least 1 MiB reserved");
static_assert(WorkspaceLayout::kErrorRecordOffset % 8 == 0, "ErrorRecord must be 8-aligned");

}  // namespace ep_layout
