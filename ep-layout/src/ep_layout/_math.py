"""Integer helpers mirroring ``ep_layout/math.cuh`` (private)."""

from __future__ import annotations

NUM_TMA_ALIGN_BYTES = 32
"""Alignment of every token part and token (``kNumTMAAlignBytes``)."""

NUM_SYMMETRIC_ALIGN_BYTES = 2 * 1024 * 1024
"""Granularity of the symmetric allocation (``kNumSymmetricAlignBytes``)."""


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b
