"""The ep-core bootstrap protocol (``rank``, ``size``, ``allgather(bytes)``, ``barrier()``) over a ProcessGroup."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from ep_core.errors import EPPeerError, EPTimeoutError

__all__ = ["EPPeerError", "ProcessGroupBootstrap", "group_device"]

_ABORT = b"\x00ep_torch.abort\x00"


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

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout_secs: float | None = None) -> None:
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
        self.timeout_secs: float | None = None
        self._store: object = None
        if timeout_secs is not None:
            self.set_timeout(timeout_secs)

    def set_timeout(self, secs: float) -> None:
        """Bound every later wait by ``secs`` (gloo groups: the buffer's ``num_cpu_timeout_secs``): a peer that does
        not arrive gives :class:`~ep_core.errors.EPTimeoutError`, a dead peer :class:`EPPeerError`, both naming the
        rank(s). Each rank then marks its step count in the group's store, so a failure can say which rank is behind
        (a store write per wait; nccl groups keep their own watchdog and are left as they are)."""
        if self.device.type != "cpu":
            return
        self.timeout_secs = float(secs)
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        except Exception:  # a custom init without a default store: failures then name every peer
            self._store = None

    def _key(self, rank: int) -> str:
        group = self.group if self.group is not None else dist.group.WORLD
        return f"ep_torch/step/{getattr(group, 'group_name', 'world')}/{dist.get_global_rank(group, rank)}"

    def _mark(self) -> None:
        if self._store is not None:
            try:
                self._store.set(self._key(self.rank), str(self.num_allgathers))
            except Exception:
                self._store = None

    def _behind(self) -> list[int]:
        """Peers whose marked step count is behind this rank's (candidates for the one that did not arrive)."""
        others = [r for r in range(self.size) if r != self.rank]
        if self._store is None:
            return others
        late = []
        for r in others:
            try:
                key = self._key(r)
                seen = int(self._store.get(key)) if self._store.check([key]) else -1
            except Exception:
                return others
            if seen < self.num_allgathers:
                late.append(r)
        return late or others

    def _wait(self, work: object, what: str) -> None:
        if self.timeout_secs is None:
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_secs))
        except RuntimeError as exc:
            text = str(exc)
            late = self._behind()
            names = ", ".join(map(str, late))
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise EPTimeoutError(
                    self.rank,
                    f"cpu.{what}",
                    f"rank {names}",
                    f"step {self.num_allgathers}",
                    f"rank {self.rank} timed out after {self.timeout_secs:g} s waiting for rank {names} in the host "
                    f"{what} (step {self.num_allgathers}): that rank did not call the same operation; check that "
                    "every rank calls the same operations, or raise num_cpu_timeout_secs. The group is out of "
                    "step now: rebuild it",
                ) from exc
            raise EPPeerError(
                f"rank {self.rank}: the host {what} (step {self.num_allgathers}) failed because rank {names} left "
                f"the group (died or closed its connection: {text.splitlines()[0][:200]})",
                ranks=tuple(late),
            ) from exc

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
        self._mark()
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        self._wait(dist.all_gather(lengths, length, group=self.group, async_op=True), "allgather")
        sizes = [int(t.item()) for t in lengths]
        width = max(1, max(sizes))
        payload = torch.zeros(width, dtype=torch.uint8)
        if data:
            payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        payload = payload.to(self.device)
        gathered = [torch.empty_like(payload) for _ in range(self.size)]
        self._wait(dist.all_gather(gathered, payload, group=self.group, async_op=True), "allgather")
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, sizes)]

    def barrier(self) -> None:
        """Host barrier over the group (bounded like :meth:`allgather` once a timeout is set)."""
        if self.timeout_secs is None:
            dist.barrier(group=self.group)
            return
        self.num_allgathers += 1
        self._mark()
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier")

    def __repr__(self) -> str:
        return f"ProcessGroupBootstrap(rank={self.rank}, size={self.size}, device={self.device})"
