"""DeepEP 2.5's shared buffer pieces: ``BufferBase``, ``BufferAllocator`` and the alignment queries.

``BufferAllocator().allocate(shape, dtype)`` plans a tensor and returns a ``meta`` tensor at once; the buffer that
owns the storage (``EPBuffer(lb_allocation_plan_or_num_bytes=plan)``) later ``materialize``\\ s the plan: every
planned tensor becomes, in place (``torch.utils.swap_tensors``), a view of its bytes in the storage (2 MiB aligned,
as DeepEP lays plans out). The plan itself is ep-core's ``BufferAllocator``; this class adds torch dtypes.

``BufferBase`` is DeepEP's common base class: ep's buffers are registered as its virtual subclasses, so
``isinstance(buffer, BufferBase)`` holds. The alignment queries return DeepEP's values, which are ep's
(``ep_core.buffer_base``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from ep_core.buffer_base import NUM_ALLOCATION_ALIGN_BYTES, NUM_RDMA_ALIGN_BYTES, NUM_TMA_ALIGN_BYTES
from ep_core.buffer_base import BufferAllocator as _CorePlan
from ep_core.errors import EPConfigError, EPStateError, EPTypeError, EPValueError

__all__ = [
    "BufferAllocator",
    "BufferBase",
    "BufferContext",
    "get_num_allocation_alignment",
    "get_num_rdma_alignment",
    "get_num_tma_alignment",
]


def get_num_allocation_alignment() -> int:
    """Bytes every buffer size and every planned tensor's offset are multiples of: 2 MiB."""
    return NUM_ALLOCATION_ALIGN_BYTES


def get_num_rdma_alignment() -> int:
    """Bytes the pieces of a bucket session and RDMA payloads are aligned to: 64."""
    return NUM_RDMA_ALIGN_BYTES


def get_num_tma_alignment() -> int:
    """Bytes a TMA copy's size and addresses are multiples of: 32 (e.g. bytes per expert in ``lb_*``)."""
    return NUM_TMA_ALIGN_BYTES


class BufferBase(abc.ABC):
    """DeepEP's base class of communication buffers. ep's buffer classes are registered as virtual subclasses (see
    the module docstring) and carry these members themselves; a class of the caller's that subclasses it gets
    DeepEP's: ``explicitly_destroy``, a ``runtime`` (None until set, and after ``destroy()``), ``main_context``
    (the runtime's) and ``print_memory_usage()`` (the runtime's)."""

    def __init__(self, explicitly_destroy: bool = False) -> None:
        self.explicitly_destroy = bool(explicitly_destroy)
        self.runtime: Any = None

    @property
    def main_context(self) -> Any:
        """The runtime's first communication context; None after ``destroy()``."""
        return None if self.runtime is None else self.runtime.main_context

    def print_memory_usage(self) -> None:
        """The runtime's report of this rank's memory."""
        if self.runtime is None:
            raise EPStateError(
                f"{type(self).__name__}.print_memory_usage: the buffer has no runtime (destroyed?)"
            )
        self.runtime.print_memory_usage()

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the runtime (for buffers built with ``explicitly_destroy=True``); subclasses call it last."""
        if not self.explicitly_destroy:
            raise EPStateError(
                f"{type(self).__name__}.destroy: build the buffer with explicitly_destroy=True to destroy it"
            )
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None


class BufferContext:
    """One communication group of a buffer (DeepEP's ``buffer.context``, ``buffer.contexts[i]`` and
    ``main_context``): its group, this rank's index, the group's size and its domain sizes, as ``buffer`` (an ep
    buffer over that group) sees them."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer
        self.group = buffer.group
        self.rank_idx = buffer.rank_idx
        self.num_ranks = buffer.num_ranks

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)`` of this group."""
        return self._buffer.get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` of this group."""
        return self._buffer.get_logical_domain_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank_idx} of {self.num_ranks})"

    @staticmethod
    def refusal(context_idx: Any, buffer: str) -> EPValueError | None:
        """The error of a barrier's ``context_idx`` on a buffer of one context (None and 0 pass), its message
        beginning with ``buffer``, or None (the caller raises it in its own block)."""
        if context_idx in (None, 0):
            return None
        return EPValueError(f"{buffer} has one communication context (0), got {context_idx}")


