#pragma once
// Device ordinals and their primary contexts. ep_symmem works in the device's primary context (the one the CUDA
// runtime, torch and cupy share). It is retained once per device on first use and kept for the life of the
// process, so create/close cycles never tear the context down.

#include <cuda.h>

namespace ep_symmem {

// Number of visible devices (0 is allowed here; device() raises).
int device_count();

// Validates `ordinal` against the visible devices and returns its CUdevice; throws Error(kNoDevice) otherwise.
CUdevice device(int ordinal);

// The device of the calling thread's current context, or 0 when there is none.
int current_device();

// Retained primary context of `ordinal` (retained on first call, never released).
CUcontext primary_context(int ordinal);

// Makes the primary context of `ordinal` current for the scope (push on entry, pop on exit).
class ScopedContext {
 public:
  explicit ScopedContext(int ordinal);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  bool pushed_ = false;
};

// Integer attribute of a device; throws on failure naming the attribute.
int device_attribute(int ordinal, CUdevice_attribute attribute, const char* attribute_name);

}  // namespace ep_symmem
