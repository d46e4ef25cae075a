// SPDX-License-Identifier: Apache-2.0
// Example of "reuse in other kernels": read the tokens that ep's direct dispatch left in a rank's receive buffer,
// straight from the symmetric buffer, with the layouts of ep-layout. One block per source rank; each warp copies
// the hidden part and the top-k ids of one received token into dense outputs.
#include <ep_layout/ep_layout.cuh>

#include <cstdio>

namespace el = ep_layout;

__global__ void gather_tokens(const el::DirectDispatchBuffers buffers, const el::WorkspaceLayout workspace,
                              int32_t num_max_tokens_per_rank, uint8_t* out_hidden, int32_t* out_topk_idx) {
    const el::TokenLayout& token = buffers.recv.token_layout;
    const int32_t src_rank = blockIdx.x;
    // Counts published by the senders: kCountValidFlag | count (zero = not arrived).
    const int64_t word = workspace.get_rank_count_recv_ptr()[src_rank];
    if ((word & el::kCountValidFlag) == 0) return;
    const int32_t count = static_cast<int32_t>(word & 0xffffffff);
    const el::BufferLayout<> region = buffers.recv.get_rank_buffer(src_rank);

    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    for (int32_t t = warp; t < count; t += num_warps) {
        const void* src = region.get_token_buffer(t);
        const int64_t row = int64_t(src_rank) * num_max_tokens_per_rank + t;
        const int4* hidden = token.get_hidden_ptr<int4>(src);
        int4* dst = reinterpret_cast<int4*>(out_hidden + row * token.num_hidden_bytes);
        for (int32_t i = lane; i < token.num_hidden_bytes / 16; i += 32) dst[i] = hidden[i];
        if (lane < token.num_topk) out_topk_idx[row * token.num_topk + lane] = token.get_topk_idx_ptr(src)[lane];
    }
}

int main() {
    // Host side: the same structs size the buffer (EP8, M = 4096, hidden 7168 bf16, K = 8).
    constexpr el::TokenLayout token = el::make_dispatch_token_layout(7168, 2, 0, 8);
    constexpr el::Topology topology(8, 8);
    constexpr el::DirectDispatchBuffers buffers(token, topology, 4096);
    static_assert(buffers.get_num_bytes() == el::dispatch_buffer_bytes(token, topology, 4096), "one formula");
    std::printf("layout %d.%d: token %d B, dispatch buffers %lld B, workspace %lld B, size hint %lld B\n",
                EP_LAYOUT_VERSION_MAJOR, EP_LAYOUT_VERSION_MINOR, token.get_num_bytes(),
                static_cast<long long>(buffers.get_num_bytes()),
                static_cast<long long>(el::WorkspaceLayout::get_num_aligned_bytes()),
                static_cast<long long>(el::size_hint_bytes(topology, 4096, 7168, 8)));
    // A real program would now take the symmetric buffer `sym` and launch:
    //   gather_tokens<<<8, 256>>>(buffers.with_base(sym + WorkspaceLayout::kNumAlignedBytes),
    //                             el::WorkspaceLayout(sym), 4096, out_hidden, out_topk_idx);
    return 0;
}
