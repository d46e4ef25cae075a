"""The bootstrap protocol (rank, size, allgather, barrier) and two implementations for tests and tools:
LocalBootstrap (ranks are threads of one process) and FileBootstrap (ranks are processes of one host sharing a
directory). Frameworks bring their own (torch.distributed, MPI, a TCP store)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from . import _env
from ._errors import BootstrapError, BootstrapTimeoutError, SymmemValueError

__all__ = ["Bootstrap", "FileBootstrap", "LocalBootstrap"]


@runtime_checkable
class Bootstrap(Protocol):
    """Host-side collectives among `size` ranks; every rank calls them in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, by rank; returns only once every rank has called it (so it is also a barrier)."""
        ...

    def barrier(self) -> None: ...


def _check_group(rank: object, size: object) -> tuple[int, int]:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise SymmemValueError(f"size must be an int >= 1, got {size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise SymmemValueError(f"rank must be an int in [0, {size}), got {rank!r}")
    return rank, size


def _check_data(data: object) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SymmemValueError(f"allgather takes bytes, got {type(data).__name__}")
    return bytes(data)


class _ThreadGroup:
    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.slots: list[bytes] = [b""] * size
        self.barrier = threading.Barrier(size)


class LocalBootstrap:
    """Bootstrap for `size` ranks running as threads of one process (the loopback domain, tests).

    `LocalBootstrap.create_group(4)` returns one object per rank; hand each to its thread.
    """

    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        # Use LocalBootstrap.create_group().
        self._group = group
        self._rank = rank

    @classmethod
    def create_group(cls, size: int, *, timeout: float | None = None) -> list[LocalBootstrap]:
        """One bootstrap per rank of a new group. timeout: seconds a collective waits (default
        EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT)."""
        _check_group(0, size)
        group = _ThreadGroup(size, _env.bootstrap_timeout_s() if timeout is None else float(timeout))
        return [cls(group, rank) for rank in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def _wait(self, what: str) -> None:
        try:
            self._group.barrier.wait(self._group.timeout)
        except threading.BrokenBarrierError:
            raise BootstrapTimeoutError(
                f"LocalBootstrap {what} (rank {self._rank} of {self.size}): not every rank arrived within "
                f"{self._group.timeout} s, or another rank gave up; every rank must call the same collectives"
            ) from None

    def allgather(self, data: bytes) -> list[bytes]:
        payload = _check_data(data)
        self._group.slots[self._rank] = payload
        self._wait("allgather")
        result = list(self._group.slots)
        self._wait("allgather")  # nobody overwrites a slot before everyone has read it
        return result

    def barrier(self) -> None:
        self._wait("barrier")

    def abort(self) -> None:
        """Make every rank's pending and future collectives of this group fail at once (a rank hit an error)."""
        self._group.barrier.abort()


class FileBootstrap:
    """Bootstrap for `size` processes of one host sharing `directory` (fresh per group, e.g. a tmp dir).

    Each allgather round writes one file per rank (atomically: write to a temp name, then rename) and polls for
    the others' files. A rank deletes its file of round k-2 once it is in round k (everyone has read it by then).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        size: int,
        *,
        timeout: float | None = None,
        poll_interval: float = 0.0005,
    ) -> None:
        self._rank, self._size = _check_group(rank, size)
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._timeout = _env.bootstrap_timeout_s() if timeout is None else float(timeout)
        if self._timeout <= 0:
            raise SymmemValueError(f"timeout must be > 0 seconds, got {self._timeout}")
        self._poll = max(float(poll_interval), 1e-5)
        self._round = 0
        if self._path(0, rank).exists():
            raise BootstrapError(
                f"{self._dir} already holds rank {rank}'s files of an earlier group; give every group a fresh "
                "directory"
            )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def directory(self) -> Path:
        return self._dir

    def _path(self, round_index: int, rank: int) -> Path:
        return self._dir / f"round{round_index:09d}.rank{rank:06d}"

    def allgather(self, data: bytes) -> list[bytes]:
        payload = _check_data(data)
        k = self._round
        self._round += 1
        final = self._path(k, self._rank)
        temp = self._dir / f".{final.name}.{os.getpid()}.tmp"
        with open(temp, "wb") as f:
            f.write(payload)
        os.replace(temp, final)
        results: list[bytes | None] = [None] * self._size
        missing = set(range(self._size))
        deadline = time.monotonic() + self._timeout
        delay = self._poll
        while missing:
            for rank in sorted(missing):
                try:
                    results[rank] = self._path(k, rank).read_bytes()
                except FileNotFoundError:
                    continue
                missing.discard(rank)
            if not missing:
                break
            if time.monotonic() > deadline:
                raise BootstrapTimeoutError(
                    f"FileBootstrap round {k} in {self._dir}: rank(s) {sorted(missing)} did not post within "
                    f"{self._timeout} s (rank {self._rank} of {self._size} waiting); are all ranks alive and "
                    "calling the same collectives?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
        if k >= 2:
            self._path(k - 2, self._rank).unlink(missing_ok=True)
        return [r for r in results if r is not None]

    def barrier(self) -> None:
        self.allgather(b"")

    def cleanup(self) -> None:
        """Delete this rank's files except the last round's (another rank may still be reading that one; it is
        one small file per rank). Call after the group's last collective; the directory can go once every rank
        has returned."""
        if self._round >= 2:
            self._path(self._round - 2, self._rank).unlink(missing_ok=True)
