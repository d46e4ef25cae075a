"""CPU: a repeated dispatch's new handle keeps its int32 arrays in one block, unviewed (ep_core.handle,
ep_core.kernels.array_block).

- `Int32Block`: the parts' pointers are the eager views' pointers; a view is made once, on first use; a copy reads
  its own array's pointers; a host (numpy) block has no pointers, only views;
- `EPHandle`: a field still in the block is viewed when read and then kept; unknown names raise AttributeError;
- the validation's fingerprint: reading a field keeps it (no second full check), replacing one changes it (and the
  full check then rejects a bad array);
(A repeat's new handle over such a block, against the full path: test_core_prepared_launch.py; through ep_torch:
ep-torch/tests/test_torch_host_overhead.py.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from ep_core import validation
from ep_core.device_array import DeviceArray as CoreArray
from ep_core.handle import BLOCK_PARTS, EPHandle
from ep_core.kernels.array_block import Int32Block, carve, int32_block

SHAPES = ((32, 4), (2,), (8,), (8,), (128, 6))
_FIELDS = (
    "dst_buffer_slot_idx",
    "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert",
    "recv_src_metadata",
)


def _core_alloc(base: int = 1 << 40):
    def allocate(shape, dtype):
        return CoreArray(base, shape, dtype, device="cuda", device_id=0)

    return allocate


def test_block_pointers_are_the_views_pointers() -> None:
    block = carve(_core_alloc(), SHAPES)
    assert isinstance(block, Int32Block) and block.views == [None] * len(SHAPES)
    views = int32_block(_core_alloc(), SHAPES)
    assert list(block.ptrs) == [v.ptr for v in views]
    first = block.view(2)
    assert block.view(2) is first and first.shape == SHAPES[2] and first.ptr == block.ptrs[2]
    assert block.views[0] is None  # only what was asked for is viewed
    torch = pytest.importorskip("torch")
    tb = carve(lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype)), SHAPES)
    assert [tb.view(i).data_ptr() for i in range(len(SHAPES))] == list(tb.ptrs)
    assert all(tb.view(i).is_contiguous() and tuple(tb.view(i).shape) == s for i, s in enumerate(SHAPES))


def test_a_copied_block_reads_its_own_pointers() -> None:
    torch = pytest.importorskip("torch")
    block = carve(lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype)), SHAPES)
    block.view(1).fill_(7)
    dup = copy.deepcopy(block)
    assert dup.array.data_ptr() != block.array.data_ptr()
    assert dup.ptrs[0] == dup.array.data_ptr() and dup.views == [None] * len(SHAPES)
    assert int(dup.view(1).sum()) == 14


def test_a_host_block_has_views_and_no_pointers() -> None:
    block = carve(lambda shape, dtype: np.full(shape, -1, dtype), SHAPES)
    assert block.ptrs is None and block.view(4).shape == SHAPES[4]
    assert carve(lambda shape, dtype: object(), SHAPES) is None


def _block_handle(block: Int32Block) -> EPHandle:
    h = EPHandle(
        False, 16, 1, 64, 8, np.zeros((32, 4), np.int64), 10, 10, [], *([None] * 5), num_ranks=2, rank=0
    )
    for name in _FIELDS:
        del h.__dict__[name]
    fields = {name: i for i, name in enumerate(_FIELDS)}  # the order of SHAPES
    h.__dict__[BLOCK_PARTS] = (block, fields, len(h.__dict__) + 1, None)
    return h


def test_a_field_in_the_block_is_viewed_when_read() -> None:
    block = carve(_core_alloc(), SHAPES)
    h = _block_handle(block)
    assert "recv_src_metadata" not in vars(h)
    meta = h.recv_src_metadata
    assert meta is block.views[4] and meta.shape == (128, 6) and vars(h)["recv_src_metadata"] is meta
    assert h.recv_src_metadata is meta and h.num_local_experts == 8
    assert not hasattr(h, "no_such_field")
    with pytest.raises(AttributeError, match="no_such_field"):
        _ = h.no_such_field
    fresh = _block_handle(carve(_core_alloc(), SHAPES))
    fresh.psum_num_recv_tokens_per_expert = "replaced"  # an ordinary write: no view is made
    assert (
        fresh.psum_num_recv_tokens_per_expert == "replaced" and vars(fresh)[BLOCK_PARTS][0].views[2] is None
    )
    assert "dst_buffer_slot_idx" in repr(h)  # repr reads (views) every field
    # a plain handle's fields are its own; the class attributes are the dataclass defaults
    plain = EPHandle(False, 16, 1, 64, 8, None, 0, 0, [], *([np.zeros(1)] * 5))
    assert plain.token_metadata_at_forward is None and plain.recv_src_metadata.shape == (1,)
    assert EPHandle.token_metadata_at_forward is None and not hasattr(EPHandle, "recv_src_metadata")


class _Target:
    array_device, device_id = "cuda", 0


def test_reading_a_field_keeps_the_fingerprint_replacing_one_changes_it() -> None:
    block = carve(_core_alloc(), SHAPES)
    h = _block_handle(block)
    before = validation.handle_fingerprint(None, _Target(), h)
    assert before[1][1] is block and before[0][2][1:] == (*SHAPES[1:], SHAPES[0])
    _ = h.recv_src_metadata, h.dst_buffer_slot_idx
    after = validation.handle_fingerprint(None, _Target(), h)
    assert validation._fingerprint_matches(before, after)
    h.recv_src_metadata = CoreArray(1 << 41, (128, 6), "int32", device="cuda")
    assert not validation._fingerprint_matches(before, validation.handle_fingerprint(None, _Target(), h))
