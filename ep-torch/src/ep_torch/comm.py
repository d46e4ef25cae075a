"""DeepEP's ``deep_ep.comm`` functions on ep: ``from ep_torch import comm`` replaces ``from deep_ep import comm``.

A buffer answers the domain sizes from its own topology. A group is measured the way ep's buffers would see it,
before any buffer exists: the ranks per NVLink domain are ``EPKIT_SCALEUP_RANKS`` where set, all ranks on the CPU
(reference) backend, else the ranks sharing a host (a host-name all-gather: a collective, as DeepEP's); both go
through ``ep_core.topology.Topology``. ``barrier``'s ``context_idx`` is a ``BucketBuffer``'s group index (0 for the
other buffers).

``get_nccl_comm_handle(group, force_new_comm=False)`` returns an ``NCCLCommHandle`` over an NCCL group (the group's
own communicator when every rank has one, else a new one; cached per group; refused on gloo) and
``destroy_all_managed_nccl_comm()`` drops that cache. ep's buffers do not use it: each owns or borrows its
communicator (``buffer.nccl_comm_handle``) and releases it in ``destroy()``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPValueError
from ep_core.topology import Topology

__all__ = [
    "NCCLCommHandle",
    "barrier",
    "destroy_all_managed_nccl_comm",
    "get_comm_stream",
    "get_logical_domain_size",
    "get_nccl_comm_handle",
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
    ``BucketBuffer`` has one context per group (``buffer.groups[context_idx]``); every other ep buffer has one (0).
    A refused ``context_idx`` is announced to the peers waiting in their barrier (issue 41: they raise
    ``EPPeerError`` naming this rank instead of pairing it with this rank's next call)."""
    groups = getattr(buffer, "groups", None)
    params = inspect.signature(buffer.barrier).parameters
    if context_idx is not None and groups is not None:
        if not (type(context_idx) is int and 0 <= context_idx < len(groups)):
            _refuse(
                buffer,
                EPValueError(
                    f"barrier (rank {_rank(buffer)}): context_idx must index the buffer's {len(groups)} groups, got "
                    f"{context_idx!r}"
                ),
            )
        buffer.barrier(wait_comm_stream, with_cpu_sync, sequential, group=groups[context_idx])
        return
    kwargs: dict[str, Any] = {}
    if "context_idx" in params:  # EPBuffer, EngramBuffer: theirs checks it (announced there)
        kwargs["context_idx"] = context_idx
    elif context_idx not in (None, 0):
        _refuse(
            buffer,
            EPValueError(
                f"barrier (rank {_rank(buffer)}): this buffer has one communication context (context_idx 0), got "
                f"{context_idx!r}"
            ),
        )
    for value, names in (
        (wait_comm_stream, ("wait_comm_stream", "use_comm_stream")),
        (with_cpu_sync, ("with_cpu_sync",)),
        (sequential, ("sequential",)),
    ):
        name = next((n for n in names if n in params), None)
        if name is not None:
            kwargs[name] = value
    buffer.barrier(**kwargs)


def _rank(buffer: Any) -> Any:
    return getattr(buffer, "rank_idx", getattr(buffer, "rank", "?"))


def _refuse(buffer: Any, error: Exception) -> None:
    """Raise ``error`` of this rank's barrier, announced where the peers' barrier waits: a ``BucketBuffer``'s
    collective block, else the announcing block of the ep-core buffer underneath (``_core`` of the buffer or of
    its ``_buffer``)."""
    refuse = getattr(buffer, "_refuse", None)
    if refuse is not None:
        refuse("barrier", error)
    core, inner = getattr(buffer, "_core", None), buffer
    while core is None and getattr(inner, "_buffer", None) is not None:
        inner = inner._buffer
        core = getattr(inner, "_core", None)
    if core is None:
        raise error
    with core.announcing("barrier"):
        raise error


def get_comm_stream(buffer: Any = None) -> torch.cuda.Stream | None:
    """ep's process-wide communication stream of the current device (None without CUDA)."""
    if buffer is not None and hasattr(buffer, "get_comm_stream"):
        return buffer.get_comm_stream()
    if not torch.cuda.is_available():
        return None
    from ._streams import comm_stream

    return comm_stream(torch.cuda.current_device())


class NCCLCommHandle:
    """A raw NCCL communicator (``get()``: the ``ncclComm_t`` as an int): borrowed from the group (``managed``
    False) or created by :func:`get_nccl_comm_handle` (``managed`` True: destroyed when the handle goes)."""

    def __init__(self, nccl_comm: int, managed: bool, communicator: Any = None) -> None:
        self.nccl_comm = int(nccl_comm)
        self.managed = bool(managed)
        self._communicator = communicator  # ep_nccl_gin.Communicator of a managed handle (it owns the comm)

    def get(self) -> int:
        return self.nccl_comm

    def __del__(self) -> None:
        comm, self._communicator = getattr(self, "_communicator", None), None
        if comm is not None:
            comm.destroy()


_handles: dict[Any, NCCLCommHandle] = {}


def get_nccl_comm_handle(
    group: dist.ProcessGroup | None = None, force_new_comm: bool = False
) -> NCCLCommHandle:
    """An NCCL communicator over ``group`` (a collective; cached per group unless ``force_new_comm``): the group's
    own when every rank has one ep-nccl-gin can borrow, else one created here (``managed``). Needs a group with an
    NCCL backend (CUDA); the CPU reference backend has no NCCL communicator. ep's buffers do not use this cache:
    each owns or borrows its communicator (``buffer.nccl_comm_handle``)."""
    group = dist.group.WORLD if group is None else group
    if not force_new_comm and group in _handles:
        return _handles[group]
    if "nccl" not in str(dist.get_backend(group)).lower():
        raise EPValueError(
            f"get_nccl_comm_handle: the group's backend is {dist.get_backend(group)!r}; an NCCL communicator needs "
            "a process group with the nccl backend (CUDA)"
        )
    from .transport_choice import _group_comm

    ptr = 0 if force_new_comm else _group_comm(group)[0]
    have = [None] * dist.get_world_size(group)
    dist.all_gather_object(have, ptr != 0, group)  # every rank takes the same branch
    if all(have):
        handle = NCCLCommHandle(ptr, False)
    else:
        from ep_core.transports.nccl import load_nccl_gin  # ep-nccl-gin through ep-core (its `nccl` extra)

        ep_nccl_gin = load_nccl_gin()
        ids = [None] * dist.get_world_size(group)
        dist.all_gather_object(ids, ep_nccl_gin.get_unique_id() if dist.get_rank(group) == 0 else None, group)
        comm = ep_nccl_gin.Communicator(
            ids[0], dist.get_world_size(group), dist.get_rank(group), device=torch.cuda.current_device()
        )
        handle = NCCLCommHandle(comm.ptr, True, comm)
    _handles[object() if force_new_comm else group] = handle
    return handle


def destroy_all_managed_nccl_comm() -> None:
    """Drop :func:`get_nccl_comm_handle`'s cache (its managed communicators are destroyed with their handles).
    ep's buffers keep none there: each releases its own in ``destroy()``."""
    _handles.clear()
