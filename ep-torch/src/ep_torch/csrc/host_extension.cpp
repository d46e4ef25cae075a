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
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>

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

PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 3 || !THPDtype_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "empty(shape: sequence of int, dtype: torch.dtype, device_index: int)");
        return nullptr;
    }
    PyObject* seq = PySequence_Fast(args[0], "empty: shape must be a sequence of int");
    if (seq == nullptr)
        return nullptr;
    const Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq);
    c10::SmallVector<int64_t, 6> sizes(static_cast<size_t>(ndim));
    for (Py_ssize_t i = 0; i < ndim; ++i)
        sizes[static_cast<size_t>(i)] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    const long index = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return nullptr;
    try {
        auto options = at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(args[1])->scalar_type);
        options = index < 0 ? options.device(at::kCPU)
                            : options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
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
        if (t.requires_grad() || t.layout() != at::kStrided || t.is_nested() || t.is_neg() || t.is_conj())
            Py_RETURN_NONE;
        long index;
        if (t.is_cuda())
            index = t.get_device();
        else if (t.is_cpu())
            index = -1;
        else
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

PyMethodDef kMethods[] = {
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
     "empty(shape, dtype, device_index) -> Tensor: at::empty on cuda:<device_index>, or on the CPU for -1"},
    {"facts", facts, METH_O,
     "facts(tensor) -> (dtype, sizes, strides, data_ptr, device_index) or None (describe reads it itself)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "ep_torch_host", "ep_torch's host extension (host_extension.py)", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_ep_torch_host() {
    return PyModule_Create(&kModule);
}
