"""The ipc transport, host side: symmetric buffers from ep_symmem (VMM + POSIX-fd exchange) and the device table of
peer base pointers that `ep_core::IpcTransport::sym_ptr` reads.

Each rank's allocation is `[workspace (ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES) | GPU data buffer]`, zeroed.
- `IpcBuffer.create_loopback(n, data_bytes)`: n buffers in this process (the loopback domain); the table lists them.
- `IpcBuffer.create_exchanged(bootstrap, data_bytes)`: one buffer per process, exchanged with `ep_symmem.exchange`.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from typing import Any

import ep_layout

from ep_core.kernels import _cuda

__all__ = ["IpcBuffer", "make_transport"]


def _current_device() -> int:
    drv = _cuda.driver()
    return int(_cuda.check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


class IpcBuffer:
    """Symmetric buffers of one process (one per local rank) plus the device peer table."""

    def __init__(self, bases: list[int], peer_table: int, owners: list[Any], table_owner: Any) -> None:
        self.bases = bases
        self.peer_table = peer_table
        self._owners = owners
        self._table_owner = table_owner

    @staticmethod
    def total_bytes(data_bytes: int) -> int:
        return ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES + ep_layout.align(
            int(data_bytes), ep_layout.NUM_SYMMETRIC_ALIGN_BYTES
        )

    @classmethod
    def create_loopback(cls, num_ranks: int, data_bytes: int, *, use_symmem: bool = True) -> IpcBuffer:
        """`num_ranks` zeroed buffers in this process (ep_symmem allocations, or plain cuMemAlloc without it)."""
        total = cls.total_bytes(data_bytes)
        owners: list[Any] = []
        bases: list[int] = []
        symmem = None
        if use_symmem:
            try:
                import ep_symmem as symmem
            except Exception:
                symmem = None
        _cuda.driver()
        for _ in range(num_ranks):
            if symmem is not None:
                try:
                    alloc = symmem.SymmetricAllocation.create(total, device=_current_device())
                except Exception as e:  # no VMM support here: plain allocations serve one process as well
                    import warnings

                    warnings.warn(f"ep_symmem allocation failed ({e}); using cuMemAlloc", stacklevel=2)
                    symmem = None
                else:
                    owners.append(alloc)
                    bases.append(int(alloc.ptr))
                    continue
            buf = _cuda.DeviceBuffer(total)
            owners.append(buf)
            bases.append(buf.ptr)
        for b in bases:
            _cuda.memset(b, total, 0)
        table = _cuda.DeviceBuffer(8 * num_ranks)
        _cuda.check(
            _cuda.driver().cuMemcpyHtoD(table.ptr, struct.pack(f"<{num_ranks}Q", *bases), 8 * num_ranks),
            "cuMemcpyHtoD",
        )
        _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        return cls(bases, table.ptr, owners, table)

    @classmethod
    def create_exchanged(cls, bootstrap: Any, data_bytes: int, memory: str = "symmem") -> IpcBuffer:
        """This process's buffer, mapped by every rank of `bootstrap`: `memory="symmem"` (ep_symmem VMM buffers and
        `ep_symmem.exchange`), or `"cuda_ipc"` (cuMemAlloc + cuIpcGetMemHandle / cuIpcOpenMemHandle: one host,
        processes on the same or on peer-capable GPUs)."""
        if memory == "cuda_ipc":
            return cls._create_cuda_ipc(bootstrap, data_bytes)
        if memory != "symmem":
            raise ValueError(f"memory: expected 'symmem' or 'cuda_ipc', got {memory!r}")
        import ep_symmem

        total = cls.total_bytes(data_bytes)
        _cuda.driver()
        alloc = ep_symmem.SymmetricAllocation.create(total, device=_current_device())
        _cuda.memset(int(alloc.ptr), total, 0)
        _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        bootstrap.barrier()
        ep_symmem.exchange(alloc, bootstrap)
        return cls([int(alloc.ptr)], int(alloc.peer_ptr_table), [alloc], None)

    @classmethod
    def _create_cuda_ipc(cls, bootstrap: Any, data_bytes: int) -> IpcBuffer:
        drv = _cuda.driver()
        total = cls.total_bytes(data_bytes)
        own = _cuda.DeviceBuffer(total)
        handle = _cuda.check(drv.cuIpcGetMemHandle(own.ptr), "cuIpcGetMemHandle")
        raw = ctypes.string_at(handle.getPtr(), 64)
        blobs = bootstrap.allgather(raw)
        rank = int(bootstrap.rank)
        bases: list[int] = []
        opened: list[int] = []
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        for r, blob in enumerate(blobs):
            if r == rank:
                bases.append(own.ptr)
                continue
            h = drv.CUipcMemHandle()
            ctypes.memmove(h.getPtr(), blob, 64)
            ptr = int(_cuda.check(drv.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))
            opened.append(ptr)
            bases.append(ptr)
        table = _cuda.DeviceBuffer(8 * len(bases))
        _cuda.check(
            drv.cuMemcpyHtoD(table.ptr, struct.pack(f"<{len(bases)}Q", *bases), 8 * len(bases)),
            "cuMemcpyHtoD",
        )
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        bootstrap.barrier()
        out = cls([own.ptr], table.ptr, [own], table)
        out._ipc_opened = opened
        return out

    def close(self) -> None:
        for ptr in getattr(self, "_ipc_opened", []):
            with contextlib.suppress(Exception):
                _cuda.driver().cuIpcCloseMemHandle(ptr)
        self._ipc_opened = []
        for o in self._owners:
            close = getattr(o, "close", None)
            if close is not None:
                close()
        if self._table_owner is not None:
            self._table_owner.close()
        self._owners = []
        self._table_owner = None


def make_transport(memory: str = "symmem") -> Any:
    """The ipc `Transport` of `EPBuffer(transport="ipc")`: GPU kernels over ep_symmem (or CUDA IPC) buffers."""
    from ep_core.kernels.gpu_executor import IpcTransport

    return IpcTransport(memory)
