"""CPU: the GPU executor's copy of a new handle's routing (`do_handle_copy`), `GpuExecutor._copy_routing`.

The copy comes from the request's allocator with topk_idx's shape and dtype and is queued on the stream the call
is ordered after (where that allocator allocates, and where topk_idx is ready); with the executor's own allocator,
which allocates on the comm stream, the comm stream first waits for the caller and the copy runs there. The C++
copy (ep_launch) is taken when usable; a failed or missing one falls back to cuda-python, which raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ep_core.kernels import _cuda
from ep_core.kernels.gpu_executor import GpuExecutor

COMM, CALLER = 0xC0, 0xCA


def Out(shape, dtype):  # an allocator's output: a device array by pointer
    return _cuda.DeviceView(0x5000, tuple(shape), dtype)


class Executor:
    """What `_copy_routing` reads of a GpuExecutor."""

    default_allocator = GpuExecutor.default_allocator  # its own allocator, as the executor recognizes it
    _is_default_allocator = GpuExecutor._is_default_allocator
    device_id = 0

    def __init__(self, native) -> None:
        self._native = native
        self.stream = SimpleNamespace(handle=COMM)
        self.log: list = []

    def _enter(self, stream) -> None:
        self.log.append(("enter", stream))


class Native:
    def __init__(self, log, code=0) -> None:
        self.log, self.code = log, code

    def copy_device(self, dst, src, nbytes, stream) -> int:
        self.log.append(("native", dst, src, nbytes, stream))
        return self.code


@pytest.fixture
def python_copies(monkeypatch):
    log: list = []
    monkeypatch.setattr(
        _cuda, "copy_device", lambda dst, src, n, stream: log.append(("python", dst, src, n, stream))
    )
    return log


IDX = SimpleNamespace(shape=(128, 8), dtype="int64", ptr=0x7000, nbytes=128 * 8 * 8)


def test_a_callers_allocator_gets_the_copy_on_the_callers_stream(python_copies) -> None:
    ex = Executor(None)
    ex._native = Native(ex.log)
    made: list = []

    def allocate(shape, dtype):
        made.append((shape, dtype))
        return Out(shape, dtype)

    req = SimpleNamespace(allocator=allocate, stream=CALLER)
    copy = GpuExecutor._copy_routing(ex, req, IDX)
    assert made == [((128, 8), "int64")] and copy.ptr == 0x5000
    assert ex.log == [("native", 0x5000, 0x7000, 8192, CALLER)] and python_copies == []


def test_the_executors_own_allocator_copies_on_the_comm_stream_after_the_caller(
    python_copies, monkeypatch
) -> None:
    monkeypatch.setattr(_cuda, "DeviceArray", lambda shape, dtype, stream: SimpleNamespace(ptr=0x6000))
    ex = Executor(None)
    ex._native = Native(ex.log)
    req = SimpleNamespace(allocator=ex.default_allocator, stream=CALLER)
    idx32 = SimpleNamespace(shape=(4, 2), dtype="int32", ptr=0x7100, nbytes=32)
    copy = GpuExecutor._copy_routing(ex, req, idx32)
    assert copy.shape == (4, 2) and copy.dtype == "int32"
    assert ex.log == [("enter", CALLER), ("native", 0x6000, 0x7100, 32, COMM)]


@pytest.mark.parametrize("native", ["missing", "failing"])
def test_without_the_cpp_copy_the_python_path_copies(python_copies, native) -> None:
    ex = Executor(None)
    if native == "failing":
        ex._native = Native(ex.log, code=1)  # CUDA_ERROR_INVALID_VALUE: retried through cuda-python
    req = SimpleNamespace(allocator=lambda shape, dtype: Out(shape, dtype), stream=CALLER)
    GpuExecutor._copy_routing(ex, req, IDX)
    assert python_copies == [("python", 0x5000, 0x7000, 8192, CALLER)]
