// SPDX-License-Identifier: Apache-2.0
/// \file kernels.cuh
/// \brief Umbrella header of the ep-core kernels and the entry points that the JIT source instantiates.
///
/// The generated source (ep_core.kernels._source) defines EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK,
/// EP_CORE_HIDDEN_BYTES (dispatch token hidden bytes), EP_CORE_COMBINE_HIDDEN_BYTES (bf16 rows),
/// EP_CORE_NUM_SF_PACKS, EP_CORE_NUM_WARPS and EP_CORE_TRANSPORT, then includes this header once.
#pragma once

#include "args.cuh"
#include "barrier.cuh"
#include "combine.cuh"
#include "dispatch.cuh"
#include "dispatch_epilogue.cuh"
#include "ptx.cuh"
#include "timeout.cuh"
#include "token.cuh"
#include "transport.cuh"

#if defined(EP_CORE_NUM_RANKS)
extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_dispatch_impl(const __grid_constant__ ep_core::OpArgs args) {
    ep_core::dispatch_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS,
                           EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT>(args);
}

extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_dispatch_copy_epilogue_impl(const __grid_constant__ ep_core::OpArgs args) {
    ep_core::dispatch_epilogue_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_HIDDEN_BYTES, EP_CORE_NUM_SF_PACKS,
                                    EP_CORE_NUM_WARPS, EP_CORE_TRANSPORT>(args);
}

extern "C" __global__ void __launch_bounds__(EP_CORE_NUM_WARPS * 32, 1)
    ep_combine_impl(const __grid_constant__ ep_core::OpArgs args) {
    ep_core::combine_impl<EP_CORE_NUM_RANKS, EP_CORE_NUM_TOPK, EP_CORE_COMBINE_HIDDEN_BYTES, EP_CORE_NUM_WARPS,
                          EP_CORE_TRANSPORT>(args);
}
#endif
