// SPDX-License-Identifier: Apache-2.0
/// \file kernels.cuh
/// \brief Umbrella header of the ep-core kernels and the entry points that the JIT source instantiates.
///
/// The generated source (ep_core.kernels._source) defines EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK,
/// EP_CORE_HIDDEN_BYTES (dispatch token hidden bytes), EP_CORE_COMBINE_HIDDEN_BYTES (bf16 rows),
/// EP_CORE_NUM_SF_PACKS, EP_CORE_NUM_WARPS and EP_CORE_TRANSPORT, then includes this header once. Hybrid instances
/// also define EP_CORE_NUM_SCALEUP_RANKS (< EP_CORE_NUM_RANKS) and EP_CORE_SCALEOUT (a scaleout.cuh template):
/// the same three entry points then run the hybrid kernels (hybrid.cuh). Direct mode across nodes defines
/// EP_CORE_NUM_NODE_RANKS (ranks per node, < EP_CORE_NUM_RANKS) and EP_CORE_SCALEOUT without
/// EP_CORE_NUM_SCALEUP_RANKS: dispatch and combine then run direct_xnode.cuh, the copy epilogue stays direct mode's.
#pragma once

#include "args.cuh"
#include "barrier.cuh"
#include "combine.cuh"
#include "dispatch.cuh"
#include "direct_xnode.cuh"
#include "dispatch_epilogue.cuh"
#include "hybrid.cuh"
#include "phase_timing.cuh"
#include "ptx.cuh"
#include "timeout.cuh"
#include "token.cuh"
#include "transport.cuh"

#if defined(EP_CORE_NUM_RANKS)
#if defined(EP_CORE_NUM_SCALEUP_RANKS) && EP_CORE_NUM_SCALEUP_RANKS < EP_CORE_NUM_RANKS
#define EP_CORE_HYBRID 1
#else
#define EP_CORE_HYBRID 0
#undef EP_CORE_NUM_SCALEUP_RANKS
#define EP_CORE_NUM_SCALEUP_RANKS EP_CORE_NUM_RANKS
#endif
#if !EP_CORE_HYBRID && defined(EP_CORE_NUM_NODE_RANKS) && EP_CORE_NUM_NODE_RANKS < EP_CORE_NUM_RANKS
#define EP_CORE_DIRECT_XNODE 1
#else
#define EP_CORE_DIRECT_XNODE 0
#endif

extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_dispatch_impl(const __grid_constant__ ep_core::OpArgs args) {
#if EP_CORE_HYBRID
    ep_core::hybrid_dispatch_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_SCALEUP_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES,
                                  EP_CORE_NUM_SF_PACKS, EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT, EP_CORE_SCALEOUT>(args);
#elif EP_CORE_DIRECT_XNODE
    ep_core::direct_xnode_dispatch_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_NODE_RANKS, EP_CORE_NUM_TOPK,
                                        EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS, EP_CORE_NUM_WARPS,
                                        EP_CORE_TRANSPORT, EP_CORE_SCALEOUT>(args);
#else
    ep_core::dispatch_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS,
                           EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT>(args);
#endif
}

extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_dispatch_copy_epilogue_impl(const __grid_constant__ ep_core::OpArgs args) {
    // direct mode's dispatch keeps only the tail of a rank's own rows in its region (dispatch.cuh)
    ep_core::dispatch_epilogue_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS,
                                    EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT, EP_CORE_NUM_SCALEUP_RANKS,
                                    !EP_CORE_HYBRID && !EP_CORE_DIRECT_XNODE && ep_core::kDirectOwnRowsTailOnly>(args);
}

#if !EP_CORE_HYBRID && !EP_CORE_DIRECT_XNODE
/// The direct dispatch into the outputs in place (dispatch.cuh, zero-copy): direct mode only.
extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_dispatch_zero_copy_impl(const __grid_constant__ ep_core::OpArgs args) {
    ep_core::dispatch_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS,
                           EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT, true>(args);
}

/// The direct combine from the ranks' combine buffers (combine.cuh, zero-copy): direct mode only.
extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_combine_zero_copy_impl(const __grid_constant__ ep_core::OpArgs args) {
    ep_core::combine_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_COMBINE_HIDDEN_BYTES, EP_CORE_NUM_WARPS,
                          EP_CORE_TRANSPORT, true>(args);
}
#endif

extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_combine_impl(const __grid_constant__ ep_core::OpArgs args) {
#if EP_CORE_HYBRID
    ep_core::hybrid_combine_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_SCALEUP_RANKS, EP_CORE_NUM_TOPK,
                                 EP_CORE_COMBINE_HIDDEN_BYTES, EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT, EP_CORE_SCALEOUT>(args);
#elif EP_CORE_DIRECT_XNODE
    ep_core::direct_xnode_combine_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_NODE_RANKS, EP_CORE_NUM_TOPK,
                                       EP_CORE_COMBINE_HIDDEN_BYTES, EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT,
                                       EP_CORE_SCALEOUT>(args);
#else
    ep_core::combine_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_COMBINE_HIDDEN_BYTES, EP_CORE_NUM_WARPS,
                          EP_CORE_TRANSPORT>(args);
#endif
}
#endif
