"""The nccl transport, host side (planned): an NCCL window over the symmetric buffer, LSA pointers for NVLink peers.

The device side exists and compiles (`ep_core::NcclTransport`, `KernelConfig(transport="nccl")`: `sym_ptr` is
`ncclGetLsaPointer`); the host side (communicator, window registration through ep-nccl-gin, `ncclDevComm`) is not
wired into `EPBuffer` yet.
"""

from __future__ import annotations

from typing import Any

from ep_core.errors import EPConfigError

__all__ = ["make_transport"]


def make_transport() -> Any:
    raise EPConfigError(
        "transport: 'nccl' is not available yet for EPBuffer (its kernels compile, the host side is pending); use "
        "transport='ipc' for GPUs of one node or processes sharing a GPU"
    )
