#include "device_ops.hpp"

#include <cuda.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "context.hpp"
#include "driver.hpp"
#include "error.hpp"

namespace ep_symmem {
namespace {

// dst[i] = first + i * step, grid-stride loop over i < count. Generic stores, so dst may be device memory, a peer
// mapping or the host NUMA part. PTX for sm_70+, JIT-compiled by the driver for the actual device.
constexpr const char* kFillPtx = R"PTX(
.version 7.0
.target sm_70
.address_size 64

.visible .entry ep_symmem_fill_u32(
    .param .u64 param_dst,
    .param .u64 param_count,
    .param .u32 param_first,
    .param .u32 param_step
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [param_dst];
    ld.param.u64 %rd2, [param_count];
    ld.param.u32 %r1, [param_first];
    ld.param.u32 %r2, [param_step];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mov.u32 %r6, %nctaid.x;
    cvt.u64.u32 %rd3, %r3;
    cvt.u64.u32 %rd4, %r4;
    cvt.u64.u32 %rd5, %r5;
    cvt.u64.u32 %rd6, %r6;
    mad.lo.u64 %rd7, %rd3, %rd4, %rd5;
    mul.lo.u64 %rd8, %rd6, %rd4;
LOOP:
    setp.ge.u64 %p1, %rd7, %rd2;
    @%p1 bra DONE;
    cvt.u32.u64 %r7, %rd7;
    mad.lo.u32 %r7, %r7, %r2, %r1;
    shl.b64 %rd9, %rd7, 2;
    add.u64 %rd9, %rd1, %rd9;
    st.u32 [%rd9], %r7;
    add.u64 %rd7, %rd7, %rd8;
    bra.uni LOOP;
DONE:
    ret;
}
)PTX";

std::mutex g_module_mutex;
std::map<int, CUfunction> g_fill_functions;

CUfunction fill_function(int ordinal) {
  std::lock_guard<std::mutex> lock(g_module_mutex);
  auto it = g_fill_functions.find(ordinal);
  if (it != g_fill_functions.end()) return it->second;
  const DriverApi& api = driver();
  CUmodule module = nullptr;
  check(api.module_load_data(&module, kFillPtx), "cuModuleLoadData",
        "ep_symmem fill kernel (PTX), device " + std::to_string(ordinal));
  CUfunction function = nullptr;
  check(api.module_get_function(&function, module, "ep_symmem_fill_u32"), "cuModuleGetFunction",
        "ep_symmem_fill_u32");
  // The module lives as long as the primary context (the process).
  g_fill_functions.emplace(ordinal, function);
  return function;
}

std::string at(int ordinal) { return "device " + std::to_string(ordinal); }

}  // namespace

DeviceInfo device_info(int ordinal) {
  const DriverApi& api = driver();
  CUdevice dev = device(ordinal);
  DeviceInfo info;
  info.ordinal = ordinal;
  info.driver_version = api.version;
  char name[256] = {};
  check(api.device_get_name(name, sizeof(name) - 1, dev), "cuDeviceGetName", at(ordinal));
  info.name = name;
  CUuuid uuid = {};
  check(api.device_get_uuid(&uuid, dev), "cuDeviceGetUuid", at(ordinal));
  info.uuid.assign(uuid.bytes, sizeof(uuid.bytes));
  info.vmm_supported = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED");
  info.posix_fd_supported =
      device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                       "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED");
  info.fabric_supported = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
                                           "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED");
  info.rdma_with_vmm_supported =
      device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                       "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED");
  info.host_numa_id =
      device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID");
  info.compute_capability_major = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                   "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR");
  info.compute_capability_minor = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                   "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR");
  return info;
}

std::pair<size_t, size_t> memory_info(int ordinal) {
  ScopedContext scope(ordinal);
  size_t free_bytes = 0, total_bytes = 0;
  check(driver().mem_get_info(&free_bytes, &total_bytes), "cuMemGetInfo", at(ordinal));
  return {free_bytes, total_bytes};
}

