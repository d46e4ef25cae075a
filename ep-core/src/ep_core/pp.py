"""Pipeline-parallel send/recv on a ring (DeepEP V2's `pp_*`): sizes, configuration, slot layout, checks, and a
numpy reference of the protocol.

A rank talks only to its ring neighbours `prev = (rank - 1) % N` and `next = (rank + 1) % N`. Between a sender and
a receiver there is one FIFO of `num_max_inflight_tensors` slots of `num_max_tensor_bytes` (aligned to 32): the
k-th tensor goes to slot `k % inflight`; a send waits until the receiver released the slot of tensor
`k - inflight`, a receive until tensor k arrived, then copies it out and releases the slot. Matched by order, never
by tag. The data region holds four slot arrays: `[recv from side 0 | recv from side 1 | send staging to side 0 |
send staging to side 1]`, side 0 the prev neighbour, side 1 the next (with two ranks, DeepEP's rule: a sender uses
its "next" side, the receiver its "prev"); hence the size hint `align(align(bytes, 32) * inflight * 2 * 2, 2 MiB)`.
The copy-engine path writes straight into the receiver's slot and leaves the staging half unused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ep_core.errors import EPStateError, EPTimeoutError, EPValueError

__all__ = [
    "PP_TENSOR_ALIGN_BYTES",
    "PPConfig",
    "PPReferenceRing",
    "get_pp_buffer_size_hint",
    "make_pp_config",
    "recv_side",
    "send_side",
]

#: per-tensor slot alignment (one 256-bit load)
PP_TENSOR_ALIGN_BYTES = 32
_BUFFER_ALIGN = 2 << 20


def _align(a: int, b: int) -> int:
    return -(-a // b) * b


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise EPValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Buffer bytes for PP: `align(align(bytes, 32) * inflight * 2 (send, recv) * 2 (prev, next), 2 MiB)`."""
    b = _positive_int("num_max_tensor_bytes", num_max_tensor_bytes)
    n = _positive_int("num_max_inflight_tensors", num_max_inflight_tensors)
    return _align(_align(b, PP_TENSOR_ALIGN_BYTES) * n * 2 * 2, _BUFFER_ALIGN)


def send_side(rank: int, dst: int, num_ranks: int) -> int:
    """The side (0 = prev, 1 = next) under which `rank` sends to `dst`."""
    return 1 if dst == (rank + 1) % num_ranks else 0


def recv_side(rank: int, src: int, num_ranks: int) -> int:
    """The side (0 = prev, 1 = next) under which `rank` receives from `src` (the receive slot array it uses)."""
    return 0 if rank == (src + 1) % num_ranks else 1


@dataclass(frozen=True)
class PPConfig:
    """What `pp_set_config` fixed on one rank."""

    rank: int
    num_ranks: int
    num_max_tensor_bytes: int  # aligned to 32
    num_max_inflight_tensors: int

    @property
    def prev_rank(self) -> int:
        return (self.rank + self.num_ranks - 1) % self.num_ranks

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.num_ranks

    @property
    def num_bytes(self) -> int:
        """Bytes of the data region the four slot arrays cover."""
        return self.num_max_tensor_bytes * self.num_max_inflight_tensors * 4

    def slot_offset(self, array: int, slot: int) -> int:
        """Byte offset (in the data region) of `slot` of slot array `array` (0, 1: receive sides; 2, 3: staging)."""
        return (array * self.num_max_inflight_tensors + slot) * self.num_max_tensor_bytes

    def recv_slot_offset(self, side: int, slot: int) -> int:
        return self.slot_offset(side, slot)

    def check_peer(self, name: str, peer: Any) -> int:
        """`peer` as an int, or `EPValueError` unless it is this rank's prev or next neighbour."""
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise EPValueError(f"{name}: expected an int rank, got {peer!r} (rank {self.rank})")
        p = int(peer)
        if p not in (self.prev_rank, self.next_rank):
            raise EPValueError(
                f"{name}: rank {self.rank} can only exchange with its ring neighbours (prev {self.prev_rank}, next "
                f"{self.next_rank}) of {self.num_ranks} ranks, got {p}"
            )
        return p

    def check_nbytes(self, name: str, nbytes: int) -> None:
        if nbytes > self.num_max_tensor_bytes:
            raise EPValueError(
                f"{name}: {nbytes} bytes exceed num_max_tensor_bytes ({self.num_max_tensor_bytes}, set by "
                f"pp_set_config) on rank {self.rank}"
            )


