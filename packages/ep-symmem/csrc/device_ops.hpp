#pragma once
// Small device services around symmetric memory: device facts, free memory, a device array (the peer pointer
// table), copies through any mapping (own, peer or host part), and a tiny PTX kernel that stores a u32 pattern
// from the SMs (used by tests to write through peer mappings the way EP kernels do). Every call makes the
// device's primary context current for its duration. Host only.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace ep_symmem {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string uuid;  // 16 raw bytes (cuDeviceGetUuid)
  int vmm_supported = 0;
  int posix_fd_supported = 0;
  int fabric_supported = 0;
  int rdma_with_vmm_supported = 0;
  int host_numa_id = -1;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int driver_version = 0;
};

DeviceInfo device_info(int ordinal);

// cuMemGetInfo: (free bytes, total bytes).
std::pair<size_t, size_t> memory_info(int ordinal);

uint64_t device_alloc(int ordinal, size_t num_bytes);
void device_free(int ordinal, uint64_t ptr);

// Synchronous copies (unified cuMemcpy, then cuCtxSynchronize); any pointer of this process on either side.
void copy_host_to_device(int ordinal, uint64_t dst, const void* src, size_t num_bytes);
void copy_device_to_host(int ordinal, void* dst, uint64_t src, size_t num_bytes);
void copy_device_to_device(int ordinal, uint64_t dst, uint64_t src, size_t num_bytes);
void memset_device(int ordinal, uint64_t dst, uint8_t value, size_t num_bytes);
void synchronize(int ordinal);

// dst[i] = first + i * step (uint32 arithmetic) for i < num_words, stored by a kernel; synchronous.
// dst must be 4-byte aligned.
void fill_u32(int ordinal, uint64_t dst, uint64_t num_words, uint32_t first, uint32_t step);

}  // namespace ep_symmem
