"""`BufferBase` (the lifecycle every communication buffer shares) and `BufferAllocator` (named symmetric tensors).

Storage: any object with `ptr` and `num_bytes` (optionally `close()`, `device`, `array_device`: "cuda", the
default, or "cpu"), laid out `[workspace | data]`: `ep_symmem.SymmetricAllocation`, or `HostStorage` (host memory,
for CPU tests and the reference executor). Peers address each other's tensors by offset, so every rank of an NVLink
domain must plan the same tensors in the same order: `BufferAllocator.check` compares the plans through the
bootstrap and raises `EPPlanMismatchError` naming the first differing tensor and the ranks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from ep_layout import NUM_SYMMETRIC_ALIGN_BYTES
from ep_layout import NUM_TMA_ALIGN_BYTES as _LAYOUT_TMA_ALIGN_BYTES

from ep_core.bootstrap import Bootstrap, check_bootstrap
from ep_core.device_array import DTYPE_SIZES, DeviceArray
from ep_core.errors import EPConfigError, EPPlanMismatchError, EPStateError, EPTypeError

__all__ = [
    "NUM_ALLOCATION_ALIGN_BYTES",
    "NUM_RDMA_ALIGN_BYTES",
    "NUM_TMA_ALIGN_BYTES",
    "BufferAllocator",
    "BufferBase",
    "HostStorage",
    "SymmetricStorage",
    "TensorSpec",
    "align",
]

NUM_ALLOCATION_ALIGN_BYTES = NUM_SYMMETRIC_ALIGN_BYTES
"""Granularity of a buffer's storage and of each tensor of a torch allocation plan: 2 MiB (DeepEP's
``get_num_allocation_alignment()``, ep-layout's symmetric allocation granularity)."""

NUM_TMA_ALIGN_BYTES = _LAYOUT_TMA_ALIGN_BYTES
"""Alignment of every token part and of the bytes a TMA copy moves: 32 (DeepEP's ``get_num_tma_alignment()``)."""

NUM_RDMA_ALIGN_BYTES = 64
"""Alignment of the pieces a bucket session hands out and of RDMA payloads: 64 (DeepEP's
``get_num_rdma_alignment()``; a multiple of the TMA alignment, a divisor of the allocation alignment)."""


