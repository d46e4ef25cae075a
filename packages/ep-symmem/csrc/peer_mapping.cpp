#include "peer_mapping.hpp"

#include <unistd.h>

#include <cstring>

#include "context.hpp"
#include "driver.hpp"
#include "error.hpp"
#include "peer_fd.hpp"

namespace ep_symmem {
namespace {

CUmemGenericAllocationHandle import_posix_fd(int pid, int fd, const char* part) {
  const int local = duplicate_peer_fd(pid, fd);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult result = driver().mem_import_from_shareable_handle(
      &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(local)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  ::close(local);  // the imported handle keeps the memory alive; the duplicate fd is no longer needed
  check(result, "cuMemImportFromShareableHandle",
        std::string(part) + " of pid " + std::to_string(pid) + ", POSIX_FD " + std::to_string(fd));
  return handle;
}

CUmemGenericAllocationHandle import_fabric(int pid, const std::string& bytes) {
  if (bytes.size() != kFabricHandleBytes) {
    throw Error(ErrorKind::kInvalidArgument, "peer pid " + std::to_string(pid) + " sent no fabric handle (" +
                                                 std::to_string(bytes.size()) + " bytes, expected " +
                                                 std::to_string(kFabricHandleBytes) + ")");
  }
  CUmemFabricHandle fabric = {};
  std::memcpy(&fabric, bytes.data(), sizeof(fabric));
  CUmemGenericAllocationHandle handle = 0;
  const CUresult result = driver().mem_import_from_shareable_handle(&handle, &fabric, CU_MEM_HANDLE_TYPE_FABRIC);
  if (result == CUDA_ERROR_NOT_PERMITTED) {
    throw Error(ErrorKind::kPeerAccess,
                "cuMemImportFromShareableHandle(FABRIC) of pid " + std::to_string(pid) + " failed with " +
                    describe(result) + ": this process has no access to the exporter's IMEX channel",
                static_cast<int>(result), "cuMemImportFromShareableHandle");
  }
  check(result, "cuMemImportFromShareableHandle", "GPU part of pid " + std::to_string(pid) + ", FABRIC");
  return handle;
}

}  // namespace

PeerMapping::PeerMapping(int device, const PeerSource& source) : device_(device) {
  try {
    build(source);
  } catch (...) {
    cleanup();
    closed_ = true;
    throw;
  }
}

PeerMapping::~PeerMapping() {
  if (!closed_) cleanup();
}

void PeerMapping::build(const PeerSource& source) {
  if (source.num_gpu_bytes == 0 || source.num_gpu_bytes % source.alignment != 0 ||
      source.num_host_bytes % source.alignment != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "peer sizes must be non-zero multiples of the alignment " + std::to_string(source.alignment) +
                    ", got GPU " + std::to_string(source.num_gpu_bytes) + " / host " +
                    std::to_string(source.num_host_bytes) + " bytes");
  }
  if (source.host_method == ImportMethod::kFabric) {
    throw Error(ErrorKind::kInvalidArgument, "host NUMA parts cannot be imported through fabric handles");
  }
  ScopedContext scope(device_);
  const DriverApi& api = driver();
  num_gpu_bytes_ = source.num_gpu_bytes;
  num_host_bytes_ = source.num_host_bytes;

  if (source.gpu_method == ImportMethod::kRetain || source.host_method == ImportMethod::kRetain) {
    if (source.gpu_method != source.host_method && num_host_bytes_ > 0) {
      throw Error(ErrorKind::kInvalidArgument, "same-process peers import both parts by retaining their handles");
    }
    CUmemGenericAllocationHandle gpu = 0, host = 0;
    if (!retain_registered(source.token, &gpu, &host)) {
      throw Error(ErrorKind::kInvalidArgument,
                  "no live allocation of this process has the peer's token (pid " + std::to_string(source.pid) +
                      "): it was closed before its peers imported it");
    }
    gpu_handle_ = gpu;
    have_gpu_handle_ = true;
    if (num_host_bytes_ > 0) {
      host_handle_ = host;
      have_host_handle_ = true;
    } else if (host != 0) {
      api.mem_release(host);
    }
  } else {
    gpu_handle_ = source.gpu_method == ImportMethod::kFabric
                      ? import_fabric(source.pid, source.gpu_fabric_handle)
                      : import_posix_fd(source.pid, source.gpu_fd, "GPU part");
    have_gpu_handle_ = true;
    if (num_host_bytes_ > 0) {
      host_handle_ = import_posix_fd(source.pid, source.host_fd, "host NUMA part");
      have_host_handle_ = true;
    }
  }

  CUdeviceptr base = 0;
  check(api.mem_address_reserve(&base, num_gpu_bytes_ + num_host_bytes_, source.alignment, 0, 0),
        "cuMemAddressReserve", "peer pid " + std::to_string(source.pid) + ", " +
                                   std::to_string(num_gpu_bytes_ + num_host_bytes_) + " bytes");
  base_ = static_cast<uint64_t>(base);
  check(api.mem_map(base, num_gpu_bytes_, 0, gpu_handle_, 0), "cuMemMap",
        "GPU part of peer pid " + std::to_string(source.pid));
  gpu_mapped_ = true;
  if (num_host_bytes_ > 0) {
    check(api.mem_map(base + num_gpu_bytes_, num_host_bytes_, 0, host_handle_, 0), "cuMemMap",
          "host NUMA part of peer pid " + std::to_string(source.pid));
    host_mapped_ = true;
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(api.mem_set_access(base, num_gpu_bytes_ + num_host_bytes_, &access, 1), "cuMemSetAccess",
        "peer pid " + std::to_string(source.pid) + ", read/write for device " + std::to_string(device_) +
            " (a peer on another GPU needs peer access between the two devices)");
}

void PeerMapping::close() {
  if (closed_) return;
  closed_ = true;
  const std::string failure = cleanup();
  if (!failure.empty()) throw Error(ErrorKind::kCuda, "close() of a peer mapping: " + failure);
}

std::string PeerMapping::cleanup() noexcept {
  if (!driver_loaded()) return {};
  const DriverApi& api = driver();
  std::string failure;
  auto note = [&](CUresult result, const char* call, const char* what) {
    if (result != CUDA_SUCCESS && failure.empty()) failure = std::string(call) + "(" + what + ") failed with " + describe(result);
  };
  bool pushed = false;
  try {
    pushed = api.ctx_push_current(primary_context(device_)) == CUDA_SUCCESS;
  } catch (const Error&) {
  }
  const CUdeviceptr base = static_cast<CUdeviceptr>(base_);
  if (host_mapped_) {
    note(api.mem_unmap(base + num_gpu_bytes_, num_host_bytes_), "cuMemUnmap", "peer host NUMA part");
    host_mapped_ = false;
  }
  if (gpu_mapped_) {
    note(api.mem_unmap(base, num_gpu_bytes_), "cuMemUnmap", "peer GPU part");
    gpu_mapped_ = false;
  }
  if (have_host_handle_) {
    note(api.mem_release(host_handle_), "cuMemRelease", "peer host NUMA part");
    have_host_handle_ = false;
  }
  if (have_gpu_handle_) {
    note(api.mem_release(gpu_handle_), "cuMemRelease", "peer GPU part");
    have_gpu_handle_ = false;
  }
  if (base_ != 0) {
    note(api.mem_address_free(base, num_gpu_bytes_ + num_host_bytes_), "cuMemAddressFree", "peer range");
    base_ = 0;
  }
  if (pushed) {
    CUcontext popped = nullptr;
    api.ctx_pop_current(&popped);
  }
  return failure;
}

}  // namespace ep_symmem
