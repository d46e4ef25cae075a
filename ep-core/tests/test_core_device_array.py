"""Device array descriptors: DeviceArray interfaces, describe() over numpy / DLPack / CAI, host views."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core.errors import EPTypeError


class DLPackOnly:
    """Exposes only numpy's DLPack protocol (like a foreign framework's tensor)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class CAIOnly:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def test_device_array_interfaces():
    d = ec.DeviceArray(0x7000, (3, 4), "bfloat16", device="cuda", device_id=1)
    cai = d.__cuda_array_interface__
    assert cai["shape"] == (3, 4) and cai["typestr"] == "<u2" and cai["data"] == (0x7000, False)
    assert cai["strides"] is None and cai["version"] == 3
    info = ec.describe(d)
    assert (info.dtype, info.device, info.device_id, info.strides) == ("bfloat16", "cuda", 1, (8, 2))
    assert info.is_contiguous and info.nbytes == 24
    with pytest.raises(AttributeError):
        _ = d.__array_interface__
    t = ec.DeviceArray(0x7000, (4, 3), "float32", strides=(4, 16))
    assert not t.info().is_contiguous and t.__cuda_array_interface__["strides"] == (4, 16)
    with pytest.raises(EPTypeError, match="dtype"):
        ec.DeviceArray(0, (1,), "complex64")


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32, np.uint8, np.uint16])
def test_describe_numpy_and_dlpack(dtype):
    a = np.arange(24, dtype=dtype).reshape(4, 6)
    for obj in (a, DLPackOnly(a)):
        info = ec.describe(obj)
        assert info.ptr == a.__array_interface__["data"][0]
        assert info.shape == (4, 6) and info.strides == a.strides and info.device == "cpu"
        assert info.dtype == np.dtype(dtype).name
    sliced = a[:, 1:3]
    info = ec.describe(DLPackOnly(sliced))
    assert info.ptr == sliced.__array_interface__["data"][0] and not info.is_contiguous


def test_describe_cai_and_errors():
    info = ec.describe(CAIOnly({"shape": (2, 3), "typestr": "<f4", "data": (1234, False), "version": 3}))
    assert (info.ptr, info.dtype, info.device, info.strides) == (1234, "float32", "cuda", (12, 4))
    with pytest.raises(EPTypeError, match="topk_idx: expected an array"):
        ec.describe(object(), "topk_idx")
    with pytest.raises(EPTypeError, match="typestr"):
        ec.describe(CAIOnly({"shape": (2,), "typestr": "<c8", "data": (1, False), "version": 3}))


def test_host_views_roundtrip():
    a = ec.host_allocator((3, 5), "bfloat16")
    v = ec.to_numpy(a)
    assert v.dtype == np.uint16 and v.shape == (3, 5) and (v == 0).all()
    v[1, 2] = 0x3F80
    assert ec.to_numpy(a)[1, 2] == 0x3F80
    t = ec.host_array(np.zeros((5, 3), np.float32).T)
    assert ec.to_numpy(t).shape == (3, 5) and not t.info().is_contiguous
    assert ec.to_numpy(ec.host_allocator((0, 4), "int32")).shape == (0, 4)
    assert ec.describe(ec.host_allocator((0, 4), "int32")).is_contiguous
    with pytest.raises(EPTypeError, match="host memory"):
        ec.to_numpy(ec.DeviceArray(0x1000, (2,), "int32"))
    with pytest.raises(EPTypeError, match="itemsize"):
        ec.host_array(np.zeros(3, np.float32), "bfloat16")


def test_describe_torch_tensors_without_importing_torch_in_ep_core():
    torch = pytest.importorskip("torch")
    cases = [
        (torch.zeros(4, 6, dtype=torch.bfloat16), "bfloat16", True),
        (torch.zeros(4, 6, dtype=torch.int64)[:, 1:3], "int64", False),
        (torch.zeros(2, 2, dtype=torch.float8_e4m3fn), "float8_e4m3fn", True),
        (torch.zeros(0, 4, dtype=torch.bfloat16), "bfloat16", True),
    ]
    for t, dtype, contiguous in cases:
        info = ec.describe(t)
        assert info.dtype == dtype and info.ptr == t.data_ptr() and info.device == "cpu"
        assert info.shape == tuple(t.shape) and info.strides == tuple(
            s * t.element_size() for s in t.stride()
        )
        assert info.is_contiguous == contiguous


def test_void_typestr_in_cai_falls_back_to_dlpack() -> None:
    """torch exports bf16 CUDA tensors with typestr '<V2' in __cuda_array_interface__: DLPack names the dtype."""
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)

    class VoidCAI:
        @property
        def __cuda_array_interface__(self) -> dict:
            return {"shape": (3, 4), "typestr": "<V2", "data": (t.data_ptr(), False), "version": 3}

        def __dlpack__(self, *args, **kwargs):
            return t.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    info = ec.describe(VoidCAI())
    assert (info.dtype, info.shape, info.ptr) == ("bfloat16", (3, 4), t.data_ptr())
    with pytest.raises(EPTypeError, match="typestr"):  # without DLPack the void type stays an error
        ec.describe(CAIOnly({"shape": (2,), "typestr": "<V2", "data": (1, False), "version": 3}))
