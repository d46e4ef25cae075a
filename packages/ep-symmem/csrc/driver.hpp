#pragma once
// Lazily loaded CUDA driver. Nothing here runs at import: the first call of driver() dlopens the library
// (default "libcuda.so.1"), calls cuInit(0) and resolves every entry point through cuGetProcAddress. A failure is
// remembered and rethrown by every later call (it names what is missing). libcuda is never linked.

#include <cuda.h>

#include <string>

namespace ep_symmem {

struct DriverApi {
  int version = 0;  // cuDriverGetVersion, e.g. 13000
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuDeviceGetCount) device_get_count = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&::cuDeviceGetUuid) device_get_uuid = nullptr;
  decltype(&::cuDeviceGetName) device_get_name = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain = nullptr;
  decltype(&::cuCtxPushCurrent) ctx_push_current = nullptr;
  decltype(&::cuCtxPopCurrent) ctx_pop_current = nullptr;
  decltype(&::cuCtxGetCurrent) ctx_get_current = nullptr;
  decltype(&::cuCtxGetDevice) ctx_get_device = nullptr;
  decltype(&::cuCtxSynchronize) ctx_synchronize = nullptr;
  decltype(&::cuMemGetInfo) mem_get_info = nullptr;
  decltype(&::cuMemAlloc) mem_alloc = nullptr;
  decltype(&::cuMemFree) mem_free = nullptr;
  decltype(&::cuMemcpy) memcpy = nullptr;
  decltype(&::cuMemsetD8) memset_d8 = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_allocation_granularity = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
  decltype(&::cuMemExportToShareableHandle) mem_export_to_shareable_handle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) mem_import_from_shareable_handle = nullptr;
  decltype(&::cuMemRetainAllocationHandle) mem_retain_allocation_handle = nullptr;
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuLaunchKernel) launch_kernel = nullptr;
};

// Path handed to dlopen on the first driver() call. Ignored once the driver is loaded. Host only.
void set_driver_library(const std::string& path);
const std::string& driver_library();

// The loaded driver; throws Error (kDriverNotFound / kNoDevice / kCuda) when it cannot be loaded.
const DriverApi& driver();

// True when driver() has succeeded before (never loads anything).
bool driver_loaded();

// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"; works without a loaded driver (prints the number).
std::string describe(CUresult result);

// Throws Error naming `call` (and `what`, free text on the arguments) when result != CUDA_SUCCESS.
void check(CUresult result, const char* call, const std::string& what = {});

}  // namespace ep_symmem
