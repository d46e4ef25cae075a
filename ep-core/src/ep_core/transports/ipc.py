"""The ipc transport, host side: symmetric buffers from ep_symmem (VMM + POSIX-fd exchange) and the device table of
peer base pointers that `ep_core::IpcTransport::sym_ptr` reads. Each rank's allocation is `[workspace | GPU data]`,
zeroed: `IpcBuffer.create_loopback(n, data_bytes)` makes n buffers in this process (the loopback domain),
`IpcBuffer.create_exchanged(bootstrap, data_bytes)` one per process.

The ranks first exchange their device identities (`rank_devices`): ranks on one GPU need nothing more; ranks on
different GPUs must be on one host with peer access and native peer atomics (the kernels' barriers and counters are
system-scope atomics on peer memory), else every rank refuses (`EPConfigError` naming the devices) before any
kernel could hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Callable
from typing import Any

import ep_layout

from ep_core.errors import EPConfigError
from ep_core.kernels import _cuda

__all__ = [
    "IpcBuffer",
    "IpcStorage",
    "IpcTransport",
    "check_peer_access",
    "exchange_devices",
    "make_transport",
    "peer_access_problems",
]


def _current_device() -> int:
    drv = _cuda.driver()
    return int(_cuda.check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def exchange_devices(bootstrap: Any) -> list[str]:
    """Every rank's `_cuda.device_identity()` ("<host>/<GPU uuid>"), in rank order (a collective)."""
    mine = _cuda.device_identity().encode()
    return [b.decode() for b in bootstrap.allgather(mine)]


def peer_access_problems(
    identities: list[str], rank: int, visible: dict[str, int], p2p: Callable[[int, int], tuple[bool, bool]]
) -> list[str]:
    """What keeps `rank` from loading, storing and atomically updating every peer's buffer directly: peers on another
    host, peers' GPUs this process does not see, device pairs without peer access or without native peer atomics.
    `visible` maps GPU UUIDs to this process's device ordinals; `p2p(src, dst)` returns `(access, native_atomics)`
    (`_cuda.p2p_support`). Ranks on this rank's own GPU need nothing."""
    mine = identities[rank]
    host, uuid = mine.split("/", 1)
    problems: list[str] = []
    seen: dict[str, tuple[bool, bool]] = {}
    for r, ident in enumerate(identities):
        if ident == mine:
            continue
        peer_host, peer_uuid = ident.split("/", 1)
        if peer_host != host:
            problems.append(
                f"rank {r} runs on host {peer_host!r} and rank {rank} on {host!r}: the ipc transport needs every "
                "rank on one host (use the nccl transport across hosts)"
            )
            continue
        if uuid not in visible or peer_uuid not in visible:
            problems.append(
                f"rank {r}'s GPU (uuid {peer_uuid}) is not visible to rank {rank}: peer access needs every GPU of the "
                "group visible to every process (do not narrow CUDA_VISIBLE_DEVICES per process), or use the nccl "
                "transport (ep_torch picks it when every rank has its own GPU and NCCL >= 2.28.7)"
            )
            continue
        src, dst = visible[uuid], visible[peer_uuid]
        if peer_uuid not in seen:
            seen[peer_uuid] = p2p(src, dst)
        access, atomics = seen[peer_uuid]
        if not access:
            problems.append(
                f"GPU {src} (rank {rank}) cannot access GPU {dst} (rank {r}) as a peer (cuDeviceCanAccessPeer / "
                "P2P ACCESS_SUPPORTED is 0): the ipc transport needs peer-to-peer access between every pair of GPUs"
            )
        elif not atomics:
            problems.append(
                f"GPU {src} (rank {rank}) -> GPU {dst} (rank {r}) has no native peer atomics (P2P "
                "NATIVE_ATOMIC_SUPPORTED is 0, typical of PCIe peers): the kernels' barriers and counters are "
                "system-scope atomics on peer memory; use NVLink-connected GPUs"
            )
    return problems


