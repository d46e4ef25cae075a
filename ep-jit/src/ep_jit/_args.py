"""Kernel arguments with explicit C types, and their packing into one parameter buffer per launch.

A launch packs its arguments into a single ctypes buffer laid out as ``[void* ptrs[n] | values...]``:
``ptrs[i]`` points at argument ``i`` inside the same buffer, which is what ``cuLaunchKernelEx``'s
``kernelParams`` expects. The layout (struct format, offsets) is computed once per signature and
cached, so a hot launch does one loop over the arguments and one ``struct.pack_into``.
"""

from __future__ import annotations

import ctypes
import struct as _struct
import threading
from typing import Any

from .dlpack import DL_CPU, capsule_tensor

__all__ = [
    "ArgLayout",
    "KernelArg",
    "Struct",
    "bool_",
    "build_signature",
    "describe",
    "fast_signature",
    "float32",
    "float64",
    "int32",
    "int64",
    "pointer",
    "resolve_address",
    "struct",
    "uint32",
    "uint64",
]

_WRAPPERS_HINT = (
    "wrap it with an explicit C type: ep_jit.int32/uint32/int64/uint64/float32/float64/bool_(value), "
    "ep_jit.pointer(address) for a device address, or ep_jit.struct(bytes) for a struct by value"
)


class KernelArg:
    """Base of the typed argument wrappers. ``_ep_code`` is the ``struct`` format code of the value."""

    __slots__ = ("value",)
    _ep_code: str = ""
    _ctype_name: str = ""

    def __repr__(self) -> str:
        return f"ep_jit.{self._ctype_name}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.value))


def _int_wrapper(name: str, code: str, lo: int, hi: int) -> type[KernelArg]:
    def __init__(self: KernelArg, value: int) -> None:
        if isinstance(value, bool):
            raise TypeError(
                f"ep_jit.{name}: expected an int, got bool (use ep_jit.bool_ for a bool parameter)"
            )
        if not isinstance(value, int):
            try:
                value = int(value.__index__())  # numpy integers, torch ints
            except AttributeError:
                raise TypeError(f"ep_jit.{name}: expected an int, got {type(value).__name__}") from None
        if not lo <= value <= hi:
            raise ValueError(f"ep_jit.{name}: {value} is out of range [{lo}, {hi}]")
        self.value = value

    cls = type(
        name, (KernelArg,), {"__slots__": (), "__init__": __init__, "_ep_code": code, "_ctype_name": name}
    )
    cls.__doc__ = f"A kernel argument of C type {name}_t (range [{lo}, {hi}])."
    return cls


int32 = _int_wrapper("int32", "i", -(1 << 31), (1 << 31) - 1)
uint32 = _int_wrapper("uint32", "I", 0, (1 << 32) - 1)
int64 = _int_wrapper("int64", "q", -(1 << 63), (1 << 63) - 1)
uint64 = _int_wrapper("uint64", "Q", 0, (1 << 64) - 1)


class float32(KernelArg):
    """A kernel argument of C type ``float``."""

    __slots__ = ()
    _ep_code = "f"
    _ctype_name = "float32"

    def __init__(self, value: float) -> None:
        self.value = float(value)


class float64(KernelArg):
    """A kernel argument of C type ``double``."""

    __slots__ = ()
    _ep_code = "d"
    _ctype_name = "float64"

    def __init__(self, value: float) -> None:
        self.value = float(value)


class bool_(KernelArg):
    """A kernel argument of C++ type ``bool`` (one byte)."""

    __slots__ = ()
    _ep_code = "?"
    _ctype_name = "bool_"

    def __init__(self, value: bool) -> None:
        self.value = bool(value)


class pointer(KernelArg):
    """A device pointer argument: an int address, an object with ``__cuda_array_interface__``,
    ``data_ptr()`` (torch tensors) or ``__dlpack__``, or None (null)."""

    __slots__ = ()
    _ep_code = "Q"
    _ctype_name = "pointer"

    def __init__(self, value: Any) -> None:
        self.value = resolve_address(value, None)

    def __repr__(self) -> str:
        return f"ep_jit.pointer(0x{self.value:x})"


