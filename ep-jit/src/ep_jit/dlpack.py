"""The DLPack C structs (dlpack.h 1.x) through ctypes: reading the tensor a capsule holds, and building a capsule
around memory this process can address.

ep_jit reads device addresses of kernel arguments through them (`ep_jit.pointer`); ep-core describes arrays and
wraps buffer memory with the same definitions, so there is one copy of the C layout in the monorepo.

>>> capsule = array.__dlpack__()
>>> tensor = capsule_tensor(capsule)   # the DLTensor inside (not consumed; valid while capsule lives), or None
>>> capsule = bytes_capsule(ptr, nbytes, DL_CUDA, 0)  # a 1-D uint8 tensor over [ptr, ptr + nbytes), no copy
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = [
    "DL_CPU",
    "DL_CUDA",
    "DL_CUDA_HOST",
    "DL_CUDA_MANAGED",
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "bytes_capsule",
    "capsule_tensor",
]

# DLDeviceType values used here (dlpack.h).
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The capsule payload named ``dltensor`` (DLPack < 1.0): the tensor first."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The capsule payload named ``dltensor_versioned`` (DLPack >= 1.0): a header, then the tensor."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _capsule_api() -> tuple[Any, Any, Any]:
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return api.PyCapsule_GetName, api.PyCapsule_GetPointer, api.PyCapsule_New


def capsule_tensor(capsule: Any) -> DLTensor | None:
    """The DLTensor of an unconsumed DLPack capsule (either payload), read in place: valid only while the capsule
    lives (hold it in a variable). None when the capsule's name is neither (``used_dltensor``: consumed already)."""
    get_name, get_pointer, _ = _capsule_api()
    name = get_name(capsule)
    if name == b"dltensor":
        return DLManagedTensor.from_address(get_pointer(capsule, name)).dl_tensor
    if name == b"dltensor_versioned":
        return DLManagedTensorVersioned.from_address(get_pointer(capsule, name)).dl_tensor
    return None


_KEEP: list = []  # the structs behind bytes_capsule's capsules: tiny, kept for the process's life (no deleter)


def bytes_capsule(ptr: int, nbytes: int, device_type: int, device_id: int) -> Any:
    """A ``dltensor`` capsule of a 1-D uint8 tensor over ``nbytes`` at ``ptr``, labelled (``device_type``,
    ``device_id``); no copy, no deleter. The memory must outlive every tensor made from the capsule: meant for
    buffers that live as long as the process's views of them (ep-core's symmetric memory)."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(
        ctypes.c_void_p(ptr), DLDevice(device_type, device_id), 1, DLDataType(1, 8, 1), shape, None, 0
    )
    managed.manager_ctx = None
    managed.deleter = None
    _KEEP.append((managed, shape))
    _, _, new_capsule = _capsule_api()
    return new_capsule(ctypes.addressof(managed), b"dltensor", None)
