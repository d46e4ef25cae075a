"""The int32 arrays of one new handle in one allocation: a dispatch makes five (six in hybrid mode), and each
allocation through the caller's allocator costs microseconds of host time.

`carve(allocate, shapes)` allocates one int32 array through `allocate(shape, dtype_name)` and lays it out for
`shapes`, each part on a 256-byte boundary (what the kernels may assume of a separate allocation): an `Int32Block`,
which knows every part's pointer at once and makes a part's view (a `DeviceArray`, a torch view, or a slice of an
array that slices and reshapes) on first use; a new handle keeps its block (`ep_core.handle`). `int32_block` makes
every view at once. The parts are disjoint and all belong to the one handle returned, none reused by a later call.
Another block type gives None (the caller allocates each array). `EPKIT_HANDLE_BLOCK` picks the allocators that use
it (`use_block`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ep_core._env import knobs
from ep_core.device_array import DeviceArray as CoreArray

__all__ = ["ALIGN_WORDS", "MODE", "Int32Block", "carve", "int32_block", "use_block", "use_offered"]

ALIGN_WORDS = 64  # 256 bytes of int32
# Which allocators carve one block (`GpuExecutor` asks `use_block` / `use_offered`): "offered" (default): an
# allocator that offers its own `int32_block` (ep_torch's torch allocator: one torch.empty and five `as_strided`
# views, which skips four trips through torch's CUDA caching allocator; on the CPU, where torch.empty is cheap, it
# costs about the same); "auto": also the executor's own (ep_core arrays: one stream-ordered driver allocation
# instead of five); "1": every allocator; "0": none. The executor's own is not carved by default: on the H200
# (2026-12-02) a carved `DeviceArray`'s `owner` was the block, not an array of the view's own shape, which broke
# callers that copy a handle array back through its owner (torch views have no owner: each is a tensor of its own
# shape).
MODE = knobs.handle_block


def use_block(is_default_allocator: bool) -> bool:
    """Whether `GpuExecutor` carves the handle arrays itself for an allocator that offers no block of its own."""
    return MODE == "1" or (MODE == "auto" and is_default_allocator)


def use_offered() -> bool:
    """Whether an allocator's own `int32_block` is used."""
    return MODE != "0"