def check_peer_access(
    bootstrap: Any,
    identities: list[str],
    *,
    visible: dict[str, int] | None = None,
    p2p: Callable[[int, int], tuple[bool, bool]] | None = None,
) -> None:
    """A collective: every rank checks its own row (`peer_access_problems`), the verdicts are gathered, and every rank
    raises the same `EPConfigError` if any pair fails (so that no rank goes on to wait for a peer that stopped)."""
    rank = int(bootstrap.rank)
    if all(ident == identities[rank] for ident in identities):
        mine: list[str] = []
    else:
        mine = peer_access_problems(
            identities,
            rank,
            _cuda.visible_devices() if visible is None else visible,
            _cuda.p2p_support if p2p is None else p2p,
        )
    everyone = [b.decode() for b in bootstrap.allgather("\n".join(mine).encode())]
    problems = [line for text in everyone for line in text.splitlines() if line]
    if problems:
        raise EPConfigError("ipc transport: " + "; ".join(dict.fromkeys(problems)))


class IpcBuffer:
    """Symmetric buffers of one process (one per local rank) plus the device peer table. `rank_devices`: every
    rank's device identity (`exchange_devices`; the loopback domain's ranks all share this process's GPU)."""

    def __init__(
        self,
        bases: list[int],
        peer_table: int,
        owners: list[Any],
        table_owner: Any,
        rank_devices: list[str] | None = None,
    ) -> None:
        self.bases = bases
        self.host_bytes = 0  # bytes at the back of the data region in host NUMA memory (create_exchanged)
        self.peer_table = peer_table
        self._owners = owners
        self._table_owner = table_owner
        self.rank_devices = rank_devices

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
    def create_exchanged(
        cls, bootstrap: Any, data_bytes: int, memory: str = "symmem", num_host_bytes: int = 0
    ) -> IpcBuffer:
        """This process's buffer, mapped by every rank of `bootstrap`: `memory="symmem"` (ep_symmem VMM buffers and
        `ep_symmem.exchange`), or `"cuda_ipc"` (cuMemAlloc + cuIpcGetMemHandle / cuIpcOpenMemHandle: one host,
        processes on the same or on peer-capable GPUs).

        `num_host_bytes > 0` (the elastic buffer, symmem only): the last `num_host_bytes` of the data region are host
        NUMA memory of the GPU's node behind the GPU part, in the same VA range (`ep_symmem` `[GPU | host]`), mapped
        by every rank. A collective choice: when any rank cannot build it, every rank keeps the whole data region in
        GPU memory (a warning names the rank and the reason). `host_bytes` on the result says which."""
        if memory not in ("symmem", "cuda_ipc"):
            raise ValueError(f"memory: expected 'symmem' or 'cuda_ipc', got {memory!r}")
        devices = exchange_devices(bootstrap)
        check_peer_access(bootstrap, devices)
        if memory == "cuda_ipc":
            out = cls._create_cuda_ipc(bootstrap, data_bytes)
            out.rank_devices = devices
            return out
        import ep_symmem

        total = cls.total_bytes(data_bytes)
        _cuda.driver()
        host = int(num_host_bytes) if memory == "symmem" else 0
        alloc = cls._create_elastic(bootstrap, total, host) if host else None
        if alloc is None:
            alloc, host = ep_symmem.SymmetricAllocation.create(total, device=_current_device()), 0
        # one memset may not cross from the GPU part's physical allocation into the host part's (the H200 driver
        # answers CUDA_ERROR_INVALID_VALUE): zero each part on its own
        gpu = min(total, int(alloc.num_gpu_bytes)) if host else total
        _cuda.memset(int(alloc.ptr), gpu, 0)
        if total > gpu:
            _cuda.memset(int(alloc.ptr) + gpu, total - gpu, 0)
        _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        bootstrap.barrier()
        ep_symmem.exchange(alloc, bootstrap)
        out = cls([int(alloc.ptr)], int(alloc.peer_ptr_table), [alloc], None, devices)
        out.host_bytes = host
        return out

    @staticmethod
    def _create_elastic(bootstrap: Any, total: int, num_host_bytes: int) -> Any:
        """`[GPU total - host | host NUMA num_host_bytes]` (one VA range), or None on every rank when any rank
        cannot build it (a collective: the ranks' verdicts are exchanged, so all fall back together)."""
        import warnings

        import ep_symmem

        alloc, why = None, ""
        if num_host_bytes >= total:
            why = f"num_host_bytes={num_host_bytes} leaves no GPU part of the {total}-byte allocation"
        else:
            try:
                alloc = ep_symmem.SymmetricAllocation.create(
                    total - num_host_bytes, num_host_bytes=num_host_bytes, device=_current_device()
                )
            except Exception as exc:  # no host NUMA VMM support here (driver, kernel, container)
                why = f"{type(exc).__name__}: {exc}"
        verdicts = [v.decode() for v in bootstrap.allgather(why.encode())]
        bad = [(r, v) for r, v in enumerate(verdicts) if v]
        if not bad:
            return alloc
        if alloc is not None:
            alloc.close()
        warnings.warn(
            f"ipc transport: the host part of the elastic buffer ({num_host_bytes} bytes) stays in GPU memory: "
            f"rank {bad[0][0]} cannot map host NUMA memory ({bad[0][1]})",
            stacklevel=4,
        )
        return None

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


