#include "driver.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "error.hpp"

namespace ep_symmem {
namespace {

std::mutex g_mutex;
std::string g_library = "libcuda.so.1";
bool g_tried = false;
std::unique_ptr<Error> g_failure;  // set when the (only) load attempt failed
DriverApi g_api;
bool g_loaded = false;

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

template <class Fn>
void resolve(GetProcAddressFn get_proc, int version, const char* symbol, Fn& out) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = get_proc(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (result != CUDA_SUCCESS || fn == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) {
    throw Error(ErrorKind::kDriverNotFound,
                std::string("the CUDA driver does not provide ") + symbol + " for CUDA version " +
                    std::to_string(version) + " (cuGetProcAddress returned " + std::to_string(result) +
                    ", status " + std::to_string(static_cast<int>(status)) +
                    "): ep_symmem needs a driver for CUDA >= 12.3; update the NVIDIA driver",
                static_cast<int>(result), "cuGetProcAddress");
  }
  out = reinterpret_cast<Fn>(fn);
}

DriverApi load(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    throw Error(ErrorKind::kDriverNotFound,
                "could not load the CUDA driver library '" + library + "' (" + (reason ? reason : "unknown") +
                    "). ep_symmem needs the NVIDIA driver for every GPU call (importing works without it): install "
                    "the driver, or point EPKIT_SYMMEM_LIBCUDA at libcuda.so.1",
                0, "dlopen");
  }
  // The library stays loaded for the life of the process (handles and mappings outlive any Python object).
  auto driver_get_version = reinterpret_cast<decltype(&::cuDriverGetVersion)>(dlsym(handle, "cuDriverGetVersion"));
  auto init = reinterpret_cast<decltype(&::cuInit)>(dlsym(handle, "cuInit"));
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(handle, "cuGetProcAddress_v2"));
  if (driver_get_version == nullptr || init == nullptr || get_proc == nullptr) {
    throw Error(ErrorKind::kDriverNotFound,
                "'" + library + "' lacks cuDriverGetVersion/cuInit/cuGetProcAddress_v2: it is not a CUDA driver "
                "for CUDA >= 12.0; install a recent NVIDIA driver",
                0, "dlsym");
  }
  DriverApi api;
  CUresult result = driver_get_version(&api.version);
  if (result != CUDA_SUCCESS) {
    throw Error(ErrorKind::kDriverNotFound,
                "cuDriverGetVersion failed with code " + std::to_string(result) + " for '" + library + "'",
                static_cast<int>(result), "cuDriverGetVersion");
  }
  result = init(0);
  if (result == CUDA_ERROR_NO_DEVICE) {
    throw Error(ErrorKind::kNoDevice,
                "cuInit failed with CUDA_ERROR_NO_DEVICE: the driver is installed but sees no CUDA device (check "
                "nvidia-smi and CUDA_VISIBLE_DEVICES)",
                static_cast<int>(result), "cuInit");
  }
  if (result == CUDA_ERROR_STUB_LIBRARY) {
    throw Error(ErrorKind::kDriverNotFound,
                "cuInit failed with CUDA_ERROR_STUB_LIBRARY: '" + library + "' is the toolkit's stub library, not "
                "the real driver; install the NVIDIA driver or fix the loader path / EPKIT_SYMMEM_LIBCUDA",
                static_cast<int>(result), "cuInit");
  }
  if (result == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH || result == CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE) {
    throw Error(ErrorKind::kDriverNotFound,
                "cuInit failed with code " + std::to_string(result) + ": the NVIDIA driver (CUDA " +
                    std::to_string(api.version) + ") is too old or incompatible; update the driver",
                static_cast<int>(result), "cuInit");
  }
  if (result != CUDA_SUCCESS) {
    throw Error(ErrorKind::kCuda, "cuInit failed with code " + std::to_string(result), static_cast<int>(result),
                "cuInit");
  }
  if (api.version < 12030) {
    throw Error(ErrorKind::kDriverNotFound,
                "the NVIDIA driver supports CUDA " + std::to_string(api.version) +
                    "; ep_symmem needs CUDA >= 12.3 (12030) for host NUMA VMM allocations; update the driver",
                0, "cuDriverGetVersion");
  }
  // Ask for the ABI of the header we were compiled with, or the driver's own if that is older.
  const int version = std::min(api.version, CUDA_VERSION);
  resolve(get_proc, version, "cuGetErrorName", api.get_error_name);
  resolve(get_proc, version, "cuGetErrorString", api.get_error_string);
  resolve(get_proc, version, "cuDeviceGetCount", api.device_get_count);
  resolve(get_proc, version, "cuDeviceGet", api.device_get);
  resolve(get_proc, version, "cuDeviceGetAttribute", api.device_get_attribute);
  resolve(get_proc, version, "cuDeviceGetUuid", api.device_get_uuid);
  resolve(get_proc, version, "cuDeviceGetName", api.device_get_name);
  resolve(get_proc, version, "cuDevicePrimaryCtxRetain", api.primary_ctx_retain);
  resolve(get_proc, version, "cuCtxPushCurrent", api.ctx_push_current);
  resolve(get_proc, version, "cuCtxPopCurrent", api.ctx_pop_current);
  resolve(get_proc, version, "cuCtxGetCurrent", api.ctx_get_current);
  // CUDA 13 gave these two a context argument (the _v13000 ABIs). Our pointers have the one-argument
  // signature of the plain declaration, so ask for the ABI of a driver older than 13.0.
  const int pre13 = std::min(version, 12090);
  resolve(get_proc, pre13, "cuCtxGetDevice", api.ctx_get_device);
  resolve(get_proc, pre13, "cuCtxSynchronize", api.ctx_synchronize);
  resolve(get_proc, version, "cuMemGetInfo", api.mem_get_info);
  resolve(get_proc, version, "cuMemAlloc", api.mem_alloc);
  resolve(get_proc, version, "cuMemFree", api.mem_free);
  resolve(get_proc, version, "cuMemcpy", api.memcpy);
  resolve(get_proc, version, "cuMemsetD8", api.memset_d8);
  resolve(get_proc, version, "cuMemGetAllocationGranularity", api.mem_get_allocation_granularity);
  resolve(get_proc, version, "cuMemCreate", api.mem_create);
  resolve(get_proc, version, "cuMemRelease", api.mem_release);
  resolve(get_proc, version, "cuMemAddressReserve", api.mem_address_reserve);
  resolve(get_proc, version, "cuMemAddressFree", api.mem_address_free);
  resolve(get_proc, version, "cuMemMap", api.mem_map);
  resolve(get_proc, version, "cuMemUnmap", api.mem_unmap);
  resolve(get_proc, version, "cuMemSetAccess", api.mem_set_access);
  resolve(get_proc, version, "cuMemExportToShareableHandle", api.mem_export_to_shareable_handle);
  resolve(get_proc, version, "cuMemImportFromShareableHandle", api.mem_import_from_shareable_handle);
  resolve(get_proc, version, "cuMemRetainAllocationHandle", api.mem_retain_allocation_handle);
  resolve(get_proc, version, "cuModuleLoadData", api.module_load_data);
  resolve(get_proc, version, "cuModuleGetFunction", api.module_get_function);
  resolve(get_proc, version, "cuLaunchKernel", api.launch_kernel);
  return api;
}

}  // namespace

