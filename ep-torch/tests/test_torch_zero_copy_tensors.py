"""CPU: `ZeroCopyTensors` turns each place of a buffer's memory into a tensor once and gives every call a fresh slice
of its rows (host memory stands in for the GPU's: numpy arrays carrying ep-core's `ptr`)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ep_torch.zero_copy_tensors import ZeroCopyTensors  # noqa: E402


class _Place(np.ndarray):
    """A view of `memory`'s first `rows` rows with ep-core's array attributes (`ptr`, `shape`)."""

    @classmethod
    def of(cls, memory: np.ndarray, rows: int) -> _Place:
        view = memory[:rows].view(cls)
        view.ptr = memory.ctypes.data
        return view


def _counting(monkeypatch) -> list:
    made: list = []
    as_tensor = torch.as_tensor

    def counted(arr, **kw):
        made.append(arr.shape)
        return as_tensor(np.asarray(arr), **kw)

    monkeypatch.setattr(torch, "as_tensor", counted)
    return made


def test_one_tensor_per_place_and_a_fresh_slice_per_call(monkeypatch):
    made = _counting(monkeypatch)
    memory = np.arange(8 * 4, dtype=np.uint16).reshape(8, 4)
    tensors = ZeroCopyTensors(torch.device("cpu"))
    a = tensors.tensor(_Place.of(memory, 8), torch.bfloat16)
    b = tensors.tensor(_Place.of(memory, 8), torch.bfloat16)
    assert made == [(8, 4)]  # the second call reuses the place's tensor
    assert a is not b and a.dtype == b.dtype == torch.bfloat16  # bf16 bits read as uint16, reinterpreted
    assert a.data_ptr() == b.data_ptr() == memory.ctypes.data and a.shape == (8, 4)
    c = tensors.tensor(_Place.of(memory, 3), torch.bfloat16)  # fewer rows (a CPU-sync call): a slice
    assert made == [(8, 4)] and c.shape == (3, 4) and c.data_ptr() == memory.ctypes.data
    assert torch.equal(c.view(torch.int16), torch.from_numpy(memory[:3].view(np.int16)))
    a.fill_(0)  # the same memory: what one call's tensor writes, the next one's reads
    assert not memory.any()


def test_more_rows_remake_the_place_and_other_dtypes_are_other_places(monkeypatch):
    made = _counting(monkeypatch)
    memory = np.zeros((8, 4), dtype=np.uint16)
    tensors = ZeroCopyTensors(torch.device("cpu"))
    assert tensors.tensor(_Place.of(memory, 2), torch.bfloat16).shape == (2, 4)
    assert tensors.tensor(_Place.of(memory, 8), torch.bfloat16).shape == (
        8,
        4,
    )  # more rows than the tensor had
    assert tensors.tensor(_Place.of(memory, 5), torch.bfloat16).shape == (5, 4)
    assert tensors.tensor(_Place.of(memory, 8), torch.int16).dtype == torch.int16
    assert made == [(2, 4), (8, 4), (8, 4)]
    assert tensors.tensor(None, torch.float32) is None
    tensors.clear()
    tensors.tensor(_Place.of(memory, 8), torch.bfloat16)
    assert len(made) == 4
