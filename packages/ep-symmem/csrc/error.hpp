#pragma once
// The one C++ exception type of ep_symmem. module.cpp translates it into the Python hierarchy of
// ep_symmem._errors (ErrorKind -> class), carrying the failing driver call and its CUresult code.

#include <stdexcept>
#include <string>
#include <utility>

namespace ep_symmem {

enum class ErrorKind {
  kDriverNotFound,   // libcuda.so.1 missing, a stub, or too old -> DriverNotFoundError
  kNoDevice,         // no CUDA device / ordinal out of range -> NoDeviceError
  kCuda,             // a driver call returned an error -> CudaError
  kUnsupported,      // a device capability is missing -> UnsupportedError
  kPeerAccess,       // pidfd_open / pidfd_getfd failed -> PeerAccessError
  kInvalidArgument,  // bad argument -> SymmemValueError
  kClosed,           // use after close() -> AllocationClosedError
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, int code = 0, std::string call = {})
      : std::runtime_error(message), kind_(kind), code_(code), call_(std::move(call)) {}

  ErrorKind kind() const noexcept { return kind_; }
  // CUresult (kCuda, kNoDevice, kDriverNotFound) or errno (kPeerAccess); 0 when not applicable.
  int code() const noexcept { return code_; }
  // Name of the failing call ("cuMemCreate", "pidfd_getfd", ...); empty when not applicable.
  const std::string& call() const noexcept { return call_; }

 private:
  ErrorKind kind_;
  int code_;
  std::string call_;
};

}  // namespace ep_symmem
