"""Minimal CUDA driver layer of the GPU executor (cuda.bindings, loaded lazily): device arrays, streams, events.

ep_core must not import torch, so kernels take and return `DeviceArray`s (stream-ordered allocations with
`__cuda_array_interface__`) or any object that exposes a device pointer (`as_view`). The primary context of the
current device is used, the same one ep_jit, ep_symmem and torch use.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep_core import device_array as _device_array
from ep_core._env import knobs
from ep_core.device_array import is_c_contiguous

__all__ = [
    "DeviceArray",
    "DeviceView",
    "Event",
    "MappedWords",
    "Stream",
    "as_view",
    "check",
    "current_device",
    "device_attribute",
    "device_identity",
    "driver",
    "frees_deferred",
    "native_launch",
    "native_launch_status",
    "num_device_sms",
    "p2p_support",
    "visible_devices",
]

_lock = threading.Lock()
_drv: Any = None
# (free function, its arguments) held while frees_deferred() is open; None when frees run at once
_deferred_frees: list[tuple[Any, tuple]] | None = None


@contextlib.contextmanager
def frees_deferred() -> Any:
    """Hold the synchronizing frees (`cuMemFree`, `cuMemFreeHost`) and the cycle collector until the block ends.

    Those frees wait for the whole device. Inside a loopback domain's launch sequence (N ranks launched one after
    another from this thread) that waits for the ranks launched so far, whose kernels wait for the ranks not launched
    yet: a deadlock until the GPU timeout. Python frees whenever a last reference drops or the cycle collector runs
    (an earlier domain's ranks, say), so the sequence holds every such free and releases them after its last
    launch. Stream-ordered frees (`cuMemFreeAsync`) do not wait and run at once. Nested blocks join the outer one.
    """
    global _deferred_frees
    if _deferred_frees is not None:
        yield
        return
    collecting = gc.isenabled()
    _deferred_frees = []
    gc.disable()
    try:
        yield
    finally:
        pending, _deferred_frees = _deferred_frees, None
        if collecting:
            gc.enable()
        for free, args in pending:
            with contextlib.suppress(Exception):
                free(*args)


def _free_now_or_later(free: Any, *args: Any) -> None:
    """`free(*args)`, or after the open frees_deferred() block."""
    held = _deferred_frees
    if held is not None:
        held.append((free, args))
    else:
        free(*args)


def driver() -> Any:
    """`cuda.bindings.driver`, initialized, with a current context (device 0's primary context if none)."""
    global _drv
    if _drv is not None:
        return _drv
    with _lock:
        if _drv is None:
            from cuda.bindings import driver as drv

            (err,) = drv.cuInit(0)
            if err != drv.CUresult.CUDA_SUCCESS:
                from ep_core.errors import EPDeviceError

                raise EPDeviceError(
                    f"cuInit failed ({err}); the GPU executor needs an NVIDIA GPU and its driver"
                )
            ctx = _check(drv, drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
            if int(ctx) == 0:
                dev = _check(drv, drv.cuDeviceGet(0), "cuDeviceGet")
                ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _check(drv, drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            _drv = drv
    return _drv


# the most hardware work queues CUDA_DEVICE_MAX_CONNECTIONS may ask for (CUDA's default: 8)
MAX_CONNECTIONS = 32


def reserve_connections(num_streams: int, device: int = 0) -> int:
    """Hardware work queues for `num_streams` streams whose kernels wait on each other; returns the count in effect.

    CUDA maps streams onto `CUDA_DEVICE_MAX_CONNECTIONS` in-order hardware queues (default 8). Streams sharing a
    queue are falsely ordered: a kernel queued behind another stream's kernel that waits for its own stream's
    running kernel does not start. Ranks of one process that wait for each other inside their kernels (the loopback
    domain, N ranks with a compute stream and a comm stream each) deadlock once their streams outnumber the queues.
    The count is read when the device's context is created: before that (no current context, `device`'s primary
    context inactive) this raises the variable to fit `num_streams` (at most `MAX_CONNECTIONS`, never lowering it);
    after, it only reports what the context was created with."""
    have = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "") or 8)
    if have >= num_streams:
        return have
    try:
        from cuda.bindings import driver as drv

        (err,) = drv.cuInit(0)
        if err != drv.CUresult.CUDA_SUCCESS:
            return have
        ctx = _check(drv, drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        dev = _check(drv, drv.cuDeviceGet(int(device)), "cuDeviceGet")
        _flags, active = _check(drv, drv.cuDevicePrimaryCtxGetState(dev), "cuDevicePrimaryCtxGetState")
    except Exception:
        # no driver or no such device: nothing to reserve (the caller's own GPU work fails clearly)
        return have
    if int(ctx) != 0 or active:
        return have
    want = min(MAX_CONNECTIONS, int(num_streams))
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(want)
    return want


_native: list = []  # [ep_launch module or None, status line], set by the first native_launch()


def native_launch() -> Any:
    """The `ep_launch` module when its C++ launch path is usable (prepared kernel launches and stream-order event
    pairs without cuda-python's per-call cost), else None. Decided once per process: `EPKIT_NATIVE_LAUNCH=0` turns
    it off; a missing or unusable module is announced once (a RuntimeWarning; `native_launch_status()` says why)
    and every launch and event then goes through cuda-python, with the same results and errors."""
    if _native:
        return _native[0]
    with _lock:
        if not _native:
            _native.extend(_load_native())
    return _native[0]


def _load_native() -> tuple[Any, str]:
    if not knobs.native_launch:
        return None, "off (EPKIT_NATIVE_LAUNCH=0): launches and events through cuda-python"
    try:
        import ep_launch
    except ImportError as exc:
        reason = f"ep_launch cannot be imported ({exc})"
        fix = "Install ep-launch (a dependency of ep-core)"
    else:
        if ep_launch.available():
            return ep_launch, f"ep_launch {ep_launch.__version__} (C++ launches and events)"
        # ep_launch is installed: what failed is the CUDA driver (none on this machine, or unusable)
        reason = f"no usable CUDA driver ({ep_launch.unavailable_reason()})"
        fix = "Without a driver no GPU work can run (the CPU reference backend needs none): install the NVIDIA driver,"
    msg = (
        f"ep_core: {reason}; kernel launches and stream-order events go through cuda-python instead (the same "
        f"results, tens of microseconds more host time per dispatch / combine). {fix} or set EPKIT_NATIVE_LAUNCH=0 "
        "to choose this path silently"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return None, f"cuda-python fallback: {reason}"


def native_launch_status() -> str:
    """Which launch path this process takes, and why (`native_launch`)."""
    native_launch()
    return _native[1]


def _check(drv: Any, result: Any, what: str) -> Any:
    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        from ep_core.errors import EPDeviceError

        try:
            name = drv.cuGetErrorName(err)[1].decode()
        except Exception:
            name = str(err)
        raise EPDeviceError(f"{what} failed: {name}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings `(err, *values)` result; EPDeviceError naming `what` on failure."""
    return _check(driver(), result, what)


def device_attribute(name: str) -> int:
    drv = driver()
    dev = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
    attr = getattr(drv.CUdevice_attribute, name)
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


def current_device() -> int:
    """The ordinal of the current context's device."""
    return int(check(driver().cuCtxGetDevice(), "cuCtxGetDevice"))


def num_device_sms() -> int:
    """Streaming multiprocessors of the current device."""
    return device_attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")


def _uuid_hex(dev: Any) -> str:
    drv = driver()
    uuid = check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    return bytes(uuid.bytes).hex()


def device_identity() -> str:
    """`"<host>/<uuid>"` of the current device: equal for two processes exactly when they drive the same GPU (a MIG
    instance has its own UUID)."""
    import socket

    drv = driver()
    dev = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
    return f"{socket.gethostname()}/{_uuid_hex(dev)}"


def visible_devices() -> dict[str, int]:
    """UUID (hex) -> device ordinal of every device this process sees (ordinals depend on CUDA_VISIBLE_DEVICES)."""
    drv = driver()
    count = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    out = {}
    for i in range(count):
        dev = check(drv.cuDeviceGet(i), "cuDeviceGet")
        out[_uuid_hex(dev)] = i
    return out


def p2p_support(src: int, dst: int) -> tuple[bool, bool]:
    """`(access, native_atomics)` of device ordinal `src` reaching memory of device ordinal `dst`
    (cuDeviceCanAccessPeer + P2P ACCESS_SUPPORTED; P2P NATIVE_ATOMIC_SUPPORTED)."""
    drv = driver()
    a = check(drv.cuDeviceGet(src), "cuDeviceGet")
    b = check(drv.cuDeviceGet(dst), "cuDeviceGet")
    attr = drv.CUdevice_P2PAttribute
    can = bool(check(drv.cuDeviceCanAccessPeer(a, b), "cuDeviceCanAccessPeer"))
    access = bool(
        check(drv.cuDeviceGetP2PAttribute(attr.CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, a, b), "P2P access")
    )
    atomics = bool(
        check(
            drv.cuDeviceGetP2PAttribute(attr.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, a, b),
            "P2P native atomics",
        )
    )
    return can and access, atomics


SYNC_SPIN_SECONDS = 2e-4
"""How long `Stream.synchronize(timeout)` polls without sleeping."""


class Stream:
    """A non-blocking CUDA stream (optionally high priority)."""

    def __init__(self, high_priority: bool = False) -> None:
        drv = driver()
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        prio = 0
        if high_priority:
            _, greatest = check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            prio = int(greatest)
        self._stream = check(drv.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")
        self.handle = int(self._stream)

    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait for the stream; with `timeout` (seconds) poll and return False if it has not drained in time.

        The poll spins for the first `SYNC_SPIN_SECONDS` (a decode-sized operation ends within it, and a sleep
        oversleeps by tens of microseconds), then sleeps with a doubling delay (10 us to 1 ms)."""
        drv = driver()
        if timeout is None:
            check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            return True
        start = time.monotonic()
        deadline = start + timeout
        spin_until = start + SYNC_SPIN_SECONDS
        success, not_ready = drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_NOT_READY
        native = native_launch()
        if native is not None:  # C++ cuStreamQuery: the poll's step is the driver's, not cuda-python's
            query, handle = native.stream_query, self.handle
            success, not_ready = 0, int(not_ready)
        delay = 1e-5
        while True:
            err = query(handle) if native is not None else drv.cuStreamQuery(self._stream)[0]
            if err == success:
                return True
            if err != not_ready:
                if native is not None:  # the driver's error by name (an error of the stream is sticky)
                    err = drv.cuStreamQuery(self._stream)[0]
                    if err == drv.CUresult.CUDA_SUCCESS:
                        return True
                if err != drv.CUresult.CUDA_ERROR_NOT_READY:
                    check((err,), "cuStreamQuery")
            now = time.monotonic()
            if now > deadline:
                return False
            if now < spin_until:
                continue
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def wait_event(self, event: Event) -> None:
        check(driver().cuStreamWaitEvent(self._stream, event._event, 0), "cuStreamWaitEvent")

    def __int__(self) -> int:
        return self.handle


class Event:
    """A CUDA event (timing enabled)."""

    def __init__(self, timing: bool = True) -> None:
        drv = driver()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._event = check(drv.cuEventCreate(flags), "cuEventCreate")
        self.handle = int(self._event)  # the raw CUevent (ep_launch.record_wait)

    def record(self, stream: Stream | int) -> None:
        check(driver().cuEventRecord(self._event, int(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        check(driver().cuEventSynchronize(self._event), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        return float(check(driver().cuEventElapsedTime(self._event, end._event), "cuEventElapsedTime"))


@dataclass
class DeviceView:
    """A device array by pointer: `shape`, numpy `dtype` (bf16 = uint16), element `strides` (None = contiguous)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...] | None = None
    owner: Any = None

    @property
    def element_strides(self) -> tuple[int, ...]:
        if self.strides is not None:
            return self.strides
        out, acc = [], 1
        for d in reversed(self.shape):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))

    @property
    def is_contiguous(self) -> bool:
        return self.strides is None or is_c_contiguous(self.shape, self.strides, 1)


class DeviceArray:
    """A stream-ordered device allocation (`cuMemAllocAsync` / `cuMemFreeAsync` on `stream`), or with
    `stream=None` a plain `cuMemAlloc` (usable while a stream is being captured into a CUDA graph).

    `strides` are in elements (None: C-contiguous); the allocation holds the largest addressed element.
    bf16 data is dtype uint16. Exposes `__cuda_array_interface__` (version 3) and `ptr`.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        stream: Stream | int | None = 0,
        strides: tuple[int, ...] | None = None,
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(int(s) for s in strides) if strides is not None else None
        self._sync = stream is None
        self._stream = 0 if stream is None else int(stream)
        if self.strides is None:
            count = int(np.prod(self.shape)) if self.shape else 1
        else:
            count = 1 + sum((d - 1) * s for d, s in zip(self.shape, self.strides)) if all(self.shape) else 0
        self.nbytes = max(count, 0) * self.dtype.itemsize
        self.ptr = 0
        if self.nbytes:
            drv = driver()
            if self._sync:
                self.ptr = int(check(drv.cuMemAlloc(self.nbytes), "cuMemAlloc"))
            else:
                self.ptr = int(check(drv.cuMemAllocAsync(self.nbytes, self._stream), "cuMemAllocAsync"))

    def view(self) -> DeviceView:
        return DeviceView(self.ptr, self.shape, self.dtype, self.strides, owner=self)

    @property
    def __cuda_array_interface__(self) -> dict:
        strides = None if self.strides is None else tuple(s * self.dtype.itemsize for s in self.strides)
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": strides,
            "version": 3,
            "stream": None,
        }

    @classmethod
    def from_numpy(cls, a: np.ndarray, stream: Stream | int = 0) -> DeviceArray:
        a = np.ascontiguousarray(a)
        out = cls(a.shape, a.dtype, stream)
        if out.nbytes:
            check(
                driver().cuMemcpyHtoDAsync(out.ptr, a.ctypes.data, out.nbytes, int(stream)),
                "cuMemcpyHtoDAsync",
            )
            check(driver().cuStreamSynchronize(int(stream)), "cuStreamSynchronize")
        return out

    def numpy(self, stream: Stream | int | None = None) -> np.ndarray:
        """Copy to host (synchronizes `stream`, default the allocation stream); strided arrays keep their view."""
        s = self._stream if stream is None else int(stream)
        count = self.nbytes // self.dtype.itemsize
        host = np.empty(count, dtype=self.dtype)
        if self.nbytes:
            check(driver().cuMemcpyDtoHAsync(host.ctypes.data, self.ptr, self.nbytes, s), "cuMemcpyDtoHAsync")
            check(driver().cuStreamSynchronize(s), "cuStreamSynchronize")
        if self.strides is None:
            return host.reshape(self.shape)
        it = self.dtype.itemsize
        return np.lib.stride_tricks.as_strided(host, self.shape, tuple(s * it for s in self.strides)).copy()

    def __len__(self) -> int:
        return self.shape[0]

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr and _drv is not None:
            with contextlib.suppress(Exception):
                if getattr(self, "_sync", False):
                    _free_now_or_later(_drv.cuMemFree, ptr)
                else:
                    _drv.cuMemFreeAsync(ptr, self._stream)

    def __repr__(self) -> str:
        return (
            f"DeviceArray(shape={self.shape}, dtype={self.dtype}, strides={self.strides}, ptr={self.ptr:#x})"
        )


# numpy storage of a torch-like tensor's dtype, by its name (bf16 as uint16 bits, FP8 as uint8), else by element size
_TORCH_NAMES = {
    "torch.bfloat16": np.uint16,
    "torch.float16": np.float16,
    "torch.float32": np.float32,
    "torch.int32": np.int32,
    "torch.int64": np.int64,
    "torch.float8_e4m3fn": np.uint8,
    "torch.uint8": np.uint8,
    "torch.int8": np.int8,
}
_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.int64}
_torch_like_dtypes: dict = {}  # (dtype object, element size) -> np.dtype


def _torch_like_dtype(obj: Any) -> np.dtype:
    dt = getattr(obj, "dtype", "")
    size = int(obj.element_size())
    try:
        return _torch_like_dtypes[(dt, size)]
    except (KeyError, TypeError):
        pass
    out = np.dtype(_TORCH_NAMES.get(str(dt), _BY_SIZE[size]))
    try:
        if len(_torch_like_dtypes) < 256:
            _torch_like_dtypes[(dt, size)] = out
    except TypeError:  # an unhashable dtype object: looked up by name every time
        pass
    return out


def as_view(obj: Any, what: str) -> DeviceView:
    """A `DeviceView` of a device array: a DeviceView, a DeviceArray, an object with `__cuda_array_interface__`,
    or a torch-like tensor (`data_ptr()`, `shape`, `stride()`, `element_size()`; bf16 maps to uint16)."""
    if isinstance(obj, DeviceView):
        return obj
    if isinstance(obj, DeviceArray):
        return obj.view()
    torch_like = hasattr(obj, "data_ptr")
    cai = getattr(obj, "__cuda_array_interface__", None) if not torch_like else None
    if cai is not None:
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(s) for s in cai["shape"])
        strides = cai.get("strides")
        el = None if strides is None else tuple(int(s) // dtype.itemsize for s in strides)
        return DeviceView(int(cai["data"][0]), shape, dtype, el, owner=obj)
    if torch_like and hasattr(obj, "element_size"):
        dtype = _torch_like_dtype(obj)
        return DeviceView(
            int(obj.data_ptr()),
            tuple([int(s) for s in obj.shape]),
            dtype,
            tuple([int(s) for s in obj.stride()]),
            obj,
        )
    raise TypeError(
        f"{what}: expected a device array (__cuda_array_interface__, DLPack-capable tensor or ep_core DeviceView), "
        f"got {type(obj).__name__}"
    )


def view_ptr(obj: Any, what: str) -> int:
    """`as_view(obj, what).ptr` without building the view, for the arrays whose pointer alone is needed: a
    DeviceView or DeviceArray, an ep_core `device_array.DeviceArray` on CUDA, or a plain torch tensor (its dtype
    is still looked up, so the same errors are raised); anything else through `as_view`."""
    cls = type(obj)
    if cls is DeviceView or cls is DeviceArray:
        return obj.ptr
    if cls is _device_array._torch_tensor_type and cls is not None:  # armed by describe() once torch is seen
        _torch_like_dtype(obj)
        return int(obj.data_ptr())
    if cls is _device_array.DeviceArray and obj.device == "cuda":  # its __cuda_array_interface__ data pointer
        return obj.ptr
    return as_view(obj, what).ptr


def synchronize_context() -> None:
    """Wait for every stream of the current context (the caller's streams too, e.g. CUDA-graph replays)."""
    check(driver().cuCtxSynchronize(), "cuCtxSynchronize")


def memset(ptr: int, nbytes: int, stream: Stream | int = 0) -> None:
    check(driver().cuMemsetD8Async(ptr, 0, nbytes, int(stream)), "cuMemsetD8Async")


def copy_device(dst: int, src: int, nbytes: int, stream: Stream | int) -> None:
    """Stream-ordered device-to-device copy."""
    check(driver().cuMemcpyDtoDAsync(dst, src, nbytes, int(stream)), "cuMemcpyDtoDAsync")


def copy_to_host(host: np.ndarray, ptr: int, stream: Stream | int) -> None:
    """Asynchronous device-to-host copy of `host.nbytes` bytes (the caller synchronizes)."""
    check(driver().cuMemcpyDtoHAsync(host.ctypes.data, ptr, host.nbytes, int(stream)), "cuMemcpyDtoHAsync")


def copy_to_device(ptr: int, host: np.ndarray, stream: Stream | int) -> None:
    host = np.ascontiguousarray(host)
    check(driver().cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, int(stream)), "cuMemcpyHtoDAsync")


class PinnedBuffer:
    """Page-locked host memory as a numpy byte array (for small device-to-host reads); `flags`: cuMemHostAlloc's."""

    def __init__(self, nbytes: int, flags: int = 0) -> None:
        drv = driver()
        self._ptr = int(check(drv.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self.nbytes = nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self._ptr))

    def __del__(self) -> None:
        if getattr(self, "_ptr", 0) and _drv is not None:
            with contextlib.suppress(Exception):
                _free_now_or_later(_drv.cuMemFreeHost, self._ptr)
            self._ptr = 0


class MappedWords(PinnedBuffer):
    """`count` int32 words of page-locked host memory mapped into the device (zero-copy, zeroed): kernels store to
    `device_ptr`, the host reads `array` without any synchronization."""

    def __init__(self, count: int) -> None:
        drv = driver()
        super().__init__(4 * int(count), drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE)
        self.device_ptr = int(check(drv.cuMemHostGetDevicePointer(self._ptr, 0), "cuMemHostGetDevicePointer"))
        self.array = np.ctypeslib.as_array((ctypes.c_int32 * int(count)).from_address(self._ptr))
        self.array[:] = 0
        # `read()`: the words as the host sees them now (no synchronization), as a list; the array's own method,
        # so that a plan's guard (`op_plan._guard`, every call) calls no Python function
        self.read = self.array.tolist

    def clear(self) -> None:
        self.array[:] = 0


class DeviceBuffer:
    """A plain (not stream-ordered) device allocation, zeroed."""

    def __init__(self, nbytes: int) -> None:
        drv = driver()
        self.nbytes = nbytes
        self.ptr = int(check(drv.cuMemAlloc(nbytes), "cuMemAlloc"))
        check(drv.cuMemsetD8(self.ptr, 0, nbytes), "cuMemsetD8")

    def close(self) -> None:
        if self.ptr and _drv is not None:
            with contextlib.suppress(Exception):
                _free_now_or_later(_drv.cuMemFree, self.ptr)
        self.ptr = 0

    def __del__(self) -> None:
        self.close()
