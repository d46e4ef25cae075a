"""Bounded stream waits without a kernel: ``cuStreamWaitValue64`` plus a host watchdog (``EPKIT_ELASTIC_WAIT=stream``).

The default wait (``ep_core.signal_wait``) is a one-thread kernel polling the signal word with a deadline, which
keeps its context busy between processes time-sliced on one GPU. This waiter queues a stream memory wait (no SM)
and bounds it from the host: a watchdog thread reads the pending waits' words (an 8-byte copy per distinct word, on
its own stream), drops the satisfied ones and, when one past its deadline is still short, records the timeout as the
kernel would (`TimeoutRecord`: the next host call raises ``EPTimeoutError``) and releases every pending wait by
writing its value (the data in flight is undefined, as after a kernel timeout); later waits are not queued. The
bound counts from when the wait is queued; the watchdog looks every ``min(50 ms, bound / 20)``. `WaitWatch` is the
bookkeeping without CUDA (unit tested); `StreamWaiter` binds it to the driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from ep_core.signal_wait import (
    RECORD_ELAPSED_NS,
    RECORD_EXPECTED,
    RECORD_STATE,
    RECORD_VALUE,
    RECORD_WAIT_ID,
    RECORD_WORDS,
    STATE_TIMED_OUT,
    TimeoutRecord,
)

__all__ = ["StreamWaiter", "WaitWatch"]


class WaitWatch(TimeoutRecord):
    """Pending waits `(addr, value, queued, wait id)` and what a poll does with them. `read(addrs)` returns the
    words' current values; `release(addr, value)` writes a word (both supplied by the caller)."""

    def __init__(self, rank: int, timeout_secs: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(np.zeros(RECORD_WORDS, dtype=np.int64), rank, timeout_secs)
        self.clock = clock
        self.pending: list[tuple[int, int, float, int]] = []
        self.lock = threading.Lock()

    @property
    def timed_out(self) -> bool:
        return int(self.words[RECORD_STATE]) == STATE_TIMED_OUT

    def add(self, addr: int, value: int, peer: int, what: str) -> bool:
        """Register a wait; False when an earlier wait timed out (the caller then queues nothing: drain)."""
        if self.timed_out:
            return False
        wid = self.log.add(peer, what)
        with self.lock:
            self.pending.append((int(addr), int(value), self.clock(), wid))
        return True

    def poll(self, read: Callable[[list[int]], list[int]], release: Callable[[int, int], None]) -> None:
        """Read the words of every pending wait and drop the satisfied ones (the list stays as short as the waits
        in flight); on the first one still short past its deadline, record the timeout and release every pending
        wait."""
        with self.lock:
            snapshot = list(self.pending)
        if not snapshot:
            return
        addrs = sorted({p[0] for p in snapshot})
        values = dict(zip(addrs, read(addrs), strict=True))
        now = self.clock()
        satisfied = {id(p) for p in snapshot if values[p[0]] >= p[1]}
        short = next((p for p in snapshot if id(p) not in satisfied and now - p[2] > self.timeout_secs), None)
        with self.lock:
            if short is None:
                self.pending = [p for p in self.pending if id(p) not in satisfied]
                return
            addr, value, queued, wid = short
            self.words[RECORD_WAIT_ID] = wid
            self.words[RECORD_VALUE] = values[addr]
            self.words[RECORD_EXPECTED] = value
            self.words[RECORD_ELAPSED_NS] = int((now - queued) * 1e9)
            self.words[RECORD_STATE] = STATE_TIMED_OUT
            release_to: dict[int, int] = {}
            for a, v, _, _ in self.pending:
                release_to[a] = max(release_to.get(a, 0), v)
            self.pending = []
        for a, v in release_to.items():
            release(a, v)


class StreamWaiter:
    """`wait` / `check` / `close` as `ep_core.signal_wait.SignalWaiter`, with stream memory waits (module doc)."""

    def __init__(self, rank: int, timeout_secs: float) -> None:
        from ep_core.kernels import _cuda

        self._cuda = _cuda
        self.drv = _cuda.driver()
        self.watch = WaitWatch(rank, timeout_secs)
        self._ctx = _cuda.check(self.drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._side: Any = None  # the watchdog's own non-blocking stream (created by the thread)
        self._staging: Any = None  # pinned words the reads land in
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = min(0.05, float(timeout_secs) / 20)

    def wait(self, addr: int, value: int, stream: int, peer: int, what: str) -> None:
        if not self.watch.add(addr, value, peer, what):
            return
        flags = self.drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._cuda.check(self.drv.cuStreamWaitValue64(stream, addr, value, flags), "cuStreamWaitValue64")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ep-elastic-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        self.watch.check()

    _CHUNK = 64  # words read per copy batch (pinned staging: no pageable copy path)

    def _read(self, addrs: list[int]) -> list[int]:
        if self._staging is None:
            self._staging = self._cuda.MappedWords(2 * self._CHUNK)
        host = self._staging.array.view(np.uint64)
        base = self._staging.array.ctypes.data
        out: list[int] = []
        for start in range(0, len(addrs), self._CHUNK):
            part = addrs[start : start + self._CHUNK]
            for i, a in enumerate(part):
                self._cuda.check(
                    self.drv.cuMemcpyDtoHAsync(base + 8 * i, a, 8, self._side.handle), "cuMemcpyDtoHAsync"
                )
            self._cuda.check(self.drv.cuStreamSynchronize(self._side.handle), "cuStreamSynchronize")
            out += [int(v) for v in host[: len(part)]]
        return out

    def _release(self, addr: int, value: int) -> None:
        flags = self.drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._cuda.check(
            self.drv.cuStreamWriteValue64(self._side.handle, addr, value, flags), "cuStreamWriteValue64"
        )

    def _run(self) -> None:
        self._cuda.check(self.drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._side = self._cuda.Stream()
        while not self._stop.wait(self._interval):
            try:
                self.watch.poll(self._read, self._release)
            except Exception:  # a failing context: nothing left to bound
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