def make_pp_config(
    rank: int, num_ranks: int, num_buffer_bytes: int, num_max_tensor_bytes: Any, num_max_inflight_tensors: Any
) -> PPConfig:
    """Validate `pp_set_config`'s arguments against the buffer (`num_buffer_bytes`: its data region)."""
    b = _positive_int("num_max_tensor_bytes", num_max_tensor_bytes)
    n = _positive_int("num_max_inflight_tensors", num_max_inflight_tensors)
    cfg = PPConfig(rank, num_ranks, _align(b, PP_TENSOR_ALIGN_BYTES), n)
    if cfg.num_bytes > num_buffer_bytes:
        raise EPValueError(
            f"num_max_tensor_bytes/num_max_inflight_tensors: align({b}, 32) * {n} * 4 = {cfg.num_bytes} bytes exceed "
            f"the buffer ({num_buffer_bytes} bytes) on rank {rank}; size the buffer with get_pp_buffer_size_hint()"
        )
    return cfg


def require_config(cfg: PPConfig | None, op: str, rank: int) -> PPConfig:
    if cfg is None:
        raise EPStateError(f"{op}: call pp_set_config() first (rank {rank})")
    return cfg


@dataclass
class _Fifo:
    sent: int = 0  # tensors the sender wrote
    received: int = 0  # tensors the receiver copied out (= slots released)
    sizes: deque = field(default_factory=deque)


class PPReferenceRing:
    """The PP protocol for `num_ranks` ranks in one process over numpy buffers (the CPU reference and the oracle).

    Each rank has a data region laid out as `PPConfig` says. `send` copies into the receiver's slot (as the
    copy-engine path does) and `recv` copies out of its own; a send into a full FIFO or a receive from an empty one
    would wait forever in one thread, so they raise `EPTimeoutError` (the GPU path waits, bounded, instead).
    """

    def __init__(self, num_ranks: int, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        n = _positive_int("num_ranks", num_ranks)
        hint = get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)
        self.configs = [
            make_pp_config(r, n, hint, num_max_tensor_bytes, num_max_inflight_tensors) for r in range(n)
        ]
        self.regions = [np.zeros(hint, dtype=np.uint8) for _ in range(n)]
        self._fifos: dict[tuple[int, int], _Fifo] = {}

    def _fifo(self, src: int, dst: int) -> _Fifo:
        return self._fifos.setdefault((src, dst), _Fifo())

    def send(self, rank: int, x: np.ndarray, dst_rank_idx: int) -> None:
        cfg = self.configs[rank]
        dst = cfg.check_peer("dst_rank_idx", dst_rank_idx)
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        cfg.check_nbytes("t", raw.nbytes)
        fifo = self._fifo(rank, dst)
        if fifo.sent - fifo.received >= cfg.num_max_inflight_tensors:
            raise EPTimeoutError(
                rank,
                "pp_send",
                f"slot release from rank {dst}",
                fifo.received,
                f"pp_send: rank {rank} -> {dst} has {cfg.num_max_inflight_tensors} tensors in flight "
                "(num_max_inflight_tensors) and the receiver released none: it would wait forever",
            )
        side = recv_side(dst, rank, cfg.num_ranks)
        off = cfg.recv_slot_offset(side, fifo.sent % cfg.num_max_inflight_tensors)
        self.regions[dst][off : off + raw.nbytes] = raw
        fifo.sizes.append(raw.nbytes)
        fifo.sent += 1

    def recv(self, rank: int, out: np.ndarray, src_rank_idx: int) -> None:
        cfg = self.configs[rank]
        src = cfg.check_peer("src_rank_idx", src_rank_idx)
        if not out.flags.c_contiguous:
            raise EPValueError(f"t: expected a contiguous array (rank {rank})")
        raw = out.reshape(-1).view(np.uint8)
        cfg.check_nbytes("t", raw.nbytes)
        fifo = self._fifo(src, rank)
        if fifo.received >= fifo.sent:
            raise EPTimeoutError(
                rank,
                "pp_recv",
                f"tensor {fifo.received} from rank {src}",
                fifo.sent,
                f"pp_recv: rank {rank} waits for tensor {fifo.received} from rank {src}, which sent "
                f"{fifo.sent}: it would wait forever",
            )
        sent_bytes = fifo.sizes.popleft()
        if sent_bytes != raw.nbytes:
            fifo.received += 1  # the slot is consumed either way: the FIFO stays in step
            raise EPValueError(
                f"t: rank {rank} receives {raw.nbytes} bytes but rank {src} sent {sent_bytes} (tensor "
                f"{fifo.received - 1} of that FIFO); pp_send and pp_recv must use tensors of the same size"
            )
        side = recv_side(rank, src, cfg.num_ranks)
        off = cfg.recv_slot_offset(side, fifo.received % cfg.num_max_inflight_tensors)
        raw[:] = self.regions[rank][off : off + raw.nbytes]
        fifo.received += 1
