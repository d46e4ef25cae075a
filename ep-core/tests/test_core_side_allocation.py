"""ep_core.side_allocation.create_exchanged over a fake ep_symmem (no GPU): a collective whose ranks fall back
together, zero before any peer maps, and exchange only when every rank has its allocation."""

from __future__ import annotations

import sys
import threading
import types

import ep_core as ec
import pytest
from ep_core import side_allocation


class _Alloc:
    def __init__(self, log: list, rank: int, gpu: int, host: int) -> None:
        self.log, self.rank, self.ptr = log, rank, 0x1000 * (rank + 1)
        self.num_gpu_bytes, self.num_host_bytes = gpu, host
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", self.rank))


@pytest.fixture
def fake(monkeypatch):
    log: list = []
    lock = threading.Lock()
    fail: set = set()

    def create(num_gpu_bytes, num_host_bytes=0, device=None):
        rank = int(threading.current_thread().name.removeprefix("rank"))
        if rank in fail:
            raise RuntimeError("no host NUMA VMM here")
        with lock:
            log.append(("create", rank, num_gpu_bytes, num_host_bytes, device))
        return _Alloc(log, rank, num_gpu_bytes, num_host_bytes)

    def exchange(alloc, bootstrap):
        with lock:
            log.append(("exchange", alloc.rank))
        bootstrap.barrier()

    mod = types.SimpleNamespace(SymmetricAllocation=types.SimpleNamespace(create=create), exchange=exchange)
    monkeypatch.setitem(sys.modules, "ep_symmem", mod)
    from ep_core.kernels import _cuda

    monkeypatch.setattr(_cuda, "memset", lambda ptr, n, v=0, *a: log.append(("memset", ptr, n)))
    monkeypatch.setattr(_cuda, "synchronize_context", lambda: None)
    return log, fail


def test_every_rank_gets_an_exchanged_allocation(fake) -> None:
    log, _ = fake
    out = ec.ThreadGroup(3, timeout_secs=10).run(
        lambda r, boot: side_allocation.create_exchanged(boot, 4096, num_host_bytes=8192, device=0, zero=True)
    )
    assert [why for _, why in out] == ["", "", ""]
    assert [(a.rank, a.num_gpu_bytes, a.num_host_bytes) for a, _ in out] == [
        (r, 4096, 8192) for r in range(3)
    ]
    for r in range(3):  # zeroed (the GPU part only) before any rank exchanged
        memset = log.index(("memset", 0x1000 * (r + 1), 4096))
        assert memset < min(i for i, e in enumerate(log) if e[0] == "exchange")


def test_one_rank_failing_makes_every_rank_fall_back(fake) -> None:
    log, fail = fake
    fail.add(1)
    out = ec.ThreadGroup(3, timeout_secs=10).run(lambda r, boot: side_allocation.create_exchanged(boot, 4096))
    assert all(a is None for a, _ in out)
    assert all(why == "rank 1: RuntimeError: no host NUMA VMM here" for _, why in out), out
    assert sorted(e[1] for e in log if e[0] == "close") == [0, 2]  # the others closed theirs
    assert not any(e[0] == "exchange" for e in log) and not any(e[0] == "memset" for e in log)
