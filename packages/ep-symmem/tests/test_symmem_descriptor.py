"""Descriptor encode/decode: exact round trip, version and integrity checks, field validation."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import ep_symmem as sm
import pytest
from ep_symmem._descriptor import DESCRIPTOR_MAGIC, FABRIC_HANDLE_BYTES
from hypothesis import given
from hypothesis import strategies as st

ALIGN = 2 << 20


@st.composite
def descriptors(draw: st.DrawFn) -> sm.Descriptor:
    alignment = draw(st.sampled_from([ALIGN, 4 * ALIGN, 512 << 20]))
    host_units = draw(st.integers(0, 1 << 20))
    return sm.Descriptor(
        pid=draw(st.integers(1, 2**32 - 1)),
        device=draw(st.integers(-(2**31), 2**31 - 1)),
        pid_namespace=draw(st.integers(0, 2**64 - 1)),
        token=draw(st.binary(min_size=16, max_size=16)),
        boot_id=draw(st.binary(min_size=16, max_size=16)),
        device_uuid=draw(st.binary(min_size=16, max_size=16)),
        num_gpu_bytes=alignment * draw(st.integers(1, 1 << 20)),
        num_host_bytes=alignment * host_units,
        alignment=alignment,
        gpu_fd=draw(st.integers(-1, 2**31 - 1)),
        host_fd=draw(st.integers(0, 2**31 - 1)) if host_units else draw(st.integers(-1, 2**31 - 1)),
        gpu_handle_types=draw(st.sampled_from([1, 8, 9, 0])),
        host_handle_types=draw(st.sampled_from([0, 1])),
        gpu_fabric_handle=draw(st.one_of(st.just(b""), st.binary(min_size=64, max_size=64))),
    )


@given(descriptors())
def test_round_trip_is_exact(descriptor: sm.Descriptor) -> None:
    data = descriptor.encode()
    assert isinstance(data, bytes)
    back = sm.Descriptor.decode(data)
    assert back == descriptor
    assert sm.Descriptor.decode(bytearray(data)) == descriptor
    assert sm.Descriptor.decode(memoryview(data)) == descriptor
    assert back.encode() == data


def _sample() -> sm.Descriptor:
    return sm.Descriptor(
        pid=4242,
        device=0,
        pid_namespace=4026531836,
        token=bytes(range(16)),
        boot_id=bytes(range(16, 32)),
        device_uuid=bytes(range(32, 48)),
        num_gpu_bytes=6 * ALIGN,
        num_host_bytes=2 * ALIGN,
        alignment=ALIGN,
        gpu_fd=17,
        host_fd=18,
        gpu_handle_types=9,
        host_handle_types=1,
        gpu_fabric_handle=bytes(range(100, 164)),
    )


def _reseal(data: bytes) -> bytes:
    """Recompute the CRC trailer after editing the bytes (simulates a well-formed record of another version)."""
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_layout_header_fields() -> None:
    data = _sample().encode()
    magic, version, body_len = struct.unpack_from("<8sHH", data)
    assert magic == DESCRIPTOR_MAGIC == b"EPSYMMEM"
    assert version == sm.DESCRIPTOR_VERSION == 1
    assert len(data) == 12 + body_len + 4
    assert struct.unpack_from("<I", data, 12)[0] == 4242  # pid first in the body


@pytest.mark.parametrize("version", [0, 2, 7, 65535])
def test_other_version_is_rejected_with_version_error(version: int) -> None:
    data = bytearray(_sample().encode())
    struct.pack_into("<H", data, 8, version)
    with pytest.raises(sm.DescriptorVersionError, match=f"descriptor version {version}.*reads version 1"):
        sm.Descriptor.decode(_reseal(bytes(data)))


def test_version_is_checked_before_length() -> None:
    # A future version may have a longer body: the error must still name the version, not the length.
    data = bytearray(_sample().encode())
    struct.pack_into("<H", data, 8, 2)
    longer = bytes(data[:-4]) + b"\0" * 40
    with pytest.raises(sm.DescriptorVersionError):
        sm.Descriptor.decode(longer + struct.pack("<I", zlib.crc32(longer)))


def test_bad_magic() -> None:
    data = b"NOTSYMMM" + _sample().encode()[8:]
    with pytest.raises(sm.DescriptorError, match="not an ep_symmem descriptor"):
        sm.Descriptor.decode(_reseal(data))


@pytest.mark.parametrize("cut", [0, 5, 11, 12, 100, -1])
def test_truncated(cut: int) -> None:
    data = _sample().encode()
    with pytest.raises(sm.DescriptorError, match=r"too short|truncated|length"):
        sm.Descriptor.decode(data[:cut])


def test_padded() -> None:
    with pytest.raises(sm.DescriptorError, match="length"):
        sm.Descriptor.decode(_sample().encode() + b"\0")


def test_corrupted_byte_fails_the_checksum() -> None:
    data = bytearray(_sample().encode())
    data[40] ^= 0x5A
    with pytest.raises(sm.DescriptorError, match="checksum"):
        sm.Descriptor.decode(bytes(data))


def test_not_bytes() -> None:
    with pytest.raises(sm.DescriptorError, match="bytes, got str"):
        sm.Descriptor.decode("EPSYMMEM")  # type: ignore[arg-type]


def test_bad_fabric_length_in_bytes() -> None:
    data = bytearray(_sample().encode())
    fabric_len_offset = 12 + struct.calcsize("<IiQ16s16s16sQQQiiII")
    struct.pack_into("<H", data, fabric_len_offset, 10)
    with pytest.raises(sm.DescriptorError, match="fabric handle length 10"):
        sm.Descriptor.decode(_reseal(bytes(data)))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"pid": 0}, "pid"),
        ({"token": b"short"}, "token must be 16 bytes"),
        ({"boot_id": "x" * 16}, "boot_id must be 16 bytes"),
        ({"num_gpu_bytes": 0}, "num_gpu_bytes must be > 0"),
        ({"num_gpu_bytes": ALIGN + 1}, "multiples of the alignment"),
        ({"num_host_bytes": -ALIGN}, "num_host_bytes must be >= 0"),
        ({"alignment": 0}, "alignment must be > 0"),
        ({"gpu_fd": -2}, "fds must be >= -1"),
        ({"host_fd": -1}, "a host part needs a host fd"),
        ({"gpu_fabric_handle": b"\0" * 63}, f"empty or {FABRIC_HANDLE_BYTES} bytes"),
        ({"device": True}, "device must be an int"),
    ],
)
def test_invalid_fields_are_rejected(change: dict, fragment: str) -> None:
    with pytest.raises(sm.DescriptorError, match=fragment):
        dataclasses.replace(_sample(), **change)


def test_num_bytes() -> None:
    assert _sample().num_bytes == 8 * ALIGN
