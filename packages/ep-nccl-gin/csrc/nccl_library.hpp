// NCCL entry points resolved at run time from the library that cuda.pathfinder loaded.
//
// The extension is compiled against the NCCL headers of an installed nvidia-nccl wheel but never links
// libnccl: every call goes through a pointer taken with dlsym from the handle that Python passes in
// (`bind(handle, path)`). Entry points that the loaded library lacks stay null; the callers check them
// and name the missing symbol.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <string>

// NCCL_VERSION(2, 29, 2) and friends are macros of nccl.h; these name the versions that add host entry points
// or struct fields that this binding uses. They are compared with NCCL_VERSION_CODE of the headers compiled in.
#define EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS (NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 2))
#define EP_NCCL_GIN_HEADERS_HAVE_GIN_CONNECTION_TYPE (NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7))
#define EP_NCCL_GIN_HEADERS_HAVE_GIN_TRAFFIC_CLASS (NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 3))
#define EP_NCCL_GIN_HEADERS_HAVE_RUNTIME_VERSION_DEVCOMM (NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0))

namespace ep_nccl_gin {

// Signatures spelled out (not decltype(&ncclX)) because several names are overloaded for the device in
// nccl_device/*.h, which makes decltype ambiguous.
struct NcclLibrary {
  using GetVersionFn = ncclResult_t (*)(int*);
  using GetErrorStringFn = const char* (*)(ncclResult_t);
  using GetLastErrorFn = const char* (*)(ncclComm_t);
  using GetUniqueIdFn = ncclResult_t (*)(ncclUniqueId*);
  using CommInitRankFn = ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int);
  using CommFn = ncclResult_t (*)(ncclComm_t);
  using CommIntFn = ncclResult_t (*)(const ncclComm_t, int*);
  using CommAsyncErrorFn = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
  using MemAllocFn = ncclResult_t (*)(void**, size_t);
  using MemFreeFn = ncclResult_t (*)(void*);
  using WindowRegisterFn = ncclResult_t (*)(ncclComm_t, void*, size_t, ncclWindow_t*, int);
  using WindowDeregisterFn = ncclResult_t (*)(ncclComm_t, ncclWindow_t);
  using DevCommCreateFn = ncclResult_t (*)(ncclComm_t, ncclDevCommRequirements_t const*, ncclDevComm_t*);
  using DevCommDestroyFn = ncclResult_t (*)(ncclComm_t, ncclDevComm_t const*);
  using TeamFn = ncclTeam_t (*)(ncclComm_t);
  using GetDevicePointerFn = ncclResult_t (*)(ncclWindow_t, size_t, int, void**);
#if EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS
  using CommQueryPropertiesFn = ncclResult_t (*)(ncclComm_t, ncclCommProperties_t*);
#endif

  void* handle = nullptr;
  std::string path;

  // Present in every NCCL this binding accepts (load fails without them).
  GetVersionFn get_version = nullptr;
  GetErrorStringFn get_error_string = nullptr;
  GetUniqueIdFn get_unique_id = nullptr;
  CommInitRankFn comm_init_rank = nullptr;
  CommFn comm_destroy = nullptr;
  CommFn comm_abort = nullptr;
  CommIntFn comm_count = nullptr;
  CommIntFn comm_user_rank = nullptr;
  CommIntFn comm_cu_device = nullptr;
  CommAsyncErrorFn comm_get_async_error = nullptr;

  // Optional: null when the loaded library predates them.
  GetLastErrorFn get_last_error = nullptr;                   // 2.13
  MemAllocFn mem_alloc = nullptr;                            // 2.19
  MemFreeFn mem_free = nullptr;                              // 2.19
  WindowRegisterFn comm_window_register = nullptr;           // 2.27
  WindowDeregisterFn comm_window_deregister = nullptr;       // 2.27
  DevCommCreateFn dev_comm_create = nullptr;                 // 2.28.3
  DevCommDestroyFn dev_comm_destroy = nullptr;               // 2.28.3
  TeamFn team_lsa = nullptr;                                 // 2.28.3
  TeamFn team_world = nullptr;                               // 2.28.3
  GetDevicePointerFn get_lsa_device_pointer = nullptr;       // 2.29.2
  GetDevicePointerFn get_peer_device_pointer = nullptr;      // 2.29.2
#if EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS
  CommQueryPropertiesFn comm_query_properties = nullptr;     // 2.29.2
#endif

  int runtime_version = 0;
};

// Resolve every entry point from `handle` (a dlopen handle; 0 means dlopen(path, RTLD_NOLOAD)). Throws
// NcclLoadError (std::runtime_error subclass) when a required entry point is missing.
void bind_library(std::uintptr_t handle, const std::string& path);

// The bound library; throws NcclLoadError when bind_library was not called.
const NcclLibrary& library();
bool library_bound();

// NCCL_VERSION_CODE of the headers this extension was compiled against.
constexpr int kHeaderVersion = NCCL_VERSION_CODE;

}  // namespace ep_nccl_gin
