// pybind11 module ep_nccl_gin._impl: thin, handle-based bindings of NCCL's host API.
//
// Every object crosses the boundary as an integer (ncclComm_t, ncclWindow_t, device pointers) or as raw bytes
// (ncclUniqueId, ncclDevComm); lifetimes and version gates live in the Python layer (communicator.py). Every
// ncclResult_t is checked and a failure raises ep_nccl_gin.errors.NcclCallError naming the call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_driver.hpp"
#include "errors.hpp"
#include "nccl_library.hpp"

namespace py = pybind11;

namespace ep_nccl_gin {
namespace {

// Wait for a non-blocking communicator's pending operation at most this long (NCCL's documented polling loop).
constexpr double kInProgressTimeoutSeconds = 300.0;

const char* result_name(int res) {
  switch (res) {
    case 0: return "ncclSuccess";
    case 1: return "ncclUnhandledCudaError";
    case 2: return "ncclSystemError";
    case 3: return "ncclInternalError";
    case 4: return "ncclInvalidArgument";
    case 5: return "ncclInvalidUsage";
    case 6: return "ncclRemoteError";
    case 7: return "ncclInProgress";
    default: return "unknown ncclResult_t";
  }
}

[[noreturn]] void raise_call_error(const NcclLibrary& lib, ncclResult_t res, const char* call, ncclComm_t comm) {
  std::string msg = std::string(call) + " failed: " + result_name(res) + " (" + std::to_string(static_cast<int>(res)) + ")";
  const char* text = lib.get_error_string ? lib.get_error_string(res) : nullptr;
  if (text != nullptr && *text != '\0') msg += ": " + std::string(text);
  const char* last = lib.get_last_error ? lib.get_last_error(comm) : nullptr;
  if (last != nullptr && *last != '\0') msg += "; NCCL reports: " + std::string(last);
  msg += ". Run with NCCL_DEBUG=WARN (or INFO) for NCCL's own diagnostics.";
  throw CallError(msg, call, static_cast<int>(res));
}

// Check an ncclResult_t; ncclInProgress on a non-blocking communicator is polled to completion first.
void check(ncclResult_t res, const char* call, ncclComm_t comm = nullptr) {
  const NcclLibrary& lib = library();
  if (res == ncclInProgress && comm != nullptr) {
    auto start = std::chrono::steady_clock::now();
    while (res == ncclInProgress) {
      ncclResult_t async = ncclSuccess;
      ncclResult_t q = lib.comm_get_async_error(comm, &async);
      if (q != ncclSuccess) raise_call_error(lib, q, "ncclCommGetAsyncError", comm);
      res = async;
      if (res != ncclInProgress) break;
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > kInProgressTimeoutSeconds) {
        throw CallError(std::string(call) + " still in progress after " + std::to_string(kInProgressTimeoutSeconds) +
                            " s on a non-blocking communicator; are all ranks calling it?",
                        call, static_cast<int>(ncclInProgress));
      }
      std::this_thread::yield();
    }
  }
  if (res != ncclSuccess) raise_call_error(lib, res, call, comm);
}

template <typename Fn>
Fn need(Fn fn, const char* symbol, const char* feature, const char* since) {
  if (fn == nullptr) {
    const NcclLibrary& lib = library();
    throw VersionError(std::string(feature) + " needs NCCL >= " + since + " (entry point " + symbol +
                       "), but the loaded NCCL (" + lib.path + ") reports version code " +
                       std::to_string(lib.runtime_version) + " and lacks it. Install nvidia-nccl-cu12/cu13 >= " +
                       since + ".");
  }
  return fn;
}

[[noreturn, maybe_unused]] void header_lacks(const char* feature, const char* since) {
  throw VersionError(std::string(feature) + " needs NCCL headers >= " + since +
                     ", but ep_nccl_gin was compiled against NCCL headers " + std::to_string(kHeaderVersion) +
                     ". Rebuild ep-nccl-gin against a newer nvidia-nccl wheel (pip install --no-build-isolation "
                     "--force-reinstall in an environment that has it).");
}

ncclComm_t as_comm(std::uintptr_t v) {
  if (v == 0) throw std::invalid_argument("comm: expected a non-null ncclComm_t, got 0");
  return reinterpret_cast<ncclComm_t>(v);
}

ncclWindow_t as_window(std::uintptr_t v) {
  if (v == 0) throw std::invalid_argument("window: expected a non-null ncclWindow_t, got 0");
  return reinterpret_cast<ncclWindow_t>(v);
}

std::uintptr_t from_ptr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

py::tuple team_tuple(ncclTeam_t t) { return py::make_tuple(t.nRanks, t.rank, t.stride); }

// ---- device communicator -----------------------------------------------------------------------------------

struct DevCommRequest {
  int lsa_barrier_count = 0;
  int barrier_count = 0;
  int rail_gin_barrier_count = 0;
  std::optional<int> gin_context_count;
  int gin_signal_count = 0;
  int gin_counter_count = 0;
  std::optional<bool> gin_exclusive_contexts;
  std::optional<int> gin_queue_depth;
  std::optional<int> gin_connection_type;  // ncclGinConnectionType_t value (0 none, 1 full, 2 rail)
  std::optional<int> gin_traffic_class;
  std::optional<bool> gin_force_enable;
  bool use_runtime_version = false;
};

ncclDevCommRequirements_t fill_requirements(const DevCommRequest& r) {
#if EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS
  ncclDevCommRequirements_t reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements_t reqs;
  std::memset(&reqs, 0, sizeof(reqs));  // NCCL < 2.29 documents zero-initialisation
#endif
  reqs.lsaBarrierCount = r.lsa_barrier_count;
  reqs.barrierCount = r.barrier_count;
  reqs.railGinBarrierCount = r.rail_gin_barrier_count;
  reqs.ginSignalCount = r.gin_signal_count;
  reqs.ginCounterCount = r.gin_counter_count;
  if (r.gin_context_count) reqs.ginContextCount = *r.gin_context_count;
  if (r.gin_force_enable) reqs.ginForceEnable = *r.gin_force_enable;
#if EP_NCCL_GIN_HEADERS_HAVE_GIN_CONNECTION_TYPE
  if (r.gin_exclusive_contexts) reqs.ginExclusiveContexts = *r.gin_exclusive_contexts;
  if (r.gin_queue_depth) reqs.ginQueueDepth = *r.gin_queue_depth;
  if (r.gin_connection_type) reqs.ginConnectionType = static_cast<ncclGinConnectionType_t>(*r.gin_connection_type);
#else
  if (r.gin_exclusive_contexts) header_lacks("gin_exclusive_contexts (ncclDevCommRequirements.ginExclusiveContexts)", "2.29.7");
  if (r.gin_queue_depth) header_lacks("gin_queue_depth (ncclDevCommRequirements.ginQueueDepth)", "2.29.7");
  if (r.gin_connection_type) header_lacks("gin_connection_type (ncclDevCommRequirements.ginConnectionType)", "2.29.7");
#endif
#if EP_NCCL_GIN_HEADERS_HAVE_GIN_TRAFFIC_CLASS
  if (r.gin_traffic_class) reqs.ginTrafficClass = *r.gin_traffic_class;
#else
  if (r.gin_traffic_class) header_lacks("gin_traffic_class (ncclDevCommRequirements.ginTrafficClass)", "2.30.3");
#endif
#if EP_NCCL_GIN_HEADERS_HAVE_RUNTIME_VERSION_DEVCOMM
  reqs.useRuntimeVersion = r.use_runtime_version;
#else
  if (r.use_runtime_version) header_lacks("a runtime-versioned ncclDevComm (useRuntimeVersion)", "2.31");
#endif
  return reqs;
}

// Bytes of the ncclDevComm that the runtime fills: the header's sizeof, or the runtime's own size when
// useRuntimeVersion is set (headers and library both >= 2.31 but different).
std::size_t dev_comm_storage_bytes(ncclComm_t comm, bool use_runtime_version) {
  if (!use_runtime_version) return sizeof(ncclDevComm);
#if EP_NCCL_GIN_HEADERS_HAVE_RUNTIME_VERSION_DEVCOMM
  const NcclLibrary& lib = library();
  auto query = need(lib.comm_query_properties, "ncclCommQueryProperties", "useRuntimeVersion", "2.31");
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  check(query(comm, &props), "ncclCommQueryProperties", comm);
  if (props.devCommRuntimeVersionSize == 0) {
    throw CallError("ncclCommQueryProperties reported devCommRuntimeVersionSize = 0", "ncclCommQueryProperties", 0);
  }
  return props.devCommRuntimeVersionSize;
#else
  (void)comm;
  header_lacks("a runtime-versioned ncclDevComm (useRuntimeVersion)", "2.31");
#endif
}

py::bytes dev_comm_create(std::uintptr_t comm_v, const DevCommRequest& r) {
  ncclComm_t comm = as_comm(comm_v);
  const NcclLibrary& lib = library();
  auto create = need(lib.dev_comm_create, "ncclDevCommCreate", "the device communicator", "2.28.3");
  ncclDevCommRequirements_t reqs = fill_requirements(r);
  std::size_t nbytes = dev_comm_storage_bytes(comm, r.use_runtime_version);
  // 16-byte aligned zeroed storage: NCCL writes the struct through this pointer.
  std::vector<std::uint64_t> storage((nbytes + 15) / 16 * 2, 0);
  ncclResult_t res;
  {
    py::gil_scoped_release release;  // collective: other ranks may need other Python threads to progress
    res = create(comm, &reqs, reinterpret_cast<ncclDevComm_t*>(storage.data()));
  }
  check(res, "ncclDevCommCreate", comm);
  return py::bytes(reinterpret_cast<const char*>(storage.data()), nbytes);
}

void dev_comm_destroy(std::uintptr_t comm_v, const py::bytes& raw) {
  ncclComm_t comm = as_comm(comm_v);
  const NcclLibrary& lib = library();
  auto destroy = need(lib.dev_comm_destroy, "ncclDevCommDestroy", "the device communicator", "2.28.3");
  std::string data = raw;
  std::vector<std::uint64_t> storage((data.size() + 15) / 16 * 2, 0);
  std::memcpy(storage.data(), data.data(), data.size());
  ncclResult_t res;
  {
    py::gil_scoped_release release;
    res = destroy(comm, reinterpret_cast<const ncclDevComm_t*>(storage.data()));
  }
  check(res, "ncclDevCommDestroy", comm);
}

// Fields of a devcomm laid out as in the headers compiled in (only valid when it was not runtime-versioned).
py::dict dev_comm_info(const py::bytes& raw) {
  std::string data = raw;
  if (data.size() != sizeof(ncclDevComm)) {
    throw std::invalid_argument("dev_comm_info: expected " + std::to_string(sizeof(ncclDevComm)) +
                                " bytes (sizeof(ncclDevComm) of the compiled headers), got " +
                                std::to_string(data.size()));
  }
  ncclDevComm dc;
  std::memcpy(static_cast<void*>(&dc), data.data(), sizeof(dc));
  py::dict d;
  d["rank"] = dc.rank;
  d["nranks"] = dc.nRanks;
  d["lsa_rank"] = dc.lsaRank;
  d["lsa_size"] = dc.lsaSize;
  d["gin_context_count"] = static_cast<int>(dc.ginContextCount);
  d["gin_signal_count"] = dc.ginSignalCount;
  d["gin_counter_count"] = dc.ginCounterCount;
  return d;
}

// ---- windows -----------------------------------------------------------------------------------------------

std::uintptr_t window_lsa_pointer(std::uintptr_t comm_v, std::uintptr_t win_v, int lsa_rank, std::size_t offset) {
  ncclComm_t comm = as_comm(comm_v);
  ncclWindow_t win = as_window(win_v);
  const NcclLibrary& lib = library();
  if (lib.get_lsa_device_pointer != nullptr) {
    void* p = nullptr;
    check(lib.get_lsa_device_pointer(win, offset, lsa_rank, &p), "ncclGetLsaDevicePointer", comm);
    return from_ptr(p);
  }
  // NCCL 2.28 has no host query: read the window's device-side descriptor (layout of the headers compiled in,
  // which the Python layer has checked equal the runtime's) and do what ncclGetLsaPointer does on the device.
  int device = 0;
  check(lib.comm_cu_device(comm, &device), "ncclCommCuDevice", comm);
  cuda_driver::ensure_context(device);
  ncclWindow_vidmem desc;
  cuda_driver::copy(&desc, win, sizeof(desc));
  std::uint64_t base = reinterpret_cast<std::uint64_t>(desc.lsaFlatBase);
  std::uint32_t high = static_cast<std::uint32_t>(base >> 32) +
                       static_cast<std::uint32_t>(lsa_rank) * static_cast<std::uint32_t>(desc.stride4G);
  std::uint64_t peer = (static_cast<std::uint64_t>(high) << 32) | (base & 0xffffffffull);
  return static_cast<std::uintptr_t>(peer + offset);
}

py::dict window_flags() {
  py::dict d;
  d["default"] = NCCL_WIN_DEFAULT;
  d["coll_symmetric"] = NCCL_WIN_COLL_SYMMETRIC;
#ifdef NCCL_WIN_STRICT_ORDERING
  d["strict_ordering"] = NCCL_WIN_STRICT_ORDERING;
#else
  d["strict_ordering"] = py::none();
#endif
  d["required_alignment"] = NCCL_WIN_REQUIRED_ALIGNMENT;
  return d;
}

py::dict comm_properties(std::uintptr_t comm_v) {
#if EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS
  ncclComm_t comm = as_comm(comm_v);
  const NcclLibrary& lib = library();
  auto query = need(lib.comm_query_properties, "ncclCommQueryProperties", "communicator properties", "2.29.2");
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  check(query(comm, &props), "ncclCommQueryProperties", comm);
  py::dict d;
  d["rank"] = props.rank;
  d["nranks"] = props.nRanks;
  d["cuda_device"] = props.cudaDev;
  d["device_api_support"] = props.deviceApiSupport;
  d["multimem_support"] = props.multimemSupport;
  d["gin_type"] = static_cast<int>(props.ginType);
#if EP_NCCL_GIN_HEADERS_HAVE_GIN_CONNECTION_TYPE
  d["n_lsa_teams"] = props.nLsaTeams;
  d["railed_gin_type"] = static_cast<int>(props.railedGinType);
#endif
#if EP_NCCL_GIN_HEADERS_HAVE_RUNTIME_VERSION_DEVCOMM
  d["dev_comm_runtime_version_size"] = props.devCommRuntimeVersionSize;
#endif
  return d;
#else
  (void)comm_v;
  header_lacks("communicator properties (ncclCommQueryProperties)", "2.29.2");
#endif
}

py::dict header_features() {
  py::dict d;
  d["versioned_structs"] = static_cast<bool>(EP_NCCL_GIN_HEADERS_HAVE_VERSIONED_STRUCTS);
  d["gin_connection_type"] = static_cast<bool>(EP_NCCL_GIN_HEADERS_HAVE_GIN_CONNECTION_TYPE);
  d["gin_traffic_class"] = static_cast<bool>(EP_NCCL_GIN_HEADERS_HAVE_GIN_TRAFFIC_CLASS);
  d["runtime_version_devcomm"] = static_cast<bool>(EP_NCCL_GIN_HEADERS_HAVE_RUNTIME_VERSION_DEVCOMM);
#ifdef NCCL_WIN_STRICT_ORDERING
  d["strict_ordering"] = true;
#else
  d["strict_ordering"] = false;
#endif
  return d;
}

// Python exception classes of ep_nccl_gin.errors; leaked on purpose (the translator outlives module teardown).
py::object* g_not_found = nullptr;
py::object* g_version = nullptr;
py::object* g_call = nullptr;

void register_translators() {
  py::module_ errors = py::module_::import("ep_nccl_gin.errors");
  g_not_found = new py::object(errors.attr("NcclNotFoundError"));
  g_version = new py::object(errors.attr("NcclVersionError"));
  g_call = new py::object(errors.attr("NcclCallError"));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NotFoundError& e) {
      PyErr_SetString(g_not_found->ptr(), e.what());
    } catch (const VersionError& e) {
      PyErr_SetString(g_version->ptr(), e.what());
    } catch (const CallError& e) {
      py::object exc = (*g_call)(e.what(), e.call, e.result);
      PyErr_SetObject(g_call->ptr(), exc.ptr());
    }
  });
}

}  // namespace
}  // namespace ep_nccl_gin

