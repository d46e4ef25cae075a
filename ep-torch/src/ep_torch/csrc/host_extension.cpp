// SPDX-License-Identifier: Apache-2.0
// ep_torch's host extension: the two torch calls every dispatch and combine makes several times, through torch's
// C++ API instead of its Python argument parser. Built at first use against the torch this process imported
// (ep_torch/host_extension.py), so it always matches that torch's ABI; nothing here touches the device.
//
//   empty(shape, dtype, device_index) -> Tensor   at::empty on cuda:<device_index> (the current stream's caching
//                                                 allocator, as torch.empty), or on the CPU for -1
//   facts(tensor) -> (dtype, sizes, strides, data_ptr, device_index) | None
//                                                 what ep_core's describe reads; device_index -1 = CPU; None for
//                                                 a tensor describe must look at itself (autograd, not strided,
//                                                 nested, negated or conjugated bits, neither CPU nor CUDA)
//   empty_many(specs, device_index) -> (tensors, pointers)
//                                                 empty() of each (shape, dtype) in `specs`, in one call (a
//                                                 repeated call's outputs: ep_core.kernels.op_plan)
//   signature(*tensors_or_none) -> Signature      the layout of each argument: dtype, sizes, strides, device
//   Signature.match(*objs) -> pointers | None     each obj's data pointer (0 for None, and for an empty CUDA
//                                                 tensor, as describe reads it) if every obj has exactly the
//                                                 layout recorded and facts() would describe it, else None
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>

#include <memory>
#include <vector>

namespace {

PyObject* int_tuple(c10::IntArrayRef values) {
    PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
    if (out == nullptr)
        return nullptr;
    for (size_t i = 0; i < values.size(); ++i) {
        PyObject* v = PyLong_FromLongLong(values[i]);
        if (v == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
    }
    return out;
}

// A tensor describe's fast path takes (facts() returns None for anything else); its device index, -1 for the CPU,
// or -2 when it is not such a tensor.
long plain_device(const at::Tensor& t) {
    if (t.requires_grad() || t.layout() != at::kStrided || t.is_nested() || t.is_neg() || t.is_conj())
        return -2;
    if (t.is_cuda())
        return t.get_device();
    return t.is_cpu() ? -1 : -2;
}

at::TensorOptions options_on(c10::ScalarType dtype, long index) {
    auto options = at::TensorOptions().dtype(dtype);
    return index < 0 ? options.device(at::kCPU)
                     : options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
}

bool read_sizes(PyObject* shape, c10::SmallVector<int64_t, 6>& sizes) {
    PyObject* seq = PySequence_Fast(shape, "empty: shape must be a sequence of int");
    if (seq == nullptr)
        return false;
    const Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq);
    sizes.resize(static_cast<size_t>(ndim));
    for (Py_ssize_t i = 0; i < ndim; ++i)
        sizes[static_cast<size_t>(i)] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    return !PyErr_Occurred();
}

PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 3 || !THPDtype_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "empty(shape: sequence of int, dtype: torch.dtype, device_index: int)");
        return nullptr;
    }
    c10::SmallVector<int64_t, 6> sizes;
    if (!read_sizes(args[0], sizes))
        return nullptr;
    const long index = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return nullptr;
    try {
        auto options = options_on(reinterpret_cast<THPDtype*>(args[1])->scalar_type, index);
        at::Tensor t;
        {
            // as torch.empty: the allocation may free cached blocks (and synchronize): not under the GIL
            PyThreadState* saved = PyEval_SaveThread();
            try {
                t = at::empty(sizes, options);
            } catch (...) {
                PyEval_RestoreThread(saved);
                throw;
            }
            PyEval_RestoreThread(saved);
        }
        return THPVariable_Wrap(std::move(t));
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

PyObject* facts(PyObject*, PyObject* obj) {
    if (!THPVariable_Check(obj))
        Py_RETURN_NONE;
    try {
        const at::Tensor& t = THPVariable_Unpack(obj);
        const long index = plain_device(t);
        if (index == -2)
            Py_RETURN_NONE;
        PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
        PyObject* sizes = int_tuple(t.sizes());
        PyObject* strides = sizes == nullptr ? nullptr : int_tuple(t.strides());
        if (strides == nullptr) {
            Py_XDECREF(sizes);
            return nullptr;
        }
        Py_INCREF(dtype);
        return Py_BuildValue("(NNNKl)", dtype, sizes, strides,
                             static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(t.data_ptr())), index);
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

// empty_many(specs, device_index): ((tensor, ...), (data_ptr, ...)) for specs ((shape, dtype), ...); the
// allocations are made together, outside the GIL, as empty() makes one.
PyObject* empty_many(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "empty_many(specs: tuple of (shape, torch.dtype), device_index: int)");
        return nullptr;
    }
    const long index = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return nullptr;
    const Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    std::vector<c10::SmallVector<int64_t, 6>> shapes(static_cast<size_t>(n));
    std::vector<c10::ScalarType> dtypes(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* spec = PyTuple_GET_ITEM(args[0], i);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 || !THPDtype_Check(PyTuple_GET_ITEM(spec, 1))) {
            PyErr_Format(PyExc_TypeError, "empty_many: specs[%zd] must be a (shape, torch.dtype) tuple", i);
            return nullptr;
        }
        if (!read_sizes(PyTuple_GET_ITEM(spec, 0), shapes[static_cast<size_t>(i)]))
            return nullptr;
        dtypes[static_cast<size_t>(i)] = reinterpret_cast<THPDtype*>(PyTuple_GET_ITEM(spec, 1))->scalar_type;
    }
    std::vector<at::Tensor> made(static_cast<size_t>(n));
    try {
        PyThreadState* saved = PyEval_SaveThread();
        try {
            for (size_t i = 0; i < made.size(); ++i)
                made[i] = at::empty(shapes[i], options_on(dtypes[i], index));
        } catch (...) {
            PyEval_RestoreThread(saved);
            throw;
        }
        PyEval_RestoreThread(saved);
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
    PyObject* tensors = PyTuple_New(n);
    PyObject* ptrs = tensors == nullptr ? nullptr : PyTuple_New(n);
    if (ptrs == nullptr) {
        Py_XDECREF(tensors);
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        at::Tensor& t = made[static_cast<size_t>(i)];
        PyObject* p = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(t.data_ptr())));
        PyObject* w = p == nullptr ? nullptr : THPVariable_Wrap(std::move(t));
        if (w == nullptr) {
            Py_XDECREF(p);
            Py_DECREF(tensors);
            Py_DECREF(ptrs);
            return nullptr;
        }
        PyTuple_SET_ITEM(tensors, i, w);
        PyTuple_SET_ITEM(ptrs, i, p);
    }
    return Py_BuildValue("(NN)", tensors, ptrs);
}

