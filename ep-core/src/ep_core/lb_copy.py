"""The load-balancing kernels over symmetric memory (host side of ``include/ep_core/lb_copy.cuh``).

``ep_torch.load_balance`` keeps the LB region in a symmetric allocation that every rank of the LSA domain has mapped
(``ep_core.side_allocation``): ``[LB region | sync words]``. From the routes of a redundancy mapping
(``ep_core.load_balance.lb_routes``) and the addresses involved, this module builds the kernels' address tables (no
GPU): `prefetch_tasks` (the owner pushes each of its experts' rows into every slot that holds it, the peers' and its
own) and `reduce_table` (the owner pulls every slot's gradients that hold one of its experts and adds them in
ascending (LSA rank, slot) order: bitwise ``ep_core.load_balance.reduce_grads_reference``). `launch` queues a call:
an entry barrier, the copy or reduce kernel on ``num_sms`` blocks, an exit barrier (the header says why).

A slot's address on peer ``s`` is ``lb_bases[s] + (slot address here - lb_bases[me])``: every rank lays its region
out alike (the plans are compared at construction).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ep_core.errors import EPValueError
from ep_core.kernel_set import KernelSet
from ep_core.load_balance import LBRoutes

__all__ = [
    "BLOCK_THREADS",
    "KERNEL_NAMES",
    "SIGNATURES",
    "SYNC_BYTES",
    "TAG_ENTRY",
    "TAG_EXIT",
    "compile_lb_copy",
    "launch",
    "load",
    "prefetch_tasks",
    "reduce_table",
    "sync_offset",
]

BLOCK_THREADS = 512  # ep_core::lb::kBlockThreads
SYNC_BYTES = 64 * 1024  # the sync words after the region: int64 [N], N <= 8192 ranks
TAG_ENTRY, TAG_EXIT = 1, 2  # `herr[3]` of a timed-out barrier

SIGNATURES: dict[str, str] = {
    "ep_lb_barrier": "piiiipi",  # sync table, rank, num_ranks, value, timeout_ms, herr, tag
    "ep_lb_copy": "pip",  # tasks [T][3], T, herr
    "ep_lb_reduce": "piip",  # table [E][3] + srcs, E, hidden, herr
}
KERNEL_NAMES = tuple(SIGNATURES)
SOURCE = "// ep_core load-balancing copies\n#include <ep_core/lb_copy.cuh>\n"

_KERNELS = KernelSet("ep_core_lb_copy", SOURCE, SIGNATURES, {})
compile_lb_copy = _KERNELS.compile
load = _KERNELS.load


def sync_offset(num_lb_bytes: int) -> int:
    """Where the sync words start in the allocation: right after the region (a multiple of 2 MiB, or 0)."""
    return int(num_lb_bytes)


def prefetch_tasks(
    routes: LBRoutes,
    pairs: Sequence[tuple[int, int, int]],
    lb_bases: Sequence[int],
) -> np.ndarray:
    """The copy tasks ``[T, 3]`` int64 (dst, src, bytes) of a prefetch by LSA rank ``routes.lsa_rank``.

    ``pairs``: per tensor pair, (address of the redundant tensor here, address of the expert tensor, bytes per
    expert); the redundant tensor lies in this rank's LB region, whose base on LSA rank ``s`` is ``lb_bases[s]``.
    Tasks go pair by pair, then by destination rank and slot."""
    me = _check_bases(routes, lb_bases)
    rows = []
    for red, experts, per in pairs:
        offset = int(red) - int(lb_bases[me])
        for s, sends in enumerate(routes.send):
            for local, slot in sends:
                rows.append((int(lb_bases[s]) + offset + slot * per, int(experts) + local * per, per))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def reduce_table(
    routes: LBRoutes,
    grads: int,
    red: int,
    row_bytes: int,
    num_local_experts: int,
    lb_bases: Sequence[int],
) -> tuple[np.ndarray, int]:
    """The reduce table of LSA rank ``routes.lsa_rank``: ``[E, 3]`` int64 (dst, first, count) followed by the
    sources (flattened, one int64 array) and ``E``. Entry per local expert with at least one slot: ``dst`` its row
    of ``grads``, the sources every slot (LSA rank ``s``, slot ``c``) holding it, ascending (s, c); ``red`` is the
    address of the redundant gradients in this rank's LB region."""
    offset = int(red) - int(lb_bases[_check_bases(routes, lb_bases)])
    srcs: list[list[int]] = [[] for _ in range(num_local_experts)]
    for s, sends in enumerate(routes.send):  # ascending rank, each rank's pairs in slot order
        for local, slot in sends:
            srcs[local].append(int(lb_bases[s]) + offset + slot * row_bytes)
    entries, flat = [], []
    for local, rows in enumerate(srcs):
        if rows:
            entries.append((int(grads) + local * row_bytes, len(flat), len(rows)))
            flat.extend(rows)
    table = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
    return np.concatenate([table.reshape(-1), np.asarray(flat, dtype=np.int64)]), len(entries)


def _check_bases(routes: LBRoutes, lb_bases: Sequence[int]) -> int:
    """This rank's LSA rank, after checking that ``lb_bases`` has a base per LSA rank."""
    if len(lb_bases) != len(routes.send):
        raise EPValueError(
            f"lb_bases: expected {len(routes.send)} bases (one per LSA rank), got {len(lb_bases)}"
        )
    return routes.lsa_rank


def launch(
    kind: str,
    table: int,
    count: int,
    *,
    hidden: int = 0,
    sync_table: int,
    rank: int,
    num_ranks: int,
    generation: int,
    timeout_ms: int,
    herr: int,
    num_sms: int,
    device: int,
    stream: int,
) -> None:
    """Queue one call on ``stream``: entry barrier, ``ep_lb_copy`` (``kind`` "copy": ``count`` tasks) or
    ``ep_lb_reduce`` ("reduce": ``count`` entries of ``hidden`` fp32) on ``num_sms`` blocks, exit barrier.
    ``generation``: this call's number (>= 1, the same on every rank); the barriers wait for ``2g - 1`` and ``2g``."""
    if kind not in ("copy", "reduce"):
        raise EPValueError(f"kind: expected 'copy' or 'reduce', got {kind!r}")
    if num_sms < 1 or not 1 <= num_ranks <= 1024 or generation < 1:
        raise EPValueError(f"lb launch: num_sms {num_sms}, num_ranks {num_ranks}, generation {generation}")
    block = max(32, -(-num_ranks // 32) * 32)
    barrier = [sync_table, rank, num_ranks, 2 * generation - 1, timeout_ms, herr, TAG_ENTRY]
    _KERNELS.launch("ep_lb_barrier", 1, block, barrier, device=device, stream=stream)
    if count:
        if kind == "copy":
            _KERNELS.launch(
                "ep_lb_copy", num_sms, BLOCK_THREADS, [table, count, herr], device=device, stream=stream
            )
        else:
            values = [table, count, hidden, herr]
            _KERNELS.launch("ep_lb_reduce", num_sms, BLOCK_THREADS, values, device=device, stream=stream)
    barrier[3], barrier[6] = 2 * generation, TAG_EXIT
    _KERNELS.launch("ep_lb_barrier", 1, block, barrier, device=device, stream=stream)
