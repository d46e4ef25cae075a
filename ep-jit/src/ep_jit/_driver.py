"""The CUDA driver through cuda.bindings.driver: lazy init, error checks, context, device arch.

Nothing here runs at import time: the package imports on machines without a GPU or driver.
"""

from __future__ import annotations

import threading
from typing import Any

from ._errors import LaunchError, NoDeviceError

__all__ = ["check", "current_arch", "current_device", "driver", "ensure_context"]

_lock = threading.Lock()
_driver: Any = None
_arch_by_device: dict[int, str] = {}


def driver() -> Any:
    """The initialized ``cuda.bindings.driver`` module; NoDeviceError when no driver or GPU is present."""
    global _driver
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is None:
            try:
                from cuda.bindings import driver as drv
            except ImportError as e:
                raise NoDeviceError(f"cuda.bindings is not importable ({e}); install cuda-bindings") from e
            try:
                (err,) = drv.cuInit(0)
            except Exception as e:  # cuda.pathfinder raises when libcuda.so is absent
                raise NoDeviceError(
                    f"no CUDA driver on this machine ({type(e).__name__}: {e}); loading and launching kernels needs "
                    "an NVIDIA GPU with its driver (compiling does not: pass arch='sm_90a')"
                ) from e
            if err != drv.CUresult.CUDA_SUCCESS:
                raise NoDeviceError(
                    f"cuInit failed: {_error_text(drv, err)}; no usable NVIDIA GPU (compiling does not need one: "
                    "pass arch='sm_90a')"
                )
            _driver = drv
    return _driver


def _error_text(drv: Any, err: Any) -> str:
    try:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        return f"{name.decode()} ({text.decode()})"
    except Exception:
        return str(err)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings ``(err, *values)`` result; LaunchError naming ``what`` on failure."""
    err = result[0]
    drv = _driver
    if err != drv.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{what} failed: {_error_text(drv, err)}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def ensure_context() -> Any:
    """The current context; retains and sets the primary context of device 0 when none is current."""
    drv = driver()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) != 0:
        return ctx
    count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        raise NoDeviceError("no CUDA device is visible (cuDeviceGetCount() == 0); check CUDA_VISIBLE_DEVICES")
    dev = check(drv.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def current_device() -> int:
    """Ordinal of the device of the current context (making device 0's primary context current if none)."""
    drv = driver()
    ensure_context()
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def current_arch() -> str:
    """``sm_XY`` of the current device, with the ``a`` suffix (arch-specific features) from sm_90 on."""
    dev = current_device()
    arch = _arch_by_device.get(dev)
    if arch is None:
        drv = _driver
        attr = drv.CUdevice_attribute
        cudev = check(drv.cuDeviceGet(dev), "cuDeviceGet")
        major = check(
            drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cudev), "attr"
        )
        minor = check(
            drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cudev), "attr"
        )
        arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
        _arch_by_device[dev] = arch
    return arch
