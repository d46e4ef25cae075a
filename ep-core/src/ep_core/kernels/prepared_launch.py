"""Prepared launches of `RankDriver`: per launch shape, the resolved kernel, its launch configuration, the occupancy
verdict and the packed `OpArgs` words, so that a repeated call only patches its per-call words and launches.

A launch shape is everything that shapes the launch (kernel configuration, flags, grid, counts, strides, regions,
the rank's own words); `RankDriver` builds the key from values it computed for this call, and the checks whose
inputs can change per call stay in `RankDriver`. A miss packs every field through `pack_op_args` and keeps the
words; a hit copies them and overwrites the per-call slots (`_DISPATCH_DYNAMIC` and the others; the words
themselves are built in `ep_core.kernels.op_plan`), so its bytes are those a fresh pack would give. A hit launches
through `ep_launch` when usable (`_cuda.native_launch`: copy, patch and `cuLaunchKernelEx` in one C++ call); a
failed native launch (nothing launched) is retried through the Python path, which raises the driver's error.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from ep_core.kernels._args import OP_ARGS_FIELDS, pack_op_args

__all__ = ["OP_ARGS_STRUCT", "PlanCache", "PreparedLaunch", "PreparedOp", "field_slots", "record_wait"]

OP_ARGS_STRUCT = struct.Struct("<" + "q" * len(OP_ARGS_FIELDS))
_INDEX = {name: i for i, name in enumerate(OP_ARGS_FIELDS)}
_TOP, _WRAP = 1 << 63, 1 << 64
# the plan cache's bound: callers cycling through many shapes keep only recent ones (a miss only costs a fresh
# pack, a lost plan one call of the full path); launches, plans and SM counts share it: room for the plan and the
# launch of every entry a buffer's `PreparedOps` keeps (two tables of 256), and some SM counts
_MAX_ENTRIES = 1088


def field_slots(names: Sequence[str]) -> tuple[int, ...]:
    """Word indices of `OpArgs` fields (KeyError names an unknown field)."""
    try:
        return tuple(_INDEX[n] for n in names)
    except KeyError as e:
        raise KeyError(f"OpArgs has no field {e.args[0]!r}") from None


class PreparedLaunch:
    """One kernel launch of one shape: kernel, grid, block, shared memory, cooperative flag and the packed words.

    `patch(values, words=None)` returns a copy of `words` (default: the words of the shape) with the per-call
    fields (`dynamic`, in order) set to `values` (ints; pointers above 2**63 wrap as in `pack_op_args`);
    `launch(words, stream)` launches those words."""

    __slots__ = (
        "block",
        "cooperative",
        "dynamic",
        "grid",
        "kernel",
        "name",
        "native",
        "pdl",
        "shared_mem",
        "slots",
        "words",
    )

    def __init__(
        self,
        kernel: Any,
        name: str,
        grid: int,
        block: int,
        shared_mem: int,
        cooperative: bool,
        words: list[int],
        dynamic: Sequence[str],
        pdl: bool = False,
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.grid = grid
        self.block = block
        self.shared_mem = shared_mem
        self.cooperative = bool(cooperative)
        # programmatic dependent launch (it may start before the stream's previous kernel ends)
        self.pdl = bool(pdl)
        self.words = words
        self.dynamic = tuple(dynamic)
        self.slots = field_slots(self.dynamic)
        self.native = _native_launch(self)

    @classmethod
    def pack(
        cls,
        kernel: Any,
        name: str,
        grid: int,
        block: int,
        shared_mem: int,
        cooperative: bool,
        args: dict,
        dynamic: Sequence[str],
        pdl: bool = False,
    ) -> PreparedLaunch:
        """A prepared launch from the full argument dict of a first call (packed by `pack_op_args`)."""
        words = list(OP_ARGS_STRUCT.unpack(pack_op_args(**args)))
        return cls(kernel, name, grid, block, shared_mem, cooperative, words, dynamic, pdl)

    def patch(self, values: Sequence[int], words: list[int] | None = None) -> list[int]:
        out = (self.words if words is None else words).copy()
        for i, v in zip(self.slots, values):
            out[i] = v - _WRAP if v >= _TOP else v
        return out

    def run(self, values: tuple, stream: int, wait: Any = None, signal: Any = None) -> None:
        """The Python path of a launch (`op_plan.run_launch` takes the native one, and this where it has none or
        it launched nothing: this raises the driver's error): the kept words with the per-call fields set to `values`
        (in `dynamic` order). `wait = (event, other)`: the launch first waits for everything queued on stream
        `other`; `signal = (event, other)`: stream `other` then waits for the launch (`_cuda.Event`s)."""
        if wait is not None:
            record_wait(wait[0], wait[1], stream)
        self.launch(self.patch(values), stream)
        if signal is not None:
            record_wait(signal[0], stream, signal[1])

    def launch(self, words: list[int], stream: Any) -> None:
        import ep_jit  # loaded by then (the kernels came from it); not needed to import ep_core

        self.kernel.launch(
            self.grid,
            self.block,
            [ep_jit.struct(OP_ARGS_STRUCT.pack(*words))],
            shared_mem=self.shared_mem,
            stream=stream,
            cooperative=self.cooperative,
            **({"pdl": True} if self.pdl else {}),
        )


class _NoEvent:
    handle = 0


_NO_PAIR = (_NoEvent, 0)


def record_wait(event: Any, on: int, waiter: int) -> None:
    """`waiter` waits for everything queued on `on` so far (`event`: a `_cuda.Event`), through ep_launch when it
    is usable, else (or when that fails, to raise the driver's error) through cuda-python."""
    from ep_core.kernels import _cuda

    native = _cuda.native_launch()
    if native is not None and not native.record_wait(event.handle, on, waiter):
        return
    event.record(on)
    _cuda.check(_cuda.driver().cuStreamWaitEvent(int(waiter), event._event, 0), "cuStreamWaitEvent")


def _native_launch(launch: PreparedLaunch) -> Any:
    """The `ep_launch.Launch` of a prepared launch, or None (no native path, or a kernel that is not ep_jit's)."""
    from ep_core.kernels import _cuda

    func = getattr(launch.kernel, "_func", None)
    module = None if func is None else _cuda.native_launch()
    if module is None:
        return None
    opt_in = getattr(launch.kernel, "_opt_in_smem", None)
    # the Python launch opts in above 48 KiB on every call; the native one relies on this
    if opt_in is not None:
        opt_in(launch.shared_mem)
    return module.Launch(
        int(func),
        launch.grid,
        launch.block,
        launch.shared_mem,
        launch.cooperative,
        OP_ARGS_STRUCT.pack(*launch.words),
        list(launch.slots),
        launch.pdl,
    )


class PlanCache:
    """The one plan cache of a rank (issue 45), bounded: launch entries (`("dispatch" | "combine", ...)` launch key
    -> `PreparedOp`, through `get` / `put`), the plans of call signatures (a prepared entry's `PreparedToken` -> its
    `DispatchPlan` / `CombinePlan`, through `get` / `keep`) and the planner's SM counts (`("sms", num_experts,
    num_topk)`, through `sms`). `misses` counts the launch entries prepared so far (tests, benchmarks): plans and
    SM counts are not misses. A full cache is cleared at once: a lost entry is only prepared again."""

    __slots__ = ("_entries", "get", "misses")

    def __init__(self) -> None:
        self._entries: dict = {}
        self.get = self._entries.get  # the dict's own lookup (read on every call); `clear` keeps the dict
        self.misses = 0

    def put(self, key: tuple, value: Any) -> Any:
        """Keep a launch entry (a miss)."""
        self.keep(key, value)
        self.misses += 1
        return value

    def keep(self, key: Any, value: Any) -> Any:
        """Keep an entry that is not a miss (a plan, an SM count)."""
        entries = self._entries
        if len(entries) >= _MAX_ENTRIES:
            entries.clear()
        entries[key] = value
        return value

    def sms(self, num_experts: int, num_topk: int, compute: Any) -> int:
        """The SM count of `("sms", num_experts, num_topk)`, `compute()` at its first use."""
        key = ("sms", num_experts, num_topk)
        sms = self._entries.get(key)
        return self.keep(key, int(compute())) if sms is None else sms

    def launches(self) -> list:
        """The launch entries (`PreparedOp`s) kept now."""
        return [v for k, v in self._entries.items() if type(k) is tuple and k[0] in ("dispatch", "combine")]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class PreparedOp:
    """What one dispatch or combine shape resolved: its launch geometry, kernel set, main launch (checked) and,
    for a dispatch, the copy epilogue's launch (prepared and checked at its first use)."""

    __slots__ = ("epilogue", "epilogue_pdl", "geometry", "kernels", "main")

    def __init__(self, geometry: Any, kernels: Any, main: PreparedLaunch) -> None:
        self.geometry = geometry
        self.kernels = kernels
        self.main = main
        self.epilogue: PreparedLaunch | None = None
        # the epilogue launched as a programmatic dependent of the dispatch (no CPU sync between them)
        self.epilogue_pdl: PreparedLaunch | None = None


# ------------------------------------------------------------------------------------- the per-call slots' names
# The per-call fields of each prepared launch in the order the kernels' launches take them; each tuple of words is
# built in that order in one place (`ep_core.kernels.op_plan`: `dispatch_words`, `combine_words`,
# `epilogue_outputs`), for the full path (`RankDriver`) and the plans' runs alike.
_DISPATCH_DYNAMIC = (
    "x",
    "sf",
    "topk_idx",
    "topk_weights",
    "dst_slot",
    "fwd_meta",
    "psum_rank",
    "psum_expert",
    "unaligned_expert",
    "cum_stats",
    "topk_idx_copy",
    "envelope",
)
# a zero-copy dispatch's kernel also writes the handle's metadata (the envelope stays last)
_DISPATCH_ZERO_COPY_DYNAMIC = (*_DISPATCH_DYNAMIC[:-1], "src_metadata", "envelope")
_EPILOGUE_DYNAMIC = (
    "envelope",
    "src_metadata",
    "recv_x",
    "recv_sf",
    "sf_out_stride0",
    "sf_out_stride1",
    "recv_topk_idx",
    "recv_topk_weights",
    "num_out_rows",
)
# the epilogue's launch starts from the dispatch launch's words: the dispatch's per-call fields, then its own
_EPILOGUE_DYNAMIC_ALL = _DISPATCH_DYNAMIC + _EPILOGUE_DYNAMIC
_COMBINE_DYNAMIC = (
    "topk_idx",
    "psum_rank",
    "src_metadata",
    "fwd_meta",
    "comb_x",
    "comb_weights",
    "bias0",
    "bias1",
    "combined_x",
    "combined_weights",
    "envelope",
)
# a zero-copy combine also reads the dispatch's slots (the envelope stays last: it says whether a launch is collective)
_COMBINE_ZERO_COPY_DYNAMIC = (*_COMBINE_DYNAMIC[:-1], "dst_slot", "envelope")
