// ep_launch._C: the per-call driver work of a prepared kernel launch, in C++.
//
// A Python call through cuda-python costs several microseconds per driver entry point (argument objects, result
// tuples); an eager dispatch makes two launches and four event calls. Here a `Launch` keeps everything that is the
// same from call to call (function, grid, block, shared memory, launch attributes, the packed argument words) and a
// call only writes its per-call words into a copy of those words and calls cuLaunchKernelEx; `record_wait` is the
// cuEventRecord + cuStreamWaitEvent pair that orders one stream after another.
//
// Errors are returned, not raised: every function returns the CUresult (0 = success) so that the Python caller
// reports them with its own messages (argument, rank, hints) and can retry through its pure-Python path.
//
// libcuda is never linked: the first driver call dlopens "libcuda.so.1" (normally loaded already by cuda-python)
// and resolves the entry points through cuGetProcAddress, so importing needs no driver.

#include <cuda.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct Api {
  decltype(&::cuLaunchKernelEx) launch_kernel_ex = nullptr;
  decltype(&::cuEventRecord) event_record = nullptr;
  decltype(&::cuStreamWaitEvent) stream_wait_event = nullptr;
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuMemcpyDtoHAsync) memcpy_dtoh_async = nullptr;
  decltype(&::cuStreamQuery) stream_query = nullptr;
};

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

std::once_flag g_once;
Api g_api;
std::string g_failure;  // why the driver could not be loaded (empty: loaded)
bool g_loaded = false;

template <class Fn>
bool resolve(GetProcAddressFn get_proc, cuuint64_t flags, const char* symbol, Fn& out) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  // 12000: the ABI of these entry points as of CUDA 12.0 (cuLaunchKernelEx exists since 11.8)
  CUresult result = get_proc(symbol, &fn, 12000, flags, &status);
  if (result != CUDA_SUCCESS || fn == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) {
    g_failure = std::string("the CUDA driver does not provide ") + symbol + " (cuGetProcAddress returned " +
                std::to_string(static_cast<int>(result)) + ", status " + std::to_string(static_cast<int>(status)) +
                "); ep_launch needs a driver for CUDA >= 12.0";
    return false;
  }
  out = reinterpret_cast<Fn>(fn);
  return true;
}

void load_once() {
  const char* env = std::getenv("EPKIT_LAUNCH_LIBCUDA");
  std::string library = (env != nullptr && *env) ? env : "libcuda.so.1";
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    g_failure = "could not load the CUDA driver library '" + library + "' (" + (reason ? reason : "unknown") + ")";
    return;
  }
  auto init = reinterpret_cast<decltype(&::cuInit)>(dlsym(handle, "cuInit"));
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(handle, "cuGetProcAddress_v2"));
  if (init == nullptr || get_proc == nullptr) {
    g_failure = "'" + library + "' lacks cuInit/cuGetProcAddress_v2: not a CUDA driver for CUDA >= 12.0";
    return;
  }
  CUresult result = init(0);
  if (result != CUDA_SUCCESS) {
    g_failure = "cuInit failed with code " + std::to_string(static_cast<int>(result));
    return;
  }
  // the same stream semantics as cuda-python's bindings: legacy default stream unless it was asked to use the
  // per-thread one (a stream handle of 0 must mean the same stream here and there)
  const char* ptds = std::getenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM");
  cuuint64_t flags = (ptds != nullptr && std::atoi(ptds) != 0) ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                               : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
  Api api;
  if (!resolve(get_proc, flags, "cuLaunchKernelEx", api.launch_kernel_ex) ||
      !resolve(get_proc, flags, "cuEventRecord", api.event_record) ||
      !resolve(get_proc, flags, "cuStreamWaitEvent", api.stream_wait_event) ||
      !resolve(get_proc, flags, "cuGetErrorName", api.get_error_name) ||
      !resolve(get_proc, flags, "cuMemcpyDtoHAsync", api.memcpy_dtoh_async) ||
      !resolve(get_proc, flags, "cuStreamQuery", api.stream_query)) {
    return;
  }
  g_api = api;
  g_loaded = true;
}

const Api& api() {
  std::call_once(g_once, load_once);
  if (!g_loaded) throw std::runtime_error("ep_launch: " + g_failure);
  return g_api;
}

// One argument word from a Python int: signed 64-bit, values in [2**63, 2**64) wrap (device pointers, envelopes)
inline int64_t word_of(PyObject* value) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow > 0) {
    unsigned long long u = PyLong_AsUnsignedLongLong(value);
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(u);
  }
  if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "ep_launch: an argument word below -2**63");
    throw py::error_already_set();
  }
  return static_cast<int64_t>(v);
}

