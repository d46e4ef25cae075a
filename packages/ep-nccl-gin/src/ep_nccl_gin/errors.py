"""Errors of ep_nccl_gin. Every one derives from :class:`NcclGinError` (itself a ``RuntimeError``)."""

from __future__ import annotations

__all__ = [
    "GinUnavailableError",
    "NcclCallError",
    "NcclGinError",
    "NcclHeadersNotFoundError",
    "NcclNotFoundError",
    "NcclVersionError",
]


class NcclGinError(RuntimeError):
    """Base class of every error raised by ep_nccl_gin."""


class NcclNotFoundError(NcclGinError):
    """No NCCL library could be loaded (none installed, disabled by ``EPKIT_NCCL_GIN_DISABLE``, or the
    extension module is missing)."""


class NcclHeadersNotFoundError(NcclGinError):
    """The NCCL device headers (``nccl.h``, ``nccl_device.h``) needed for JIT compilation were not found."""


class NcclVersionError(NcclGinError):
    """The loaded NCCL, or the NCCL headers ep_nccl_gin was built against, is too old for a feature, or the two
    versions do not satisfy NCCL's header/library compatibility rule."""


class GinUnavailableError(NcclGinError):
    """GIN (GPU-initiated networking) cannot be had here; the message names every missing piece (disabled by
    ``EPKIT_DISABLE_GIN``, no NCCL, NCCL library or headers too old, no RDMA NIC). ``missing`` lists them."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class NcclCallError(NcclGinError):
    """An NCCL (or CUDA driver) call returned an error.

    Attributes:
        call: the name of the C function, e.g. ``"ncclCommInitRank"``.
        result: the ``ncclResult_t`` (or ``CUresult``) value it returned.
    """

    def __init__(self, message: str, call: str = "", result: int = -1) -> None:
        super().__init__(message)
        self.call = call
        self.result = result
