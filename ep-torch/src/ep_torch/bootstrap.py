"""The ep-core bootstrap protocol (``rank``, ``size``, ``allgather(bytes)``, ``barrier()``) over a ProcessGroup."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPPeerError, EPTimeoutError
from ep_core.rank_state import RankState

__all__ = ["EPPeerError", "ProcessGroupBootstrap", "group_device"]

_ABORT = b"\x00ep_torch.abort\x00"
# per group: resyncs so far (every rank resyncs a group's buffers in the same order)
_RESYNCS: dict[str, int] = {}


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
        # the steps of the buffer(s) over this bootstrap (ep_core.rank_state): every channel over it shares them
        self.rank_state = RankState(self.rank, "buffer")
        self._suspect = False  # a wait of this bootstrap failed: the group's collectives may be out of step
        self._via_store: str | None = None  # after a resync that followed a failure: the store keys' prefix
        self._store_step = 0
        if (
            timeout_secs is None
        ):  # bounded from the start (the construction's exchanges): EPKIT_CPU_TIMEOUT_SECS
            from . import _env

            timeout_secs = _env.cpu_timeout_secs()
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

    def _group_name(self) -> str:
        group = self.group if self.group is not None else dist.group.WORLD
        return str(getattr(group, "group_name", "world"))

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group if self.group is not None else dist.group.WORLD, rank)

    def _key(self, rank: int) -> str:
        return f"ep_torch/step/{self._group_name()}/{self._global(rank)}"

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
            self._suspect = True
            try:
                self._raise_wait_error(exc, what)
            except (EPTimeoutError, EPPeerError) as err:  # every operation over this bootstrap refuses now
                self.rank_state.record(what, err)
                raise

    def _raise_wait_error(self, exc: RuntimeError, what: str) -> None:
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
                "every rank calls the same operations, or raise num_cpu_timeout_secs. The buffer refuses "
                "every operation now, until reset() is called on every rank",
            ) from exc
        dead = self._dead()
        names = ", ".join(map(str, dead))
        raise EPPeerError(
            f"rank {self.rank}: the host {what} (step {self.num_allgathers}) failed because rank {names} left "
            f"the group (died or closed its connection: {text.splitlines()[0][:200]}); the buffer refuses every "
            "operation now (a lost rank cannot come back: rebuild the group)",
            ranks=tuple(dead),
        ) from exc

    def _dead(self) -> list[int]:
        """The peers that died: every survivor of a failed wait posts its step count in the store, and the peers
        that post none within a short grace are the dead ones (the survivors see the closed connections at once)."""
        others = [r for r in range(self.size) if r != self.rank]
        if self._store is None:
            return self._behind()
        mine = self.num_allgathers
        try:
            self._store.set(f"ep_torch/alive/{self._group_name()}/{self._global(self.rank)}", str(mine))
        except Exception:
            return self._behind()
        grace = min(2.0, max(0.2, (self.timeout_secs or 4.0) / 2))
        deadline = time.monotonic() + grace
        missing = others
        while missing and time.monotonic() < deadline:
            still = []
            for r in missing:
                key = f"ep_torch/alive/{self._group_name()}/{self._global(r)}"
                try:
                    seen = int(self._store.get(key)) if self._store.check([key]) else -1
                except Exception:
                    return others
                if seen < mine:
                    still.append(r)
            missing = still
            if missing:
                time.sleep(0.02)
        return missing or others

    def resync(self) -> None:
        """Meet every peer outside the group's collectives (in the group's store, bounded by the timeout): the
        first step of ``reset()``. When any rank's waits failed, the collectives of the group may be out of step
        (a wait given up leaves its collective pending), so every later exchange of this bootstrap runs through
        the store under a fresh prefix instead. Without a store or a timeout (nccl groups): nothing to do here."""
        if self._store is None or self.timeout_secs is None:
            return
        name = self._group_name()
        n = _RESYNCS.get(name, 0) + 1
        _RESYNCS[name] = n
        prefix = f"ep_torch/resync/{name}/{n}"
        flags = self._store_gather(f"{prefix}/meet", b"1" if self._suspect else b"0", "reset")
        if self._via_store is not None or any(f == b"1" for f in flags):
            self._via_store, self._store_step = prefix, 0
        self._suspect = False

    def _store_gather(self, key: str, data: bytes, what: str) -> list[bytes]:
        keys = [f"{key}/{self._global(r)}" for r in range(self.size)]
        store: Any = self._store
        store.set(keys[self.rank], data)
        try:
            store.wait(keys, timedelta(seconds=float(self.timeout_secs or 300)))
        except Exception as exc:
            self._suspect = True
            self.rank_state.record(what, EPTimeoutError(self.rank, what, "store", key))
            try:
                late = [r for r, k in enumerate(keys) if not store.check([k])]
            except Exception:
                late = [r for r in range(self.size) if r != self.rank]
            names = ", ".join(map(str, late))
            raise EPTimeoutError(
                self.rank,
                f"cpu.{what}",
                f"rank {names}",
                key,
                f"rank {self.rank} timed out after {self.timeout_secs:g} s waiting for rank {names} in the host "
                f"{what}: that rank did not call the same operation; every rank must call it (raise "
                "num_cpu_timeout_secs if it is only slow)",
            ) from exc
        return [bytes(store.get(k)) for k in keys]

    def _allgather_via_store(self, data: bytes) -> list[bytes]:
        self._store_step += 1
        self.num_allgathers += 1
        out = self._store_gather(f"{self._via_store}/x/{self._store_step}", data, "allgather")
        if self._store_step > 1:  # every rank has posted this step, so all of them read the one before
            with contextlib.suppress(Exception):
                self._store.delete_key(
                    f"{self._via_store}/x/{self._store_step - 1}/{self._global(self.rank)}"
                )
        return out

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank. Raises :class:`EPPeerError` if a peer called :meth:`abort`."""
        out = self._allgather(data)
        for r, b in enumerate(out):
            if b.startswith(_ABORT) and r != self.rank:
                msg = b[len(_ABORT) :].decode(errors="replace")
                raise EPPeerError(f"rank {r} abandoned the operation: {msg}", ranks=(r,), announced=True)
        return out

    def abort(self, message: str) -> None:
        """Take part in the peers' pending ``allgather`` with an abort note instead of data (they raise
        :class:`EPPeerError` naming this rank and ``message``); used when this rank rejects its inputs."""
        self._allgather(_ABORT + message.encode())

    def _allgather(self, data: bytes) -> list[bytes]:
        # a step this rank took part in (ep_core.rank_state.Guard: no announcing after)
        self.rank_state.taken += 1
        if self._via_store is not None:
            return self._allgather_via_store(data)
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
        if self._via_store is not None:
            self._allgather_via_store(b"")
            return
        self.num_allgathers += 1
        self._mark()
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier")

    def __repr__(self) -> str:
        return f"ProcessGroupBootstrap(rank={self.rank}, size={self.size}, device={self.device})"
