"""The Engram fetch kernel on one node (host side of ``include/ep_core/engram_gather.cuh``): `EngramGather.launch`
gathers `rows` entries from their owners' storage into a contiguous output, one warp per row, several 16-byte loads
in flight per lane; `plan_launch` (no GPU) picks the kernel and the grid (`num_sms` blocks of 512 threads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ep_core.errors import EPValueError

__all__ = ["BLOCK_THREADS", "EngramGather", "GatherLaunch", "compile_engram_gather", "plan_launch"]

BLOCK_THREADS = 512
_VECS = (16, 8, 4, 1)


@dataclass(frozen=True)
class GatherLaunch:
    kernel: str
    vec: int
    grid: int
    block: int


def plan_launch(rows: int, entry_bytes: int, addresses: list[int], num_sms: int) -> GatherLaunch:
    """The kernel (widest vector dividing `entry_bytes` and every address) and the grid (`num_sms` blocks, fewer
    when the rows need fewer warps)."""
    if num_sms < 1:
        raise EPValueError(f"num_sms: expected >= 1, got {num_sms}")
    vec = next(v for v in _VECS if entry_bytes % v == 0 and all(a % v == 0 for a in addresses))
    warps = BLOCK_THREADS // 32
    grid = max(1, min(int(num_sms), -(-int(rows) // warps)))
    return GatherLaunch(f"ep_engram_gather_{vec}", vec, grid, BLOCK_THREADS)


def compile_engram_gather(arch: str | None = None, *, headers: tuple[str, str] | None = None) -> Any:
    """Compile (or fetch from ep_jit's cache) the gather kernels; returns the ep_jit Artifact. `headers`: as
    `kernels._source.compile_kernels`'s."""
    import ep_jit

    from ep_core.kernels._source import get_include

    return ep_jit.compile(
        "// ep_core Engram gather\n#include <ep_core/engram_gather.cuh>\n",
        name="ep_core_engram_gather",
        include_dirs=list(headers) if headers is not None else [get_include()],
        arch=arch,
        flags=("-std=c++17",),
    )


_module: Any = None
_lock = threading.Lock()


class EngramGather:
    """The loaded kernels (compiled on first use, shared by the process)."""

    def __init__(self) -> None:
        global _module
        import ep_jit

        with _lock:
            if _module is None:
                _module = ep_jit.load(compile_engram_gather())
        self._module = _module
        self._fns: dict[str, Any] = {}

    def launch(
        self,
        bases_ptr: int,
        bases: list[int],
        indices_ptr: int,
        out_ptr: int,
        rows: int,
        entries_per_rank: int,
        entry_bytes: int,
        stream: int,
        num_sms: int,
    ) -> GatherLaunch:
        """Queue the gather on `stream`; `bases_ptr` is a device array of the `bases` (uint64)."""
        import ep_jit

        plan = plan_launch(rows, entry_bytes, [*bases, out_ptr], num_sms)
        if rows == 0:
            return plan
        fn = self._fns.get(plan.kernel)
        if fn is None:
            fn = self._fns[plan.kernel] = self._module.function(plan.kernel)
        fn.launch(
            plan.grid,
            plan.block,
            [
                ep_jit.pointer(int(bases_ptr)),
                ep_jit.pointer(int(indices_ptr)),
                ep_jit.pointer(int(out_ptr)),
                ep_jit.int64(int(rows)),
                ep_jit.int64(int(entries_per_rank)),
                ep_jit.int32(len(bases)),
                ep_jit.int64(int(entry_bytes)),
            ],
            stream=stream,
        )
        return plan
