"""Framework-neutral array descriptors: read pointer, shape, strides, dtype and device of any array without
importing its framework, and a minimal `DeviceArray` (pointer + shape + dtype) for views and host tests.

`describe(obj)` accepts, in this order: a `DeviceArray`; an object with `__cuda_array_interface__` (CuPy, Numba,
torch except bf16); an object with `__dlpack__` (torch, CuPy, JAX, numpy; read through the capsule with ctypes,
`stream=-1` so that no synchronization is enqueued); an object with `__array_interface__` (host numpy).

dtype names are canonical strings: "bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool".
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ep_core.errors import EPTypeError

__all__ = [
    "DTYPE_SIZES",
    "ArrayInfo",
    "DeviceArray",
    "bytes_capsule",
    "describe",
    "describe_all",
    "host_allocator",
    "host_array",
    "host_copy",
    "set_torch_reader",
    "to_numpy",
]

# every dtype ep_core knows, with its numpy storage for host views (the bit pattern for the types numpy lacks:
# bf16 as uint16, FP8 as uint8); the sizes and the array-interface type strings derive from it
_NUMPY_STORAGE = {
    "bool": np.bool_,
    "int8": np.int8,
    "uint8": np.uint8,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "float32": np.float32,
    "int64": np.int64,
    "uint64": np.uint64,
    "float64": np.float64,
}
DTYPE_SIZES: dict[str, int] = {name: np.dtype(st).itemsize for name, st in _NUMPY_STORAGE.items()}
# the array interface's type string of each dtype: bf16 and FP8 are exported as their bits ('<u2', '|u1')
_DTYPE_TO_TYPESTR = {name: np.dtype(st).newbyteorder("<").str for name, st in _NUMPY_STORAGE.items()}
# a type string (without its byte order) -> the dtype it names: the dtypes numpy has (no bf16, no FP8)
_TYPESTR_TO_DTYPE = {
    _DTYPE_TO_TYPESTR[name][1:]: name for name, st in _NUMPY_STORAGE.items() if np.dtype(st).name == name
}


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(int(dim), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ArrayInfo:
    """What ep_core needs to know about an array. `strides` are in bytes; `device` is "cuda" or "cpu"."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]
    device: str
    device_id: int
    obj: Any = field(default=None, repr=False, compare=False)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Row-major contiguous (dimensions of size 1 may have any stride; empty arrays are contiguous)."""
        return is_c_contiguous(self.shape, self.strides, self.itemsize)


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Row-major contiguity as torch defines it: an empty array always is, and the stride of a size-1
    dimension is irrelevant (frameworks export arbitrary strides there, e.g. (0, 0) for an empty tensor).
    `strides` in the unit of `itemsize` (bytes with the element size, elements with 1)."""
    if 0 in shape:
        return True
    n = len(shape)
    if len(strides) == n:  # the common case, from the last dimension without building the C strides
        expected = itemsize
        for i in range(n - 1, -1, -1):
            d = shape[i]
            if d != 1 and strides[i] != expected:
                return False
            if d > 1:
                expected *= d
        return True
    want = _c_strides(shape, itemsize)
    return all(s == w or d == 1 for s, w, d in zip(strides, want, shape))


