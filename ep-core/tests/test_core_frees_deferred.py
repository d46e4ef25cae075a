"""`_cuda.frees_deferred`: the synchronizing frees (and the cycle collector) held until a loopback launch sequence
ends, with a recording stand-in for the driver (no GPU)."""

from __future__ import annotations

import gc

import pytest
from ep_core.kernels import _cuda


class _RecordingDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def cuMemFree(self, ptr: int) -> None:
        self.calls.append(("cuMemFree", ptr))

    def cuMemFreeHost(self, ptr: int) -> None:
        self.calls.append(("cuMemFreeHost", ptr))

    def cuMemFreeAsync(self, ptr: int, stream: int) -> None:
        self.calls.append(("cuMemFreeAsync", ptr))


@pytest.fixture
def drv(monkeypatch):
    d = _RecordingDriver()
    monkeypatch.setattr(_cuda, "_drv", d)
    return d


def _buffer(ptr: int) -> _cuda.DeviceBuffer:
    b = object.__new__(_cuda.DeviceBuffer)
    b.ptr, b.nbytes = ptr, 64
    return b


def _array(ptr: int, sync: bool) -> _cuda.DeviceArray:
    a = object.__new__(_cuda.DeviceArray)
    a.ptr, a._sync, a._stream = ptr, sync, 7
    return a


def _pinned(ptr: int) -> _cuda.PinnedBuffer:
    p = object.__new__(_cuda.PinnedBuffer)
    p._ptr = ptr
    return p


def test_frees_run_at_once_outside_a_block(drv) -> None:
    _buffer(0x10).close()
    _array(0x20, sync=True).__del__()
    assert drv.calls == [("cuMemFree", 0x10), ("cuMemFree", 0x20)]


def test_synchronizing_frees_wait_for_the_end_of_the_block(drv) -> None:
    with _cuda.frees_deferred():
        _buffer(0x10).close()
        _array(0x20, sync=True).__del__()
        _pinned(0x30).__del__()
        _array(0x40, sync=False).__del__()  # stream-ordered: does not wait for the device, runs at once
        assert drv.calls == [("cuMemFreeAsync", 0x40)]
    assert drv.calls[1:] == [("cuMemFree", 0x10), ("cuMemFree", 0x20), ("cuMemFreeHost", 0x30)]


def test_the_cycle_collector_is_held_and_restored() -> None:
    assert gc.isenabled()
    with _cuda.frees_deferred():
        assert not gc.isenabled()
        with _cuda.frees_deferred():  # nested: joins the outer block
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _cuda.frees_deferred():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_a_nested_block_does_not_release_early_and_an_error_still_releases(drv) -> None:
    with pytest.raises(RuntimeError, match="boom"), _cuda.frees_deferred():
        with _cuda.frees_deferred():
            _buffer(0x10).close()
        assert drv.calls == []
        raise RuntimeError("boom")
    assert drv.calls == [("cuMemFree", 0x10)] and gc.isenabled()


def test_a_failing_free_does_not_stop_the_others(drv, monkeypatch) -> None:
    def broken(ptr: int) -> None:
        raise RuntimeError("driver gone")

    with _cuda.frees_deferred():
        _cuda._free_now_or_later(broken, 0x1)
        _buffer(0x10).close()
    assert drv.calls == [("cuMemFree", 0x10)]
