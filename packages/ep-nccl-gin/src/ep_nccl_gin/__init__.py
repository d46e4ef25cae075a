"""ep_nccl_gin: pybind11 bindings of NCCL's host API plus NCCL device-API headers (LSA, GIN) for symmetric windows.

Importing needs neither NCCL nor a GPU; the first call that needs NCCL loads ``libnccl.so.2`` through
cuda.pathfinder (which prefers a copy already loaded, e.g. torch's) and raises
:class:`~ep_nccl_gin.errors.NcclNotFoundError` when there is none. See README.md for the API.
"""

from __future__ import annotations

from ._loader import LoadedNccl, is_loaded, load
from .communicator import (
    Communicator,
    DevComm,
    Team,
    Window,
    get_unique_id,
    mem_alloc,
    mem_free,
    nccl_version,
)
from .errors import (
    GinUnavailableError,
    NcclCallError,
    NcclGinError,
    NcclHeadersNotFoundError,
    NcclNotFoundError,
    NcclVersionError,
)
from .gin_availability import GinSupport, gin_support, rdma_devices, require_gin
from .headers import include_dirs, nccl_header_version, nccl_include_dir, own_include_dir
from .version import FEATURES, NcclVersion

__version__ = "0.1.0"

__all__ = [
    "FEATURES",
    "Communicator",
    "DevComm",
    "GinSupport",
    "GinUnavailableError",
    "LoadedNccl",
    "NcclCallError",
    "NcclGinError",
    "NcclHeadersNotFoundError",
    "NcclNotFoundError",
    "NcclVersion",
    "NcclVersionError",
    "Team",
    "Window",
    "__version__",
    "get_unique_id",
    "gin_support",
    "include_dirs",
    "is_available",
    "is_loaded",
    "load",
    "mem_alloc",
    "mem_free",
    "nccl_header_version",
    "nccl_include_dir",
    "nccl_version",
    "own_include_dir",
    "rdma_devices",
    "require_gin",
]


def is_available() -> bool:
    """True when an NCCL library can be loaded (never raises)."""
    try:
        load()
    except NcclGinError:
        return False
    return True
