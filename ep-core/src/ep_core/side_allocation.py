"""A symmetric allocation beside a buffer's storage: ep_symmem's `[GPU | host NUMA]` memory, created on every rank,
zeroed and exchanged over the buffer's bootstrap, as one collective: the signal words and Engram host storage of
ep_torch's copy-engine primitives (ep-torch reaches ep_symmem only through ep-core, DESIGN.md §1).
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_exchanged"]


def create_exchanged(
    bootstrap: Any,
    num_gpu_bytes: int,
    *,
    num_host_bytes: int = 0,
    device: int | None = None,
    zero: bool = False,
) -> tuple[Any | None, str]:
    """A collective: every rank creates its allocation (`num_gpu_bytes` of GPU memory on `device`, then
    `num_host_bytes` of host memory of the GPU's NUMA node behind it, one VA range), zeroes its GPU part when
    `zero` (before any peer can map it), and exchanges it with every rank of `bootstrap`: `peer_ptr(r)` is then
    rank r's base as mapped in this process.

    Returns `(allocation, "")`; when any rank could not create its allocation, `(None, "rank r: <reason>")` on every
    rank (each closes its own, nothing is exchanged), so that all ranks fall back or raise together. The caller
    owns the allocation (`close()` after the streams that use it drained)."""
    import ep_symmem

    alloc, why = None, ""
    try:
        alloc = ep_symmem.SymmetricAllocation.create(
            int(num_gpu_bytes), num_host_bytes=int(num_host_bytes), device=device
        )
        if zero:
            from ep_core.kernels import _cuda

            _cuda.memset(int(alloc.ptr), int(num_gpu_bytes), 0)
            _cuda.synchronize_context()
    except Exception as exc:  # no host NUMA VMM support here (driver, kernel, container), out of memory, ...
        why = f"{type(exc).__name__}: {exc}"
    verdicts = [v.decode() for v in bootstrap.allgather(why.encode())]  # also: every rank zeroed its part
    bad = [(r, v) for r, v in enumerate(verdicts) if v]
    if bad:
        if alloc is not None:
            alloc.close()
        return None, f"rank {bad[0][0]}: {bad[0][1]}"
    ep_symmem.exchange(alloc, bootstrap)
    return alloc, ""
