"""The bf16 reduce-scatter of ``BucketBuffer`` (host side of ``include/ep_core/bucket_bf16.cuh``): DeepEP 2.5's
arithmetic, in numpy (`pack` / `reduce`: the CPU reference backend runs them, and they are the kernels' oracle)
and as two kernels over the peers' mapped memory (`launch`, queued by ep-torch's copy-engine backend between its
two stream barriers).

Each sender rounds the shards other ranks own (``ep_core.bf16.stochastic_bits``) and packs them in place: element
``j`` of a shard goes to bf16 slot ``(j // tile) * 2 * tile + j % tile`` (the front half of each ``tile`` of fp32,
DeepEP's chunks: ``tile_elems``); the rest of those shards' bytes stay as they were. The owner adds, in float32, to
its own shard the peers' bf16, ranks ``rank-1, rank-2, ...`` (cyclic), then multiplies by the scale unless it is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ep_core.bf16 import bf16_to_float32, stochastic_bits
from ep_core.kernel_set import KernelSet

__all__ = [
    "BLOCK_THREADS",
    "KERNEL_NAMES",
    "SIGNATURES",
    "compile_bucket_bf16",
    "launch",
    "pack",
    "packed",
    "reduce",
    "tile_elems",
]

BLOCK_THREADS = 512  # ep_core::bucket_bf16::kBlockThreads
SIGNATURES: dict[str, str] = {
    "ep_bucket_bf16_pack": "pipiii",  # entries [E][2], E, base, rank, num_ranks, tile
    "ep_bucket_bf16_reduce": "pipiiii",  # entries [E][2], E, bases [N], rank, num_ranks, tile, scale bits
}
KERNEL_NAMES = tuple(SIGNATURES)
_KERNELS = KernelSet("ep_core_bucket_bf16", "#include <ep_core/bucket_bf16.cuh>\n", SIGNATURES, {})
compile_bucket_bf16 = _KERNELS.compile


def tile_elems(num_ranks: int) -> int:
    """fp32 elements a packing tile: DeepEP's chunk (64 KiB of bf16 up to 8 ranks, 32 KiB beyond)."""
    return 32768 if num_ranks <= 8 else 16384


def _slots(m: int, tile: int) -> np.ndarray:
    j = np.arange(m, dtype=np.int64)
    return (j // tile) * 2 * tile + j % tile


def pack(x: np.ndarray, rank: int, num_ranks: int) -> None:
    """The sender's step, in place: every shard ``q != rank`` of the float32 array ``x`` (1-D, ``num_ranks``
    shards of a multiple of 8) becomes its packed bf16."""
    m = x.size // num_ranks
    bits, u16, slots = stochastic_bits(x), x.view(np.uint16), _slots(m, tile_elems(num_ranks))
    for q in range(num_ranks):
        if q != rank:
            u16[2 * q * m + slots] = bits[q * m : (q + 1) * m]


def packed(shard: np.ndarray, m: int, num_ranks: int) -> np.ndarray:
    """The ``m`` bf16 bits (uint16) that a packed shard (its bytes, any dtype) holds."""
    return shard.view(np.uint16)[_slots(m, tile_elems(num_ranks))]


def reduce(own: np.ndarray, peers: Sequence[np.ndarray], scale: float) -> np.ndarray:
    """The owner's step: ``own`` (float32) + each of ``peers`` (bf16 bits, ranks ``rank-1, rank-2, ...``) in
    float32, times ``scale`` (as float32) unless it is 1."""
    acc = np.array(own, dtype=np.float32)
    with np.errstate(all="ignore"):
        for bits in peers:
            acc += bf16_to_float32(bits)
        if float(scale) != 1.0:
            acc *= np.float32(scale)
    return acc


def launch(kind: str, entries: int, num_entries: int, bases: int, base: int, rank: int, num_ranks: int,
           scale: float, *, num_sms: int, device: int, stream: int) -> None:  # fmt: skip
    """Queue ``ep_bucket_bf16_pack`` (``kind`` "pack") or ``ep_bucket_bf16_reduce`` ("reduce") on ``stream``:
    ``entries`` a device int64 ``[num_entries][2]`` (byte offset in the data region, elements a shard), ``bases``
    a device int64 ``[num_ranks]`` (every rank's data region as mapped here), ``base`` this rank's."""
    values = [entries, num_entries, base if kind == "pack" else bases, rank, num_ranks, tile_elems(num_ranks)]
    if kind != "pack":
        values.append(int(np.float32(scale).view(np.int32)))
    _KERNELS.launch(
        f"ep_bucket_bf16_{kind}", max(1, num_sms), BLOCK_THREADS, values, device=device, stream=stream
    )
