"""Every LSA peer's base of an NCCL window as an address in this process, for kernels that take a table of peer
bases (V1 low-latency mode's own, ``include/ep_core/ll_native.cuh``) instead of ``ncclGetLsaPointer``: a one-block
kernel writes ``ncclGetLsaPointer(window, 0, p)`` for every peer and the host reads the table back (valid until the
window is deregistered; a synchronizing call, not under CUDA-graph capture, like `IpcStorage.peer_bases`).
"""

from __future__ import annotations

from ep_core.errors import EPConfigError
from ep_core.kernel_set import KernelSet

__all__ = ["SOURCE", "compile_lsa_bases", "lsa_peer_bases"]

SOURCE = r"""// ep_core: the LSA bases of an NCCL window's peers
#include <nccl_device.h>
extern "C" __global__ void ep_nccl_lsa_bases(void* window, int num_peers, unsigned long long* out) {
  for (int p = threadIdx.x; p < num_peers; p += blockDim.x)
    out[p] = reinterpret_cast<unsigned long long>(ncclGetLsaPointer(static_cast<ncclWindow_t>(window), 0, p));
}
"""


def _nccl_headers() -> tuple[str, ...]:
    import ep_nccl_gin  # optional extra (the nccl transport's)

    from ep_core.kernels._source import get_include

    return (get_include(), *ep_nccl_gin.include_dirs(check=False))


_KERNELS = KernelSet("ep_core_nccl_lsa_bases", SOURCE, {"ep_nccl_lsa_bases": "pip"}, {}, _nccl_headers)
compile_lsa_bases = _KERNELS.compile  # (or fetch from ep_jit's cache) returns the ep_jit Artifact


def lsa_peer_bases(window: int, num_peers: int, device: int) -> list[int]:
    """The base of ``window`` on each of its LSA team's ``num_peers`` peers (team order), as mapped here."""
    import numpy as np

    from ep_core.kernels import _cuda

    if not window:
        raise EPConfigError("lsa_peer_bases: the NCCL window is closed")
    table = _cuda.DeviceArray((int(num_peers),), np.uint64, stream=None)
    _KERNELS.launch(
        "ep_nccl_lsa_bases", 1, 128, [int(window), int(num_peers), table.ptr], device=int(device), stream=0
    )
    return [int(v) for v in table.numpy(0)]
