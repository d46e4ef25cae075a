"""The host watchdog of ``EPKIT_ELASTIC_WAIT=stream`` (``ep_torch.elastic_stream_wait.WaitWatch``), without CUDA: waits
satisfied in time are dropped, the first one still short past its deadline is recorded as the kernel would record it
(``EPTimeoutError`` naming rank, peer and signal, sticky) and every pending wait is released; later waits queue nothing."""

from __future__ import annotations

import pytest
from ep_core.errors import EPTimeoutError
from ep_torch.elastic_stream_wait import WaitWatch


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_satisfied_waits_are_dropped_and_a_short_one_times_out():
    clock = _Clock()
    w = WaitWatch(rank=1, timeout_secs=2.0, clock=clock)
    words = {0x1000: 0, 0x2000: 0}
    released: list = []
    read = lambda addrs: [words[a] for a in addrs]  # noqa: E731
    release = lambda a, v: released.append((a, v))  # noqa: E731
    assert w.add(0x1000, 1, 0, "pp_recv: tensor 0 from rank 0")
    clock.t += 1.0
    assert w.add(0x2000, 3, 2, "all_gather: slot 0 of session 3")
    w.poll(read, release)  # nothing late yet
    assert len(w.pending) == 2 and not released
    words[0x1000] = 1  # the first arrives
    clock.t += 1.5  # the first is late but satisfied: dropped
    w.poll(read, release)
    assert [p[0] for p in w.pending] == [0x2000] and not released
    w.check()  # no timeout
    clock.t += 1.0  # the second is late and short
    w.poll(read, release)
    assert released == [(0x2000, 3)] and w.pending == []
    with pytest.raises(EPTimeoutError) as err:
        w.check()
    assert err.value.rank == 1 and err.value.counter == 2
    assert "all_gather: slot 0 of session 3" in str(err.value) and "2.5 s" in str(err.value)
    with pytest.raises(EPTimeoutError):  # sticky
        w.check()
    assert not w.add(0x1000, 2, 0, "pp_recv: tensor 1 from rank 0")  # later waits queue nothing


def test_a_timeout_releases_every_pending_wait_to_its_largest_value():
    clock = _Clock()
    w = WaitWatch(rank=0, timeout_secs=1.0, clock=clock)
    released: list = []
    for v in (1, 2, 3):
        w.add(0x10, v, 1, f"pp_recv: tensor {v - 1} from rank 1")
    w.add(0x20, 5, 1, "pp_send: the release of tensor 4 by rank 1 (2 in flight)")
    clock.t += 2
    w.poll(lambda addrs: [0] * len(addrs), lambda a, v: released.append((a, v)))
    assert sorted(released) == [(0x10, 3), (0x20, 5)]
    with pytest.raises(EPTimeoutError, match="tensor 0 from rank 1"):
        w.check()


def test_satisfied_waits_are_dropped_before_their_deadline():
    clock = _Clock()
    w = WaitWatch(rank=0, timeout_secs=100.0, clock=clock)
    words = {0x10: 0}
    for v in range(1, 1001):  # a long run of hand-offs on one word
        w.add(0x10, v, 1, f"pp_recv: tensor {v - 1} from rank 1")
    words[0x10] = 998
    reads: list = []

    def read(addrs):
        reads.append(list(addrs))
        return [words[a] for a in addrs]

    w.poll(read, lambda a, v: None)
    assert reads == [[0x10]]  # one read per distinct word
    assert [p[1] for p in w.pending] == [999, 1000]
    w.check()


def test_the_knob(monkeypatch):
    from ep_torch import _env

    monkeypatch.delenv("EPKIT_ELASTIC_WAIT", raising=False)
    assert _env.elastic_wait() == "kernel"
    monkeypatch.setenv("EPKIT_ELASTIC_WAIT", "Stream")
    assert _env.elastic_wait() == "stream"
    monkeypatch.setenv("EPKIT_ELASTIC_WAIT", "spin")
    with pytest.raises(ValueError, match="EPKIT_ELASTIC_WAIT='spin'"):
        _env.elastic_wait()
