"""Every environment knob of ep_nccl_gin, read here and only here (prefix ``EPKIT_``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["KNOBS", "Knob", "disabled", "gin_disabled", "nccl_include_dir", "rdma_sysfs_dir"]


@dataclass(frozen=True)
class Knob:
    name: str
    type: str
    default: str
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob(
        "EPKIT_NCCL_GIN_DISABLE",
        "bool (0/1)",
        "0",
        "Act as if no NCCL library were installed: every call that needs NCCL raises NcclNotFoundError. "
        "For tests and for forcing ep-core onto its ipc transport.",
    ),
    Knob(
        "EPKIT_DISABLE_GIN",
        "bool (0/1)",
        "0",
        "Refuse GIN (GPU-initiated networking) while keeping the rest of NCCL, as DeepEP's EP_DISABLE_GIN: "
        "gin_support() reports it missing and a device communicator that asks for GIN raises GinUnavailableError.",
    ),
    Knob(
        "EPKIT_RDMA_SYSFS_DIR",
        "path",
        "/sys/class/infiniband",
        "Where gin_support() looks for RDMA devices (one directory per device, ports/<n>/state).",
    ),
    Knob(
        "EPKIT_NCCL_INCLUDE_DIR",
        "path",
        "",
        "Directory holding nccl.h and nccl_device.h to hand to the JIT instead of the headers of the loaded "
        "library's wheel.",
    ),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _bool(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}: expected one of 0/1/true/false/yes/no/on/off, got {os.environ[name]!r}")


def disabled() -> bool:
    """``EPKIT_NCCL_GIN_DISABLE``: pretend NCCL is absent."""
    return _bool("EPKIT_NCCL_GIN_DISABLE")


def nccl_include_dir() -> str | None:
    """``EPKIT_NCCL_INCLUDE_DIR``: explicit NCCL header directory, or None."""
    raw = os.environ.get("EPKIT_NCCL_INCLUDE_DIR", "").strip()
    return raw or None


def gin_disabled() -> bool:
    """``EPKIT_DISABLE_GIN``: refuse GIN, keep the rest of NCCL."""
    return _bool("EPKIT_DISABLE_GIN")


def rdma_sysfs_dir() -> str:
    """``EPKIT_RDMA_SYSFS_DIR``: the sysfs directory of RDMA devices."""
    return os.environ.get("EPKIT_RDMA_SYSFS_DIR", "").strip() or "/sys/class/infiniband"