def _offsets(shapes: Sequence[tuple]) -> tuple[list[int], list[int], int]:
    offsets, sizes, total = [], [], 0
    for shape in shapes:
        n = math.prod(shape)
        offsets.append(total)
        sizes.append(n)
        total += -(-n // ALIGN_WORDS) * ALIGN_WORDS
    return offsets, sizes, total


def c_strides(shape: tuple, itemsize: int = 1) -> tuple:
    """The C-contiguous strides of `shape`, in units of `itemsize` (elements by default)."""
    out, acc = [], itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _core_view(block: CoreArray, off: int, shape: tuple) -> CoreArray:
    """A C-contiguous int32 `DeviceArray` `off` words into `block`, owning it (the fields are set directly: the
    constructor's checks hold by construction, and its conversions would cost what the one block saves)."""
    a = CoreArray.__new__(CoreArray)
    a.ptr = block.ptr + 4 * off
    a.shape = tuple([int(d) for d in shape])
    a.dtype = "int32"
    a.strides = c_strides(a.shape, 4)
    a.device = block.device
    a.device_id = block.device_id
    a.owner = block
    return a


_layouts: dict = {}  # shapes -> (offsets, sizes, total words, torch as_strided arguments per view)


def _layout(shapes: Sequence[tuple]) -> tuple:
    # a tuple of tuples (a repeat's, made once) is its own key; other sequences are converted
    key = shapes if type(shapes) is tuple else tuple([tuple(s) for s in shapes])
    got = _layouts.get(key)
    if got is None:
        key = tuple([tuple(s) for s in shapes])
        if len(_layouts) >= 64:
            _layouts.clear()
        offsets, sizes, total = _offsets(key)
        strided = tuple([(shape, c_strides(shape), off) for shape, off in zip(key, offsets)])
        got = _layouts[key] = (offsets, sizes, total, strided)
    return got


class Int32Block:
    """One int32 allocation (`array`) and its layout: the pointer of each part is known at once, its view is made
    on first use (`view(i)`, then kept: the same object every time). A new handle holds its block this way
    (`ep_core.handle`), so a dispatch whose handle arrays are only read by the kernels makes no view at all."""

    __slots__ = ("_kind", "_strided", "array", "ptrs", "shapes", "views")

    def __init__(self, array: Any, shapes: tuple, kind: str) -> None:
        offsets, _sizes, _total, strided = _layout(shapes)
        self.array = array
        self.shapes = shapes
        self._strided = strided
        self._kind = kind
        # the parts' pointers (None for a sliced host or foreign array: its views are made and read instead)
        self.ptrs: tuple | None = None
        if kind != "sliced":
            base = array.data_ptr() if kind == "torch" else array.ptr
            self.ptrs = tuple([base + 4 * off for off in offsets])
        self.views: list = [None] * len(shapes)

    @staticmethod
    def layout(shapes: tuple) -> tuple:
        """`(word offsets, word sizes, total words, as_strided arguments per part)` of a block for `shapes`."""
        return _layout(shapes)

    @classmethod
    def adopt(cls, array: Any, shapes: tuple, base: int) -> Int32Block:
        """The block of an `array` allocated for `shapes` (a tuple of tuples) whose data pointer `base` the caller
        has read already (a kept plan's batch, ep_core.kernels.op_plan): what `carve` makes, without its pointer read."""
        offsets, _sizes, _total, strided = _layout(shapes)
        block = cls.__new__(cls)
        block.array = array
        block.shapes = shapes
        block._strided = strided
        block._kind = _kind(array) or "sliced"
        block.ptrs = tuple([base + 4 * off for off in offsets])
        block.views = [None] * len(shapes)
        return block

    def view(self, i: int) -> Any:
        """Part `i` as the block's array type (C-contiguous int32, the shape `shapes[i]`)."""
        got = self.views[i]
        if got is None:
            shape, strides, off = self._strided[i]
            if self._kind == "torch":
                got = self.array.as_strided(shape, strides, off)
            elif self._kind == "core":
                got = _core_view(self.array, off, shape)
            else:
                got = self.array[off : off + math.prod(shape)].reshape(shape)
            self.views[i] = got
        return got

    def __reduce__(self) -> tuple:
        # a copy (copy.deepcopy of a handle) reads its own array's pointers; views are made again
        return (Int32Block, (self.array, self.shapes, self._kind))


def _kind(array: Any) -> str | None:
    if type(array) is CoreArray:
        return "core"
    if type(array).__module__ == "torch":
        return "torch"
    if hasattr(array, "reshape") and hasattr(array, "__getitem__"):
        return "sliced"  # an array type that slices and reshapes (CuPy, numpy)
    return None


def carve(allocate: Callable[[tuple, str], Any], shapes: Sequence[tuple]) -> Int32Block | None:
    """One int32 allocation through `allocate` laid out for `shapes` (None: the block's type cannot be carved;
    it is dropped and the caller allocates each array)."""
    key = shapes if type(shapes) is tuple else tuple([tuple(s) for s in shapes])
    total = _layout(key)[2]
    array = allocate((max(total, 1),), "int32")
    kind = _kind(array)
    return None if kind is None else Int32Block(array, key, kind)


def int32_block(allocate: Callable[[tuple, str], Any], shapes: Sequence[tuple]) -> list[Any] | None:
    """One int32 allocation carved into C-contiguous arrays of `shapes`, every view made now (None: the block's
    type cannot be carved; the caller allocates each array)."""
    block = carve(allocate, shapes)
    if block is None:
        return None
    return [block.view(i) for i in range(len(block.shapes))]
