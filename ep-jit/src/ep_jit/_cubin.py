"""Minimal reading of a cubin (an ELF file): validity check and the names of its kernel entry points."""

from __future__ import annotations

import struct

__all__ = ["is_cubin", "kernel_names"]

_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10


def is_cubin(data: bytes) -> bool:
    """True when ``data`` starts like a 64-bit little-endian ELF file for CUDA (EM_CUDA = 190)."""
    return (
        len(data) >= 64 and data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1 and _u16(data, 18) == 190
    )


def _u16(data: bytes, off: int) -> int:
    return struct.unpack_from("<H", data, off)[0]


def kernel_names(data: bytes) -> list[str]:
    """Symbol names of the ``__global__`` functions (entry points) in the cubin, sorted."""
    if not is_cubin(data):
        raise ValueError("not a 64-bit CUDA ELF (cubin)")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, base
        )
        sections.append((sh_type, offset, size, link, entsize))
    names: list[str] = []
    for sh_type, offset, size, link, entsize in sections:
        if sh_type != 2 or entsize < 24:  # SHT_SYMTAB
            continue
        str_off = sections[link][1]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info, st_other = struct.unpack_from("<IBB", data, pos)
            if st_info & 0xF == _STT_FUNC and st_other & _STO_CUDA_ENTRY:
                end = data.index(b"\0", str_off + st_name)
                names.append(data[str_off + st_name : end].decode())
    return sorted(set(names))