def align(num_bytes: int, alignment: int) -> int:
    """``num_bytes`` rounded up to a multiple of ``alignment``."""
    return -(-int(num_bytes) // alignment) * alignment


@runtime_checkable
class SymmetricStorage(Protocol):
    """One rank's symmetric memory: a base pointer and a size."""

    @property
    def ptr(self) -> int: ...

    @property
    def num_bytes(self) -> int: ...


def _storage_device(storage: Any) -> tuple[str, int]:
    kind = getattr(storage, "array_device", "cuda")
    dev = getattr(storage, "device", 0)
    return kind, dev if isinstance(dev, int) else 0


class HostStorage:
    """Zeroed host memory standing in for symmetric memory (CPU tests, reference executor)."""

    array_device = "cpu"
    device = 0

    def __init__(self, num_bytes: int, alignment: int = 4096) -> None:
        if num_bytes < 0:
            raise EPConfigError(f"num_bytes: expected >= 0, got {num_bytes}")
        self._raw = np.zeros(num_bytes + alignment, dtype=np.uint8)
        base = self._raw.__array_interface__["data"][0]
        self._offset = (-base) % alignment
        self.num_bytes = num_bytes
        self.closed = False

    @property
    def ptr(self) -> int:
        return self._raw.__array_interface__["data"][0] + self._offset

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class TensorSpec:
    """A planned tensor: `offset` in bytes from the start of the region the plan is materialized into."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    alignment: int
    offset: int

    @property
    def num_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def key(self) -> list:
        return [self.name, list(self.shape), self.dtype, self.alignment]


class BufferAllocator:
    """Plan named tensors one after another (each aligned), check the plan across ranks, materialize as views."""

    def __init__(self) -> None:
        self._specs: list[TensorSpec] = []
        self._end = 0
        self._frozen = False

    def tensor(self, name: str, shape: Sequence[int], dtype: str, alignment: int = 256) -> TensorSpec:
        """Plan tensor `name`; returns its spec (offset included)."""
        if self._frozen:
            raise EPStateError(f"tensor {name!r}: the plan was already materialized; plan every tensor first")
        if not isinstance(name, str) or not name or any(s.name == name for s in self._specs):
            raise EPConfigError(f"name: expected a new non-empty tensor name, got {name!r}")
        if dtype not in DTYPE_SIZES:
            raise EPTypeError(f"dtype: expected one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        if alignment < 1 or alignment & (alignment - 1):
            raise EPConfigError(f"alignment: expected a power of two, got {alignment}")
        shp = tuple(int(s) for s in shape)
        if any(s < 0 for s in shp):
            raise EPConfigError(f"shape: expected non-negative dimensions for {name!r}, got {shp}")
        offset = -(-self._end // alignment) * alignment
        spec = TensorSpec(name, shp, dtype, alignment, offset)
        self._specs.append(spec)
        self._end = offset + spec.num_bytes
        return spec

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(self._specs)

    @property
    def num_bytes(self) -> int:
        """Bytes the plan needs (end of the last tensor)."""
        return self._end

    @property
    def num_aligned_bytes(self) -> int:
        """``num_bytes`` rounded up to ``NUM_ALLOCATION_ALIGN_BYTES`` (2 MiB): the storage to allocate for it."""
        return align(self._end, NUM_ALLOCATION_ALIGN_BYTES)

    def check(self, bootstrap: Bootstrap, domain: Sequence[int] | None = None) -> None:
        """Compare this rank's plan with every rank of `domain` (default: all ranks) through the bootstrap.

        A collective: every rank calls it. Raises `EPPlanMismatchError` on the first differing tensor.
        """
        boot = check_bootstrap(bootstrap)
        mine = json.dumps([s.key() for s in self._specs]).encode()
        plans = [json.loads(p.decode()) for p in boot.allgather(mine)]
        ranks = list(range(boot.size)) if domain is None else list(domain)
        ref_rank = ranks[0]
        ref = plans[ref_rank]
        for r in ranks[1:]:
            other = plans[r]
            for i in range(max(len(ref), len(other))):
                a = ref[i] if i < len(ref) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    what = (a or b)[0]
                    raise EPPlanMismatchError(
                        f"symmetric tensor #{i} ({what!r}) differs between rank {ref_rank} ({_fmt(a)}) and rank {r} "
                        f"({_fmt(b)}); every rank of a domain must plan the same tensors in the same order "
                        "(same num_max_tokens_per_rank, hidden, num_topk, num_bytes on every rank)"
                    )

    def materialize(self, storage: Any, base_offset: int = 0) -> dict[str, DeviceArray]:
        """Views of every planned tensor over `storage`, starting at `base_offset` bytes."""
        if not isinstance(storage, SymmetricStorage):
            raise EPTypeError(
                f"storage: expected an object with ptr and num_bytes, got {type(storage).__name__}"
            )
        if base_offset + self._end > storage.num_bytes:
            raise EPConfigError(
                f"storage: the plan needs {base_offset + self._end} bytes, the storage has {storage.num_bytes}; "
                "allocate a larger buffer (num_bytes)"
            )
        self._frozen = True
        kind, dev = _storage_device(storage)
        base = int(storage.ptr) + base_offset
        return {
            s.name: DeviceArray(base + s.offset, s.shape, s.dtype, device=kind, device_id=dev, owner=storage)
            for s in self._specs
        }


def _fmt(key: list | None) -> str:
    if key is None:
        return "absent"
    name, shape, dtype, alignment = key
    return f"{name} {tuple(shape)} {dtype} align {alignment}"


class BufferBase:
    """Lifecycle shared by communication buffers: bootstrap, storage `[workspace | data]`, barrier, destroy.

    `destroy()` is collective (subclasses release device resources after a barrier); with
    `explicitly_destroy=False` a buffer that is garbage collected releases its local resources without any
    collective call (a collective in `__del__` could hang when ranks collect at different times). Use it as a
    context manager to destroy on exit.
    """

    def __init__(
        self,
        bootstrap: Bootstrap,
        storage: Any,
        *,
        num_workspace_bytes: int,
        explicitly_destroy: bool = False,
    ) -> None:
        self.bootstrap = check_bootstrap(bootstrap)
        if not isinstance(storage, SymmetricStorage):
            raise EPTypeError(
                f"storage: expected an object with ptr and num_bytes, got {type(storage).__name__}"
            )
        if not 0 <= num_workspace_bytes <= storage.num_bytes:
            raise EPConfigError(
                f"num_workspace_bytes: expected 0..{storage.num_bytes} (the storage size), got {num_workspace_bytes}"
            )
        self.storage = storage
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_workspace_bytes = num_workspace_bytes
        kind, dev = _storage_device(storage)
        self.workspace = DeviceArray(
            storage.ptr, (num_workspace_bytes,), "uint8", device=kind, device_id=dev, owner=storage
        )
        self.data = DeviceArray(
            storage.ptr + num_workspace_bytes,
            (storage.num_bytes - num_workspace_bytes,),
            "uint8",
            device=kind,
            device_id=dev,
            owner=storage,
        )
        self._destroyed = False

    @property
    def rank(self) -> int:
        return self.bootstrap.rank

    @property
    def num_ranks(self) -> int:
        return self.bootstrap.size

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _check_alive(self) -> None:
        if getattr(self, "_destroyed", True):
            raise EPStateError(f"{type(self).__name__}: used after destroy(); create a new buffer")

    # hooks for subclasses
    def _device_barrier(self) -> None:
        self.bootstrap.barrier()

    def _release(self, *, collective: bool) -> None:
        """Free the storage. `collective=True` from `destroy()` (every rank is here); `False` from garbage
        collection, where ranks collect at different times: then a storage with `release_local()` frees only what
        needs no peer (see the nccl transport), and any other storage is simply closed."""
        release_local = getattr(self.storage, "release_local", None)
        if not collective and release_local is not None:
            release_local()
            return
        close = getattr(self.storage, "close", None)
        if close is not None:
            close()

    def barrier(self) -> None:
        """Barrier over every rank (device barrier where the subclass has one, else the bootstrap's)."""
        self._check_alive()
        self._device_barrier()

    def destroy(self) -> None:
        """Collective: barrier, then release resources. A second call raises `EPStateError`."""
        self._check_alive()
        try:
            self._device_barrier()
        finally:
            self._destroyed = True
            self._release(collective=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._destroyed:
            self.destroy()

    def __del__(self) -> None:
        if getattr(self, "_destroyed", True) or getattr(self, "explicitly_destroy", True):
            return
        self._destroyed = True
        with contextlib.suppress(Exception):
            self._release(collective=False)
