"""ep_jit.dlpack: the DLPack structs read the tensor of either capsule payload in place, and a capsule built over
raw memory reads back as what it was given."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from ep_jit import dlpack


def test_struct_sizes_are_dlpack_h():
    # dlpack.h on LP64: DLTensor 48 bytes, DLManagedTensor 64, DLManagedTensorVersioned 80 (the tensor at 32)
    assert ctypes.sizeof(dlpack.DLTensor) == 48
    assert ctypes.sizeof(dlpack.DLManagedTensor) == 64
    assert dlpack.DLManagedTensorVersioned.dl_tensor.offset == 32
    assert ctypes.sizeof(dlpack.DLManagedTensorVersioned) == 80


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["dltensor", "dltensor_versioned"])
def test_capsule_tensor_reads_a_numpy_capsule(max_version):
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:]
    kwargs = {} if max_version is None else {"max_version": max_version}
    try:
        capsule = a.__dlpack__(**kwargs)
    except TypeError:
        pytest.skip("this numpy exports only the unversioned capsule")
    t = dlpack.capsule_tensor(capsule)
    assert t is not None
    assert t.device.device_type == dlpack.DL_CPU
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (0, 32, 1)
    assert [t.shape[i] for i in range(t.ndim)] == [3, 3]
    assert [t.strides[i] for i in range(t.ndim)] == [4, 1]
    assert int(t.data) + int(t.byte_offset) == a.ctypes.data


def test_bytes_capsule_reads_back():
    buf = ctypes.create_string_buffer(256)
    capsule = dlpack.bytes_capsule(ctypes.addressof(buf) + 16, 200, dlpack.DL_CUDA, 3)
    t = dlpack.capsule_tensor(capsule)
    assert t is not None
    assert int(t.data) == ctypes.addressof(buf) + 16 and t.byte_offset == 0
    assert (t.device.device_type, t.device.device_id) == (dlpack.DL_CUDA, 3)
    assert (t.ndim, t.shape[0], bool(t.strides)) == (1, 200, False)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, 8, 1)  # uint8


def test_a_consumed_capsule_reads_as_none():
    capsule = dlpack.bytes_capsule(0, 8, dlpack.DL_CPU, 0)
    ctypes.pythonapi.PyCapsule_SetName.restype = ctypes.c_int
    ctypes.pythonapi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert ctypes.pythonapi.PyCapsule_SetName(capsule, b"used_dltensor") == 0  # what a consumer does
    assert dlpack.capsule_tensor(capsule) is None
