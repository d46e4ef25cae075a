"""DeepEP's ``deep_ep.comm`` functions on ep: ``from ep_torch import comm`` replaces ``from deep_ep import comm``.

- ``get_physical_domain_size(group_or_buffer)``: ``(num_rdma_ranks, num_nvlink_ranks)``;
- ``get_logical_domain_size(group_or_buffer, allow_hybrid_mode=None)``: ``(num_scaleout_ranks,
  num_scaleup_ranks)``, hybrid mode allowed by default as DeepEP;
- ``barrier(buffer, wait_comm_stream=True, with_cpu_sync=False, sequential=True, context_idx=None)``
  (``context_idx``: a ``BucketBuffer``'s group index, 0 for the other buffers) and ``get_comm_stream(buffer)``;
- ``destroy_all_managed_nccl_comm()``.

A buffer answers from its own topology. A group is measured the way ep's buffers would see it, before any buffer
exists: the ranks per NVLink domain are ``EPKIT_SCALEUP_RANKS`` where set, all ranks on the CPU (reference)
backend, else the ranks sharing a host (a host-name all-gather over the group: a collective, as DeepEP's, which
builds an NCCL communicator there). Both then go through ``ep_core.topology.Topology``, the rule every ep buffer
uses.

ep keeps no cache of NCCL communicators: each buffer owns its communicator (or borrows the group's) and releases it
in ``destroy()``. ``destroy_all_managed_nccl_comm()`` therefore has nothing to free; it exists so that code calling
it runs unchanged. DeepEP's ``get_nccl_comm_handle``/``NCCLCommHandle`` are not provided (a buffer's communicator
is ``buffer.nccl_comm_handle``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPValueError
from ep_core.topology import Topology

__all__ = [
    "barrier",
    "destroy_all_managed_nccl_comm",
    "get_comm_stream",
    "get_logical_domain_size",
    "get_physical_domain_size",
]


def _topology(group: dist.ProcessGroup | None, allow_hybrid_mode: bool) -> Topology:
    from .legacy.internode import predicted_nvl_ranks  # ep's rule for S_u before a buffer exists

    group = dist.group.WORLD if group is None else group
    nvl = predicted_nvl_ranks(group, None)
    return Topology(dist.get_world_size(group), nvl, allow_hybrid_mode)


def _is_buffer(obj: Any) -> bool:
    return obj is not None and not isinstance(obj, dist.ProcessGroup)


def get_physical_domain_size(group_or_buffer: Any = None) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of a buffer or of a process group (None: the default group)."""
    if _is_buffer(group_or_buffer):
        if hasattr(group_or_buffer, "get_physical_domain_size"):
            return tuple(int(v) for v in group_or_buffer.get_physical_domain_size())  # type: ignore[return-value]
        if hasattr(group_or_buffer, "_domain"):  # V1's Buffer
            return tuple(int(v) for v in group_or_buffer._domain())  # type: ignore[return-value]
        raise EPValueError(
            f"get_physical_domain_size: expected a process group or an ep buffer, got {type(group_or_buffer).__name__}"
        )
    return _topology(group_or_buffer, True).physical_domain_size


def get_logical_domain_size(
    group_or_buffer: Any = None, allow_hybrid_mode: bool | None = None
) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: a buffer's own, or a group's with ``allow_hybrid_mode`` (None:
    True): hybrid iff allowed and the group spans several NVLink domains, else ``(1, N)``."""
    if _is_buffer(group_or_buffer):
        if hasattr(group_or_buffer, "get_logical_domain_size"):
            return tuple(int(v) for v in group_or_buffer.get_logical_domain_size())  # type: ignore[return-value]
        raise EPValueError(
            f"get_logical_domain_size: expected a process group or an ep buffer, got {type(group_or_buffer).__name__}"
        )
    return _topology(
        group_or_buffer, True if allow_hybrid_mode is None else bool(allow_hybrid_mode)
    ).logical_domain_size


def barrier(
    buffer: Any,
    wait_comm_stream: bool = True,
    with_cpu_sync: bool = False,
    sequential: bool = True,
    context_idx: int | None = None,
) -> None:
    """A barrier over the ranks of one of the buffer's communication contexts (None: its main one). A
    ``BucketBuffer`` has one context per group (``buffer.groups[context_idx]``); every other ep buffer has one (0)."""
    groups = getattr(buffer, "groups", None)
    if context_idx is not None and groups is not None:
        if not 0 <= int(context_idx) < len(groups):
            raise EPValueError(
                f"barrier: context_idx must index the buffer's {len(groups)} groups, got {context_idx}"
            )
        buffer.barrier(wait_comm_stream, with_cpu_sync, sequential, group=groups[int(context_idx)])
        return
    if context_idx not in (None, 0):
        raise EPValueError(
            f"barrier: this buffer has one communication context (context_idx 0), got {context_idx}"
        )
    params = inspect.signature(buffer.barrier).parameters
    kwargs: dict[str, bool] = {}
    for value, names in (
        (wait_comm_stream, ("wait_comm_stream", "use_comm_stream")),
        (with_cpu_sync, ("with_cpu_sync",)),
        (sequential, ("sequential",)),
    ):
        name = next((n for n in names if n in params), None)
        if name is not None:
            kwargs[name] = value
    buffer.barrier(**kwargs)


def get_comm_stream(buffer: Any = None) -> torch.cuda.Stream | None:
    """ep's process-wide communication stream of the current device (None without CUDA)."""
    if buffer is not None and hasattr(buffer, "get_comm_stream"):
        return buffer.get_comm_stream()
    if not torch.cuda.is_available():
        return None
    from ._streams import comm_stream

    return comm_stream(torch.cuda.current_device())


def destroy_all_managed_nccl_comm() -> None:
    """Nothing to free: ep caches no NCCL communicators (each buffer releases its own in ``destroy()``)."""
