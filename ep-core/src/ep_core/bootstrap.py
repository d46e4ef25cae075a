"""The bootstrap protocol (host-side exchange among the ranks of an EP group) and two in-process bootstraps.

A bootstrap has `rank`, `size`, `allgather(bytes) -> list[bytes]` (rank order) and `barrier()`, optionally
`set_timeout(secs)` (the reference executor then bounds its waits by `num_cpu_timeout_secs`). `LocalBootstrap` is
the one-rank group; `ThreadGroup(n).bootstraps()` gives n bootstraps for n threads of one process and
`ThreadGroup(n).run(fn)` runs `fn(rank, bootstrap)` in them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ep_core.errors import EPTimeoutError, EPValueError

__all__ = ["Bootstrap", "LocalBootstrap", "ThreadGroup", "check_bootstrap"]


@runtime_checkable
class Bootstrap(Protocol):
    """Host-side collectives of an EP group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, indexed by rank (a collective: every rank calls it)."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...


def check_bootstrap(bootstrap: object) -> Bootstrap:
    """Validate that `bootstrap` implements the protocol with a sane rank and size."""
    if not isinstance(bootstrap, Bootstrap):
        raise EPValueError(
            f"bootstrap: expected an object with rank, size, allgather(bytes) and barrier(), got "
            f"{type(bootstrap).__name__}"
        )
    rank, size = bootstrap.rank, bootstrap.size
    if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
        raise EPValueError(f"bootstrap: expected 0 <= rank < size, got rank={rank!r}, size={size!r}")
    return bootstrap


class LocalBootstrap:
    """The group of one rank."""

    rank = 0
    size = 1

    def allgather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def barrier(self) -> None:
        return None


class ThreadGroup:
    """`size` ranks living in threads of one process; `bootstraps()` returns one bootstrap per rank."""

    def __init__(self, size: int, timeout_secs: float = 300.0) -> None:
        if size < 1:
            raise EPValueError(f"size: expected >= 1, got {size}")
        self.size = size
        self.timeout_secs = timeout_secs
        self._barrier = threading.Barrier(size)
        self._slots: list[bytes | None] = [None] * size
        # `resync`: every rank meets here; the last to arrive repairs the main barrier (broken by a timeout)
        self._resync_barrier = threading.Barrier(size, action=self._repair)

    def _repair(self) -> None:
        self._barrier.reset()
        self._slots = [None] * self.size

    def _resync(self, rank: int) -> None:
        try:
            self._resync_barrier.wait(self.timeout_secs)
        except threading.BrokenBarrierError as exc:
            self._resync_barrier.reset()  # usable by the next reset() (the waiters have left it already)
            raise EPTimeoutError(
                rank,
                "bootstrap.resync",
                "thread barrier",
                "broken",
                f"rank {rank} timed out after {self.timeout_secs:g} s in reset() of a ThreadGroup of {self.size}: "
                "a peer thread did not call it",
            ) from exc

    def bootstraps(self) -> list[_ThreadBootstrap]:
        return [_ThreadBootstrap(self, r) for r in range(self.size)]

    def run(
        self,
        fn: Callable[[int, Any], Any],
        *,
        raise_first: bool = True,
        join_timeout_secs: float | None = None,
    ) -> list[Any]:
        """`fn(rank, bootstrap)` for every rank, each in its own thread (named `rank<r>`), joined; returns the
        results by rank. An exception raised by a rank is kept in its place; `raise_first` re-raises, once every
        thread ended, the one raised first (the cause: the peers then usually time out waiting for that rank).
        `join_timeout_secs`: a rank still running that long after the start is a hang (`EPTimeoutError`; its
        thread is a daemon and is left behind)."""
        out: list[Any] = [None] * self.size
        errors: list[BaseException] = []
        lock = threading.Lock()

        def body(rank: int, boot: _ThreadBootstrap) -> None:
            try:
                out[rank] = fn(rank, boot)
            except BaseException as exc:  # handed to the caller's thread
                out[rank] = exc
                with lock:
                    errors.append(exc)

        threads = [
            threading.Thread(target=body, args=(r, b), name=f"rank{r}", daemon=True)
            for r, b in enumerate(self.bootstraps())
        ]
        for t in threads:
            t.start()
        deadline = None if join_timeout_secs is None else time.monotonic() + join_timeout_secs
        for r, t in enumerate(threads):
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise EPTimeoutError(
                    r,
                    "ThreadGroup.run",
                    "thread",
                    "running",
                    f"rank {r} of a ThreadGroup of {self.size} still runs after join_timeout_secs="
                    f"{join_timeout_secs:g} (a hang: it waits for a peer that never arrives, or never returns)",
                )
        if raise_first and errors:
            raise errors[0]
        return out

    def _wait(self, rank: int, tag: str) -> None:
        try:
            self._barrier.wait(self.timeout_secs)
        except threading.BrokenBarrierError as exc:
            raise EPTimeoutError(
                rank,
                tag,
                "thread barrier",
                f"{self._barrier.n_waiting} waiting",
                f"rank {rank} timed out after {self.timeout_secs:g} s in {tag} of a ThreadGroup of {self.size}: a "
                "peer thread did not arrive (or another one timed out first and broke the barrier); check that "
                "every rank calls the same operations, or raise ThreadGroup(timeout_secs=...) (a buffer's "
                "num_cpu_timeout_secs does not apply to a ThreadGroup)",
            ) from exc

    def _allgather(self, rank: int, data: bytes) -> list[bytes]:
        self._wait(rank, "bootstrap.allgather.enter")
        self._slots[rank] = bytes(data)
        self._wait(rank, "bootstrap.allgather.write")
        out = [s if s is not None else b"" for s in self._slots]
        self._wait(rank, "bootstrap.allgather.read")
        return out


class _ThreadBootstrap:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.size = group.size

    def allgather(self, data: bytes) -> list[bytes]:
        return self._group._allgather(self.rank, data)

    def barrier(self) -> None:
        self._group._wait(self.rank, "bootstrap.barrier")

    def resync(self) -> None:
        """Meet every peer outside the (possibly broken) exchange barrier, which is then repaired (`reset()`)."""
        self._group._resync(self.rank)
