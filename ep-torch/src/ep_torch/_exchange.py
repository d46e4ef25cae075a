"""All-gather of small bundles of numpy arrays through a bootstrap (one exchange per call).

The CPU reference backend uses this: every rank contributes its inputs (bit patterns, any shapes), every rank
receives everybody's, runs ``ep_core.reference`` over all of them and keeps its own result.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol

import numpy as np

_HEADER = struct.Struct("<Q")


class Bootstrap(Protocol):
    rank: int
    size: int

    def allgather(self, data: bytes) -> list[bytes]: ...

    def barrier(self) -> None: ...


def pack(arrays: dict[str, np.ndarray | None]) -> bytes:
    """Serialize named arrays (None allowed) into one byte string."""
    meta: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, a in arrays.items():
        if a is None:
            meta[name] = None
            continue
        c = np.ascontiguousarray(a)
        raw = c.tobytes()
        meta[name] = {"dtype": c.dtype.str, "shape": list(c.shape), "offset": offset, "nbytes": len(raw)}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(meta).encode()
    return _HEADER.pack(len(head)) + head + b"".join(blobs)


def unpack(data: bytes) -> dict[str, np.ndarray | None]:
    """The inverse of :func:`pack` (arrays are fresh copies, writable)."""
    (n,) = _HEADER.unpack_from(data, 0)
    meta = json.loads(data[_HEADER.size : _HEADER.size + n].decode())
    base = _HEADER.size + n
    out: dict[str, np.ndarray | None] = {}
    for name, m in meta.items():
        if m is None:
            out[name] = None
            continue
        start = base + m["offset"]
        buf = data[start : start + m["nbytes"]]
        out[name] = np.frombuffer(buf, dtype=np.dtype(m["dtype"])).reshape(m["shape"]).copy()
    return out


def allgather_arrays(
    bootstrap: Bootstrap, arrays: dict[str, np.ndarray | None]
) -> list[dict[str, np.ndarray | None]]:
    """Every rank's ``arrays``, indexed by rank."""
    return [unpack(b) for b in bootstrap.allgather(pack(arrays))]