class Struct(KernelArg):
    """A struct passed by value: its raw bytes (exactly ``sizeof``) and its alignment."""

    __slots__ = ("_ep_code", "_ep_sig", "align")

    def __init__(self, data: bytes | bytearray | memoryview, align: int = 8) -> None:
        data = bytes(data)
        if not data:
            raise ValueError("ep_jit.struct: expected the struct's bytes (sizeof > 0), got empty bytes")
        if align not in (1, 2, 4, 8, 16):
            raise ValueError(f"ep_jit.struct: align must be 1, 2, 4, 8 or 16, got {align}")
        self.value = data
        self.align = align
        self._ep_code = f"{len(data)}s"
        self._ep_sig = (self._ep_code, align)

    def __repr__(self) -> str:
        return f"ep_jit.struct(<{len(self.value)} bytes>, align={self.align})"


def struct(data: bytes | bytearray | memoryview, align: int = 8) -> Struct:
    """Wrap raw bytes as a struct argument passed by value (e.g. a layout struct, ``ncclDevComm``)."""
    return Struct(data, align)


def resolve_address(obj: Any, position: int | None) -> int:
    """The device address of ``obj``: int, None, ``data_ptr()``, ``__cuda_array_interface__``, ``__dlpack__``."""
    if obj is None:
        return 0
    if isinstance(obj, int) and not isinstance(obj, bool):
        if not 0 <= obj < (1 << 64):
            raise ValueError(f"ep_jit.pointer: address {obj} is not a 64-bit unsigned value")
        return obj
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(obj, "__dlpack__"):
        return _dlpack_address(obj)
    where = f"argument {position}" if position is not None else "ep_jit.pointer"
    raise TypeError(
        f"{where}: expected a device address (int), an object with __cuda_array_interface__, data_ptr() "
        f"or __dlpack__, got {type(obj).__name__}"
    )


def _dlpack_address(obj: Any) -> int:
    """Address of a DLPack tensor: data + byte_offset. The capsule is not consumed (it is left unused)."""
    capsule = obj.__dlpack__()  # held while its tensor is read
    tensor = capsule_tensor(capsule)
    if tensor is None:
        raise TypeError("ep_jit.pointer: __dlpack__ returned a capsule that was consumed already")
    if tensor.device.device_type == DL_CPU:  # pageable host memory is not a device address
        raise TypeError("ep_jit.pointer: the DLPack tensor lives in host (CPU) memory; pass a device tensor")
    return int(tensor.data or 0) + int(tensor.byte_offset)


