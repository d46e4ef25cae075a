// SPDX-License-Identifier: Apache-2.0
// Prints sizes and offsets computed by the ep_layout headers, one output line per input line, so that the Python
// mirror can be compared against the C++ arithmetic (tests/test_layout_mirror.py). Requests (whitespace separated):
//   token H S K WM                      -> bytes, bytes with mbarrier, metadata bytes, 7 field offsets
//   buffer H S K WM MB R T r t c tpc    -> bytes/token, bytes/rank, bytes, rank offset, token offset, channel offset
//   compose H S K WM N SU NVL M AMR     -> dispatch: kind, per part (offset ranks tokens bytes), total;
//                                          combine (token H S K WM as combine token): same
//   hint N SU NVL M HIDDEN K FP8 AMR    -> size hint bytes
//   workspace                           -> per region: offset elems elem_bytes; then end, aligned end, error fields
//   version                             -> major minor
// Output of a request is one line (flushed); unknown requests print "error". Reads until EOF.
#include <iostream>
#include <sstream>
#include <string>

#include "ep_layout/ep_layout.cuh"

using namespace ep_layout;

namespace {

void print_buffer(std::ostream& os, int64_t offset, const BufferLayout<false>& b) {
    os << ' ' << offset << ' ' << b.num_ranks << ' ' << b.num_tokens_per_rank << ' ' << b.get_num_bytes();
}

void handle(const std::string& line, std::ostream& os) {
    std::istringstream is(line);
    std::string cmd;
    is >> cmd;
    if (cmd == "token") {
        int32_t h, s, k, wm;
        is >> h >> s >> k >> wm;
        const TokenLayout t(h, s, k, wm != 0);
        os << t.get_num_bytes() << ' ' << t.get_num_bytes<true, int64_t>() << ' ' << t.get_num_metadata_bytes() << ' '
           << t.get_hidden_offset() << ' ' << t.get_sf_offset() << ' ' << t.get_topk_idx_offset() << ' '
           << t.get_topk_weights_offset() << ' ' << t.get_src_token_idx_offset() << ' '
           << t.get_linked_list_idx_offset() << ' ' << t.get_mbarrier_offset() << ' ' << int(t.is_valid());
    } else if (cmd == "buffer") {
        int32_t h, s, k, wm, mb, ranks, tokens, r, tk, c, tpc;
        is >> h >> s >> k >> wm >> mb >> ranks >> tokens >> r >> tk >> c >> tpc;
        const TokenLayout t(h, s, k, wm != 0);
        auto dump = [&](auto b) {
            os << b.get_num_bytes_per_token() << ' ' << b.get_num_bytes_per_rank() << ' ' << b.get_num_bytes() << ' '
               << b.get_rank_offset(r) << ' ' << b.get_token_offset(r, tk) << ' ' << b.get_channel_offset(c, tpc);
            // Views must agree with the offsets.
            char* base = reinterpret_cast<char*>(0x100000);
            auto v = b.with_base(base);
            const bool ok = static_cast<char*>(v.get_rank_buffer(r).base) == base + b.get_rank_offset(r) &&
                            v.template get_token_ptr<char>(r, tk) == base + b.get_token_offset(r, tk) &&
                            static_cast<char*>(v.get_channel_buffer(c, tpc).base) == base + b.get_channel_offset(c, tpc) &&
                            v.template get_end_ptr<char>() == base + b.get_num_bytes() &&
                            v.get_rank_buffer(r).template get_token_buffer<char>(tk) == base + b.get_token_offset(r, tk);
            os << ' ' << int(ok);
        };
        if (mb) dump(BufferLayout<true>(t, ranks, tokens));
        else dump(BufferLayout<false>(t, ranks, tokens));
    } else if (cmd == "compose") {
        int32_t h, s, k, wm, n, su, nvl, m, amr;
        is >> h >> s >> k >> wm >> n >> su >> nvl >> m >> amr;
        const TokenLayout t(h, s, k, wm != 0);
        const Topology topo(n, su, nvl != 0);
        if (topo.is_hybrid()) {
            const HybridDispatchBuffers d(t, topo, m);
            const HybridCombineBuffers cb(t, topo, m, amr != 0);
            os << "hybrid";
            print_buffer(os, d.get_scaleup_recv_offset(), d.scaleup_recv);
            print_buffer(os, d.get_scaleout_send_offset(), d.scaleout_send);
            print_buffer(os, d.get_scaleout_recv_offset(), d.scaleout_recv);
            os << ' ' << d.get_num_bytes() << ' ' << dispatch_buffer_bytes(t, topo, m);
            print_buffer(os, cb.get_scaleup_recv_offset(), cb.scaleup_recv);
            print_buffer(os, cb.get_scaleout_recv_offset(), cb.scaleout_recv);
            print_buffer(os, cb.get_scaleout_send_offset(), cb.scaleout_send);
            os << ' ' << cb.get_num_bytes() << ' ' << combine_buffer_bytes(t, topo, m, amr != 0);
        } else {
            const DirectDispatchBuffers d(t, topo, m);
            const DirectCombineBuffers cb(t, topo, m, amr != 0);
            os << "direct";
            print_buffer(os, d.get_recv_offset(), d.recv);
            print_buffer(os, d.get_send_offset(), d.send);
            os << ' ' << d.get_num_bytes() << ' ' << dispatch_buffer_bytes(t, topo, m);
            print_buffer(os, cb.get_recv_offset(), cb.recv);
            print_buffer(os, cb.get_send_offset(), cb.send);
            os << ' ' << cb.get_num_bytes() << ' ' << combine_buffer_bytes(t, topo, m, amr != 0);
        }
    } else if (cmd == "hint") {
        int32_t n, su, nvl, m, hidden, k, fp8, amr;
        is >> n >> su >> nvl >> m >> hidden >> k >> fp8 >> amr;
        os << size_hint_bytes(Topology(n, su, nvl != 0), m, hidden, k, fp8 != 0, amr != 0);
    } else if (cmd == "workspace") {
        const int32_t n = static_cast<int32_t>(WorkspaceRegion::kNumRegions);
        for (int32_t i = 0; i < n; ++i) {
            const auto r = static_cast<WorkspaceRegion>(i);
            os << workspace_region_offset(r) << ' ' << workspace_region_num_elems(r) << ' '
               << workspace_region_elem_bytes(r) << ' ';
        }
        os << WorkspaceLayout::get_num_bytes() << ' ' << WorkspaceLayout::get_num_aligned_bytes();
        // The named constants, in region order (offset, elements).
        const int64_t named[][2] = {
            {WorkspaceLayout::kBarrierSignalsOffset, WorkspaceLayout::kBarrierSignalsNumElems},
            {WorkspaceLayout::kNotifyReductionOffset, WorkspaceLayout::kNotifyReductionNumElems},
            {WorkspaceLayout::kRankCountSendOffset, WorkspaceLayout::kRankCountSendNumElems},
            {WorkspaceLayout::kRankCountRecvOffset, WorkspaceLayout::kRankCountRecvNumElems},
            {WorkspaceLayout::kExpertCountSendOffset, WorkspaceLayout::kExpertCountSendNumElems},
            {WorkspaceLayout::kExpertCountRecvOffset, WorkspaceLayout::kExpertCountRecvNumElems},
            {WorkspaceLayout::kScaleoutRankCountSendOffset, WorkspaceLayout::kScaleoutRankCountSendNumElems},
            {WorkspaceLayout::kScaleoutRankCountRecvOffset, WorkspaceLayout::kScaleoutRankCountRecvNumElems},
            {WorkspaceLayout::kScaleoutExpertCountSendOffset, WorkspaceLayout::kScaleoutExpertCountSendNumElems},
            {WorkspaceLayout::kScaleoutExpertCountRecvOffset, WorkspaceLayout::kScaleoutExpertCountRecvNumElems},
            {WorkspaceLayout::kSenderSlotCountersOffset, WorkspaceLayout::kSenderSlotCountersNumElems},
            {WorkspaceLayout::kScaleoutSenderSlotCountersOffset, WorkspaceLayout::kScaleoutSenderSlotCountersNumElems},
            {WorkspaceLayout::kErrorRecordOffset, WorkspaceLayout::kErrorRecordNumElems},
            {WorkspaceLayout::kChannelTailsOffset, WorkspaceLayout::kChannelTailsNumElems},
            {WorkspaceLayout::kScaleoutChannelTailsOffset, WorkspaceLayout::kScaleoutChannelTailsNumElems},
            {WorkspaceLayout::kReservedOffset, WorkspaceLayout::kReservedNumElems},
        };
        static_assert(sizeof(named) / sizeof(named[0]) == static_cast<int>(WorkspaceRegion::kNumRegions), "all");
        for (const auto& n : named) os << ' ' << n[0] << ' ' << n[1];
        os << ' ' << kErrorRecordAbortFlagOffset << ' ' << kErrorRecordRankOffset << ' ' << kErrorRecordPeerRankOffset
           << ' ' << kErrorRecordTagOffset << ' ' << kErrorRecordCounterOffset << ' ' << kErrorRecordValueOffset
           << ' ' << kErrorRecordExpectedOffset << ' ' << kErrorRecordTokenIdxOffset << ' '
           << kErrorRecordLaneOffset;
    } else if (cmd == "version") {
        os << EP_LAYOUT_VERSION_MAJOR << ' ' << EP_LAYOUT_VERSION_MINOR;
    } else {
        os << "error";
    }
}

}  // namespace

int main() {
    std::ios::sync_with_stdio(false);
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        handle(line, std::cout);
        std::cout << '\n';
        std::cout.flush();
    }
    std::cout.flush();
    return 0;
}