class ElasticBacked:
    """The members of a buffer built over one ``ElasticBuffer`` (``_buffer``, None after ``destroy()``):
    ``PPBuffer``, ``EngramBuffer`` and ``BucketBuffer`` (whose main context is its first group's)."""

    _buffer: Any

    def _buf(self) -> Any:
        if self._buffer is None:
            raise EPStateError(f"{type(self).__name__}: used after destroy(); create a new buffer")
        return self._buffer

    @property
    def runtime(self) -> Any:
        """The ep-core buffer underneath (None after ``destroy()``)."""
        return None if self._buffer is None else self._buffer.runtime

    @property
    def main_context(self) -> BufferContext | None:
        """The group's rank, size and domain sizes (DeepEP's ``BufferBase.main_context``); None after
        ``destroy()``."""
        return None if self._buffer is None else BufferContext(self._buffer)


class BufferAllocator:
    """Plan aligned tensors before their storage exists (DeepEP's ``BufferAllocator``)."""

    def __init__(self) -> None:
        self.alignment = NUM_ALLOCATION_ALIGN_BYTES
        self.allocations: list[tuple[torch.Tensor, int]] = []
        self.materialized = False
        self._plan = _CorePlan()

    @property
    def num_bytes(self) -> int:
        """Storage bytes the plan needs: a multiple of ``alignment`` (2 MiB)."""
        return self._plan.num_aligned_bytes

    def allocate(self, shape: Sequence[int] | int | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Plan one tensor and return its ``meta`` placeholder (the same object becomes the real tensor)."""
        if self.materialized:
            raise EPStateError(
                "BufferAllocator.allocate: the plan was materialized already; plan every tensor first"
            )
        if not isinstance(dtype, torch.dtype):
            raise EPTypeError(f"BufferAllocator.allocate: dtype must be a torch.dtype, got {dtype!r}")
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        name = str(dtype).removeprefix("torch.")
        spec = self._plan.tensor(
            f"t{len(self.allocations)}", tuple(tensor.shape), name, alignment=self.alignment
        )
        self.allocations.append((tensor, spec.offset))
        return tensor

    def materialize(self, storage: torch.Tensor) -> None:
        """Turn every planned tensor, in place, into a view of ``storage`` (1-D uint8, exactly ``num_bytes``)."""
        if self.materialized:
            raise EPStateError("BufferAllocator.materialize: a plan is materialized once")
        if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
            raise EPTypeError(
                f"BufferAllocator.materialize: storage must be a contiguous 1-D uint8 tensor, got "
                f"{tuple(storage.shape)} {storage.dtype}"
            )
        if storage.numel() != self.num_bytes:
            raise EPConfigError(
                f"BufferAllocator.materialize: storage has {storage.numel()} bytes, the plan needs {self.num_bytes}"
            )
        for tensor, offset in self.allocations:
            view = storage.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
            torch.utils.swap_tensors(tensor, view)
        self.materialized = True


def register_buffers() -> None:
    """Register ep's buffer classes as virtual subclasses (``ep_torch/__init__`` calls it once all are imported)."""
    from .bucket_buffer import BucketBuffer
    from .buffer import ElasticBuffer
    from .engram_buffer import EngramBuffer
    from .legacy import Buffer
    from .pp_buffer import PPBuffer

    for cls in (ElasticBuffer, PPBuffer, EngramBuffer, BucketBuffer, Buffer):  # EPBuffer: an ElasticBuffer
        BufferBase.register(cls)
