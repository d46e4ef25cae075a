"""CPU tests of kernel argument wrappers, parameter-buffer packing, stream handles and cubin parsing."""

from __future__ import annotations

import ctypes
import itertools
import struct
import timeit

import ep_jit
import pytest
from ep_jit._args import ArgLayout, build_signature, fast_signature
from ep_jit._module import _dim3, _mangled_prefixes, stream_handle


def _unpack(layout: ArgLayout, buf) -> tuple[list[int], bytes]:
    n = len(layout.offsets)
    raw = bytes(buf)
    ptrs = list(struct.unpack_from(f"<{n}Q", raw, 0))
    return ptrs, raw


class FakeArray:
    def __init__(self, ptr: int):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (ptr, False), "version": 3}


class FakeTensor:
    def __init__(self, ptr: int):
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def test_layout_points_each_slot_at_its_packed_value():
    args = [
        ep_jit.pointer(0x7F00_0000_1000),
        ep_jit.int32(-5),
        ep_jit.struct(bytes(range(12)), align=4),
        ep_jit.float64(2.5),
        ep_jit.bool_(True),
        ep_jit.uint32(0xFFFF_FFFF),
        ep_jit.struct(bytes(range(16)), align=16),
        ep_jit.float32(0.25),
        ep_jit.int64(-(1 << 40)),
        ep_jit.uint64((1 << 64) - 1),
    ]
    sig, vals = fast_signature(args)
    assert sig == build_signature(args)[0]
    layout = ArgLayout(sig)
    buf, base = layout.shared()
    layout.pack(buf, vals)
    ptrs, raw = _unpack(layout, buf)
    assert base == ctypes.addressof(buf)
    offs = [p - base for p in ptrs]
    assert offs == list(layout.offsets)
    expected = [
        struct.pack("<Q", 0x7F00_0000_1000),
        struct.pack("<i", -5),
        bytes(range(12)),
        struct.pack("<d", 2.5),
        b"\x01",
        struct.pack("<I", 0xFFFF_FFFF),
        bytes(range(16)),
        struct.pack("<f", 0.25),
        struct.pack("<q", -(1 << 40)),
        struct.pack("<Q", (1 << 64) - 1),
    ]
    aligns = [8, 4, 4, 8, 1, 4, 16, 4, 8, 8]
    for off, want, al in zip(offs, expected, aligns):
        assert raw[off : off + len(want)] == want
        assert off % al == 0
    # slots never overlap and everything lies inside the buffer
    spans = sorted((o, o + len(w)) for o, w in zip(offs, expected))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] <= layout.nbytes and spans[0][0] >= 8 * len(args)
    # a fresh buffer (used when another thread holds the shared one) packs identically
    buf2, base2 = layout.new_buffer()
    layout.pack(buf2, vals)
    ptrs2, raw2 = _unpack(layout, buf2)
    assert [p - base2 for p in ptrs2] == offs and raw2[8 * len(args) :] == raw[8 * len(args) :]


def test_arrays_tensors_none_become_pointers():
    sig, vals = build_signature(
        [FakeArray(0x1000), FakeTensor(0x2000), None, ep_jit.pointer(FakeArray(0x3000))]
    )
    assert sig == (("Q", 8),) * 4 and vals == [0x1000, 0x2000, 0, 0x3000]
    assert ep_jit.pointer(FakeTensor(0x40)).value == 0x40


def test_numpy_scalars_map_to_their_c_type():
    np = pytest.importorskip("numpy")
    sig, vals = build_signature([np.int32(3), np.float32(1.5), np.uint64(7), np.bool_(True)])
    assert sig == (("i", 4), ("f", 4), ("Q", 8), ("?", 1)) and vals == [3, 1.5, 7, True]
    with pytest.raises(TypeError, match="host"):
        ep_jit.pointer(np.zeros(4))  # DLPack capsule of CPU memory: not a device address


