"""Device queries and small device services: visible devices, their capabilities, free memory (cuMemGetInfo),
synchronous copies through any mapping, and a tiny fill kernel. Each call loads the driver on first use and runs
in the device's primary context. Meant for setup, checks and tests, not hot paths."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

from . import _C
from ._errors import NoDeviceError, SymmemValueError

__all__ = [
    "DeviceInfo",
    "MemoryInfo",
    "copy_device",
    "copy_from_device",
    "copy_to_device",
    "device_count",
    "device_info",
    "device_memory_info",
    "fill_u32",
    "is_available",
    "memset_device",
    "open_fd_count",
    "resolve_device",
    "synchronize",
]


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    uuid: bytes
    compute_capability: tuple[int, int]
    driver_version: int
    vmm_supported: bool
    posix_fd_supported: bool
    fabric_supported: bool
    rdma_with_vmm_supported: bool
    host_numa_id: int


class MemoryInfo(NamedTuple):
    free: int
    total: int


def _check_int(name: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SymmemValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise SymmemValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def device_count() -> int:
    """Number of visible CUDA devices. Raises DriverNotFoundError / NoDeviceError without a usable driver."""
    return _C.device_count()


def is_available() -> bool:
    """True when the driver loads and at least one device is visible (never raises)."""
    try:
        return _C.device_count() > 0
    except NoDeviceError:
        return False


def resolve_device(device: int | None) -> int:
    """`device`, or the device of the calling thread's current CUDA context (0 when there is none)."""
    if device is None:
        return _C.current_device()
    return _check_int("device", device)


@cache
def device_info(device: int = 0) -> DeviceInfo:
    """Name, uuid and the capabilities ep_symmem relies on, of one device."""
    raw = _C.device_info(_check_int("device", device))
    return DeviceInfo(
        ordinal=raw["ordinal"],
        name=raw["name"],
        uuid=raw["uuid"],
        compute_capability=tuple(raw["compute_capability"]),
        driver_version=raw["driver_version"],
        vmm_supported=raw["vmm_supported"],
        posix_fd_supported=raw["posix_fd_supported"],
        fabric_supported=raw["fabric_supported"],
        rdma_with_vmm_supported=raw["rdma_with_vmm_supported"],
        host_numa_id=raw["host_numa_id"],
    )


def device_memory_info(device: int | None = None) -> MemoryInfo:
    """cuMemGetInfo of the device: (free, total) bytes."""
    free, total = _C.memory_info(resolve_device(device))
    return MemoryInfo(free, total)


def copy_to_device(dst: int, data: bytes | bytearray | memoryview, device: int | None = None) -> None:
    """Copy a host buffer to device address `dst` (own, peer-mapped or host part); synchronous."""
    _C.copy_host_to_device(resolve_device(device), _check_int("dst", dst, minimum=1), data)


def copy_from_device(src: int, num_bytes: int, device: int | None = None) -> bytes:
    """Copy `num_bytes` at device address `src` to a new bytes object; synchronous."""
    return _C.copy_device_to_host(
        resolve_device(device), _check_int("src", src, minimum=1), _check_int("num_bytes", num_bytes)
    )


def copy_device(dst: int, src: int, num_bytes: int, device: int | None = None) -> None:
    """cuMemcpy between two device addresses (any mapping of this process); synchronous."""
    _C.copy_device_to_device(
        resolve_device(device), _check_int("dst", dst, minimum=1), _check_int("src", src, minimum=1),
        _check_int("num_bytes", num_bytes),
    )  # fmt: skip


def memset_device(dst: int, value: int, num_bytes: int, device: int | None = None) -> None:
    """cuMemsetD8 on the device; synchronous."""
    if not 0 <= _check_int("value", value) <= 255:
        raise SymmemValueError(f"value must be a byte (0..255), got {value}")
    _C.memset_device(
        resolve_device(device), _check_int("dst", dst, minimum=1), value, _check_int("num_bytes", num_bytes)
    )


def fill_u32(dst: int, num_words: int, first: int, step: int = 1, device: int | None = None) -> None:
    """A kernel stores dst[i] = (first + i * step) mod 2**32 for i < num_words (uint32 words); synchronous.

    The stores come from the SMs, through whatever mapping `dst` lies in (own, peer or host part)."""
    _C.fill_u32(
        resolve_device(device), _check_int("dst", dst, minimum=1), _check_int("num_words", num_words),
        _check_int("first", first) & 0xFFFFFFFF, _check_int("step", step) & 0xFFFFFFFF,
    )  # fmt: skip


def synchronize(device: int | None = None) -> None:
    """cuCtxSynchronize on the device's primary context."""
    _C.synchronize(resolve_device(device))


def open_fd_count() -> int:
    """Number of open file descriptors of this process (for leak checks)."""
    return len(os.listdir("/proc/self/fd"))
