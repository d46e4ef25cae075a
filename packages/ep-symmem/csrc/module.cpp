// ep_symmem._C: Python bindings. Policy (which import method per peer, descriptor format, bootstrap) lives in
// Python; this module executes driver work and translates ep_symmem::Error into ep_symmem._errors classes.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "context.hpp"
#include "device_ops.hpp"
#include "driver.hpp"
#include "error.hpp"
#include "local_allocation.hpp"
#include "peer_fd.hpp"
#include "peer_mapping.hpp"

namespace py = pybind11;
using namespace ep_symmem;

namespace {

const char* error_class(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kDriverNotFound: return "DriverNotFoundError";
    case ErrorKind::kNoDevice: return "NoDeviceError";
    case ErrorKind::kCuda: return "CudaError";
    case ErrorKind::kUnsupported: return "UnsupportedError";
    case ErrorKind::kPeerAccess: return "PeerAccessError";
    case ErrorKind::kInvalidArgument: return "SymmemValueError";
    case ErrorKind::kClosed: return "AllocationClosedError";
  }
  return "SymmemError";
}

Token to_token(const py::bytes& bytes) {
  const std::string raw = bytes;
  if (raw.size() != sizeof(Token)) {
    throw Error(ErrorKind::kInvalidArgument,
                "token must be " + std::to_string(sizeof(Token)) + " bytes, got " + std::to_string(raw.size()));
  }
  Token token{};
  std::memcpy(token.data(), raw.data(), token.size());
  return token;
}

HandleMode to_handle_mode(const std::string& name) {
  if (name == "auto") return HandleMode::kAuto;
  if (name == "posix_fd") return HandleMode::kPosixFd;
  if (name == "fabric") return HandleMode::kFabric;
  throw Error(ErrorKind::kInvalidArgument, "handle_type must be 'auto', 'posix_fd' or 'fabric', got '" + name + "'");
}

ImportMethod to_import_method(const std::string& name) {
  if (name == "retain") return ImportMethod::kRetain;
  if (name == "posix_fd") return ImportMethod::kPosixFd;
  if (name == "fabric") return ImportMethod::kFabric;
  throw Error(ErrorKind::kInvalidArgument, "import method must be 'retain', 'posix_fd' or 'fabric', got '" + name + "'");
}

