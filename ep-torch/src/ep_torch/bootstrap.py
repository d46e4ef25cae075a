"""The ep-core bootstrap protocol (``rank``, ``size``, ``allgather(bytes)``, ``barrier()``) over a ProcessGroup."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ep_core.errors import EPStateError

__all__ = ["EPPeerError", "ProcessGroupBootstrap", "group_device"]

_ABORT = b"\x00ep_torch.abort\x00"


class EPPeerError(EPStateError):
    """Another rank abandoned the collective operation this rank is in (its own error is raised there)."""


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device that collectives of ``group`` take tensors on: CUDA for nccl groups, CPU otherwise."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ProcessGroupBootstrap:
    """Implements ep-core's bootstrap with ``torch.distributed`` collectives on ``group``.

    ``allgather`` exchanges arbitrary-length byte strings: first the lengths, then the payloads padded to the
    longest one. Works on gloo (CPU tensors) and nccl (CUDA tensors) groups.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupBootstrap: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = group_device(group)
        self.num_allgathers = 0

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank. Raises :class:`EPPeerError` if a peer called :meth:`abort`."""
        out = self._allgather(data)
        for r, b in enumerate(out):
            if b.startswith(_ABORT) and r != self.rank:
                msg = b[len(_ABORT) :].decode(errors="replace")
                raise EPPeerError(f"rank {r} abandoned the operation: {msg}")
        return out

    def abort(self, message: str) -> None:
        """Take part in the peers' pending ``allgather`` with an abort note instead of data (they raise
        :class:`EPPeerError` naming this rank and ``message``); used when this rank rejects its inputs."""
        self._allgather(_ABORT + message.encode())

    def _allgather(self, data: bytes) -> list[bytes]:
        self.num_allgathers += 1
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        dist.all_gather(lengths, length, group=self.group)
        sizes = [int(t.item()) for t in lengths]
        width = max(1, max(sizes))
        payload = torch.zeros(width, dtype=torch.uint8)
        if data:
            payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        payload = payload.to(self.device)
        gathered = [torch.empty_like(payload) for _ in range(self.size)]
        dist.all_gather(gathered, payload, group=self.group)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, sizes)]

    def barrier(self) -> None:
        """Host barrier over the group."""
        dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"ProcessGroupBootstrap(rank={self.rank}, size={self.size}, device={self.device})"
