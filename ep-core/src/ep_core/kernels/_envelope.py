"""The kernel-side operation envelope (`OpArgs::envelope`, checked in barrier.cuh `cross_rank_barrier`): one 64-bit
word per dispatch / combine launch, `(kind << 56) | (seq & 0xffffff) << 32 | digest32` (the operation kind, never 0;
this rank's sequence number of collective launches; a digest of the configuration every rank must share). The entry
barrier leaves it in every peer's workspace and compares: a peer in another operation, step or shape is recorded as
`ErrorKind.ENVELOPE_MISMATCH` naming it, so the launch stops at once instead of pairing data of different calls.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["OP_COMBINE", "OP_DISPATCH", "describe_envelope", "pack_envelope"]

OP_DISPATCH = 1
OP_COMBINE = 2
_OP_NAMES = {OP_DISPATCH: "dispatch", OP_COMBINE: "combine"}
_SEQ_MASK = 0xFFFFFF


def pack_envelope(kind: int, seq: int, fields: tuple[int, ...]) -> int:
    """The envelope word of one launch; `fields` are the integers that must agree across ranks."""
    digest = zlib.crc32(struct.pack(f"<{len(fields)}q", *fields))
    return (kind << 56) | ((seq & _SEQ_MASK) << 32) | digest


def describe_envelope(word: int) -> str:
    """`word` for an error message: the operation, the sequence number and the digest."""
    word &= (1 << 64) - 1
    kind = word >> 56
    return f"{_OP_NAMES.get(kind, f'kind {kind}')} #{(word >> 32) & _SEQ_MASK} (config digest {word & 0xFFFFFFFF:08x})"
