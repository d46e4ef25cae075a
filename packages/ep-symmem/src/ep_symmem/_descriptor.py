"""The exported form of a symmetric allocation: a small versioned binary record that peers import.

Layout (little-endian), version 1:

    header  8s magic b"EPSYMMEM" | H version | H body length
    body    I pid | i device ordinal | Q pid namespace inode | 16s token | 16s host boot id | 16s device uuid
            | Q GPU bytes | Q host bytes | Q alignment | i GPU fd | i host fd | I GPU handle types
            | I host handle types | H fabric handle length (0 or 64) | 64s GPU fabric handle
    trailer I crc32 of header + body

fds are numbers in the exporting process (peers duplicate them with pidfd_getfd); handle types are
CUmemAllocationHandleType bits (1 = POSIX fd, 8 = fabric).
"""

from __future__ import annotations

import os
import socket
import struct
import uuid
import zlib
from dataclasses import dataclass
from functools import lru_cache

from ._errors import DescriptorError, DescriptorVersionError

__all__ = ["DESCRIPTOR_VERSION", "HANDLE_TYPE_FABRIC", "HANDLE_TYPE_POSIX_FD", "Descriptor", "host_identity"]

DESCRIPTOR_MAGIC = b"EPSYMMEM"
DESCRIPTOR_VERSION = 1
HANDLE_TYPE_POSIX_FD = 0x1
HANDLE_TYPE_FABRIC = 0x8
FABRIC_HANDLE_BYTES = 64

_HEADER = struct.Struct("<8sHH")
_BODY_V1 = struct.Struct("<IiQ16s16s16sQQQiiIIH64s")
_TRAILER = struct.Struct("<I")
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


@lru_cache(maxsize=1)
def host_identity() -> tuple[bytes, int]:
    """(boot id, pid namespace inode) of this process: equal boot ids mean the same running kernel (host), and
    pidfd_open can only address peers of the same pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        boot_id = uuid.uuid5(uuid.NAMESPACE_DNS, socket.gethostname()).bytes
    try:
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_namespace = 0
    return boot_id, pid_namespace


@dataclass(frozen=True)
class Descriptor:
    """What a peer needs to map one rank's symmetric allocation."""

    pid: int
    device: int
    pid_namespace: int
    token: bytes
    boot_id: bytes
    device_uuid: bytes
    num_gpu_bytes: int
    num_host_bytes: int
    alignment: int
    gpu_fd: int
    host_fd: int
    gpu_handle_types: int
    host_handle_types: int
    gpu_fabric_handle: bytes = b""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise DescriptorError(f"invalid descriptor field: {what}")

        for name in ("pid", "device", "pid_namespace", "num_gpu_bytes", "num_host_bytes", "alignment", "gpu_fd",
                     "host_fd", "gpu_handle_types", "host_handle_types"):  # fmt: skip
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool),
                f"{name} must be an int, got {value!r}",
            )
        for name in ("token", "boot_id", "device_uuid"):
            value = getattr(self, name)
            need(isinstance(value, bytes) and len(value) == 16, f"{name} must be 16 bytes, got {value!r}")
        need(isinstance(self.gpu_fabric_handle, bytes), "gpu_fabric_handle must be bytes")
        need(
            len(self.gpu_fabric_handle) in (0, FABRIC_HANDLE_BYTES),
            f"gpu_fabric_handle must be empty or {FABRIC_HANDLE_BYTES} bytes, got {len(self.gpu_fabric_handle)}",
        )
        need(0 < self.pid <= _U32_MAX, f"pid must be in (0, 2**32), got {self.pid}")
        need(_I32_MIN <= self.device <= _I32_MAX, f"device out of int32 range: {self.device}")
        need(0 <= self.pid_namespace <= _U64_MAX, f"pid_namespace out of range: {self.pid_namespace}")
        need(0 < self.num_gpu_bytes <= _U64_MAX, f"num_gpu_bytes must be > 0, got {self.num_gpu_bytes}")
        need(0 <= self.num_host_bytes <= _U64_MAX, f"num_host_bytes must be >= 0, got {self.num_host_bytes}")
        need(0 < self.alignment <= _U64_MAX, f"alignment must be > 0, got {self.alignment}")
        need(
            self.num_gpu_bytes % self.alignment == 0 and self.num_host_bytes % self.alignment == 0,
            f"sizes {self.num_gpu_bytes}/{self.num_host_bytes} must be multiples of the alignment {self.alignment}",
        )
        need(-1 <= self.gpu_fd <= _I32_MAX and -1 <= self.host_fd <= _I32_MAX, "fds must be >= -1 (int32)")
        need(
            0 <= self.gpu_handle_types <= _U32_MAX and 0 <= self.host_handle_types <= _U32_MAX, "handle types"
        )
        need(self.num_host_bytes == 0 or self.host_fd >= 0, "a host part needs a host fd")

    @property
    def num_bytes(self) -> int:
        return self.num_gpu_bytes + self.num_host_bytes

    def encode(self) -> bytes:
        """The descriptor as bytes (version DESCRIPTOR_VERSION)."""
        body = _BODY_V1.pack(
            self.pid,
            self.device,
            self.pid_namespace,
            self.token,
            self.boot_id,
            self.device_uuid,
            self.num_gpu_bytes,
            self.num_host_bytes,
            self.alignment,
            self.gpu_fd,
            self.host_fd,
            self.gpu_handle_types,
            self.host_handle_types,
            len(self.gpu_fabric_handle),
            self.gpu_fabric_handle.ljust(FABRIC_HANDLE_BYTES, b"\0"),
        )
        head = _HEADER.pack(DESCRIPTOR_MAGIC, DESCRIPTOR_VERSION, len(body)) + body
        return head + _TRAILER.pack(zlib.crc32(head))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Descriptor:
        """Parse bytes written by encode(); raises DescriptorError / DescriptorVersionError saying what is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a descriptor is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise DescriptorError(
                f"descriptor too short: {len(data)} bytes, the header alone is {_HEADER.size}; pass the bytes "
                "returned by SymmetricAllocation.export()"
            )
        magic, version, body_len = _HEADER.unpack_from(data)
        if magic != DESCRIPTOR_MAGIC:
            raise DescriptorError(
                f"not an ep_symmem descriptor: magic {magic!r}, expected {DESCRIPTOR_MAGIC!r}; pass the bytes "
                "returned by SymmetricAllocation.export()"
            )
        if version != DESCRIPTOR_VERSION:
            raise DescriptorVersionError(
                f"descriptor version {version}, this ep_symmem reads version {DESCRIPTOR_VERSION}: every rank "
                "must run the same ep-symmem release"
            )
        expected = _HEADER.size + _BODY_V1.size + _TRAILER.size
        if body_len != _BODY_V1.size or len(data) != expected:
            raise DescriptorError(
                f"descriptor length {len(data)} (body {body_len}), version {version} has {expected} (body "
                f"{_BODY_V1.size}): the bytes were truncated or padded in transit"
            )
        (crc,) = _TRAILER.unpack_from(data, expected - _TRAILER.size)
        if zlib.crc32(data[: expected - _TRAILER.size]) != crc:
            raise DescriptorError("descriptor checksum mismatch: the bytes were altered in transit")
        fields = list(_BODY_V1.unpack_from(data, _HEADER.size))
        fabric_len, fabric = fields[-2], fields[-1]
        if fabric_len not in (0, FABRIC_HANDLE_BYTES):
            raise DescriptorError(f"fabric handle length {fabric_len}, expected 0 or {FABRIC_HANDLE_BYTES}")
        return cls(*fields[:-2], gpu_fabric_handle=fabric[:fabric_len])
