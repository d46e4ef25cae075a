"""SymmetricAllocation: one rank's symmetric buffer, [GPU part | host NUMA part] in one virtual range, plus the
mappings of every peer's buffer after an exchange."""

from __future__ import annotations

import contextlib
import math
import os
import struct
import threading
from collections.abc import Sequence
from typing import Literal

from . import _C, _env
from ._descriptor import Descriptor, host_identity
from ._device import device_info, resolve_device
from ._errors import (
    AllocationClosedError,
    DescriptorError,
    ExchangeError,
    SymmemError,
    SymmemValueError,
    UnsupportedError,
)
from ._peer_import import import_methods

__all__ = ["ALIGNMENT_BYTES", "HandleType", "SymmetricAllocation"]

HandleType = Literal["auto", "posix_fd", "fabric"]
ALIGNMENT_BYTES: int = (
    _C.ALIGNMENT_BYTES
)  # 2 MiB; sizes are rounded up to a multiple of it (or of the granularity)
_HANDLE_TYPES = ("auto", "posix_fd", "fabric")

_ptrace_lock = threading.Lock()
_ptrace_allowed = False


def _allow_ptrace_once() -> None:
    global _ptrace_allowed
    with _ptrace_lock:
        if not _ptrace_allowed:
            _C.allow_ptrace_from_any_process()
            _ptrace_allowed = True


def _size(name: str, value: object, *, positive: bool) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SymmemValueError(f"{name} must be an int number of bytes, got {type(value).__name__}")
    if value < 0 or (positive and value == 0):
        raise SymmemValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


