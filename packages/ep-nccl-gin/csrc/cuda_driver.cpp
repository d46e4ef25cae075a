#include "cuda_driver.hpp"

#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "errors.hpp"

namespace ep_nccl_gin::cuda_driver {
namespace {

struct Driver {
  CUresult (*init)(unsigned int) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*memcpy)(CUdeviceptr, CUdeviceptr, size_t) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
};

Driver g_driver;
std::once_flag g_once;
std::string g_load_error;

template <typename Fn>
bool take(void* handle, const char* name, Fn& out) {
  out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (out == nullptr) g_load_error = std::string("libcuda.so.1 has no entry point ") + name;
  return out != nullptr;
}

const Driver& driver() {
  std::call_once(g_once, [] {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      g_load_error = std::string("cannot load the CUDA driver libcuda.so.1 (") + (why ? why : "?") +
                     "); this needs a machine with an NVIDIA GPU and driver";
      return;
    }
    Driver d;
    bool ok = take(handle, "cuInit", d.init) && take(handle, "cuDeviceGet", d.device_get) &&
              take(handle, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain) &&
              take(handle, "cuCtxSetCurrent", d.ctx_set_current) &&
              take(handle, "cuCtxGetCurrent", d.ctx_get_current) && take(handle, "cuMemcpy", d.memcpy) &&
              take(handle, "cuGetErrorString", d.get_error_string);
    if (ok) g_driver = d;
  });
  if (g_driver.init == nullptr) throw CallError(g_load_error, "dlopen(libcuda.so.1)", -1);
  return g_driver;
}

void check(CUresult res, const char* call) {
  if (res == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (g_driver.get_error_string != nullptr) g_driver.get_error_string(res, &text);
  throw CallError(std::string(call) + " failed: CUresult " + std::to_string(static_cast<int>(res)) + " (" +
                      (text ? text : "unknown") + ")",
                  call, static_cast<int>(res));
}

void make_primary_current(const Driver& d, int device) {
  check(d.init(0), "cuInit");
  CUdevice dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  // The retain is deliberately never released: the runtime (and NCCL through it) uses this same context.
  check(d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(d.ctx_set_current(ctx), "cuCtxSetCurrent");
}

}  // namespace

void set_device(int device) { make_primary_current(driver(), device); }

void ensure_context(int device) {
  const Driver& d = driver();
  check(d.init(0), "cuInit");
  CUcontext ctx = nullptr;
  check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) make_primary_current(d, device);
}

void copy(void* dst, const void* src, std::size_t nbytes) {
  const Driver& d = driver();
  check(d.memcpy(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), nbytes), "cuMemcpy");
}

}  // namespace ep_nccl_gin::cuda_driver
