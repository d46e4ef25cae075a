#pragma once
// A peer's symmetric allocation mapped into this process: the peer's GPU part and host part (if any) imported and
// mapped back to back in one reserved range, read/write for our device. Host only.

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "local_allocation.hpp"

namespace ep_symmem {

enum class ImportMethod {
  kRetain,   // same process: cuMemRetainAllocationHandle on the live allocation with the peer's token
  kPosixFd,  // same host: pidfd_open + pidfd_getfd of the peer's exported fd, cuMemImportFromShareableHandle
  kFabric,   // any host of the NVLink fabric: cuMemImportFromShareableHandle(FABRIC) of the 64-byte handle
};

struct PeerSource {
  int pid = 0;
  Token token{};
  size_t num_gpu_bytes = 0;
  size_t num_host_bytes = 0;
  size_t alignment = kAlignmentBytes;  // VA alignment for the mapping (lcm of both sides' alignments)
  int gpu_fd = -1;                     // fd numbers in the peer process
  int host_fd = -1;
  std::string gpu_fabric_handle;       // 64 bytes or empty
  ImportMethod gpu_method = ImportMethod::kPosixFd;
  ImportMethod host_method = ImportMethod::kPosixFd;  // kRetain or kPosixFd (host parts have no fabric handle)
};

class PeerMapping {
 public:
  PeerMapping(int device, const PeerSource& source);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  // Unmaps, releases the imported handles, frees the range; idempotent; throws the first failure after all steps.
  void close();
  bool closed() const { return closed_; }
  uint64_t base() const { return base_; }
  size_t num_bytes() const { return num_gpu_bytes_ + num_host_bytes_; }

 private:
  void build(const PeerSource& source);
  std::string cleanup() noexcept;

  int device_;
  size_t num_gpu_bytes_ = 0;
  size_t num_host_bytes_ = 0;
  uint64_t base_ = 0;
  CUmemGenericAllocationHandle gpu_handle_ = 0;
  CUmemGenericAllocationHandle host_handle_ = 0;
  bool have_gpu_handle_ = false;
  bool have_host_handle_ = false;
  bool gpu_mapped_ = false;
  bool host_mapped_ = false;
  bool closed_ = false;
};

}  // namespace ep_symmem