def test_bare_python_numbers_are_rejected_with_position_and_hint():
    with pytest.raises(TypeError, match=r"argument 1 is a bare Python int \(5\).*ep_jit.int32"):
        build_signature([ep_jit.int32(1), 5])
    with pytest.raises(TypeError, match=r"argument 0 is a bare Python float"):
        fast_signature([2.0])
    with pytest.raises(TypeError, match=r"argument 0 is a bare Python bool"):
        fast_signature([True])
    with pytest.raises(TypeError, match="argument 2 has type str"):
        fast_signature([ep_jit.int32(1), ep_jit.int32(1), "x"])


def test_wrappers_validate_ranges_and_types():
    with pytest.raises(ValueError, match="out of range"):
        ep_jit.int32(1 << 31)
    with pytest.raises(ValueError, match="out of range"):
        ep_jit.uint32(-1)
    with pytest.raises(ValueError, match="out of range"):
        ep_jit.uint64(1 << 64)
    with pytest.raises(TypeError, match="expected an int"):
        ep_jit.int64(1.5)
    with pytest.raises(TypeError, match="expected an int"):
        ep_jit.int32(True)
    with pytest.raises(ValueError, match="64-bit"):
        ep_jit.pointer(-1)
    with pytest.raises(TypeError, match="device address"):
        ep_jit.pointer("0x10")
    with pytest.raises(ValueError, match="align"):
        ep_jit.struct(b"1234", align=3)
    with pytest.raises(ValueError, match="empty"):
        ep_jit.struct(b"")
    assert ep_jit.int32(7) == ep_jit.int32(7) != ep_jit.int64(7)
    assert repr(ep_jit.pointer(16)) == "ep_jit.pointer(0x10)"


def test_stream_handles_and_dims():
    class TorchLike:
        cuda_stream = 0x55

    class Proto:
        def __cuda_stream__(self):
            return (0, 0x66)

    class CupyLike:
        ptr = 0x77

    from cuda.bindings import driver

    assert stream_handle(None) == 0 and stream_handle(0x44) == 0x44
    assert (
        stream_handle(TorchLike()) == 0x55
        and stream_handle(Proto()) == 0x66
        and stream_handle(CupyLike()) == 0x77
    )
    assert stream_handle(driver.CUstream(0x88)) == 0x88
    with pytest.raises(TypeError, match="stream"):
        stream_handle("s")
    assert (
        _dim3(4, "grid") == (4, 1, 1)
        and _dim3((2, 3), "grid") == (2, 3, 1)
        and _dim3([1, 2, 3], "g") == (1, 2, 3)
    )
    with pytest.raises(ValueError, match=">= 1"):
        _dim3((0, 1), "grid")
    with pytest.raises(ValueError, match="1 to 3"):
        _dim3((1, 1, 1, 1), "block")
    assert _mangled_prefixes("add_n") == ["_Z5add_n"]
    assert _mangled_prefixes("ep::k") == ["_ZN2ep1kE", "_ZN2ep1kI"]


def test_packing_overhead_is_small(capsys):
    """Per-launch Python work (signature, layout lookup, pack) for a typical 12-argument EP kernel."""
    args = [ep_jit.pointer(0x1000 + i) for i in range(6)] + [ep_jit.int32(i) for i in range(5)]
    args.append(ep_jit.struct(bytes(64)))
    layouts: dict = {}

    def one() -> None:
        sig, vals = fast_signature(args)
        layout = layouts.get(sig)
        if layout is None:
            layout = layouts[sig] = ArgLayout(sig)
        if layout.lock.acquire(False):
            try:
                buf, _ = layout.shared()
                layout.pack(buf, vals)
            finally:
                layout.lock.release()

    n = 20000
    per_us = min(timeit.repeat(one, number=n, repeat=3)) / n * 1e6
    with capsys.disabled():
        print(f"\n[ep-jit] argument packing: {per_us:.2f} us per launch (12 args)")
    assert per_us < 50
