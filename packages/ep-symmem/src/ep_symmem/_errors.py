"""The exception hierarchy of ep_symmem. Every error raised by the package is a `SymmemError`.

The native extension raises these classes too (module.cpp maps its error kinds here), with `call` set to the
failing driver or system call (e.g. "cuMemCreate", "pidfd_getfd") and `code` to its CUresult or errno.
"""

from __future__ import annotations

__all__ = [
    "AllocationClosedError",
    "BootstrapError",
    "BootstrapTimeoutError",
    "CudaError",
    "DescriptorError",
    "DescriptorVersionError",
    "DriverNotFoundError",
    "ExchangeError",
    "NoDeviceError",
    "PeerAccessError",
    "SymmemError",
    "SymmemValueError",
    "UnsupportedError",
]


class SymmemError(RuntimeError):
    """Base class of every ep_symmem error."""

    def __init__(self, message: str, *, call: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.code = code


class NoDeviceError(SymmemError):
    """No usable CUDA device: none visible, ordinal out of range, or no driver at all (see subclass)."""


class DriverNotFoundError(NoDeviceError):
    """libcuda.so.1 is missing, is the toolkit's stub, or is too old."""


class CudaError(SymmemError):
    """A CUDA driver call failed; `call` names it and `code` is its CUresult."""


class UnsupportedError(SymmemError):
    """The device, driver or system lacks a capability the request needs (VMM, fabric handles, RDMA, ...)."""


class PeerAccessError(SymmemError):
    """A peer's handle could not be obtained (pidfd_open / pidfd_getfd permission, IMEX channel access)."""


class SymmemValueError(SymmemError, ValueError):
    """An argument is out of range or of the wrong kind."""


class AllocationClosedError(SymmemError):
    """The allocation was used after close()."""


class DescriptorError(SymmemError, ValueError):
    """Bytes that are not a valid ep_symmem descriptor."""


class DescriptorVersionError(DescriptorError):
    """A descriptor written by an incompatible ep_symmem version."""


class ExchangeError(SymmemError):
    """Ranks disagree during an exchange (sizes, own descriptor, a peer failed to import)."""


class BootstrapError(SymmemError):
    """The bootstrap (allgather / barrier) failed."""


class BootstrapTimeoutError(BootstrapError, TimeoutError):
    """A bootstrap collective did not complete in time; the message names the missing ranks."""