_SIZES = {"i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8, "?": 1}
_NUMPY_CODES = {
    "int32": "i",
    "uint32": "I",
    "int64": "q",
    "uint64": "Q",
    "float32": "f",
    "float64": "d",
    "bool": "?",
}
_CODE_NAMES = {
    "i": "int32",
    "I": "uint32",
    "q": "int64",
    "Q": "uint64/pointer",
    "f": "float32",
    "d": "float64",
    "?": "bool",
}

for _cls in (int32, uint32, int64, uint64, float32, float64, bool_, pointer):
    _cls._ep_sig = (_cls._ep_code, _SIZES[_cls._ep_code])  # type: ignore[attr-defined]


def describe(sig_entry: tuple[str, int]) -> str:
    """Human name of one signature entry, for error messages."""
    code, align = sig_entry
    if code in _CODE_NAMES:
        return f"{_CODE_NAMES[code]} ({_SIZES[code]} bytes)"
    return f"struct ({code[:-1]} bytes, align {align})"


class ArgLayout:
    """The packed layout of one argument signature.

    The buffer is ``[void* ptrs[n] | pad | values]``; ``ptrs`` is written once per buffer and each
    launch packs only the values, with one ``struct.pack_into``. A reusable buffer is kept per layout
    and used whenever no other thread holds it; ``cuLaunchKernelEx`` copies the parameters before it
    returns, so reusing the buffer after the call is safe.
    """

    __slots__ = ("_addr", "_buf", "data_offset", "data_struct", "lock", "nbytes", "offsets", "sizes")

    def __init__(self, sig: tuple[tuple[str, int], ...]) -> None:
        n = len(sig)
        self.data_offset = (n * 8 + 15) & ~15
        fmt = ["<"]
        pos = 0
        offsets = []
        sizes = []
        for code, align in sig:
            size = _SIZES.get(code) or int(code[:-1])
            pad = (-pos) % align
            if pad:
                fmt.append(f"{pad}x")
                pos += pad
            offsets.append(self.data_offset + pos)
            sizes.append(size)
            fmt.append(code)
            pos += size
        self.data_struct = _struct.Struct("".join(fmt))
        self.offsets = tuple(offsets)
        self.sizes = tuple(sizes)
        self.nbytes = max(self.data_offset + pos, 16)
        self.lock = threading.Lock()
        self._buf, self._addr = self.new_buffer()

    def new_buffer(self) -> tuple[ctypes.Array, int]:
        buf = ctypes.create_string_buffer(self.nbytes)
        base = ctypes.addressof(buf)
        n = len(self.offsets)
        if n:
            _struct.pack_into(f"<{n}Q", buf, 0, *[base + off for off in self.offsets])
        return buf, base

    def shared(self) -> tuple[ctypes.Array, int]:
        """The reusable buffer; call with ``self.lock`` held."""
        return self._buf, self._addr

    def pack(self, buf: ctypes.Array, values: list[Any]) -> None:
        self.data_struct.pack_into(buf, self.data_offset, *values)

    def to_bytes(self, values: list[Any]) -> bytes:
        """The packed values alone (what the kernel's parameter block will hold, modulo its own padding)."""
        return self.data_struct.pack(*values)


def build_signature(args: Any) -> tuple[tuple[tuple[str, int], ...], list[Any]]:
    """The signature ``((code, align), ...)`` and the values of a launch's arguments (general path)."""
    sig: list[tuple[str, int]] = []
    vals: list[Any] = []
    for i, a in enumerate(args):
        if isinstance(a, KernelArg):
            sig.append(a._ep_sig)  # type: ignore[attr-defined]
            vals.append(a.value)
            continue
        if isinstance(a, (bool, int, float)):
            kind = "bool" if isinstance(a, bool) else type(a).__name__
            raise TypeError(f"argument {i} is a bare Python {kind} ({a!r}); {_WRAPPERS_HINT}")
        if a is None or callable(getattr(a, "data_ptr", None)) or hasattr(a, "__cuda_array_interface__"):
            sig.append(("Q", 8))
            vals.append(resolve_address(a, i))
            continue
        dtype = getattr(a, "dtype", None)
        if dtype is not None and getattr(a, "shape", None) == () and hasattr(a, "item"):
            c = _NUMPY_CODES.get(str(dtype))
            if c is None:
                raise TypeError(
                    f"argument {i}: a scalar of dtype {dtype} has no kernel type; {_WRAPPERS_HINT}"
                )
            sig.append((c, _SIZES[c]))
            vals.append(a.item())
            continue
        if hasattr(a, "__dlpack__"):
            sig.append(("Q", 8))
            vals.append(resolve_address(a, i))
            continue
        raise TypeError(
            f"argument {i} has type {type(a).__name__}, which is not a kernel argument; {_WRAPPERS_HINT}"
        )
    return tuple(sig), vals


def fast_signature(args: Any) -> tuple[tuple[tuple[str, int], ...], list[Any]]:
    """Signature and values when every argument is a wrapper; falls back to :func:`build_signature`."""
    try:
        return tuple([a._ep_sig for a in args]), [a.value for a in args]
    except AttributeError:
        return build_signature(args)