void set_driver_library(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_tried) g_library = path;
}

const std::string& driver_library() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_library;
}

const DriverApi& driver() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_loaded) return g_api;
    if (g_tried) throw Error(*g_failure);
    g_tried = true;
    try {
      g_api = load(g_library);
      g_loaded = true;
      return g_api;
    } catch (const Error& e) {
      g_failure = std::make_unique<Error>(e);
      throw;
    } catch (const std::exception& e) {
      g_failure = std::make_unique<Error>(ErrorKind::kDriverNotFound,
                                          std::string("loading the CUDA driver failed: ") + e.what());
      throw Error(*g_failure);
    }
  }
}

bool driver_loaded() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_loaded;
}

std::string describe(CUresult result) {
  std::string text = "CUresult " + std::to_string(static_cast<int>(result));
  if (!driver_loaded()) return text;
  const char* name = nullptr;
  const char* message = nullptr;
  if (g_api.get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) return text;
  text = name;
  if (g_api.get_error_string(result, &message) == CUDA_SUCCESS && message != nullptr) {
    text += std::string(" (") + message + ")";
  }
  return text;
}

void check(CUresult result, const char* call, const std::string& what) {
  if (result == CUDA_SUCCESS) return;
  std::string message = std::string(call) + " failed with " + describe(result);
  if (!what.empty()) message += " [" + what + "]";
  if (result == CUDA_ERROR_OUT_OF_MEMORY) {
    message += ": not enough memory for the request; free memory or ask for fewer bytes";
  } else if (result == CUDA_ERROR_NOT_PERMITTED || result == CUDA_ERROR_NOT_SUPPORTED) {
    message += ": the device, driver or system configuration does not allow this operation";
  }
  ErrorKind kind = result == CUDA_ERROR_NO_DEVICE || result == CUDA_ERROR_INVALID_DEVICE ? ErrorKind::kNoDevice
                                                                                         : ErrorKind::kCuda;
  throw Error(kind, message, static_cast<int>(result), call);
}

}  // namespace ep_symmem
