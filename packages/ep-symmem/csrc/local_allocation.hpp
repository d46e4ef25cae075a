#pragma once
// A symmetric allocation owned by this process: one reserved virtual range [GPU part | host NUMA part].
//
//   base ............ base + num_gpu_bytes ............ base + num_gpu_bytes + num_host_bytes
//   | GPU memory (CU_MEM_LOCATION_TYPE_DEVICE)   | host memory (CU_MEM_LOCATION_TYPE_HOST_NUMA, device's NUMA id) |
//
// Both parts are created with cuMemCreate (PINNED), are exportable as POSIX fds (and the GPU part as a fabric handle
// where the driver allows it), and are readable/writable by the owning device. The host part is also made
// CPU-accessible (cuMemSetAccess with a HOST_NUMA location) when the driver allows it. Sizes are multiples of
// `alignment` (lcm of 2 MiB and the recommended granularities). Host only; not thread-safe per object.

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace ep_symmem {

constexpr size_t kAlignmentBytes = size_t{2} << 20;  // 2 MiB, as DeepEP's symmetric buffers
constexpr size_t kFabricHandleBytes = sizeof(CUmemFabricHandle);

// Random id of an allocation, carried in its descriptor; lets same-process peers find the live allocation.
using Token = std::array<uint8_t, 16>;

enum class HandleMode { kAuto, kPosixFd, kFabric };

class LocalAllocation {
 public:
  // num_gpu_bytes > 0, num_host_bytes >= 0 (rounded up to `alignment`). mode: which shareable handles to request
  // (kAuto: POSIX fd, plus fabric when the device supports it, dropped cleanly if the driver refuses).
  // require_rdma: raise Error(kUnsupported) unless the device reports GPUDirect RDMA with VMM.
  LocalAllocation(int device, size_t num_gpu_bytes, size_t num_host_bytes, HandleMode mode, bool require_rdma);
  ~LocalAllocation();
  LocalAllocation(const LocalAllocation&) = delete;
  LocalAllocation& operator=(const LocalAllocation&) = delete;

  // Unmaps, releases, frees the range and closes exported fds; idempotent. Runs every step even when one fails,
  // then throws the first failure.
  void close();
  bool closed() const { return closed_; }

  int device() const { return device_; }
  uint64_t base() const { return base_; }
  size_t num_gpu_bytes() const { return gpu_.num_bytes; }
  size_t num_host_bytes() const { return host_.num_bytes; }
  size_t alignment() const { return alignment_; }
  unsigned gpu_handle_types() const { return gpu_.handle_types; }
  unsigned host_handle_types() const { return host_.handle_types; }
  const std::string& gpu_fabric_handle() const { return gpu_.fabric_handle; }  // 64 bytes or empty
  bool rdma_capable() const { return rdma_capable_; }
  int host_numa_id() const { return host_numa_id_; }
  bool host_cpu_access() const { return host_cpu_access_; }
  const std::string& host_cpu_access_error() const { return host_cpu_access_error_; }
  const std::string& notes() const { return notes_; }  // why fabric / RDMA flags were dropped, if they were
  const Token& token() const { return token_; }

  // POSIX fds of (GPU part, host part or -1), exported on first call and kept open until release_export_fds() or
  // close(): peers duplicate them with pidfd_getfd while they are open.
  std::pair<int, int> export_fds();
  void release_export_fds() noexcept;

 private:
  struct Part {
    size_t num_bytes = 0;
    CUmemGenericAllocationHandle handle = 0;
    bool created = false;
    bool mapped = false;
    unsigned handle_types = 0;
    int export_fd = -1;
    std::string fabric_handle;
  };

  void build(HandleMode mode, bool require_rdma);
  std::string cleanup() noexcept;  // first error message, or empty

  int device_;
  Part gpu_;
  Part host_;
  uint64_t base_ = 0;
  size_t reserved_bytes_ = 0;
  size_t alignment_ = kAlignmentBytes;
  bool rdma_capable_ = false;
  int host_numa_id_ = -1;
  bool host_cpu_access_ = false;
  std::string host_cpu_access_error_;
  std::string notes_;
  Token token_{};
  bool registered_ = false;
  bool closed_ = false;
};

// Same-process peers: retains (cuMemRetainAllocationHandle) the GPU and host handles of the live allocation with
// this token; the caller must cuMemRelease them. Returns false when no live allocation of this process has it.
bool retain_registered(const Token& token, CUmemGenericAllocationHandle* gpu, CUmemGenericAllocationHandle* host);

// Whether a live allocation of this process has this token.
bool is_registered(const Token& token);

}  // namespace ep_symmem
