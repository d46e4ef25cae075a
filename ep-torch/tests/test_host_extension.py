"""ep_torch's host extension (`ep_torch.host_extension`): built with the host compiler against this torch, its
`empty`, `empty_many` and `facts` agree with torch's Python API, describe reads the same `ArrayInfo` through it,
`signature` matches exactly the layouts describe would key, and the knob's three modes (auto: warn and fall back; 0: off; 1: an error) behave as documented."""

from __future__ import annotations

import shutil

import pytest
import torch
from ep_core import device_array
from ep_torch import host_extension


@pytest.fixture(scope="module")
def native():
    mod = host_extension._import(host_extension.build(quiet=True))
    host_extension._self_check(mod)
    return mod


@pytest.fixture
def fresh_state(monkeypatch):
    """module()/status() decide again in this test (and the process's decision is restored afterwards)."""
    monkeypatch.setattr(host_extension, "_state", [])


DTYPES = [
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint8,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 7168), (128, 8), (0, 8), (17,), (), (3, 0, 2)])
def test_empty_matches_torch_empty(native, dtype, shape):
    t = native.empty(shape, dtype, -1)
    ref = torch.empty(size=shape, dtype=dtype)
    assert type(t) is torch.Tensor
    assert (t.shape, t.dtype, t.device, t.stride(), t.requires_grad) == (
        ref.shape,
        ref.dtype,
        ref.device,
        ref.stride(),
        False,
    )
    assert native.empty(list(shape), dtype, -1).shape == ref.shape  # any sequence of int


def test_empty_bad_arguments(native):
    with pytest.raises(TypeError, match="device_index"):
        native.empty((2, 3), "float32", -1)
    with pytest.raises(TypeError, match="sequence of int"):
        native.empty(5, torch.float32, -1)
    with pytest.raises(TypeError):
        native.empty((2, "x"), torch.float32, -1)
    with pytest.raises(RuntimeError, match="negative"):
        native.empty((2, -1), torch.float32, -1)


def _tensors():
    base = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    return {
        "contiguous": base,
        "rows": base[2:5],
        "columns": base[:, 3:],
        "transposed": base.t(),
        "expanded": torch.zeros(1, 8).expand(6, 8),
        "empty": torch.empty(0, 8, dtype=torch.int64),
        "scalar": torch.tensor(3, dtype=torch.int32),
        "bf16": torch.zeros(4, 16, dtype=torch.bfloat16)[:, ::2],
        "fp8": torch.zeros(4, 16, dtype=torch.float8_e4m3fn),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_facts_match_torch(native, name):
    t = _tensors()[name]
    assert native.facts(t) == (t.dtype, tuple(t.shape), t.stride(), t.data_ptr(), -1)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_facts_none_where_describe_decides_itself(native):
    x = torch.ones(3, 4)
    assert native.facts(x.clone().requires_grad_()) is None
    assert native.facts(x._neg_view()) is None
    assert native.facts(torch.ones(3, 4, dtype=torch.complex64).conj()) is None
    assert native.facts(torch.ones(3, 4, device="meta")) is None
    assert native.facts(x.to_sparse()) is None
    assert native.facts(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])) is None
    assert native.facts([1, 2]) is None


@pytest.mark.parametrize("name", list(_tensors()))
def test_describe_through_the_reader_is_unchanged(native, name, monkeypatch):
    t = _tensors()[name]
    monkeypatch.setattr(device_array, "_torch_reader", None)
    want = device_array.describe(t)
    device_array.set_torch_reader(native.facts)
    got = device_array.describe(t)
    assert got == want and got.obj is t


def test_describe_slow_path_cases_through_the_reader(native, monkeypatch):
    """What the reader turns down keeps the attribute path's result or error."""
    monkeypatch.setattr(device_array, "_torch_reader", native.facts)
    x = torch.ones(3, 4).requires_grad_()
    with pytest.raises(Exception) as with_reader:
        device_array.describe(x, "x")
    monkeypatch.setattr(device_array, "_torch_reader", None)
    with pytest.raises(Exception) as without:
        device_array.describe(x, "x")
    assert type(with_reader.value) is type(without.value) and str(with_reader.value) == str(without.value)


