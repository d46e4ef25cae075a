"""Where a zero-copy dispatch leaves its outputs in a rank's receive region (`dispatch(..., zero_copy=True)`).

The mirror of include/ep_core/zero_copy_rows.cuh: for R = N * M rows, each array 128-byte aligned, `recv_x`
[R, hidden bytes] at offset 0, scale packs uint32 [R, P], top-k ids int64 [R, K], weights float32 [R, K], then two
int32 words per row for the handle's metadata. The views a call returns are the first rows of each array.
"""

from __future__ import annotations

from dataclasses import dataclass

import ep_layout

__all__ = ["ZeroCopyRows"]

ALIGN = 128


@dataclass(frozen=True)
class ZeroCopyRows:
    rows: int  # R = N * M
    hidden_bytes: int
    num_sf_packs: int
    num_topk: int

    @property
    def sf_offset(self) -> int:
        return ep_layout.align(self.rows * self.hidden_bytes, ALIGN)

    @property
    def topk_idx_offset(self) -> int:
        return ep_layout.align(self.sf_offset + self.rows * self.num_sf_packs * 4, ALIGN)

    @property
    def weights_offset(self) -> int:
        return ep_layout.align(self.topk_idx_offset + self.rows * self.num_topk * 8, ALIGN)

    @property
    def meta_offset(self) -> int:
        return ep_layout.align(self.weights_offset + self.rows * self.num_topk * 4, ALIGN)

    @property
    def num_bytes(self) -> int:
        return self.meta_offset + self.rows * 8
