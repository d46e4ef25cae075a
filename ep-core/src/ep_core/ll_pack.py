"""V1 low-latency mode's kernels (host side of ``include/ep_core/ll_pack.cuh``): compiled through ep_jit like the
other kernels, launched with device addresses and ints, so a front end passes its tensors' addresses and stream
(``ep_torch.legacy.ll_kernels`` does; what the kernels compute is documented in the header).

`SIGNATURES` gives each kernel's parameters in order, ``p`` a device address (0 = null), ``i`` an int32: the
header's ``extern "C"`` signatures (a CPU test compares them). `launch` checks the argument count and ranges
against it before anything reaches the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ep_core.kernel_set import KernelSet

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


_KERNELS = KernelSet("ep_core_ll_pack", SOURCE, SIGNATURES, {"EP_LL_MAX_TOPK": MAX_TOPK})


def compile_ll_kernels(arch: str | None = None, *, headers: tuple[str, str] | None = None) -> Any:
    """Compile (or fetch from ep_jit's cache) these kernels; returns the ep_jit Artifact (`KernelSet.compile`)."""
    return _KERNELS.compile(arch, headers=headers)


def load(device: int) -> None:
    """Load every kernel on ``device`` now (`KernelSet.load`: ranks of one process wait for each other)."""
    _KERNELS.load(device)


def _args(name: str, values: Sequence[Any]) -> list[Any]:
    return _KERNELS.args(name, values)


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
    """Queue kernel ``name`` on ``stream`` of ``device``; ``values`` in the order of `SIGNATURES`."""
    _KERNELS.launch(name, grid, block, values, device=device, stream=stream, shared_mem=shared_mem)
