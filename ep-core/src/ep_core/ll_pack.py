"""V1 low-latency mode's kernels (host side of ``include/ep_core/ll_pack.cuh``): compiled through ep_jit like the
other kernels, launched with device addresses and ints, so a front end passes its tensors' addresses and stream
(``ep_torch.legacy.ll_kernels`` does; what the kernels compute is documented in the header).

`SIGNATURES` gives each kernel's parameters in order, ``p`` a device address (0 = null), ``i`` an int32: the
header's ``extern "C"`` signatures (a CPU test compares them). `launch` checks the argument count and ranges
against it before anything reaches the driver.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ep_core.errors import EPValueError

__all__ = ["KERNEL_NAMES", "MAX_TOPK", "SIGNATURES", "compile_ll_kernels", "launch", "load"]

MAX_TOPK = 128  # EP_LL_MAX_TOPK: a row's lane slots are staged in shared memory

# kernel -> its parameters in order: p = device address, i = int32 (ll_pack.cuh's extern "C" signatures)
SIGNATURES: dict[str, str] = {
    "ep_ll_order": "pipip",
    "ep_ll_layout": "piipippiiiiippppp",
    "ep_ll_pack_bf16": "pippipp",
    "ep_ll_pack_fp8": "pippipppiii",
    "ep_ll_gather": "pippiiipp",
    "ep_ll_weighted_sum": "pipipiiipiip",
}
KERNEL_NAMES = tuple(SIGNATURES)
SOURCE = "// ep_core V1 low-latency kernels\n#include <ep_core/ll_pack.cuh>\n"


def compile_ll_kernels(arch: str | None = None, *, headers: tuple[str, str] | None = None) -> Any:
    """Compile (or fetch from ep_jit's cache) the low-latency kernels; returns the ep_jit Artifact. One
    configuration: sizes, the index dtype and the FP8 options are kernel arguments. `headers`: as
    `kernels._source.compile_kernels`'s (another tree's ep-core and ep-layout include directories)."""
    import ep_jit

    from ep_core.kernels._source import get_include

    return ep_jit.compile(
        SOURCE,
        name="ep_core_ll_pack",
        include_dirs=list(headers) if headers is not None else [get_include()],
        defines={"EP_LL_MAX_TOPK": MAX_TOPK},
        arch=arch,
        flags=("-std=c++17",),
    )


_functions: dict[int, dict[str, Any]] = {}  # device ordinal -> kernel name -> loaded function
_lock = threading.Lock()


def _function(device: int, name: str) -> Any:
    fns = _functions.get(device)
    if fns is None:
        import ep_jit

        with _lock:
            fns = _functions.get(device)
            if fns is None:
                module = ep_jit.load(compile_ll_kernels())
                fns = {n: module.function(n) for n in KERNEL_NAMES}
                _functions[device] = fns
    return fns[name]


def load(device: int) -> None:
    """Load every kernel on ``device`` now (compiling on first use). Launches load them anyway; call this first
    where a load must not happen later: several ranks of one process whose kernels wait for each other (a load, or
    CUDA's lazy loading of a function, may wait for the kernels already running, which wait for a rank not yet
    launched)."""
    for name in KERNEL_NAMES:
        _function(int(device), name)


def _args(name: str, values: Sequence[Any]) -> list[Any]:
    """The ep_jit arguments of ``values`` by the kernel's signature (addresses: ints or None)."""
    import ep_jit

    sig = SIGNATURES.get(name)
    if sig is None:
        raise EPValueError(f"kernel: expected one of {KERNEL_NAMES}, got {name!r}")
    if len(values) != len(sig):
        raise EPValueError(f"{name}: expected {len(sig)} arguments ({sig}), got {len(values)}")
    out: list[Any] = []
    for pos, (code, v) in enumerate(zip(sig, values)):
        if code == "p":
            out.append(ep_jit.pointer(0 if v is None else int(v)))
        else:
            if isinstance(v, bool):
                v = int(v)
            if not isinstance(v, int) or not -(1 << 31) <= v < (1 << 31):
                raise EPValueError(f"{name}: argument {pos} must be an int32, got {v!r}")
            out.append(ep_jit.int32(v))
    return out


def launch(
    name: str,
    grid: int | tuple[int, ...],
    block: int,
    values: Sequence[Any],
    *,
    device: int,
    stream: int,
    shared_mem: int = 0,
) -> None:
    """Queue kernel ``name`` on ``stream`` (a raw CUDA stream handle) of ``device`` (the ordinal whose context is
    current); ``values`` in the order of `SIGNATURES` (device addresses as ints, None for null)."""
    args = _args(name, values)
    _function(int(device), name).launch(grid, block, args, shared_mem=int(shared_mem), stream=int(stream))