@pytest.mark.parametrize("name", list(_tensors()))
def test_signature_matches_exactly_the_recorded_layouts(native, name):
    """`signature(...).match(...)` returns the pointers for arguments with the recorded dtype, sizes, strides and
    device (another tensor of that layout included, None slots as None), and None for any other layout."""
    t = _tensors()[name]
    other = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    sig = native.signature(t, None, other)
    assert isinstance(sig, native.Signature)
    assert sig.match(t, None, other) == (t.data_ptr(), 0, other.data_ptr())
    assert sig.match(other, None, t) == (other.data_ptr(), 0, t.data_ptr())
    for name2, u in _tensors().items():
        same = (u.dtype, u.shape, u.stride()) == (t.dtype, t.shape, t.stride())
        assert (sig.match(u, None, other) is not None) == same, name2
    assert sig.match(t, t, other) is None  # a tensor where None was recorded
    assert sig.match(None, None, other) is None
    assert sig.match(t.to(torch.int16 if t.dtype != torch.int16 else torch.int32), None, other) is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_signature_turns_down_what_describe_decides_itself(native):
    x = torch.ones(3, 4)
    sig = native.signature(x)
    assert sig.match(x.clone().requires_grad_()) is None
    assert sig.match(x._neg_view()) is None
    assert (
        sig.match(torch.nn.Parameter(x.clone(), requires_grad=False)) is None
    )  # a subclass: describe decides
    assert sig.match(x.to("meta")) is None
    assert sig.match([1, 2]) is None
    with pytest.raises(TypeError, match="expected 1 arguments, got 2"):
        sig.match(x, x)
    with pytest.raises(ValueError, match="argument 0"):
        native.signature(x.clone().requires_grad_())
    with pytest.raises(TypeError, match="argument 1"):
        native.signature(x, torch.nn.Parameter(x.clone()))
    with pytest.raises(TypeError, match="argument 0"):
        native.signature([1])
    assert native.signature().match() == ()


def test_empty_many_matches_empty(native):
    specs = (
        ((4, 7168), torch.bfloat16),
        ((128, 8), torch.int64),
        ((0, 8), torch.float32),
        ((17,), torch.int32),
    )
    tensors, ptrs = native.empty_many(specs, -1)
    assert len(tensors) == len(ptrs) == len(specs)
    for t, p, (shape, dtype) in zip(tensors, ptrs, specs):
        ref = native.empty(shape, dtype, -1)
        assert type(t) is torch.Tensor and (t.shape, t.dtype, t.stride(), t.device) == (
            ref.shape,
            ref.dtype,
            ref.stride(),
            ref.device,
        )
        assert p == t.data_ptr()
    assert len({t.data_ptr() for t in tensors if t.numel()}) == 3  # separate allocations
    assert native.empty_many((), -1) == ((), ())


def test_empty_many_bad_arguments(native):
    with pytest.raises(TypeError, match="specs"):
        native.empty_many([((2,), torch.float32)], -1)
    with pytest.raises(TypeError, match=r"specs\[1\]"):
        native.empty_many((((2,), torch.float32), ((2,), "float32")), -1)
    with pytest.raises(TypeError, match="sequence of int"):
        native.empty_many(((5, torch.float32),), -1)
    with pytest.raises(RuntimeError, match="negative"):
        native.empty_many((((2, -1), torch.float32),), -1)


def test_mode_off(monkeypatch, fresh_state):
    monkeypatch.setenv("EPKIT_TORCH_HOST_EXTENSION", "0")
    assert host_extension.module() is None
    assert "off" in host_extension.status()


def test_mode_auto_builds(monkeypatch, fresh_state):
    monkeypatch.delenv("EPKIT_TORCH_HOST_EXTENSION", raising=False)
    assert host_extension.module() is not None
    assert host_extension.status().startswith(f"built against torch {torch.__version__}")


def _broken_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path))


def test_mode_auto_warns_and_falls_back(monkeypatch, fresh_state, tmp_path):
    _broken_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("EPKIT_TORCH_HOST_EXTENSION", "auto")
    with pytest.warns(RuntimeWarning, match="host extension is unavailable.*compiler exited with 1"):
        assert host_extension.module() is None
    assert host_extension.status().startswith("Python fallback")
    assert host_extension.module() is None  # decided once: no second warning, no second build


def test_mode_required_raises(monkeypatch, fresh_state, tmp_path):
    _broken_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("EPKIT_TORCH_HOST_EXTENSION", "1")
    with pytest.raises(host_extension.HostExtensionError, match=r"build\.log"):
        host_extension.module()
    # a second process finds the failure recorded instead of compiling again
    monkeypatch.setattr(host_extension, "_state", [])
    with pytest.raises(host_extension.HostExtensionError, match=r"an earlier build; remove .* to retry"):
        host_extension.module()


def test_mode_bad_value(monkeypatch, fresh_state):
    monkeypatch.setenv("EPKIT_TORCH_HOST_EXTENSION", "maybe")
    with pytest.raises(ValueError, match="EPKIT_TORCH_HOST_EXTENSION='maybe'"):
        host_extension.module()


def test_build_is_cached(native):
    first = host_extension.build(quiet=True)
    assert host_extension.build(quiet=True) == first and first.is_file()