std::unique_ptr<PeerMapping> make_peer_mapping(int device, int pid, const py::bytes& token, size_t num_gpu_bytes,
                                               size_t num_host_bytes, size_t alignment, int gpu_fd, int host_fd,
                                               const py::bytes& gpu_fabric_handle, const std::string& gpu_method,
                                               const std::string& host_method) {
  PeerSource source;
  source.pid = pid;
  source.token = to_token(token);
  source.num_gpu_bytes = num_gpu_bytes;
  source.num_host_bytes = num_host_bytes;
  source.alignment = alignment;
  source.gpu_fd = gpu_fd;
  source.host_fd = host_fd;
  source.gpu_fabric_handle = gpu_fabric_handle;
  source.gpu_method = to_import_method(gpu_method);
  source.host_method = to_import_method(host_method);
  py::gil_scoped_release release;
  return std::make_unique<PeerMapping>(device, source);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_symmem native core: lazily loaded CUDA driver, VMM allocations, peer mappings";

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const Error& error) {
      try {
        py::module_ errors = py::module_::import("ep_symmem._errors");
        py::object cls = errors.attr(error_class(error.kind()));
        py::object call = error.call().empty() ? py::object(py::none()) : py::object(py::str(error.call()));
        py::object code = error.code() == 0 ? py::object(py::none()) : py::object(py::int_(error.code()));
        py::object instance = cls(py::str(error.what()), py::arg("call") = call, py::arg("code") = code);
        PyErr_SetObject(cls.ptr(), instance.ptr());
      } catch (py::error_already_set& nested) {
        nested.restore();
      }
    }
  });

  m.attr("ALIGNMENT_BYTES") = py::int_(kAlignmentBytes);
  m.attr("FABRIC_HANDLE_BYTES") = py::int_(kFabricHandleBytes);
  m.attr("HANDLE_TYPE_POSIX_FD") = py::int_(static_cast<int>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  m.attr("HANDLE_TYPE_FABRIC") = py::int_(static_cast<int>(CU_MEM_HANDLE_TYPE_FABRIC));
  m.attr("CUDA_HEADER_VERSION") = py::int_(CUDA_VERSION);

  m.def("set_driver_library", &set_driver_library, py::arg("path"),
        "Path given to dlopen on the first GPU call (no effect once the driver is loaded).");
  m.def("driver_library", &driver_library);
  m.def("driver_loaded", &driver_loaded);
  m.def("driver_version", []() { return driver().version; }, "Loads the driver; cuDriverGetVersion.");
  m.def("device_count", &device_count);
  m.def("current_device", &current_device);
  m.def(
      "device_info",
      [](int ordinal) {
        DeviceInfo info = device_info(ordinal);
        py::dict out;
        out["ordinal"] = info.ordinal;
        out["name"] = info.name;
        out["uuid"] = py::bytes(info.uuid);
        out["vmm_supported"] = info.vmm_supported != 0;
        out["posix_fd_supported"] = info.posix_fd_supported != 0;
        out["fabric_supported"] = info.fabric_supported != 0;
        out["rdma_with_vmm_supported"] = info.rdma_with_vmm_supported != 0;
        out["host_numa_id"] = info.host_numa_id;
        out["compute_capability"] = py::make_tuple(info.compute_capability_major, info.compute_capability_minor);
        out["driver_version"] = info.driver_version;
        return out;
      },
      py::arg("ordinal"));
  m.def("memory_info", &memory_info, py::arg("ordinal"), "cuMemGetInfo: (free, total) bytes");
  m.def("device_alloc", &device_alloc, py::arg("ordinal"), py::arg("num_bytes"));
  m.def("device_free", &device_free, py::arg("ordinal"), py::arg("ptr"));
  m.def(
      "copy_host_to_device",
      [](int ordinal, uint64_t dst, const py::buffer& data) {
        py::buffer_info info = data.request();
        const size_t num_bytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        copy_host_to_device(ordinal, dst, info.ptr, num_bytes);
      },
      py::arg("ordinal"), py::arg("dst"), py::arg("data"));
  m.def(
      "copy_device_to_host",
      [](int ordinal, uint64_t src, size_t num_bytes) {
        std::string out(num_bytes, '\0');
        {
          py::gil_scoped_release release;
          copy_device_to_host(ordinal, out.data(), src, num_bytes);
        }
        return py::bytes(out);
      },
      py::arg("ordinal"), py::arg("src"), py::arg("num_bytes"));
  m.def("copy_device_to_device", &copy_device_to_device, py::arg("ordinal"), py::arg("dst"), py::arg("src"),
        py::arg("num_bytes"), py::call_guard<py::gil_scoped_release>());
  m.def("memset_device", &memset_device, py::arg("ordinal"), py::arg("dst"), py::arg("value"), py::arg("num_bytes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("synchronize", &synchronize, py::arg("ordinal"), py::call_guard<py::gil_scoped_release>());
  m.def("fill_u32", &fill_u32, py::arg("ordinal"), py::arg("dst"), py::arg("num_words"), py::arg("first"),
        py::arg("step"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "host_memoryview",
      [](uint64_t ptr, size_t num_bytes) {
        return py::memoryview::from_memory(reinterpret_cast<void*>(ptr), static_cast<py::ssize_t>(num_bytes), false);
      },
      py::arg("ptr"), py::arg("num_bytes"), "Writable memoryview over CPU-accessible memory (no lifetime tracking).");
  m.def("is_registered", [](const py::bytes& token) { return is_registered(to_token(token)); }, py::arg("token"));
  m.def("allow_ptrace_from_any_process", &allow_ptrace_from_any_process);
  m.def("duplicate_peer_fd", &duplicate_peer_fd, py::arg("pid"), py::arg("fd"),
        "pidfd_open + pidfd_getfd; returns a new fd of this process (the caller closes it).");

  py::class_<LocalAllocation>(m, "LocalAllocation")
      .def(py::init([](int device, size_t num_gpu_bytes, size_t num_host_bytes, const std::string& handle_type,
                       bool require_rdma) {
             const HandleMode mode = to_handle_mode(handle_type);
             py::gil_scoped_release release;
             return std::make_unique<LocalAllocation>(device, num_gpu_bytes, num_host_bytes, mode, require_rdma);
           }),
           py::arg("device"), py::arg("num_gpu_bytes"), py::arg("num_host_bytes"), py::arg("handle_type"),
           py::arg("require_rdma"))
      .def_property_readonly("device", &LocalAllocation::device)
      .def_property_readonly("base", &LocalAllocation::base)
      .def_property_readonly("num_gpu_bytes", &LocalAllocation::num_gpu_bytes)
      .def_property_readonly("num_host_bytes", &LocalAllocation::num_host_bytes)
      .def_property_readonly("alignment", &LocalAllocation::alignment)
      .def_property_readonly("gpu_handle_types", &LocalAllocation::gpu_handle_types)
      .def_property_readonly("host_handle_types", &LocalAllocation::host_handle_types)
      .def_property_readonly("gpu_fabric_handle",
                             [](const LocalAllocation& a) { return py::bytes(a.gpu_fabric_handle()); })
      .def_property_readonly("rdma_capable", &LocalAllocation::rdma_capable)
      .def_property_readonly("host_numa_id", &LocalAllocation::host_numa_id)
      .def_property_readonly("host_cpu_access", &LocalAllocation::host_cpu_access)
      .def_property_readonly("host_cpu_access_error", &LocalAllocation::host_cpu_access_error)
      .def_property_readonly("notes", &LocalAllocation::notes)
      .def_property_readonly("token",
                             [](const LocalAllocation& a) {
                               return py::bytes(reinterpret_cast<const char*>(a.token().data()), a.token().size());
                             })
      .def_property_readonly("closed", &LocalAllocation::closed)
      .def("export_fds", &LocalAllocation::export_fds)
      .def("release_export_fds", &LocalAllocation::release_export_fds)
      .def("close", &LocalAllocation::close, py::call_guard<py::gil_scoped_release>());

  py::class_<PeerMapping>(m, "PeerMapping")
      .def(py::init(&make_peer_mapping), py::arg("device"), py::arg("pid"), py::arg("token"), py::arg("num_gpu_bytes"),
           py::arg("num_host_bytes"), py::arg("alignment"), py::arg("gpu_fd"), py::arg("host_fd"),
           py::arg("gpu_fabric_handle"), py::arg("gpu_method"), py::arg("host_method"))
      .def_property_readonly("base", &PeerMapping::base)
      .def_property_readonly("num_bytes", &PeerMapping::num_bytes)
      .def_property_readonly("closed", &PeerMapping::closed)
      .def("close", &PeerMapping::close, py::call_guard<py::gil_scoped_release>());
}
