"""Transports of the direct-mode kernels (host side): `ipc` (ep_symmem peer tables); `nccl` (LSA windows, the
device side is `ep_core::NcclTransport`, selected with `KernelConfig(transport="nccl")`)."""

from __future__ import annotations

__all__ = ["ipc"]
