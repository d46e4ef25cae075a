// C++ exceptions of the extension; module.cpp translates each into the Python class of ep_nccl_gin.errors
// named in its comment.
#pragma once

#include <stdexcept>
#include <string>

namespace ep_nccl_gin {

// -> NcclNotFoundError: no NCCL library is bound, or it lacks an entry point every supported NCCL has.
struct NotFoundError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// -> NcclVersionError: the loaded NCCL (or the headers compiled in) lacks what a feature needs.
struct VersionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// -> NcclCallError: an NCCL (or CUDA driver) call returned an error code.
struct CallError : std::runtime_error {
  CallError(const std::string& message, std::string call_, int result_)
      : std::runtime_error(message), call(std::move(call_)), result(result_) {}
  std::string call;
  int result;
};

}  // namespace ep_nccl_gin
