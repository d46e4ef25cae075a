#include "nccl_library.hpp"

#include <dlfcn.h>

#include "errors.hpp"

namespace ep_nccl_gin {
namespace {

NcclLibrary g_library;
bool g_bound = false;

template <typename Fn>
void resolve(void* handle, const char* name, Fn& out, bool required, const std::string& path) {
  dlerror();  // clear
  void* sym = dlsym(handle, name);
  if (sym == nullptr && required) {
    const char* why = dlerror();
    throw NotFoundError(std::string("the NCCL library at ") + path + " has no entry point " + name + " (" +
                        (why ? why : "dlsym returned null") +
                        "); expected a libnccl.so.2 of NCCL >= 2.19. Install nvidia-nccl-cu12/cu13 >= 2.28.7.");
  }
  out = reinterpret_cast<Fn>(sym);
}

}  // namespace

void bind_library(std::uintptr_t handle_value, const std::string& path) {
  void* handle = reinterpret_cast<void*>(handle_value);
  if (handle == nullptr) {
    if (path.empty()) throw NotFoundError("bind_library: neither a dlopen handle nor a library path was given");
    // RTLD_NOLOAD: only take a library that is already loaded (cuda.pathfinder loaded it), never load another copy.
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
      const char* why = dlerror();
      throw NotFoundError("NCCL library " + path + " is not loaded in this process (" + (why ? why : "?") +
                          "); load it first with cuda.pathfinder.load_nvidia_dynamic_lib('nccl')");
    }
  }
  NcclLibrary lib;
  lib.handle = handle;
  lib.path = path;
  resolve(handle, "ncclGetVersion", lib.get_version, true, path);
  resolve(handle, "ncclGetErrorString", lib.get_error_string, true, path);
  resolve(handle, "ncclGetUniqueId", lib.get_unique_id, true, path);
  resolve(handle, "ncclCommInitRank", lib.comm_init_rank, true, path);
  resolve(handle, "ncclCommDestroy", lib.comm_destroy, true, path);
  resolve(handle, "ncclCommAbort", lib.comm_abort, true, path);
  resolve(handle, "ncclCommCount", lib.comm_count, true, path);
  resolve(handle, "ncclCommUserRank", lib.comm_user_rank, true, path);
  resolve(handle, "ncclCommCuDevice", lib.comm_cu_device, true, path);
  resolve(handle, "ncclCommGetAsyncError", lib.comm_get_async_error, true, path);

  resolve(handle, "ncclGetLastError", lib.get_last_error, false, path);
  resolve(handle, "ncclMemAlloc", lib.mem_alloc, false, path);
  resolve(handle, "ncclMemFree", lib.mem_free, false, path);
  resolve(handle, "ncclCommWindowRegister", lib.comm_window_register, false, path);
  resolve(handle, "ncclCommWindowDeregister", lib.comm_window_deregister, false, path);
  resolve(handle, "ncclDevCommCreate", lib.dev_comm_create, false, path);
  resolve(handle, "ncclDevCommDestroy", lib.dev_comm_destroy, false, path);
  resolve(handle, "ncclTeamLsa", lib.team_lsa, false, path);
  resolve(handle, "ncclTeamWorld", lib.team_world, false, path);
  resolve(handle, "ncclGetLsaDevicePointer", lib.get_lsa_device_pointer, false, path);
  resolve(handle, "ncclGetPeerDevicePointer", lib.get_peer_device_pointer, false, path);
#if EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS
  resolve(handle, "ncclCommQueryProperties", lib.comm_query_properties, false, path);
#endif

  int version = 0;
  ncclResult_t res = lib.get_version(&version);
  if (res != ncclSuccess) {
    throw CallError("ncclGetVersion failed with ncclResult_t " + std::to_string(static_cast<int>(res)) +
                        " for the library at " + path,
                    "ncclGetVersion", static_cast<int>(res));
  }
  lib.runtime_version = version;
  g_library = lib;
  g_bound = true;
}

bool library_bound() { return g_bound; }

const NcclLibrary& library() {
  if (!g_bound) {
    throw NotFoundError(
        "no NCCL library is bound to ep_nccl_gin; call ep_nccl_gin.load() (it loads libnccl through "
        "cuda.pathfinder)");
  }
  return g_library;
}

}  // namespace ep_nccl_gin
