"""Bounded stream waits on signal words (the host side of ``include/ep_core/signal_wait.cuh``).

``cuStreamWaitValue64`` has no timeout, so `SignalWaiter.wait` launches a one-thread kernel that polls a peer's
signal word with a deadline (``num_gpu_timeout_secs``). A timed-out wait records itself in host-mapped memory,
every later wait returns at once (what the streams copy is then undefined), and `SignalWaiter.check` raises
`EPTimeoutError` naming the rank, the peer and the wait, at every call (build a new buffer). `decode_timeout` and
`WaitLog` need no GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ep_core.errors import EPTimeoutError, EPValueError

__all__ = [
    "KERNEL_NAME",
    "RECORD_ELAPSED_NS",
    "RECORD_EXPECTED",
    "RECORD_STATE",
    "RECORD_VALUE",
    "RECORD_WAIT_ID",
    "RECORD_WORDS",
    "STATE_TIMED_OUT",
    "SignalWaiter",
    "TimeoutRecord",
    "WaitLog",
    "compile_signal_wait",
    "decode_timeout",
    "signal_wait_source",
]

KERNEL_NAME = "ep_signal_wait"
# the record's int64 words (signal_wait.cuh: RecordWord)
RECORD_STATE, RECORD_WAIT_ID, RECORD_VALUE, RECORD_EXPECTED, RECORD_ELAPSED_NS = range(5)
RECORD_WORDS = 8
STATE_TIMED_OUT = 2


@dataclass(frozen=True)
class WaitInfo:
    """What one wait waits for: `peer` writes the word; `what` says which signal (e.g. "pp_recv: tensor 3 from
    rank 1")."""

    peer: int
    what: str


class WaitLog:
    """The names of the last `capacity` waits, by wait id (ids grow from 1; the record stores the id)."""

    def __init__(self, capacity: int = 1 << 14) -> None:
        if capacity <= 0:
            raise EPValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.capacity = int(capacity)
        self._next = 1
        self._ring: list[tuple[int, WaitInfo] | None] = [None] * self.capacity
        self._lock = threading.Lock()

    def add(self, peer: int, what: str) -> int:
        with self._lock:
            wid = self._next
            self._next += 1
            self._ring[wid % self.capacity] = (wid, WaitInfo(int(peer), str(what)))
        return wid

    def get(self, wait_id: int) -> WaitInfo | None:
        entry = self._ring[int(wait_id) % self.capacity]
        return entry[1] if entry is not None and entry[0] == wait_id else None


def decode_timeout(
    record: Sequence[int], log: WaitLog, rank: int, timeout_secs: float
) -> EPTimeoutError | None:
    """The error a published record stands for, or None while no wait timed out."""
    if int(record[RECORD_STATE]) != STATE_TIMED_OUT:
        return None
    wid = int(record[RECORD_WAIT_ID])
    value, expected = int(record[RECORD_VALUE]), int(record[RECORD_EXPECTED])
    secs = int(record[RECORD_ELAPSED_NS]) / 1e9
    info = log.get(wid)
    peer: int | str = info.peer if info is not None else "?"
    what = (
        info.what
        if info is not None
        else f"wait {wid} (its name was dropped: more than {log.capacity} since)"
    )
    return EPTimeoutError(
        rank,
        f"gpu.signal_wait: {what}",
        peer,
        value,
        f"rank {rank} timed out on the GPU after {secs:.1f} s (num_gpu_timeout_secs={timeout_secs:g}) waiting for "
        f"rank {peer}: {what} (signal word {value}, expected >= {expected}); rank {peer} did not arrive: check that "
        "every rank makes the same calls, or raise num_gpu_timeout_secs. Later waits of this buffer returned at "
        "once, so the data of the calls in flight is undefined: build a new buffer",
    )


def get_include() -> str:
    from ep_core.kernels._source import get_include as _get_include

    return _get_include()


def signal_wait_source() -> str:
    return "// ep_core bounded signal wait\n#include <ep_core/signal_wait.cuh>\n"


def compile_signal_wait(arch: str | None = None, *, headers: tuple[str, str] | None = None) -> Any:
    """Compile (or fetch from ep_jit's cache) the wait kernel; returns the ep_jit Artifact. Needs nvcc, and a
    driver only when `arch` is None (the current GPU's). `headers`: as `kernels._source.compile_kernels`'s."""
    import ep_jit

    return ep_jit.compile(
        signal_wait_source(),
        name="ep_core_signal_wait",
        include_dirs=list(headers) if headers is not None else [get_include()],
        arch=arch,
        flags=("-std=c++17",),
    )


_kernel: Any = None
_kernel_lock = threading.Lock()


def _load_kernel() -> Any:
    global _kernel
    with _kernel_lock:
        if _kernel is None:
            import ep_jit

            _kernel = ep_jit.load(compile_signal_wait()).function(KERNEL_NAME)
    return _kernel


class TimeoutRecord:
    """A waiter's record (`RECORD_WORDS` int64 words, host-mapped on the GPU) and the names of its waits: what the
    host reads. `check` raises the first timeout, then again at every call (sticky)."""

    def __init__(self, words: Any, rank: int, timeout_secs: float) -> None:
        if not timeout_secs > 0:
            raise EPValueError(f"num_gpu_timeout_secs: expected > 0, got {timeout_secs!r} (rank {rank})")
        self.words = words  # int64 array of RECORD_WORDS (numpy)
        self.rank = int(rank)
        self.timeout_secs = float(timeout_secs)
        self.log = WaitLog()
        self.error: EPTimeoutError | None = None

    def check(self) -> None:
        if self.error is None and self.words is not None:
            self.error = decode_timeout(self.words.tolist(), self.log, self.rank, self.timeout_secs)
        if self.error is not None:
            raise self.error


class SignalWaiter(TimeoutRecord):
    """Bounded waits of one rank on the GPU: the wait kernel, a host-mapped record and a device claim word."""

    def __init__(self, rank: int, timeout_secs: float) -> None:
        import numpy as np

        from ep_core.kernels import _cuda

        self._mapped = _cuda.MappedWords(2 * RECORD_WORDS)  # int32 words, viewed as int64
        super().__init__(self._mapped.array.view(np.int64), rank, timeout_secs)
        self._timeout_ns = int(self.timeout_secs * 1e9)
        self._kernel = _load_kernel()
        self._claim: Any = _cuda.DeviceBuffer(8)

    def wait(self, addr: int, value: int, stream: int, peer: int, what: str) -> None:
        """Queue on `stream`: wait until the 64-bit word at `addr` is >= `value` (written by `peer`)."""
        import ep_jit

        wid = self.log.add(peer, what)
        self._kernel.launch(
            1,
            1,
            [
                ep_jit.pointer(int(addr)),
                ep_jit.uint64(int(value)),
                ep_jit.int64(self._timeout_ns),
                ep_jit.pointer(self._claim.ptr),
                ep_jit.pointer(self._mapped.device_ptr),
                ep_jit.int64(wid),
            ],
            stream=stream,
        )

    def close(self) -> None:
        """Free the record and the claim word (after the streams that wait on them drained)."""
        self.words = None
        self._mapped = None  # MappedWords frees the pinned words
        if self._claim is not None:
            self._claim.close()
            self._claim = None