class SymmetricAllocation:
    """A CUDA VMM allocation that peers can map: GPU memory, optionally followed by host NUMA memory (the
    *elastic* buffer), in one reserved virtual range starting at `ptr`.

    Create with `SymmetricAllocation.create(...)`, share `export()` with every rank (or use `ep_symmem.exchange`),
    then `import_peers(...)`: `peer_ptr(r)` is rank r's buffer in this process's address space and
    `peer_ptr_table` a device array of those pointers for kernels. `close()` (or the context manager) unmaps and
    releases everything; peers keep their own mappings alive until they close.
    """

    def __init__(self, native: _C.LocalAllocation, handle_type: str) -> None:
        # Use SymmetricAllocation.create().
        self._native = native
        self._handle_type = handle_type
        self._peers: dict[int, _C.PeerMapping] = {}
        self._peer_ptrs: list[int] | None = None
        self._rank: int | None = None
        self._table_ptr: int | None = None
        self._closed = False

    @classmethod
    def create(
        cls,
        num_gpu_bytes: int,
        num_host_bytes: int = 0,
        device: int | None = None,
        *,
        handle_type: HandleType = "auto",
        require_rdma: bool = False,
    ) -> SymmetricAllocation:
        """Allocate `num_gpu_bytes` of GPU memory followed by `num_host_bytes` of host memory on the device's NUMA
        node, each rounded up to `alignment` (2 MiB or the driver's granularity, whichever is coarser).

        handle_type: 'auto' (POSIX fds, plus a fabric handle where the driver grants one), 'posix_fd' (one host),
        'fabric' (required; raises UnsupportedError without IMEX). require_rdma: raise UnsupportedError unless the
        device supports GPUDirect RDMA on VMM memory (the memory is then created RDMA-capable).
        device: ordinal; None = the current context's device, else 0.
        """
        _size("num_gpu_bytes", num_gpu_bytes, positive=True)
        _size("num_host_bytes", num_host_bytes, positive=False)
        if handle_type not in _HANDLE_TYPES:
            raise SymmemValueError(f"handle_type must be one of {_HANDLE_TYPES}, got {handle_type!r}")
        if not isinstance(require_rdma, bool):
            raise SymmemValueError(f"require_rdma must be a bool, got {type(require_rdma).__name__}")
        ordinal = resolve_device(device)
        if _env.allow_ptrace():
            _allow_ptrace_once()
        native = _C.LocalAllocation(ordinal, num_gpu_bytes, num_host_bytes, handle_type, require_rdma)
        return cls(native, handle_type)

    # ------------------------------------------------------------------ properties

    @property
    def ptr(self) -> int:
        """Local virtual address of the start of the buffer (GPU part first)."""
        self._check_open()
        return self._native.base

    @property
    def num_gpu_bytes(self) -> int:
        return self._native.num_gpu_bytes

    @property
    def num_host_bytes(self) -> int:
        return self._native.num_host_bytes

    @property
    def num_bytes(self) -> int:
        return self._native.num_gpu_bytes + self._native.num_host_bytes

    @property
    def host_ptr(self) -> int | None:
        """Start of the host NUMA part (ptr + num_gpu_bytes), or None without one."""
        self._check_open()
        return self._native.base + self._native.num_gpu_bytes if self._native.num_host_bytes else None

    @property
    def device(self) -> int:
        return self._native.device

    @property
    def alignment(self) -> int:
        return self._native.alignment

    @property
    def handle_type(self) -> str:
        return self._handle_type

    @property
    def fabric_exportable(self) -> bool:
        """Whether the GPU part carries a fabric handle (exported at create)."""
        return bool(self._native.gpu_fabric_handle)

    @property
    def rdma_capable(self) -> bool:
        """Whether the GPU part was created with gpuDirectRDMACapable."""
        return self._native.rdma_capable

    @property
    def host_numa_id(self) -> int | None:
        return self._native.host_numa_id if self._native.num_host_bytes else None

    @property
    def host_cpu_accessible(self) -> bool:
        return self._native.num_host_bytes > 0 and self._native.host_cpu_access

    @property
    def notes(self) -> str:
        """Why optional features (fabric handle, RDMA flag) were dropped at create, if they were."""
        return self._native.notes

    @property
    def rank(self) -> int | None:
        """This allocation's rank after import_peers(), else None."""
        return self._rank

    @property
    def num_ranks(self) -> int | None:
        return None if self._peer_ptrs is None else len(self._peer_ptrs)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ export / import

    def descriptor(self) -> Descriptor:
        """This allocation's descriptor (exports its POSIX fds on first call; they stay open until close() or
        release_exported_fds())."""
        self._check_open()
        gpu_fd, host_fd = self._native.export_fds()
        boot_id, pid_namespace = host_identity()
        return Descriptor(
            pid=os.getpid(),
            device=self.device,
            pid_namespace=pid_namespace,
            token=self._native.token,
            boot_id=boot_id,
            device_uuid=device_info(self.device).uuid,
            num_gpu_bytes=self.num_gpu_bytes,
            num_host_bytes=self.num_host_bytes,
            alignment=self.alignment,
            gpu_fd=gpu_fd,
            host_fd=host_fd,
            gpu_handle_types=self._native.gpu_handle_types,
            host_handle_types=self._native.host_handle_types,
            gpu_fabric_handle=self._native.gpu_fabric_handle,
        )

    def export(self) -> bytes:
        """The encoded descriptor that peers pass to import_peers()."""
        return self.descriptor().encode()

    def release_exported_fds(self) -> None:
        """Close the exported POSIX fds; only once every peer has imported (exchange() does this after its
        final collective). A later export() exports fresh ones."""
        self._check_open()
        self._native.release_export_fds()

    def import_peers(self, descriptors: Sequence[bytes | Descriptor], my_rank: int) -> None:
        """Map every rank's buffer. descriptors[r] is rank r's export(); descriptors[my_rank] must be this
        allocation's own. All ranks must have the same sizes. Raises ExchangeError on disagreement, and maps
        nothing (rolls back) when any peer fails."""
        self._check_open()
        if self._peer_ptrs is not None:
            raise ExchangeError(
                "import_peers() was already called on this allocation; create a new allocation to exchange again"
            )
        if isinstance(descriptors, (bytes, bytearray)) or not isinstance(descriptors, Sequence):
            raise SymmemValueError("descriptors must be a list with one descriptor (bytes) per rank")
        num_ranks = len(descriptors)
        if num_ranks == 0:
            raise SymmemValueError("descriptors is empty; it needs one descriptor per rank")
        if not isinstance(my_rank, int) or isinstance(my_rank, bool) or not 0 <= my_rank < num_ranks:
            raise SymmemValueError(f"my_rank must be an int in [0, {num_ranks}), got {my_rank!r}")
        parsed: list[Descriptor] = []
        for rank, item in enumerate(descriptors):
            if isinstance(item, Descriptor):
                parsed.append(item)
                continue
            try:
                parsed.append(Descriptor.decode(item))
            except DescriptorError as error:
                raise type(error)(f"descriptor of rank {rank}: {error}") from error
        mine = parsed[my_rank]
        if mine.token != self._native.token:
            raise ExchangeError(
                f"descriptors[{my_rank}] (my_rank) is not this allocation's descriptor (pid {mine.pid}); the list "
                "must be ordered by rank and my_rank must be this process's rank"
            )
        seen: dict[bytes, int] = {}
        for rank, peer in enumerate(parsed):
            if (peer.num_gpu_bytes, peer.num_host_bytes) != (mine.num_gpu_bytes, mine.num_host_bytes):
                raise ExchangeError(
                    f"rank {rank} has {peer.num_gpu_bytes} GPU + {peer.num_host_bytes} host bytes, rank {my_rank} "
                    f"(this one) {mine.num_gpu_bytes} + {mine.num_host_bytes}: every rank must create() with the "
                    "same sizes"
                )
            if peer.token in seen:
                raise ExchangeError(
                    f"ranks {seen[peer.token]} and {rank} passed the same allocation's descriptor"
                )
            seen[peer.token] = rank
        same_process = _env.same_process_import()
        mappings: dict[int, _C.PeerMapping] = {}
        ptrs: list[int] = []
        try:
            for rank, peer in enumerate(parsed):
                if rank == my_rank:
                    ptrs.append(self._native.base)
                    continue
                gpu_method, host_method = import_methods(
                    mine,
                    peer,
                    peer_rank=rank,
                    handle_type=self._handle_type,
                    same_process=same_process,
                    peer_registered=peer.pid == mine.pid and _C.is_registered(peer.token),
                )
                mapping = _C.PeerMapping(
                    self.device,
                    peer.pid,
                    peer.token,
                    peer.num_gpu_bytes,
                    peer.num_host_bytes,
                    math.lcm(peer.alignment, mine.alignment),
                    peer.gpu_fd,
                    peer.host_fd,
                    peer.gpu_fabric_handle,
                    gpu_method,
                    host_method,
                )
                mappings[rank] = mapping
                ptrs.append(mapping.base)
        except BaseException:
            for mapping in mappings.values():
                with contextlib.suppress(SymmemError):
                    mapping.close()
            raise
        self._peers = mappings
        self._peer_ptrs = ptrs
        self._rank = my_rank

    def _drop_peers(self) -> None:
        """Unmap every peer (used when an exchange fails on another rank)."""
        first: BaseException | None = None
        for mapping in self._peers.values():
            try:
                mapping.close()
            except SymmemError as error:
                first = first or error
        self._peers = {}
        self._peer_ptrs = None
        self._rank = None
        if self._table_ptr is not None:
            table, self._table_ptr = self._table_ptr, None
            _C.device_free(self.device, table)
        if first is not None:
            raise first

    # ------------------------------------------------------------------ peers

    def _check_imported(self) -> list[int]:
        self._check_open()
        if self._peer_ptrs is None:
            raise ExchangeError("no peers yet: call import_peers() or ep_symmem.exchange() first")
        return self._peer_ptrs

    def peer_ptr(self, rank: int) -> int:
        """Rank `rank`'s buffer in this process (this rank: ptr)."""
        ptrs = self._check_imported()
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(ptrs):
            raise IndexError(f"rank must be an int in [0, {len(ptrs)}), got {rank!r}")
        return ptrs[rank]

    @property
    def peer_ptrs(self) -> list[int]:
        """Every rank's buffer in this process, by rank (a copy)."""
        return list(self._check_imported())

    @property
    def peer_ptr_table(self) -> int:
        """Device address of num_ranks uint64 peer base pointers (by rank), allocated on first access, freed at
        close()."""
        ptrs = self._check_imported()
        if self._table_ptr is None:
            table = _C.device_alloc(self.device, 8 * len(ptrs))
            try:
                _C.copy_host_to_device(self.device, table, struct.pack(f"<{len(ptrs)}Q", *ptrs))
            except BaseException:
                _C.device_free(self.device, table)
                raise
            self._table_ptr = table
        return self._table_ptr

    # ------------------------------------------------------------------ host part

    def host_view(self) -> memoryview:
        """Writable CPU view (format 'B') of the host NUMA part; numpy: np.frombuffer(view, dtype). The view does
        not keep the memory alive: never touch it after close()."""
        self._check_open()
        if self._native.num_host_bytes == 0:
            raise SymmemValueError("this allocation has no host part; create it with num_host_bytes > 0")
        if not self._native.host_cpu_access:
            raise UnsupportedError(
                "the host part is not CPU-accessible on this system: " + self._native.host_cpu_access_error
            )
        return _C.host_memoryview(self._native.base + self._native.num_gpu_bytes, self._native.num_host_bytes)

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise AllocationClosedError("this SymmetricAllocation is closed; create a new one")

    def close(self) -> None:
        """Unmap every peer, free the pointer table, unmap and release the buffer and close its fds. Idempotent;
        runs every step and raises the first failure."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        try:
            self._drop_peers()
        except SymmemError as error:
            first = error
        try:
            self._native.close()
        except SymmemError as error:
            first = first or error
        if first is not None:
            raise first

    def __enter__(self) -> SymmetricAllocation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._closed:
            return "SymmetricAllocation(closed)"
        return (
            f"SymmetricAllocation(ptr=0x{self._native.base:x}, num_gpu_bytes={self.num_gpu_bytes}, "
            f"num_host_bytes={self.num_host_bytes}, device={self.device}, rank={self._rank}, "
            f"num_ranks={self.num_ranks})"
        )
