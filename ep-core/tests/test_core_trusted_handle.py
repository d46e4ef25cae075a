"""CPU: a new handle from the library's own allocator is recorded as validated at dispatch
(`validation.trust_handle`), so that its first combine or cached dispatch compares its fingerprint instead of
checking every array (over 20 us per call on a 2-core host: every training step's combine meets a new handle).

Sound only if such a handle passes the full checks by construction, which the first tests check for every dispatch
mode; a field replaced afterwards changes the fingerprint, and the full validation runs again (and raises)."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core import validation
from ep_core.validation import _check_handle_arrays, is_trusted_allocator

T, H, K, E = 6, 32, 3, 8


def _buffer():
    return ec.EPBuffer(
        ec.LocalBootstrap(), transport="reference", num_max_tokens_per_rank=T, hidden=H, num_topk=K
    )


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = ec.host_array(rng.integers(0x3C00, 0x4000, (T, H), dtype=np.uint16), "bfloat16")
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    idx[0, 1] = -1  # a dropped lane
    w = ec.host_array(rng.random((T, K), dtype=np.float32))
    return x, ec.host_array(idx), w


MODES = {
    "cpu sync": {},
    "no cpu sync": {"do_cpu_sync": False},
    "expand": {"do_expand": True},
    "expand, aligned, zero padding": {"do_expand": True, "expert_alignment": 4, "do_zero_padding": True},
    "no handle copy": {"do_handle_copy": False},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_new_handle_is_recorded_and_passes_every_check_by_construction(mode: str) -> None:
    buf = _buffer()
    x, idx, w = _inputs()
    res = buf.dispatch(x, idx, w, num_experts=E, **MODES[mode])
    assert res.handle in validation._validated_handles
    _check_handle_arrays(buf.config, buf._executor, res.handle)  # the full checks it would have met: no error
    combined = buf.combine(res.recv_x, res.handle)
    assert combined.combined_x.shape == (T, H)


def test_the_executors_allocators_are_marked_and_a_callers_is_not() -> None:
    from ep_core.kernels.gpu_executor import GpuExecutor
    from ep_core.reference_executor import ReferenceExecutor

    assert is_trusted_allocator(GpuExecutor.default_allocator)
    assert is_trusted_allocator(ReferenceExecutor.default_allocator)
    assert not is_trusted_allocator(lambda shape, dtype: None)
    assert not is_trusted_allocator(None)


def test_a_handle_from_a_callers_allocator_is_validated_at_first_use() -> None:
    buf = _buffer()
    x, idx, w = _inputs()
    res = buf.dispatch(x, idx, w, num_experts=E, allocator=ec.host_allocator)
    assert res.handle not in validation._validated_handles
    buf.combine(res.recv_x, res.handle)
    assert res.handle in validation._validated_handles  # recorded by check_handle, having passed


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("recv_src_metadata", np.zeros((1, K + 2), np.int32), "recv_src_metadata"),
        (
            "psum_num_recv_tokens_per_scaleup_rank",
            np.zeros(2, np.float32),
            "psum_num_recv_tokens_per_scaleup",
        ),
        ("topk_idx", np.zeros((T, K + 1), np.int64), "handle"),
    ],
)
def test_a_trusted_handle_changed_afterwards_is_validated_again(field: str, value, match: str) -> None:
    buf = _buffer()
    x, idx, w = _inputs()
    res = buf.dispatch(x, idx, w, num_experts=E)
    setattr(res.handle, field, ec.host_array(value))
    with pytest.raises((ec.EPValueError, ec.EPTypeError), match=match):
        buf.combine(res.recv_x, res.handle)
    with pytest.raises((ec.EPValueError, ec.EPTypeError), match=match):
        buf.dispatch(x, handle=res.handle)


def test_a_noted_routing_copy_is_not_described_again(monkeypatch) -> None:
    """`op_plan.note_handle_topk_idx` (GpuExecutor, for a routing copy from a marked allocator) keeps the verdict
    `handle_topk_idx` would reach; the pointer is still read at every call, and another array object or shape is
    described again."""
    import weakref

    from ep_core.kernels import op_plan as repeat

    class Rank:
        _handle_idx: weakref.WeakKeyDictionary

    rank = Rank()
    rank._handle_idx = weakref.WeakKeyDictionary()
    buf = _buffer()
    x, idx, w = _inputs()
    handle = buf.dispatch(x, idx, w, num_experts=E).handle
    copy = ec.DeviceArray(0x9000, (T, K), "int32", device="cuda")
    repeat.note_handle_topk_idx(rank, handle, copy, True)
    handle.topk_idx = copy

    def no_describe(*a):
        raise AssertionError("described again")

    monkeypatch.setattr(repeat, "as_view", no_describe)
    assert repeat.handle_topk_idx(rank, handle, T) == (0x9000, True)
    handle.topk_idx = ec.DeviceArray(0xA000, (T, K), "int32", device="cuda")
    with pytest.raises(AssertionError, match="described again"):
        repeat.handle_topk_idx(rank, handle, T)
