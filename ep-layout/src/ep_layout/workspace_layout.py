"""``WorkspaceLayout``: the fixed-size control region of every rank's symmetric buffer (``workspace_layout.cuh``).

The layout is independent of the configuration; every byte is zero between operations (the allocator zeroes it
once, kernels reset what they use), except ``error_record`` after a failure, which the host reads and zeroes.
Regions start on 128-byte boundaries, in the order of ``WORKSPACE_REGIONS``. See the package README for who writes
and who reads each region.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._math import NUM_SYMMETRIC_ALIGN_BYTES, align
from .errors import LayoutValueError

__all__ = [
    "COUNT_VALID_FLAG",
    "ERROR_RECORD_FIELDS",
    "NUM_BARRIER_PHASES",
    "NUM_ERROR_RECORD_BYTES",
    "NUM_MAX_CHANNELS",
    "NUM_MAX_EXPERTS",
    "NUM_MAX_EXPERTS_PER_RANK",
    "NUM_MAX_RANKS",
    "NUM_RESERVED_BYTES",
    "NUM_WORKSPACE_BYTES",
    "NUM_WORKSPACE_REGION_ALIGN_BYTES",
    "WORKSPACE_REGIONS",
    "ErrorKind",
    "ErrorRecordField",
    "WorkspaceLayout",
    "WorkspaceRegion",
]

NUM_MAX_RANKS = 1024
NUM_MAX_EXPERTS = 2048
NUM_MAX_EXPERTS_PER_RANK = 256
NUM_MAX_CHANNELS = 1024
"""Workspace channel limit (per-channel tails); distinct from ``NUM_MAX_HYBRID_CHANNELS`` (1280)."""
NUM_BARRIER_PHASES = 8
NUM_WORKSPACE_BYTES = 14 << 20
"""Bytes of the whole workspace (``kNumWorkspaceBytes``); ``reserved`` takes what the other regions leave."""
NUM_WORKSPACE_REGION_ALIGN_BYTES = 128
COUNT_VALID_FLAG = 1 << 32
"""Count words are written as ``COUNT_VALID_FLAG | count`` so that zero means "not arrived yet"."""
NUM_ERROR_RECORD_BYTES = 64


class ErrorKind(enum.IntEnum):
    """Values of ``ErrorRecord.abort_flag`` (pinned; ``ep_layout::ErrorKind``)."""

    NONE = 0
    TIMEOUT = 1
    PEER_ABORT = 2
    INVALID_EXPERT = 3
    DUPLICATE_EXPERT = 4
    CAPACITY = 5
    ENVELOPE_MISMATCH = 6


class ErrorRecordField(NamedTuple):
    name: str
    offset: int
    dtype: str  # "int32" or "int64"


ERROR_RECORD_FIELDS: tuple[ErrorRecordField, ...] = (
    ErrorRecordField("abort_flag", 0, "int32"),
    ErrorRecordField("rank", 4, "int32"),
    ErrorRecordField("peer_rank", 8, "int32"),
    ErrorRecordField("tag", 12, "int32"),
    ErrorRecordField("counter", 16, "int64"),
    ErrorRecordField("value", 24, "int64"),
    ErrorRecordField("expected", 32, "int64"),
    ErrorRecordField("token_idx", 40, "int32"),
    ErrorRecordField("lane", 44, "int32"),
)
"""Fields of the 64-byte ``ErrorRecord`` (bytes 48..63 reserved)."""


class WorkspaceRegion(NamedTuple):
    """One workspace region: ``name`` (C++ ``WorkspaceRegion::k<CamelName>``), byte ``offset`` from the workspace
    base, ``num_elems`` elements of ``elem_bytes`` bytes, ``dtype`` (``int32``, ``int64``, ``uint8`` or
    ``error_record``)."""

    name: str
    offset: int
    num_elems: int
    elem_bytes: int
    dtype: str

    @property
    def num_bytes(self) -> int:
        return self.num_elems * self.elem_bytes


_DTYPE_BYTES = {"int32": 4, "int64": 8, "uint8": 1, "error_record": NUM_ERROR_RECORD_BYTES}

# (name, dtype, num_elems) in memory order; mirrors workspace_region_elem_bytes / workspace_region_num_elems.
_REGION_SPECS: tuple[tuple[str, str, int], ...] = (
    ("barrier_signals", "int32", NUM_BARRIER_PHASES * NUM_MAX_RANKS),
    ("notify_reduction", "int64", NUM_MAX_RANKS + NUM_MAX_EXPERTS),
    ("rank_count_send", "int64", NUM_MAX_RANKS),
    ("rank_count_recv", "int64", NUM_MAX_RANKS),
    ("expert_count_send", "int64", NUM_MAX_EXPERTS),
    ("expert_count_recv", "int64", NUM_MAX_EXPERTS),
    ("scaleout_rank_count_send", "int64", NUM_MAX_RANKS),
    ("scaleout_rank_count_recv", "int64", NUM_MAX_RANKS),
    ("scaleout_expert_count_send", "int64", NUM_MAX_EXPERTS),
    ("scaleout_expert_count_recv", "int64", NUM_MAX_EXPERTS),
    ("sender_slot_counters", "int32", NUM_MAX_RANKS),
    ("scaleout_sender_slot_counters", "int32", NUM_MAX_RANKS),
    ("error_record", "error_record", 1),
    ("channel_tails", "int32", NUM_MAX_CHANNELS * NUM_MAX_RANKS),
    ("scaleout_channel_tails", "int64", NUM_MAX_CHANNELS * NUM_MAX_RANKS),
    ("reserved", "uint8", -1),  # the rest of NUM_WORKSPACE_BYTES
)


def _build_regions() -> tuple[tuple[WorkspaceRegion, ...], int]:
    regions = []
    offset = 0
    for name, dtype, num_elems in _REGION_SPECS:
        if num_elems < 0:
            num_elems = NUM_WORKSPACE_BYTES - offset
        region = WorkspaceRegion(name, offset, num_elems, _DTYPE_BYTES[dtype], dtype)
        regions.append(region)
        offset = align(offset + region.num_bytes, NUM_WORKSPACE_REGION_ALIGN_BYTES)
    return tuple(regions), offset


WORKSPACE_REGIONS, _NUM_BYTES = _build_regions()
"""Every region in memory order."""
_BY_NAME = {r.name: r for r in WORKSPACE_REGIONS}
NUM_RESERVED_BYTES = _BY_NAME["reserved"].num_bytes
"""Bytes of the ``reserved`` region (``kNumReservedBytes``, 1,933,184): later features and kernel-private scratch."""


class WorkspaceLayout:
    """Offsets of the workspace regions (class-level; there is nothing per instance).

    ``WorkspaceLayout.BARRIER_SIGNALS_OFFSET`` / ``BARRIER_SIGNALS_NUM_ELEMS`` etc. mirror C++
    ``WorkspaceLayout::kBarrierSignalsOffset`` / ``kBarrierSignalsNumElems``;
    ``region(name)`` gives offset, element count and type.
    """

    BARRIER_SIGNALS_OFFSET = _BY_NAME["barrier_signals"].offset
    NOTIFY_REDUCTION_OFFSET = _BY_NAME["notify_reduction"].offset
    RANK_COUNT_SEND_OFFSET = _BY_NAME["rank_count_send"].offset
    RANK_COUNT_RECV_OFFSET = _BY_NAME["rank_count_recv"].offset
    EXPERT_COUNT_SEND_OFFSET = _BY_NAME["expert_count_send"].offset
    EXPERT_COUNT_RECV_OFFSET = _BY_NAME["expert_count_recv"].offset
    SCALEOUT_RANK_COUNT_SEND_OFFSET = _BY_NAME["scaleout_rank_count_send"].offset
    SCALEOUT_RANK_COUNT_RECV_OFFSET = _BY_NAME["scaleout_rank_count_recv"].offset
    SCALEOUT_EXPERT_COUNT_SEND_OFFSET = _BY_NAME["scaleout_expert_count_send"].offset
    SCALEOUT_EXPERT_COUNT_RECV_OFFSET = _BY_NAME["scaleout_expert_count_recv"].offset
    SENDER_SLOT_COUNTERS_OFFSET = _BY_NAME["sender_slot_counters"].offset
    SCALEOUT_SENDER_SLOT_COUNTERS_OFFSET = _BY_NAME["scaleout_sender_slot_counters"].offset
    ERROR_RECORD_OFFSET = _BY_NAME["error_record"].offset
    CHANNEL_TAILS_OFFSET = _BY_NAME["channel_tails"].offset
    SCALEOUT_CHANNEL_TAILS_OFFSET = _BY_NAME["scaleout_channel_tails"].offset
    RESERVED_OFFSET = _BY_NAME["reserved"].offset
    BARRIER_SIGNALS_NUM_ELEMS = _BY_NAME["barrier_signals"].num_elems
    NOTIFY_REDUCTION_NUM_ELEMS = _BY_NAME["notify_reduction"].num_elems
    RANK_COUNT_SEND_NUM_ELEMS = _BY_NAME["rank_count_send"].num_elems
    RANK_COUNT_RECV_NUM_ELEMS = _BY_NAME["rank_count_recv"].num_elems
    EXPERT_COUNT_SEND_NUM_ELEMS = _BY_NAME["expert_count_send"].num_elems
    EXPERT_COUNT_RECV_NUM_ELEMS = _BY_NAME["expert_count_recv"].num_elems
    SCALEOUT_RANK_COUNT_SEND_NUM_ELEMS = _BY_NAME["scaleout_rank_count_send"].num_elems
    SCALEOUT_RANK_COUNT_RECV_NUM_ELEMS = _BY_NAME["scaleout_rank_count_recv"].num_elems
    SCALEOUT_EXPERT_COUNT_SEND_NUM_ELEMS = _BY_NAME["scaleout_expert_count_send"].num_elems
    SCALEOUT_EXPERT_COUNT_RECV_NUM_ELEMS = _BY_NAME["scaleout_expert_count_recv"].num_elems
    SENDER_SLOT_COUNTERS_NUM_ELEMS = _BY_NAME["sender_slot_counters"].num_elems
    SCALEOUT_SENDER_SLOT_COUNTERS_NUM_ELEMS = _BY_NAME["scaleout_sender_slot_counters"].num_elems
    ERROR_RECORD_NUM_ELEMS = _BY_NAME["error_record"].num_elems
    CHANNEL_TAILS_NUM_ELEMS = _BY_NAME["channel_tails"].num_elems
    SCALEOUT_CHANNEL_TAILS_NUM_ELEMS = _BY_NAME["scaleout_channel_tails"].num_elems
    RESERVED_NUM_ELEMS = _BY_NAME["reserved"].num_elems
    NUM_BYTES = _NUM_BYTES
    """End of the last region."""
    NUM_ALIGNED_BYTES = align(_NUM_BYTES, NUM_SYMMETRIC_ALIGN_BYTES)
    """Bytes the workspace takes in the symmetric allocation (14 MiB); the GPU buffer starts here."""

    @staticmethod
    def get_num_bytes() -> int:
        return WorkspaceLayout.NUM_BYTES

    @staticmethod
    def get_num_aligned_bytes() -> int:
        return WorkspaceLayout.NUM_ALIGNED_BYTES

    @staticmethod
    def regions() -> tuple[WorkspaceRegion, ...]:
        return WORKSPACE_REGIONS

    @staticmethod
    def region(name: str) -> WorkspaceRegion:
        try:
            return _BY_NAME[name]
        except KeyError:
            raise LayoutValueError(f"region: expected one of {sorted(_BY_NAME)}, got {name!r}") from None

    @staticmethod
    def get_offset(name: str) -> int:
        return WorkspaceLayout.region(name).offset

    @staticmethod
    def get_num_elems(name: str) -> int:
        return WorkspaceLayout.region(name).num_elems

    @staticmethod
    def get_barrier_signal_offset(phase: int, src_rank: int) -> int:
        """Byte offset of the signal that ``src_rank`` bumps for barrier ``phase``."""
        return WorkspaceLayout.BARRIER_SIGNALS_OFFSET + 4 * (phase * NUM_MAX_RANKS + src_rank)

    @staticmethod
    def get_channel_tail_offset(channel: int, rank: int, num_ranks: int) -> int:
        """Byte offset of the (channel, rank) tail, dense index ``channel * num_ranks + rank``."""
        return WorkspaceLayout.CHANNEL_TAILS_OFFSET + 4 * (channel * num_ranks + rank)

    @staticmethod
    def get_error_record_field_offset(field: str) -> int:
        for f in ERROR_RECORD_FIELDS:
            if f.name == field:
                return WorkspaceLayout.ERROR_RECORD_OFFSET + f.offset
        raise LayoutValueError(
            f"field: expected one of {[f.name for f in ERROR_RECORD_FIELDS]}, got {field!r}"
        )