class DeviceArray:
    """A plain strided array over raw memory: pointer, shape, dtype, byte strides, device.

    Exposes `__cuda_array_interface__` (v3) for CUDA memory and `__array_interface__` for host memory, so CuPy,
    Numba, torch (`torch.as_tensor`) or numpy can wrap it; bf16 and FP8 are exported as their bit patterns (u2 /
    u1) and keep their real dtype in `.dtype`. `owner` keeps the underlying memory alive.
    """

    __slots__ = ("device", "device_id", "dtype", "owner", "ptr", "shape", "strides")

    def __init__(
        self,
        ptr: int,
        shape: Sequence[int],
        dtype: str,
        strides: Sequence[int] | None = None,
        *,
        device: str = "cuda",
        device_id: int = 0,
        owner: Any = None,
    ) -> None:
        if dtype not in DTYPE_SIZES:
            raise EPTypeError(f"dtype: expected one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        if device not in ("cuda", "cpu"):
            raise EPTypeError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.strides = (
            _c_strides(self.shape, DTYPE_SIZES[dtype]) if strides is None else tuple(int(s) for s in strides)
        )
        self.device = device
        self.device_id = int(device_id)
        self.owner = owner

    def info(self) -> ArrayInfo:
        return ArrayInfo(self.ptr, self.shape, self.dtype, self.strides, self.device, self.device_id, self)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def _interface(self) -> dict:
        contiguous = self.strides == _c_strides(self.shape, DTYPE_SIZES[self.dtype])
        return {
            "shape": self.shape,
            "typestr": _DTYPE_TO_TYPESTR[self.dtype],
            "data": (self.ptr, False),
            "strides": None if contiguous else self.strides,
            "version": 3,
        }

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device != "cuda":
            raise AttributeError("__cuda_array_interface__: host array")
        return self._interface() | {"stream": None}

    @property
    def __array_interface__(self) -> dict:
        if self.device != "cpu":
            raise AttributeError("__array_interface__: device array")
        return self._interface()

    def __repr__(self) -> str:
        return f"DeviceArray(ptr=0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype}, device={self.device}:{self.device_id})"


# ------------------------------------------------------------------------------------------------------------
# describe


def _from_cai(obj: Any, cai: dict) -> ArrayInfo:
    shape = tuple(int(s) for s in cai["shape"])
    typestr = cai["typestr"]
    dtype = _TYPESTR_TO_DTYPE.get(typestr[1:])
    if dtype is None:
        raise EPTypeError(f"array: unsupported __cuda_array_interface__ typestr {typestr!r}")
    strides = cai.get("strides")
    strides = _c_strides(shape, DTYPE_SIZES[dtype]) if strides is None else tuple(int(s) for s in strides)
    device_id = _cuda_device_of(obj)
    return ArrayInfo(int(cai["data"][0]), shape, dtype, strides, "cuda", device_id, obj)


def _cuda_device_of(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    idx = getattr(dev, "index", None)
    if isinstance(idx, int):
        return idx
    if isinstance(dev, int):
        return dev
    dev_id = getattr(dev, "id", None)
    return dev_id if isinstance(dev_id, int) else 0


_DL_CODES = {
    (0, 8): "int8",
    (0, 16): "int16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (1, 16): "uint16",
    (1, 32): "uint32",
    (1, 64): "uint64",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
    (6, 8): "bool",
    (10, 8): "float8_e4m3fn",
    (12, 8): "float8_e5m2",
}


def bytes_capsule(ptr: int, nbytes: int, device_type: int, device_id: int) -> Any:
    """A DLPack capsule of a 1-D uint8 tensor over `nbytes` at `ptr` (`ep_jit.dlpack.bytes_capsule`): how a framework
    layer wraps symmetric memory in its own tensor type without a copy. `device_type`: 2 (CUDA) or 1 (CPU)."""
    from ep_jit.dlpack import bytes_capsule as make  # ep_jit's package is imported on first use only

    return make(ptr, nbytes, device_type, device_id)


def _from_dlpack(obj: Any) -> ArrayInfo:
    from ep_jit.dlpack import DL_CUDA, DL_CUDA_MANAGED, capsule_tensor

    device_type = None
    if hasattr(obj, "__dlpack_device__"):
        device_type = int(obj.__dlpack_device__()[0])
    try:
        capsule = obj.__dlpack__(stream=-1) if device_type == DL_CUDA else obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__()
    t = capsule_tensor(capsule)  # read while `capsule` lives
    if t is None:
        raise EPTypeError("array: __dlpack__ returned a capsule that was consumed already")
    dtype = _DL_CODES.get((t.dtype.code, t.dtype.bits))
    if dtype is None or t.dtype.lanes != 1:
        raise EPTypeError(f"array: unsupported DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits})")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    itemsize = DTYPE_SIZES[dtype]
    if t.strides:
        strides = tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    else:
        strides = _c_strides(shape, itemsize)
    dev = t.device.device_type
    device = "cuda" if dev in (DL_CUDA, DL_CUDA_MANAGED) else "cpu"
    data = (t.data or 0) + int(t.byte_offset)
    # the capsule is not consumed: its destructor calls the producer's deleter; obj keeps the memory alive
    return ArrayInfo(data, shape, dtype, strides, device, int(t.device.device_id), obj)


def _from_numpy_interface(obj: Any, ai: dict) -> ArrayInfo:
    a = np.asarray(obj)
    dtype = a.dtype.name if a.dtype.name in DTYPE_SIZES else _TYPESTR_TO_DTYPE.get(ai["typestr"][1:])
    if a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
        dtype = "bfloat16"
    if dtype is None:
        raise EPTypeError(f"array: unsupported dtype {a.dtype}")
    return ArrayInfo(int(ai["data"][0]), tuple(a.shape), dtype, tuple(a.strides), "cpu", 0, obj)


# torch fast path: the exact `ArrayInfo` that the slow path derives from torch's `__cuda_array_interface__` or
# DLPack export, read from the tensor's own cheap accessors (data_ptr(), shape, stride(), dtype, device). torch is
# never imported here: the path is armed once a tensor's type is torch's own `Tensor` class, which exists only when
# the caller imported torch. Anything unusual (a Tensor subclass, requires_grad, a negative/conjugate view, a nested,
# sparse or non-strided layout, a device other than cpu/cuda, a dtype outside the table) takes the slow path, so
# its result or its error is unchanged.
_torch_tensor_type: Any = None
_torch_strided: Any = None
# torch dtype -> (name, read through CAI on cuda, its layouts: (torch.Size, element strides) -> `_TorchLayout`)
_torch_dtypes: dict[Any, tuple[str, bool, dict]] = {}
# dtypes whose CUDA tensors torch exports through __cuda_array_interface__ (a typestr the table names); bf16 ('<V2')
# and FP8 (no typestr) go through DLPack
_TORCH_CAI_DTYPES = tuple(_TYPESTR_TO_DTYPE.values())
_TORCH_DLPACK_DTYPES = tuple(name for name in _NUMPY_STORAGE if name not in _TORCH_CAI_DTYPES)


def _arm_torch(cls: type) -> bool:
    """Arm the torch fast path if `cls` is torch's `Tensor` (torch is then already imported)."""
    global _torch_tensor_type, _torch_strided
    if _torch_tensor_type is not None or cls.__name__ != "Tensor" or cls.__module__ != "torch":
        return False
    import sys

    torch = sys.modules.get("torch")
    if torch is None or getattr(torch, "Tensor", None) is not cls:
        return False
    table = {}
    for name in _TORCH_CAI_DTYPES + _TORCH_DLPACK_DTYPES:
        dt = getattr(torch, name, None)
        if dt is not None:
            table[dt] = (name, name in _TORCH_CAI_DTYPES, {})
    _torch_dtypes.update(table)
    _torch_strided = torch.strided
    _torch_tensor_type = cls
    return True


_new_object = object.__new__
_set_attr = object.__setattr__


def _torch_layout(t: Any, layouts: dict, size: Any, stride: tuple, name: str, via_cai: bool) -> tuple:
    """What `describe` reports for a torch tensor of this dtype, sizes and element strides, a pure function of
    them (torch's contiguity is too): `(shape, byte strides on the CPU, byte strides on CUDA, pointer read on
    CUDA)`. On CUDA through `__cuda_array_interface__` as torch exports it: no strides when contiguous (so C
    strides), a null pointer when empty; through DLPack (and on the CPU) the tensor's own strides."""
    if len(layouts) >= 256:  # many distinct layouts: keep recent ones
        layouts.clear()
    itemsize = DTYPE_SIZES[name]
    shape = tuple(size)
    own = tuple([s * itemsize for s in stride])
    cuda, read_ptr = own, True
    if via_cai:
        if t.is_contiguous():
            cuda = _c_strides(shape, itemsize)
        read_ptr = math.prod(shape) > 0
    got = layouts[(size, stride)] = (shape, own, cuda, read_ptr)
    return got


def set_torch_reader(reader: Callable[[Any], tuple | None] | None) -> None:
    """Have the torch fast path read a tensor's facts through `reader` (ep_torch's host extension, one C call
    instead of ten attribute reads): `reader(t)` returns `(dtype, sizes, element strides, data_ptr, device index or
    -1 for the CPU)`, or None for every tensor the attribute path below would send to the slow path. None restores
    the attribute reads."""
    global _torch_reader
    _torch_reader = reader


_torch_reader: Callable[[Any], tuple | None] | None = None


def _from_torch(t: Any) -> ArrayInfo | None:
    """The fast path for a plain torch tensor, or None when the slow path must decide. Per dtype, the layout part
    is looked up by (sizes, strides) (`_torch_layout`); the `ArrayInfo` is built inline (its frozen dataclass's `__dict__`, no per-field `__setattr__`):
    this runs for every array of every call."""
    reader = _torch_reader
    if reader is not None:
        facts = reader(t)
        if facts is None:
            return None
        dtype, size, stride, ptr, index = facts
        entry = _torch_dtypes.get(dtype)
        if entry is None:
            return None
    else:
        entry = _torch_dtypes.get(t.dtype)
        if entry is None or t.requires_grad or t.layout is not _torch_strided or t.is_nested or t.is_neg():
            return None
        size = t.shape
        stride = t.stride()
        if t.is_cuda:
            ptr, index = t.data_ptr(), t.get_device()
        elif t.is_cpu:
            ptr, index = t.data_ptr(), -1
        else:
            return None
    name, via_cai, layouts = entry
    got = layouts.get((size, stride))
    if got is None:
        got = _torch_layout(t, layouts, size, stride, name, via_cai)
    if index >= 0:
        ptr, strides, device = ptr if got[3] else 0, got[2], "cuda"
    else:  # DLPack: the tensor's own strides
        strides, device, index = got[1], "cpu", 0
    info = _new_object(ArrayInfo)
    _set_attr(
        info,
        "__dict__",
        {
            "ptr": ptr,
            "shape": got[0],
            "dtype": name,
            "strides": strides,
            "device": device,
            "device_id": index,
            "obj": t,
        },
    )
    return info


def describe(obj: Any, name: str = "array") -> ArrayInfo:
    """Read an array's pointer, shape, strides (bytes), dtype and device without importing its framework."""
    cls = type(obj)
    if cls is _torch_tensor_type or (_torch_tensor_type is None and _arm_torch(cls)):
        info = _from_torch(obj)
        if info is not None:
            return info
    if isinstance(obj, ArrayInfo):
        return obj
    if isinstance(obj, DeviceArray):
        return obj.info()
    dev = getattr(getattr(obj, "device", None), "type", None)
    if isinstance(dev, str) and dev not in ("cpu", "cuda"):  # torch's meta, xpu, mps, ...: no pointer to read
        raise EPTypeError(f"{name}: expected a CPU or CUDA array, got one on the {dev!r} device")
    try:
        cai = obj.__cuda_array_interface__
    except Exception:  # torch raises for bf16; many types lack it
        cai = None
    has_dlpack = hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray)
    try:
        # The array interface cannot name bf16 or fp8 (torch exports them as void '<V2' / '|V1'): such arrays are
        # read through DLPack, whose dtype codes can.
        if cai is not None and (not has_dlpack or cai["typestr"][1:] in _TYPESTR_TO_DTYPE):
            return _from_cai(obj, cai)
        if has_dlpack:
            return _from_dlpack(obj)
        ai = getattr(obj, "__array_interface__", None)
        if ai is not None:
            return _from_numpy_interface(obj, ai)
    except EPTypeError as exc:
        raise EPTypeError(f"{name}: {exc}") from exc
    raise EPTypeError(
        f"{name}: expected an array (DLPack, __cuda_array_interface__ or a DeviceArray), got {type(obj).__name__}"
    )


def describe_all(*objs: Any) -> tuple:
    """`describe` of each of `objs`, None kept as None: a request's arrays in one call (`ep_core.prepared`)."""
    return tuple([None if obj is None else describe(obj) for obj in objs])


# ------------------------------------------------------------------------------------------------------------
# host arrays (reference executor, CPU tests)


def host_array(data: np.ndarray, dtype: str | None = None) -> DeviceArray:
    """Wrap a numpy array as a host `DeviceArray` (kept alive); `dtype` overrides the numpy dtype (e.g. uint16
    bit patterns as "bfloat16")."""
    a = np.asarray(data)
    dt = dtype or a.dtype.name
    if DTYPE_SIZES.get(dt) != a.dtype.itemsize:
        raise EPTypeError(f"dtype: {dt!r} does not match the numpy itemsize {a.dtype.itemsize}")
    ptr = a.__array_interface__["data"][0]
    return DeviceArray(ptr, a.shape, dt, a.strides, device="cpu", owner=a)


def host_allocator(shape: Sequence[int], dtype: str) -> DeviceArray:
    """Allocator for host outputs: zeroed numpy storage wrapped as a host `DeviceArray`."""
    return host_array(np.zeros(tuple(shape), dtype=_NUMPY_STORAGE[dtype]), dtype)


def to_numpy(array: Any) -> np.ndarray:
    """A numpy view of a host array (bf16/FP8 as their uint16/uint8 bit patterns). Raises for device memory."""
    info = describe(array)
    if info.device != "cpu":
        raise EPTypeError(f"array: expected host memory, got {info.device} memory; copy it to the host first")
    storage = np.dtype(_NUMPY_STORAGE[info.dtype])
    if info.size == 0:
        return np.zeros(info.shape, dtype=storage)
    span = sum((d - 1) * s for d, s in zip(info.shape, info.strides)) + info.itemsize
    buf = (ctypes.c_char * span).from_address(info.ptr)
    return np.ndarray(info.shape, dtype=storage, buffer=buf, strides=info.strides)


def host_copy(array: Any) -> np.ndarray | None:
    """A numpy copy of an array's bits (None stays None): numpy and host arrays through `to_numpy`, device arrays
    that copy themselves to the host with `.numpy()` (ep_core.kernels' DeviceArray; synchronizes)."""
    if array is None:
        return None
    if isinstance(array, np.ndarray):
        return array.copy()
    if describe(array).device == "cpu":
        return np.array(to_numpy(array), copy=True)
    numpy = getattr(array, "numpy", None)
    if numpy is None:
        raise EPTypeError(
            f"array: cannot copy {type(array).__name__} device memory to the host; copy it first"
        )
    return np.asarray(numpy())
