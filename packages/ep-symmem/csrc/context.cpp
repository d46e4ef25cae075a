#include "context.hpp"

#include <map>
#include <mutex>
#include <string>

#include "driver.hpp"
#include "error.hpp"

namespace ep_symmem {
namespace {
std::mutex g_mutex;
std::map<int, CUcontext> g_contexts;
}  // namespace

int device_count() {
  const DriverApi& api = driver();
  int count = 0;
  check(api.device_get_count(&count), "cuDeviceGetCount");
  return count;
}

CUdevice device(int ordinal) {
  const DriverApi& api = driver();
  const int count = device_count();
  if (count == 0) {
    throw Error(ErrorKind::kNoDevice,
                "no CUDA device is visible (cuDeviceGetCount returned 0); check nvidia-smi and CUDA_VISIBLE_DEVICES");
  }
  if (ordinal < 0 || ordinal >= count) {
    throw Error(ErrorKind::kNoDevice, "device " + std::to_string(ordinal) + " requested but only " +
                                          std::to_string(count) +
                                          " CUDA device(s) are visible; pass a device in [0, " +
                                          std::to_string(count) + ") or check CUDA_VISIBLE_DEVICES");
  }
  CUdevice dev = 0;
  check(api.device_get(&dev, ordinal), "cuDeviceGet", "device " + std::to_string(ordinal));
  return dev;
}

int current_device() {
  const DriverApi& api = driver();
  CUcontext ctx = nullptr;
  check(api.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) return 0;
  CUdevice dev = 0;
  check(api.ctx_get_device(&dev), "cuCtxGetDevice");
  // CUdevice values are the ordinals of the visible devices.
  return static_cast<int>(dev);
}

CUcontext primary_context(int ordinal) {
  CUdevice dev = device(ordinal);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_contexts.find(ordinal);
  if (it != g_contexts.end()) return it->second;
  CUcontext ctx = nullptr;
  check(driver().primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain", "device " + std::to_string(ordinal));
  g_contexts.emplace(ordinal, ctx);
  return ctx;
}

ScopedContext::ScopedContext(int ordinal) {
  CUcontext ctx = primary_context(ordinal);
  check(driver().ctx_push_current(ctx), "cuCtxPushCurrent", "primary context of device " + std::to_string(ordinal));
  pushed_ = true;
}

ScopedContext::~ScopedContext() {
  if (pushed_) {
    CUcontext popped = nullptr;
    driver().ctx_pop_current(&popped);  // cannot fail after a successful push; nothing to report from a destructor
  }
}

int device_attribute(int ordinal, CUdevice_attribute attribute, const char* attribute_name) {
  CUdevice dev = device(ordinal);
  int value = 0;
  check(driver().device_get_attribute(&value, attribute, dev), "cuDeviceGetAttribute",
        std::string(attribute_name) + ", device " + std::to_string(ordinal));
  return value;
}

}  // namespace ep_symmem
