#include "local_allocation.hpp"

#include <unistd.h>

#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "context.hpp"
#include "driver.hpp"
#include "error.hpp"

namespace ep_symmem {
namespace {

std::mutex g_registry_mutex;
std::map<Token, const LocalAllocation*> g_registry;

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

Token random_token() {
  std::random_device entropy;
  Token token{};
  for (size_t i = 0; i < token.size(); i += 4) {
    const uint32_t word = entropy();
    for (size_t j = 0; j < 4; ++j) token[i + j] = static_cast<uint8_t>(word >> (8 * j));
  }
  return token;
}

std::string bytes_text(size_t bytes) { return std::to_string(bytes) + " bytes"; }

struct Candidate {
  unsigned handle_types;
  bool rdma;
};

std::string handle_types_text(unsigned types) {
  std::string text;
  if (types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) text += "POSIX_FD";
  if (types & CU_MEM_HANDLE_TYPE_FABRIC) text += text.empty() ? "FABRIC" : "|FABRIC";
  return text.empty() ? "NONE" : text;
}

bool may_fall_back(CUresult result) {
  return result == CUDA_ERROR_NOT_PERMITTED || result == CUDA_ERROR_NOT_SUPPORTED || result == CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

LocalAllocation::LocalAllocation(int device, size_t num_gpu_bytes, size_t num_host_bytes, HandleMode mode,
                                 bool require_rdma)
    : device_(device) {
  if (num_gpu_bytes == 0) {
    throw Error(ErrorKind::kInvalidArgument, "num_gpu_bytes must be > 0, got 0");
  }
  gpu_.num_bytes = num_gpu_bytes;
  host_.num_bytes = num_host_bytes;
  try {
    build(mode, require_rdma);
  } catch (...) {
    cleanup();
    closed_ = true;
    throw;
  }
}

LocalAllocation::~LocalAllocation() {
  if (!closed_) cleanup();
}

void LocalAllocation::build(HandleMode mode, bool require_rdma) {
  ScopedContext scope(device_);
  const DriverApi& api = driver();
  const std::string where = "device " + std::to_string(device_);

  if (!device_attribute(device_, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")) {
    throw Error(ErrorKind::kUnsupported,
                where + " reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0: CUDA virtual memory "
                        "management (cuMemCreate/cuMemMap) is required for symmetric memory");
  }
  const bool posix = device_attribute(device_, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                      "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED") != 0;
  const bool fabric = device_attribute(device_, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
                                       "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED") != 0;
  const bool rdma = device_attribute(device_, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                     "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED") != 0;
  if (require_rdma && !rdma) {
    throw Error(ErrorKind::kUnsupported,
                where + " reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 0: RDMA on VMM "
                        "memory needs GPUDirect RDMA with CUDA VMM (a data-center GPU, driver >= 525 and the "
                        "nvidia-peermem / dma-buf path); pass require_rdma=False for NVLink/IPC-only use");
  }
  if (mode == HandleMode::kPosixFd && !posix) {
    throw Error(ErrorKind::kUnsupported,
                where + " reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0: cannot "
                        "export POSIX fd handles; try handle_type='fabric' or 'auto'");
  }
  if (mode == HandleMode::kFabric && !fabric) {
    throw Error(ErrorKind::kUnsupported,
                where + " reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0: fabric handles need a "
                        "multi-node NVLink system with IMEX channels; use handle_type='posix_fd' or 'auto'");
  }
  if (!posix && !fabric) {
    throw Error(ErrorKind::kUnsupported, where + " supports neither POSIX fd nor fabric shareable handles "
                                                 "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_*_SUPPORTED = 0)");
  }
  if (host_.num_bytes > 0 && !posix) {
    throw Error(ErrorKind::kUnsupported,
                where + " cannot export POSIX fds, which the host NUMA part needs; use num_host_bytes=0");
  }

  // Candidate property sets for the GPU part, most capable first; later ones are fallbacks.
  const unsigned base_types = posix ? static_cast<unsigned>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) : 0u;
  std::vector<Candidate> candidates;
  const bool want_fabric = mode != HandleMode::kPosixFd && fabric;
  for (bool with_rdma : {true, false}) {
    if (with_rdma && !rdma) continue;
    if (!with_rdma && require_rdma) continue;
    if (want_fabric) candidates.push_back({base_types | CU_MEM_HANDLE_TYPE_FABRIC, with_rdma});
    if (mode != HandleMode::kFabric && base_types != 0) candidates.push_back({base_types, with_rdma});
  }
  if (candidates.empty()) {
    throw Error(ErrorKind::kUnsupported, where + ": no combination of handle types and RDMA flag fits the request");
  }

  CUmemAllocationProp gpu_prop = {};
  gpu_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  gpu_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  gpu_prop.location.id = device_;
  // Granularity does not depend on the optional features; ask without them so that a driver that refuses FABRIC
  // cannot fail the query.
  gpu_prop.requestedHandleTypes =
      static_cast<CUmemAllocationHandleType>(base_types != 0 ? base_types : candidates.back().handle_types);

  size_t granularity = 0;
  check(api.mem_get_allocation_granularity(&granularity, &gpu_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity", where + ", DEVICE location");
  alignment_ = std::lcm(kAlignmentBytes, granularity);

  CUmemAllocationProp host_prop = {};
  if (host_.num_bytes > 0) {
    host_numa_id_ = device_attribute(device_, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID");
    // -1: no NUMA on this system; cuMemCreate then wants id 0.
    if (host_numa_id_ < 0) host_numa_id_ = 0;
    host_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    host_prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    host_prop.location.id = host_numa_id_;
    host_prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t host_granularity = 0;
    check(api.mem_get_allocation_granularity(&host_granularity, &host_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity", "HOST_NUMA location " + std::to_string(host_numa_id_));
    alignment_ = std::lcm(alignment_, host_granularity);
  }
  gpu_.num_bytes = round_up(gpu_.num_bytes, alignment_);
  host_.num_bytes = round_up(host_.num_bytes, alignment_);

  // GPU part: try the candidates in order.
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& candidate = candidates[i];
    gpu_prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(candidate.handle_types);
    gpu_prop.allocFlags.gpuDirectRDMACapable = candidate.rdma ? 1 : 0;
    const CUresult result = api.mem_create(&gpu_.handle, gpu_.num_bytes, &gpu_prop, 0);
    const std::string what = where + ", " + bytes_text(gpu_.num_bytes) + ", handle types " +
                             handle_types_text(candidate.handle_types) +
                             (candidate.rdma ? ", gpuDirectRDMACapable" : "");
    if (result == CUDA_SUCCESS) {
      gpu_.created = true;
      gpu_.handle_types = candidate.handle_types;
      rdma_capable_ = candidate.rdma;
      break;
    }
    if (i + 1 < candidates.size() && may_fall_back(result)) {
      notes_ += "cuMemCreate(" + what + ") failed with " + describe(result) + "; retried with fewer features. ";
      continue;
    }
    if (mode == HandleMode::kFabric && may_fall_back(result)) {
      throw Error(ErrorKind::kUnsupported,
                  "cuMemCreate(" + what + ") failed with " + describe(result) +
                      ": fabric handles need an IMEX channel (/dev/nvidia-caps-imex-channels) for this user; use "
                      "handle_type='auto' or 'posix_fd' on a single node",
                  static_cast<int>(result), "cuMemCreate");
    }
    check(result, "cuMemCreate", what);
  }

  if (host_.num_bytes > 0) {
    check(api.mem_create(&host_.handle, host_.num_bytes, &host_prop, 0), "cuMemCreate",
          bytes_text(host_.num_bytes) + " at HOST_NUMA location " + std::to_string(host_numa_id_) + ", handle type POSIX_FD");
    host_.created = true;
    host_.handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  }

  reserved_bytes_ = gpu_.num_bytes + host_.num_bytes;
  CUdeviceptr base = 0;
  check(api.mem_address_reserve(&base, reserved_bytes_, alignment_, 0, 0), "cuMemAddressReserve",
        bytes_text(reserved_bytes_) + ", alignment " + std::to_string(alignment_));
  base_ = static_cast<uint64_t>(base);

  check(api.mem_map(base, gpu_.num_bytes, 0, gpu_.handle, 0), "cuMemMap", "GPU part, " + where);
  gpu_.mapped = true;
  if (host_.num_bytes > 0) {
    check(api.mem_map(base + gpu_.num_bytes, host_.num_bytes, 0, host_.handle, 0), "cuMemMap", "host NUMA part");
    host_.mapped = true;
  }

  CUmemAccessDesc access[2] = {};
  access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access[0].location.id = device_;
  access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(api.mem_set_access(base, gpu_.num_bytes, access, 1), "cuMemSetAccess", "GPU part, read/write for " + where);
  if (host_.num_bytes > 0) {
    // Device access plus CPU access (HOST_NUMA location; its id is ignored by the driver) in one call; if the
    // driver refuses CPU access, the device still gets access and host_view() reports why it is unavailable.
    access[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    access[1].location.id = host_numa_id_;
    access[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const CUresult result = api.mem_set_access(base + gpu_.num_bytes, host_.num_bytes, access, 2);
    if (result == CUDA_SUCCESS) {
      host_cpu_access_ = true;
    } else {
      host_cpu_access_error_ = "cuMemSetAccess(host NUMA part, read/write for " + where + " and HOST_NUMA " +
                               std::to_string(host_numa_id_) + ") failed with " + describe(result);
      check(api.mem_set_access(base + gpu_.num_bytes, host_.num_bytes, access, 1), "cuMemSetAccess",
            "host NUMA part, read/write for " + where);
    }
  }

  if (gpu_.handle_types & CU_MEM_HANDLE_TYPE_FABRIC) {
    CUmemFabricHandle handle = {};
    const CUresult result =
        api.mem_export_to_shareable_handle(&handle, gpu_.handle, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    if (result == CUDA_SUCCESS) {
      gpu_.fabric_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    } else if (mode == HandleMode::kFabric) {
      throw Error(ErrorKind::kUnsupported,
                  "cuMemExportToShareableHandle(FABRIC) failed with " + describe(result) +
                      ": fabric handles need an IMEX channel for this user; use handle_type='auto' or 'posix_fd'",
                  static_cast<int>(result), "cuMemExportToShareableHandle");
    } else {
      notes_ += "cuMemExportToShareableHandle(FABRIC) failed with " + describe(result) +
                "; the descriptor carries POSIX fds only. ";
    }
  }

  token_ = random_token();
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry[token_] = this;
    registered_ = true;
  }
}

std::pair<int, int> LocalAllocation::export_fds() {
  if (closed_) throw Error(ErrorKind::kClosed, "export_fds() on a closed allocation");
  const DriverApi& api = driver();
  for (Part* part : {&gpu_, &host_}) {
    if (!part->created || part->export_fd >= 0) continue;
    if (!(part->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) continue;
    int fd = -1;
    check(api.mem_export_to_shareable_handle(&fd, part->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle", part == &gpu_ ? "GPU part, POSIX_FD" : "host NUMA part, POSIX_FD");
    part->export_fd = fd;
  }
  return {gpu_.export_fd, host_.export_fd};
}

void LocalAllocation::release_export_fds() noexcept {
  for (Part* part : {&gpu_, &host_}) {
    if (part->export_fd >= 0) {
      ::close(part->export_fd);
      part->export_fd = -1;
    }
  }
}

void LocalAllocation::close() {
  if (closed_) return;
  closed_ = true;
  const std::string failure = cleanup();
  if (!failure.empty()) throw Error(ErrorKind::kCuda, "close() of a symmetric allocation: " + failure);
}

std::string LocalAllocation::cleanup() noexcept {
  if (registered_) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry.erase(token_);
    registered_ = false;
  }
  release_export_fds();
  if (!driver_loaded()) return {};
  const DriverApi& api = driver();
  std::string failure;
  auto note = [&](CUresult result, const char* call, const char* what) {
    if (result != CUDA_SUCCESS && failure.empty()) failure = std::string(call) + "(" + what + ") failed with " + describe(result);
  };
  CUcontext ctx = nullptr;
  bool pushed = false;
  try {
    ctx = primary_context(device_);
    pushed = api.ctx_push_current(ctx) == CUDA_SUCCESS;
  } catch (const Error&) {
    // Unmapping works without a current context; carry on.
  }
  const CUdeviceptr base = static_cast<CUdeviceptr>(base_);
  if (host_.mapped) {
    note(api.mem_unmap(base + gpu_.num_bytes, host_.num_bytes), "cuMemUnmap", "host NUMA part");
    host_.mapped = false;
  }
  if (gpu_.mapped) {
    note(api.mem_unmap(base, gpu_.num_bytes), "cuMemUnmap", "GPU part");
    gpu_.mapped = false;
  }
  for (Part* part : {&host_, &gpu_}) {
    if (part->created) {
      note(api.mem_release(part->handle), "cuMemRelease", part == &gpu_ ? "GPU part" : "host NUMA part");
      part->created = false;
    }
  }
  if (base_ != 0) {
    note(api.mem_address_free(base, reserved_bytes_), "cuMemAddressFree", "reserved range");
    base_ = 0;
  }
  if (pushed) {
    CUcontext popped = nullptr;
    api.ctx_pop_current(&popped);
  }
  return failure;
}

bool retain_registered(const Token& token, CUmemGenericAllocationHandle* gpu, CUmemGenericAllocationHandle* host) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_registry.find(token);
  if (it == g_registry.end()) return false;
  const LocalAllocation& owner = *it->second;
  const DriverApi& api = driver();
  const CUdeviceptr base = static_cast<CUdeviceptr>(owner.base());
  check(api.mem_retain_allocation_handle(gpu, reinterpret_cast<void*>(base)), "cuMemRetainAllocationHandle",
        "GPU part of a same-process peer");
  *host = 0;
  if (owner.num_host_bytes() > 0) {
    const CUresult result =
        api.mem_retain_allocation_handle(host, reinterpret_cast<void*>(base + owner.num_gpu_bytes()));
    if (result != CUDA_SUCCESS) {
      api.mem_release(*gpu);
      check(result, "cuMemRetainAllocationHandle", "host NUMA part of a same-process peer");
    }
  }
  return true;
}

bool is_registered(const Token& token) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  return g_registry.count(token) != 0;
}

}  // namespace ep_symmem
