"""V1 low-latency mode's own kernels over ep's symmetric memory (host side of
``include/ep_core/ll_native.cuh``): compiled through ep_jit like the other kernels, launched with device
addresses and ints (``ep_torch.legacy.ll_kernels`` passes its tensors' addresses and stream). What the kernels
compute, and the layout of the symmetric region they share, is documented in the header; `region_layout` is its
host mirror (the bytes a rank needs, the offsets of the two halves).

`SIGNATURES` gives each kernel's parameters in order, ``p`` a device address (0 = null), ``i`` an int32: the
header's ``extern "C"`` signatures (a CPU test compares them). `launch` checks the argument count and ranges
against it before anything reaches the driver.
"""

from __future__ import annotations

from typing import NamedTuple

from ep_core.kernel_set import KernelSet

__all__ = [
    "HEADER_BYTES",
    "KERNEL_NAMES",
    "MAX_TOPK",
    "RECORD_WORDS",
    "SIGNATURES",
    "SYNC_OFFSET",
    "RegionLayout",
    "compile_ll_native",
    "header_bytes",
    "herr_words",
    "launch",
    "load",
    "region_layout",
]

MAX_TOPK = 128  # EP_LL_MAX_TOPK: a token's lanes are staged in shared memory by the combine receive
HEADER_BYTES = 256  # the region's front (at least): the device error word (int32 [4]) before the two halves
SYNC_OFFSET = 64  # in the front: the clean barrier's sync words, int64 [N] (`header_bytes`)


def header_bytes(num_ranks: int) -> int:
    """The region's front for ``num_ranks`` ranks (``ep_lln::header_bytes``): the error word, the sync words."""
    return (SYNC_OFFSET + 8 * num_ranks + 255) // 256 * 256


# the last two parameters of the four exchanges (and their LogFMT twins): the rank mask, int32 [N + 1] (0 = none),
# and the call's signature word (issue 41; ep_torch.legacy.ll_kernels.dispatch_sig / combine_sig)
SIGNATURES: dict[str, str] = {
    "ep_lln_cast_fp8": "piipi",
    "ep_lln_dispatch_send": "piipiiiiiiiipppiippppi",
    "ep_lln_dispatch_recv": "iiiiiipiippppppppiipiiipipppi",
    "ep_lln_combine_send": "ppppiiiiiipppipppi",
    "ep_lln_combine_recv": "pipiiiiiiipppppiipppi",
    "ep_lln_combine_send_logfmt": "ppppiiiiiipppipppi",  # the two above with LogFMT-10 rows (ll_logfmt.cuh)
    "ep_lln_combine_recv_logfmt": "pipiiiiiiipppppiipppi",
    "ep_lln_clean": "ppiiiiiiiippp",  # rank masking's rejoin: a collective of every rank (see the header)
    "ep_lln_abort": "pppiiiiiiiip",  # a call this rank refused on the host: its flags get the abort word
}
# the host-mapped error words (`herr`, int32): [0, 4) a timeout's record, [4, 4 + N) the rank mask's, then the
# signature record (token, peer, tag, their word, this rank's word; ``envelope_record`` in the header)
RECORD_WORDS = 5


def herr_words(num_ranks: int) -> int:
    """The length of the host-mapped error words for ``num_ranks`` ranks."""
    return 4 + num_ranks + RECORD_WORDS


KERNEL_NAMES = tuple(SIGNATURES)
SOURCE = "// ep_core V1 low-latency native kernels\n#include <ep_core/ll_native.cuh>\n"


class RegionLayout(NamedTuple):
    """Byte offsets inside one half (native.cuh's ``ep_lln::Layout``) and the region's total size."""

    ctrl: int
    dflag: int
    cflag: int
    ddata: int
    cdata: int
    half_bytes: int
    msg: int
    total_bytes: int  # header + 2 halves
    cmeta: int = 0  # LogFMT group words of the combine slots [M][K][hidden / 128] uint32
    header: int = HEADER_BYTES  # the region's front (`header_bytes`)

    def half_offset(self, half: int) -> int:
        return self.header + int(half) * self.half_bytes


def region_layout(
    epr: int, num_ranks: int, num_experts: int, m: int, num_topk: int, hidden: int
) -> RegionLayout:
    """The host mirror of ``ep_lln::Layout`` (keep the two equal)."""
    msg = 16 + (hidden * 2 + 15) // 16 * 16
    dflag = 64
    cflag = dflag + epr * num_ranks * 8
    ddata = (cflag + num_experts * 8 + 127) // 128 * 128
    cdata = ddata + epr * num_ranks * m * msg
    cmeta = cdata + m * num_topk * hidden * 2
    half = (cmeta + m * num_topk * (hidden // 128) * 4 + 4095) // 4096 * 4096
    front = header_bytes(num_ranks)
    return RegionLayout(0, dflag, cflag, ddata, cdata, half, msg, front + 2 * half, cmeta, front)


_KERNELS = KernelSet("ep_core_ll_native", SOURCE, SIGNATURES, {"EP_LL_MAX_TOPK": MAX_TOPK})

# the module's launch surface is its KernelSet's (one implementation for ll_pack and ll_native): compile (or fetch
# from ep_jit's cache) returning the Artifact, load on a device now, the ep_jit arguments of a launch, and the launch
# (``values`` in the order of `SIGNATURES`, device addresses as ints or None)
compile_ll_native = _KERNELS.compile
load = _KERNELS.load
_args = _KERNELS.args
launch = _KERNELS.launch