// torch.Tensor itself (THPVariable_CheckExact also admits nn.Parameter): what describe's fast path reads
bool is_tensor_itself(PyObject* obj) {
    return THPVariableClass != nullptr && Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
}

// The layout a prepared call was validated for, one slot per argument (a tensor, or None).
struct Slot {
    bool none = true;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    long device = -1;
    c10::SmallVector<int64_t, 6> sizes, strides;
};

struct SignatureObject {
    PyObject_HEAD
    std::vector<Slot>* slots;
};

void signature_dealloc(PyObject* self) {
    delete reinterpret_cast<SignatureObject*>(self)->slots;
    Py_TYPE(self)->tp_free(self);
}

// Signature.match(*objs): each obj's pointer if all have exactly the recorded layouts, else None. An obj must be a
// torch.Tensor itself (not a subclass, as describe's fast path) that facts() would describe.
PyObject* signature_match(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    const std::vector<Slot>& slots = *reinterpret_cast<SignatureObject*>(self)->slots;
    if (static_cast<size_t>(nargs) != slots.size()) {
        PyErr_Format(PyExc_TypeError, "match: expected %zu arguments, got %zd", slots.size(), nargs);
        return nullptr;
    }
    c10::SmallVector<unsigned long long, 6> ptrs(static_cast<size_t>(nargs));
    try {
        for (Py_ssize_t i = 0; i < nargs; ++i) {
            const Slot& slot = slots[static_cast<size_t>(i)];
            PyObject* obj = args[i];
            if (slot.none) {
                if (obj != Py_None)
                    Py_RETURN_NONE;
                ptrs[static_cast<size_t>(i)] = 0;
                continue;
            }
            if (!is_tensor_itself(obj))
                Py_RETURN_NONE;
            const at::Tensor& t = THPVariable_Unpack(obj);
            // ArrayRef::equals: older torch headers have no != between an IntArrayRef and a SmallVector
            if (t.scalar_type() != slot.dtype || plain_device(t) != slot.device || !t.sizes().equals(slot.sizes) ||
                !t.strides().equals(slot.strides))
                Py_RETURN_NONE;
            ptrs[static_cast<size_t>(i)] = (slot.device >= 0 && t.numel() == 0)
                                               ? 0
                                               : static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(t.data_ptr()));
        }
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
    PyObject* out = PyTuple_New(nargs);
    if (out == nullptr)
        return nullptr;
    for (Py_ssize_t i = 0; i < nargs; ++i) {
        PyObject* p = PyLong_FromUnsignedLongLong(ptrs[static_cast<size_t>(i)]);
        if (p == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, i, p);
    }
    return out;
}

