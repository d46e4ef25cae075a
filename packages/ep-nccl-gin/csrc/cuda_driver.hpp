// The few CUDA driver calls the binding needs, taken from libcuda.so.1 with dlopen on first use (never linked),
// so that importing the extension works on machines without a driver.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ep_nccl_gin::cuda_driver {

// Make the primary context of `device` current on the calling thread (what cudaSetDevice does), so that
// NCCL, which uses the CUDA runtime, creates the communicator on that device. Throws CallError.
void set_device(int device);

// Make some context current when none is (the primary context of `device`), for driver calls below.
void ensure_context(int device);

// cuMemcpy (unified addressing: host or device on either side), synchronous. Throws CallError.
void copy(void* dst, const void* src, std::size_t nbytes);

}  // namespace ep_nccl_gin::cuda_driver