constexpr size_t kStackWords = 512;  // 4 KiB: the classic kernel parameter limit; larger argument blocks use the heap

class Launch {
 public:
  Launch(uintptr_t function, unsigned grid, unsigned block, unsigned shared_mem, bool cooperative, py::bytes words,
         std::vector<int> slots, bool pdl)
      : function_(reinterpret_cast<CUfunction>(function)),
        grid_(grid),
        block_(block),
        shared_mem_(shared_mem),
        cooperative_(cooperative),
        pdl_(pdl),
        slots_(std::move(slots)) {
    std::string raw = words;
    if (raw.empty() || raw.size() % 8) throw std::invalid_argument("words: expected a non-empty multiple of 8 bytes");
    if (grid == 0 || block == 0) throw std::invalid_argument("grid, block: expected >= 1");
    base_.resize(raw.size() / 8);
    std::memcpy(base_.data(), raw.data(), raw.size());
    for (int s : slots_) {
      if (s < 0 || static_cast<size_t>(s) >= base_.size())
        throw std::invalid_argument("slots: index " + std::to_string(s) + " outside the " +
                                    std::to_string(base_.size()) + " argument words");
    }
    unsigned n = 0;
    if (cooperative_) {
      attrs_[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs_[n].value.cooperative = 1;
      ++n;
    }
    if (pdl_) {
      attrs_[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs_[n].value.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    num_attrs_ = n;
  }

  // Copy the words, set slot i to values[i] (ints; values may hold fewer entries than slots), launch on `stream`.
  // With `wait_event`, `stream` first waits for everything queued on `wait_on` (cuEventRecord + cuStreamWaitEvent);
  // with `signal_event`, `signal_to` then waits for the launch. Returns 0; a positive CUresult when a step up to
  // and including the launch failed (nothing was launched); minus the CUresult when the launch went out and the
  // signal pair failed.
  int call(uintptr_t stream, py::handle values, uintptr_t wait_event, uintptr_t wait_on, uintptr_t signal_event,
           uintptr_t signal_to) const {
    if (!PyTuple_Check(values.ptr())) throw py::type_error("values: expected a tuple of ints");
    const Py_ssize_t count = PyTuple_GET_SIZE(values.ptr());
    if (static_cast<size_t>(count) > slots_.size())
      throw py::value_error("values: " + std::to_string(count) + " values for " + std::to_string(slots_.size()) +
                            " slots");
    const size_t n = base_.size();
    int64_t stack[kStackWords];
    std::vector<int64_t> heap;
    int64_t* words = stack;
    if (n > kStackWords) {
      heap.resize(n);
      words = heap.data();
    }
    std::memcpy(words, base_.data(), n * 8);
    for (Py_ssize_t i = 0; i < count; ++i) words[slots_[i]] = word_of(PyTuple_GET_ITEM(values.ptr(), i));
    const Api& a = api();
    CUlaunchConfig cfg{};
    cfg.gridDimX = grid_;
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = block_;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.sharedMemBytes = shared_mem_;
    cfg.hStream = reinterpret_cast<CUstream>(stream);
    CUlaunchAttribute attrs[2];
    std::memcpy(attrs, attrs_, sizeof(attrs));
    cfg.attrs = num_attrs_ ? attrs : nullptr;
    cfg.numAttrs = num_attrs_;
    void* params[1] = {words};
    CUresult result;
    {
      py::gil_scoped_release release;
      CUstream s = reinterpret_cast<CUstream>(stream);
      if (wait_event != 0) {
        CUevent ev = reinterpret_cast<CUevent>(wait_event);
        result = a.event_record(ev, reinterpret_cast<CUstream>(wait_on));
        if (result == CUDA_SUCCESS) result = a.stream_wait_event(s, ev, 0);
        if (result != CUDA_SUCCESS) return static_cast<int>(result);
      }
      result = a.launch_kernel_ex(&cfg, function_, params, nullptr);
      if (result != CUDA_SUCCESS) return static_cast<int>(result);
      if (signal_event != 0) {
        CUevent ev = reinterpret_cast<CUevent>(signal_event);
        result = a.event_record(ev, s);
        if (result == CUDA_SUCCESS) result = a.stream_wait_event(reinterpret_cast<CUstream>(signal_to), ev, 0);
        if (result != CUDA_SUCCESS) return -static_cast<int>(result);
      }
    }
    return 0;
  }

  // The words a call with `values` would launch (tests compare them with a fresh pack).
  py::bytes patched(py::handle values) const {
    if (!PyTuple_Check(values.ptr())) throw py::type_error("values: expected a tuple of ints");
    std::vector<int64_t> words(base_);
    const Py_ssize_t count = PyTuple_GET_SIZE(values.ptr());
    if (static_cast<size_t>(count) > slots_.size()) throw py::value_error("values: more values than slots");
    for (Py_ssize_t i = 0; i < count; ++i) words[slots_[i]] = word_of(PyTuple_GET_ITEM(values.ptr(), i));
    return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * 8);
  }

  py::bytes words() const { return py::bytes(reinterpret_cast<const char*>(base_.data()), base_.size() * 8); }
  std::vector<int> slots() const { return slots_; }
  unsigned grid() const { return grid_; }
  unsigned block() const { return block_; }
  unsigned shared_mem() const { return shared_mem_; }
  bool cooperative() const { return cooperative_; }
  bool pdl() const { return pdl_; }

 private:
  CUfunction function_;
  unsigned grid_, block_, shared_mem_;
  bool cooperative_, pdl_;
  std::vector<int> slots_;
  std::vector<int64_t> base_;
  CUlaunchAttribute attrs_[2]{};
  unsigned num_attrs_ = 0;
};

// `waiter` waits for everything issued to `on` so far: cuEventRecord(event, on) + cuStreamWaitEvent(waiter, event).
// Returns 0, or the CUresult of the call that failed (nothing after it ran).
int record_wait(uintptr_t event, uintptr_t on, uintptr_t waiter) {
  const Api& a = api();
  py::gil_scoped_release release;
  CUevent ev = reinterpret_cast<CUevent>(event);
  CUresult result = a.event_record(ev, reinterpret_cast<CUstream>(on));
  if (result != CUDA_SUCCESS) return static_cast<int>(result);
  return static_cast<int>(a.stream_wait_event(reinterpret_cast<CUstream>(waiter), ev, 0));
}

// Queue a device-to-host copy of `nbytes` on `stream` (the caller synchronizes); returns the CUresult.
int copy_to_host(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
  const Api& a = api();
  py::gil_scoped_release release;
  return static_cast<int>(a.memcpy_dtoh_async(reinterpret_cast<void*>(dst), static_cast<CUdeviceptr>(src), nbytes,
                                              reinterpret_cast<CUstream>(stream)));
}

// cuStreamQuery: 0 when everything queued on `stream` has finished, CUDA_ERROR_NOT_READY (600) while it runs.
int stream_query(uintptr_t stream) {
  const Api& a = api();
  return static_cast<int>(a.stream_query(reinterpret_cast<CUstream>(stream)));
}

std::string error_name(int code) {
  const char* name = nullptr;
  if (api().get_error_name(static_cast<CUresult>(code), &name) != CUDA_SUCCESS || name == nullptr)
    return "CUresult " + std::to_string(code);
  return name;
}

bool available() {
  std::call_once(g_once, load_once);
  return g_loaded;
}

std::string unavailable_reason() {
  std::call_once(g_once, load_once);
  return g_failure;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Prepared kernel launches and stream-order event pairs over the CUDA driver (ep_launch)";
  py::class_<Launch>(m, "Launch")
      .def(py::init<uintptr_t, unsigned, unsigned, unsigned, bool, py::bytes, std::vector<int>, bool>(),
           py::arg("function"), py::arg("grid"), py::arg("block"), py::arg("shared_mem"), py::arg("cooperative"),
           py::arg("words"), py::arg("slots"), py::arg("pdl") = false)
      .def("__call__", &Launch::call, py::arg("stream"), py::arg("values"), py::arg("wait_event") = 0,
           py::arg("wait_on") = 0, py::arg("signal_event") = 0, py::arg("signal_to") = 0)
      .def("patched", &Launch::patched, py::arg("values"))
      .def_property_readonly("words", &Launch::words)
      .def_property_readonly("slots", &Launch::slots)
      .def_property_readonly("grid", &Launch::grid)
      .def_property_readonly("block", &Launch::block)
      .def_property_readonly("shared_mem", &Launch::shared_mem)
      .def_property_readonly("cooperative", &Launch::cooperative)
      .def_property_readonly("pdl", &Launch::pdl);
  m.def("record_wait", &record_wait, py::arg("event"), py::arg("on"), py::arg("waiter"));
  m.def("copy_to_host", &copy_to_host, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"));
  m.def("stream_query", &stream_query, py::arg("stream"));
  m.def("error_name", &error_name, py::arg("code"));
  m.def("available", &available);
  m.def("unavailable_reason", &unavailable_reason);
}