PyMethodDef kSignatureMethods[] = {
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signature_match)), METH_FASTCALL,
     "match(*objs) -> (data_ptr, ...) if every obj has its recorded layout (None for a None slot), else None"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject kSignatureType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// signature(*tensors_or_none): the layouts of a call's arguments, which match() compares later calls with. Raises
// ValueError for a tensor facts() would not describe (the caller records a signature only for a plain call).
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    auto slots = std::make_unique<std::vector<Slot>>(static_cast<size_t>(nargs));
    try {
        for (Py_ssize_t i = 0; i < nargs; ++i) {
            Slot& slot = (*slots)[static_cast<size_t>(i)];
            if (args[i] == Py_None)
                continue;
            if (!is_tensor_itself(args[i])) {
                PyErr_Format(PyExc_TypeError, "signature: argument %zd is neither a torch.Tensor nor None", i);
                return nullptr;
            }
            const at::Tensor& t = THPVariable_Unpack(args[i]);
            slot.device = plain_device(t);
            if (slot.device == -2) {
                PyErr_Format(PyExc_ValueError, "signature: argument %zd is not a tensor facts() describes", i);
                return nullptr;
            }
            slot.none = false;
            slot.dtype = t.scalar_type();
            slot.sizes.assign(t.sizes().begin(), t.sizes().end());
            slot.strides.assign(t.strides().begin(), t.strides().end());
        }
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
    auto* obj = PyObject_New(SignatureObject, &kSignatureType);
    if (obj == nullptr)
        return nullptr;
    obj->slots = slots.release();
    return reinterpret_cast<PyObject*>(obj);
}

PyMethodDef kMethods[] = {
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
     "empty(shape, dtype, device_index) -> Tensor: at::empty on cuda:<device_index>, or on the CPU for -1"},
    {"facts", facts, METH_O,
     "facts(tensor) -> (dtype, sizes, strides, data_ptr, device_index) or None (describe reads it itself)"},
    {"empty_many", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty_many)), METH_FASTCALL,
     "empty_many(specs, device_index) -> ((tensor, ...), (data_ptr, ...)): empty() of each (shape, dtype)"},
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signature)), METH_FASTCALL,
     "signature(*tensors_or_none) -> Signature: the layouts that Signature.match(*objs) compares with"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "ep_torch_host", "ep_torch's host extension (host_extension.py)", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_ep_torch_host() {
    kSignatureType.tp_name = "ep_torch_host.Signature";
    kSignatureType.tp_basicsize = sizeof(SignatureObject);
    kSignatureType.tp_dealloc = signature_dealloc;
    kSignatureType.tp_flags = Py_TPFLAGS_DEFAULT;
    kSignatureType.tp_doc = "The layouts of a call's arguments (signature())";
    kSignatureType.tp_methods = kSignatureMethods;
    if (PyType_Ready(&kSignatureType) < 0)
        return nullptr;
    PyObject* m = PyModule_Create(&kModule);
    if (m == nullptr)
        return nullptr;
    Py_INCREF(&kSignatureType);
    if (PyModule_AddObject(m, "Signature", reinterpret_cast<PyObject*>(&kSignatureType)) < 0) {
        Py_DECREF(&kSignatureType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
