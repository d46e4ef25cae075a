"""Elastic memory of an EP buffer (issue 20): `num_cpu_bytes` of host NUMA memory behind the GPU part, in one VA
range (`ep_symmem`'s `[GPU | host NUMA]`), where receive regions that do not fit the GPU part continue instead of
being refused. The kernels address the regions by offset, so a region's tail rows simply live in host memory (at
the host link's bandwidth: `ep_core.planner.explain_memory`). `allocate_storage` maps the host part where the
transport can (ipc over ep_symmem), else the whole buffer is GPU memory; `host_bytes(storage)` says how many bytes
at the back of the data region really are host memory.
"""

from __future__ import annotations

from typing import Any

__all__ = ["allocate_storage", "host_bytes"]


def allocate_storage(transport: Any, bootstrap: Any, num_bytes: int, num_cpu_bytes: int) -> Any:
    """`transport.allocate(bootstrap, num_bytes)` with the last `num_cpu_bytes` in host memory when the transport
    says it can (`supports_host_memory`); a collective like `allocate` itself."""
    if num_cpu_bytes > 0 and getattr(transport, "supports_host_memory", False):
        return transport.allocate(bootstrap, num_bytes, num_host_bytes=int(num_cpu_bytes))
    return transport.allocate(bootstrap, num_bytes)


def host_bytes(storage: Any) -> int:
    """Bytes at the back of `storage`'s data region that live in host NUMA memory (0: all GPU or host storage)."""
    return int(getattr(storage, "num_host_bytes", 0) or 0)