uint64_t device_alloc(int ordinal, size_t num_bytes) {
  ScopedContext scope(ordinal);
  CUdeviceptr ptr = 0;
  check(driver().mem_alloc(&ptr, num_bytes), "cuMemAlloc", std::to_string(num_bytes) + " bytes, " + at(ordinal));
  return static_cast<uint64_t>(ptr);
}

void device_free(int ordinal, uint64_t ptr) {
  ScopedContext scope(ordinal);
  check(driver().mem_free(static_cast<CUdeviceptr>(ptr)), "cuMemFree", at(ordinal));
}

// All copies use the unified cuMemcpy: the driver infers the direction from the pointers (UVA), so a host
// pointer, a GPU part, a peer mapping or a HOST_NUMA host part are all valid on either side.
void copy_host_to_device(int ordinal, uint64_t dst, const void* src, size_t num_bytes) {
  ScopedContext scope(ordinal);
  const DriverApi& api = driver();
  check(api.memcpy(static_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), num_bytes), "cuMemcpy",
        "host to device, " + std::to_string(num_bytes) + " bytes, " + at(ordinal));
  check(api.ctx_synchronize(), "cuCtxSynchronize", "after cuMemcpy");
}

void copy_device_to_host(int ordinal, void* dst, uint64_t src, size_t num_bytes) {
  ScopedContext scope(ordinal);
  const DriverApi& api = driver();
  check(api.memcpy(reinterpret_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), num_bytes), "cuMemcpy",
        "device to host, " + std::to_string(num_bytes) + " bytes, " + at(ordinal));
  check(api.ctx_synchronize(), "cuCtxSynchronize", "after cuMemcpy");
}

void copy_device_to_device(int ordinal, uint64_t dst, uint64_t src, size_t num_bytes) {
  ScopedContext scope(ordinal);
  const DriverApi& api = driver();
  check(api.memcpy(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), num_bytes), "cuMemcpy",
        std::to_string(num_bytes) + " bytes, " + at(ordinal));
  check(api.ctx_synchronize(), "cuCtxSynchronize", "after cuMemcpy");
}

void memset_device(int ordinal, uint64_t dst, uint8_t value, size_t num_bytes) {
  ScopedContext scope(ordinal);
  const DriverApi& api = driver();
  check(api.memset_d8(static_cast<CUdeviceptr>(dst), value, num_bytes), "cuMemsetD8",
        std::to_string(num_bytes) + " bytes, " + at(ordinal));
  check(api.ctx_synchronize(), "cuCtxSynchronize", "after cuMemsetD8");
}

void synchronize(int ordinal) {
  ScopedContext scope(ordinal);
  check(driver().ctx_synchronize(), "cuCtxSynchronize", at(ordinal));
}

void fill_u32(int ordinal, uint64_t dst, uint64_t num_words, uint32_t first, uint32_t step) {
  if (dst % 4 != 0) {
    throw Error(ErrorKind::kInvalidArgument, "fill_u32: dst must be 4-byte aligned, got " + std::to_string(dst));
  }
  if (num_words == 0) return;
  ScopedContext scope(ordinal);
  const DriverApi& api = driver();
  CUfunction function = fill_function(ordinal);
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = std::min<uint64_t>((num_words + kThreads - 1) / kThreads, 4096);
  void* params[] = {&dst, &num_words, &first, &step};
  check(api.launch_kernel(function, static_cast<unsigned>(blocks), 1, 1, kThreads, 1, 1, 0, nullptr, params, nullptr),
        "cuLaunchKernel", "ep_symmem_fill_u32, " + std::to_string(num_words) + " words, " + at(ordinal));
  check(api.ctx_synchronize(), "cuCtxSynchronize", "after ep_symmem_fill_u32 (a fault here means dst is not "
                                                   "mapped read/write for this device)");
}

}  // namespace ep_symmem