class IpcStorage:
    """One rank's symmetric storage `[workspace | data]` and the device table of every rank's base."""

    array_device = "cuda"

    def __init__(self, buffer: Any, num_bytes: int, device: int) -> None:
        self._buffer = buffer
        self.ptr = buffer.bases[0]
        self.num_bytes = num_bytes
        self.peer_table = buffer.peer_table
        self.device = device
        self.rank_devices = getattr(buffer, "rank_devices", None)
        # the back of the data region in host NUMA memory (the elastic part; 0: all GPU memory)
        self.num_host_bytes = int(getattr(buffer, "host_bytes", 0))

    def peer_bases(self, num_ranks: int) -> list[int]:
        """Every rank's storage base as mapped in this process (rank order), for copies between the ranks'
        buffers (the copy-engine primitives of ep_torch): ep_symmem's peer pointers, or (CUDA IPC memory) the
        device peer table read back."""
        if self._buffer is None:
            raise EPConfigError("peer_bases: the storage was closed")
        owners = getattr(self._buffer, "_owners", None) or []
        if owners and hasattr(owners[0], "peer_ptr"):
            return [int(owners[0].peer_ptr(r)) for r in range(int(num_ranks))]
        raw = bytearray(8 * int(num_ranks))
        host = (ctypes.c_char * len(raw)).from_buffer(raw)
        _cuda.check(
            _cuda.driver().cuMemcpyDtoH(ctypes.addressof(host), int(self.peer_table), len(raw)),
            "cuMemcpyDtoH",
        )
        return list(struct.unpack(f"<{int(num_ranks)}Q", bytes(raw)))

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


class IpcTransport:
    """Direct mode over load/store-reachable peers (one node, or processes sharing a GPU): buffers from ep_symmem
    (`memory="symmem"`) or CUDA IPC handles (`memory="cuda_ipc"`)."""

    def __init__(self, memory: str = "symmem") -> None:
        if memory not in ("symmem", "cuda_ipc"):
            raise EPConfigError(f"memory: expected 'symmem' or 'cuda_ipc', got {memory!r}")
        self.memory = memory

    def num_nvlink_ranks(self, bootstrap: Any) -> int:
        return int(bootstrap.size)

    supports_host_memory = True  # allocate(num_host_bytes=): the elastic buffer's host part

    def allocate(self, bootstrap: Any, num_bytes: int, num_host_bytes: int = 0) -> IpcStorage:
        """`[workspace | data]` of `num_bytes`; the last `num_host_bytes` of it in host NUMA memory where every rank
        can map it (`IpcStorage.num_host_bytes` says whether it is)."""
        data = int(num_bytes) - ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
        buf = IpcBuffer.create_exchanged(bootstrap, data, self.memory, int(num_host_bytes))
        return IpcStorage(buf, IpcBuffer.total_bytes(data), _current_device())

    def create_executor(self, config: Any, buffer: Any) -> Any:
        from ep_core.kernels.gpu_executor import GpuExecutor  # the kernels load only when a buffer is made

        return GpuExecutor(config, buffer.storage, buffer.bootstrap)


def make_transport(memory: str = "symmem") -> Any:
    """The ipc `Transport` of `EPBuffer(transport="ipc")`: GPU kernels over ep_symmem (or CUDA IPC) buffers."""
    return IpcTransport(memory)
