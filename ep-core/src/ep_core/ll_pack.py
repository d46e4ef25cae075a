"""V1 low-latency mode's kernels (host side of ``include/ep_core/ll_pack.cuh``): compiled through ep_jit like the
other kernels, launched with device addresses and ints, so a front end passes its tensors' addresses and stream
(``ep_torch.legacy.ll_kernels`` does; what the kernels compute is documented in the header).

`SIGNATURES` gives each kernel's parameters in order, ``p`` a device address (0 = null), ``i`` an int32: the
header's ``extern "C"`` signatures (a CPU test compares them). `launch` checks the argument count and ranges
against it before anything reaches the driver.
"""

from __future__ import annotations

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

# the module's launch surface is its KernelSet's (one implementation for ll_pack and ll_native): compile (or fetch
# from ep_jit's cache) returning the Artifact, load on a device now, the ep_jit arguments of a launch, and the launch
# (``values`` in the order of `SIGNATURES`, device addresses as ints or None)
compile_ll_kernels = _KERNELS.compile
load = _KERNELS.load
_args = _KERNELS.args
launch = _KERNELS.launch