PYBIND11_MODULE(_impl, m) {
  using namespace ep_nccl_gin;
  m.doc() = "Handle-based bindings of NCCL's host API (use the ep_nccl_gin package, not this module).";
  register_translators();

  m.def("bind_library", &bind_library, py::arg("handle"), py::arg("path"),
        "Resolve NCCL entry points from a dlopen handle (0: dlopen(path, RTLD_NOLOAD)).");
  m.def("library_bound", &library_bound);
  m.def("library_path", [] { return library().path; });
  m.def("runtime_version", [] { return library().runtime_version; });
  m.def("header_version", [] { return kHeaderVersion; }, "NCCL_VERSION_CODE of the headers compiled in.");
  m.def("header_features", &header_features);
  m.def("dev_comm_header_size", [] { return sizeof(ncclDevComm); });
  m.def("set_device", &cuda_driver::set_device, py::arg("device"));

  m.def("get_unique_id", [] {
    ncclUniqueId id;
    check(library().get_unique_id(&id), "ncclGetUniqueId");
    return py::bytes(id.internal, NCCL_UNIQUE_ID_BYTES);
  });
  m.attr("UNIQUE_ID_BYTES") = NCCL_UNIQUE_ID_BYTES;

  m.def("comm_init_rank", [](const py::bytes& uid, int nranks, int rank) {
    std::string raw = uid;
    if (raw.size() != NCCL_UNIQUE_ID_BYTES) {
      throw std::invalid_argument("unique_id: expected " + std::to_string(NCCL_UNIQUE_ID_BYTES) +
                                  " bytes (from get_unique_id()), got " + std::to_string(raw.size()));
    }
    ncclUniqueId id;
    std::memcpy(id.internal, raw.data(), NCCL_UNIQUE_ID_BYTES);
    const NcclLibrary& lib = library();
    ncclComm_t comm = nullptr;
    ncclResult_t res;
    {
      py::gil_scoped_release release;
      res = lib.comm_init_rank(&comm, nranks, id, rank);
    }
    try {
      check(res, "ncclCommInitRank", comm);
    } catch (...) {
      if (comm != nullptr) lib.comm_abort(comm);  // release what a failed init left behind
      throw;
    }
    return from_ptr(comm);
  }, py::arg("unique_id"), py::arg("nranks"), py::arg("rank"));
  m.def("comm_destroy", [](std::uintptr_t c) {
    ncclComm_t comm = as_comm(c);
    ncclResult_t res;
    {
      py::gil_scoped_release release;
      res = library().comm_destroy(comm);
    }
    check(res, "ncclCommDestroy");
  });
  m.def("comm_abort", [](std::uintptr_t c) {
    ncclComm_t comm = as_comm(c);
    ncclResult_t res;
    {
      py::gil_scoped_release release;
      res = library().comm_abort(comm);
    }
    check(res, "ncclCommAbort");
  });
  m.def("comm_rank", [](std::uintptr_t c) {
    int v = 0;
    check(library().comm_user_rank(as_comm(c), &v), "ncclCommUserRank", as_comm(c));
    return v;
  });
  m.def("comm_count", [](std::uintptr_t c) {
    int v = 0;
    check(library().comm_count(as_comm(c), &v), "ncclCommCount", as_comm(c));
    return v;
  });
  m.def("comm_device", [](std::uintptr_t c) {
    int v = 0;
    check(library().comm_cu_device(as_comm(c), &v), "ncclCommCuDevice", as_comm(c));
    return v;
  });
  m.def("comm_async_error", [](std::uintptr_t c) {
    ncclResult_t v = ncclSuccess;
    check(library().comm_get_async_error(as_comm(c), &v), "ncclCommGetAsyncError");
    return static_cast<int>(v);
  });
  m.def("comm_properties", &comm_properties);
  m.def("team_lsa", [](std::uintptr_t c) {
    auto fn = need(library().team_lsa, "ncclTeamLsa", "LSA teams", "2.28.3");
    return team_tuple(fn(as_comm(c)));
  });
  m.def("team_world", [](std::uintptr_t c) {
    auto fn = need(library().team_world, "ncclTeamWorld", "teams", "2.28.3");
    return team_tuple(fn(as_comm(c)));
  });

  m.def("mem_alloc", [](std::size_t nbytes) {
    auto fn = need(library().mem_alloc, "ncclMemAlloc", "mem_alloc", "2.19");
    void* p = nullptr;
    check(fn(&p, nbytes), "ncclMemAlloc");
    return from_ptr(p);
  }, py::arg("nbytes"));
  m.def("mem_free", [](std::uintptr_t p) {
    auto fn = need(library().mem_free, "ncclMemFree", "mem_free", "2.19");
    check(fn(reinterpret_cast<void*>(p)), "ncclMemFree");
  }, py::arg("ptr"));

  m.def("window_flags", &window_flags);
  m.def("window_register", [](std::uintptr_t c, std::uintptr_t ptr, std::size_t nbytes, int flags) {
    ncclComm_t comm = as_comm(c);
    auto fn = need(library().comm_window_register, "ncclCommWindowRegister", "window registration", "2.27");
    ncclWindow_t win = nullptr;
    ncclResult_t res;
    {
      py::gil_scoped_release release;  // collective with an internal barrier
      res = fn(comm, reinterpret_cast<void*>(ptr), nbytes, &win, flags);
    }
    check(res, "ncclCommWindowRegister", comm);
    if (win == nullptr) throw CallError("ncclCommWindowRegister returned ncclSuccess but a null window", "ncclCommWindowRegister", 0);
    return from_ptr(win);
  }, py::arg("comm"), py::arg("ptr"), py::arg("nbytes"), py::arg("flags"));
  m.def("window_deregister", [](std::uintptr_t c, std::uintptr_t w) {
    ncclComm_t comm = as_comm(c);
    auto fn = need(library().comm_window_deregister, "ncclCommWindowDeregister", "window registration", "2.27");
    ncclResult_t res;
    {
      py::gil_scoped_release release;
      res = fn(comm, as_window(w));
    }
    check(res, "ncclCommWindowDeregister", comm);
  });
  m.def("window_lsa_pointer", &window_lsa_pointer, py::arg("comm"), py::arg("window"), py::arg("lsa_rank"),
        py::arg("offset") = 0);
  m.def("window_peer_pointer", [](std::uintptr_t c, std::uintptr_t w, int peer, std::size_t offset) {
    ncclComm_t comm = as_comm(c);
    auto fn = need(library().get_peer_device_pointer, "ncclGetPeerDevicePointer", "host peer pointer query", "2.29.2");
    void* p = nullptr;
    check(fn(as_window(w), offset, peer, &p), "ncclGetPeerDevicePointer", comm);
    return from_ptr(p);
  }, py::arg("comm"), py::arg("window"), py::arg("peer"), py::arg("offset") = 0);

  py::class_<DevCommRequest>(m, "DevCommRequest")
      .def(py::init<>())
      .def_readwrite("lsa_barrier_count", &DevCommRequest::lsa_barrier_count)
      .def_readwrite("barrier_count", &DevCommRequest::barrier_count)
      .def_readwrite("rail_gin_barrier_count", &DevCommRequest::rail_gin_barrier_count)
      .def_readwrite("gin_context_count", &DevCommRequest::gin_context_count)
      .def_readwrite("gin_signal_count", &DevCommRequest::gin_signal_count)
      .def_readwrite("gin_counter_count", &DevCommRequest::gin_counter_count)
      .def_readwrite("gin_exclusive_contexts", &DevCommRequest::gin_exclusive_contexts)
      .def_readwrite("gin_queue_depth", &DevCommRequest::gin_queue_depth)
      .def_readwrite("gin_connection_type", &DevCommRequest::gin_connection_type)
      .def_readwrite("gin_traffic_class", &DevCommRequest::gin_traffic_class)
      .def_readwrite("gin_force_enable", &DevCommRequest::gin_force_enable)
      .def_readwrite("use_runtime_version", &DevCommRequest::use_runtime_version);
  m.def("dev_comm_create", &dev_comm_create, py::arg("comm"), py::arg("request"));
  m.def("dev_comm_destroy", &dev_comm_destroy, py::arg("comm"), py::arg("dev_comm"));
  m.def("dev_comm_info", &dev_comm_info, py::arg("dev_comm"));
}
