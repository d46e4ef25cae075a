"""``TokenLayout``: the bytes of one token, mirroring ``ep_layout/token_layout.cuh`` exactly.

A token is ``[hidden | sf | metadata | mbarrier?]``, every part aligned to 32 bytes. Metadata holds K int32 top-k
ids and K float32 weights; with ``with_metadata`` also one int32 source token index and K int32 linked-list indices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int
from ._math import NUM_TMA_ALIGN_BYTES, align

__all__ = [
    "NUM_MAX_TOPK",
    "NUM_MBARRIER_BYTES",
    "NUM_TMA_ALIGN_BYTES",
    "TokenLayout",
    "make_combine_token_layout",
    "make_dispatch_token_layout",
]

NUM_MAX_TOPK = 32
"""Largest supported top-k (``kNumMaxTopk``)."""

NUM_MBARRIER_BYTES = 8
"""Bytes of the shared-memory mbarrier; a token reserves ``align(8, 32) = 32`` bytes for it."""


@dataclass(frozen=True)
class TokenLayout:
    """Layout of one token.

    Args:
        num_hidden_bytes: bytes of the hidden part (hidden * element size); > 0 and a multiple of 32.
        num_sf_bytes: bytes of the scale packs (packs * 4); >= 0 and a multiple of 4.
        num_topk: K, 0..32.
        with_metadata: also carry the source token index and K linked-list indices.
    """

    num_hidden_bytes: int
    num_sf_bytes: int
    num_topk: int
    with_metadata: bool

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "num_hidden_bytes",
            check_int(
                "num_hidden_bytes",
                self.num_hidden_bytes,
                lo=NUM_TMA_ALIGN_BYTES,
                multiple_of=NUM_TMA_ALIGN_BYTES,
            ),
        )
        object.__setattr__(self, "num_sf_bytes", check_int("num_sf_bytes", self.num_sf_bytes, multiple_of=4))
        object.__setattr__(self, "num_topk", check_int("num_topk", self.num_topk, hi=NUM_MAX_TOPK))
        object.__setattr__(self, "with_metadata", bool(self.with_metadata))
        check_int("token bytes", self.get_num_bytes(with_mbarrier=True))

    # Sizes (bytes)

    def get_num_metadata_bytes(self) -> int:
        """Unaligned metadata bytes: ``K * 8 + (with_metadata ? (1 + K) * 4 : 0)``."""
        return self.num_topk * 8 + ((1 + self.num_topk) * 4 if self.with_metadata else 0)

    def get_num_bytes(self, with_mbarrier: bool = False) -> int:
        """Bytes of one token, with the 32-byte mbarrier slot if ``with_mbarrier`` (shared-memory staging)."""
        return self.get_end_offset() + (
            align(NUM_MBARRIER_BYTES, NUM_TMA_ALIGN_BYTES) if with_mbarrier else 0
        )

    # Offsets within a token (bytes)

    def get_hidden_offset(self) -> int:
        return 0

    def get_sf_offset(self) -> int:
        return align(self.num_hidden_bytes, NUM_TMA_ALIGN_BYTES)

    def get_metadata_offset(self) -> int:
        return self.get_sf_offset() + align(self.num_sf_bytes, NUM_TMA_ALIGN_BYTES)

    def get_topk_idx_offset(self) -> int:
        return self.get_metadata_offset()

    def get_topk_weights_offset(self) -> int:
        return self.get_metadata_offset() + 4 * self.num_topk

    def get_src_token_idx_offset(self) -> int:
        """Only meaningful with ``with_metadata``."""
        return self.get_metadata_offset() + 8 * self.num_topk

    def get_linked_list_idx_offset(self) -> int:
        """Only meaningful with ``with_metadata``."""
        return self.get_metadata_offset() + 8 * self.num_topk + 4

    def get_mbarrier_offset(self) -> int:
        """Only meaningful for shared-memory staging."""
        return self.get_end_offset()

    def get_end_offset(self) -> int:
        """Token size without the mbarrier."""
        return self.get_metadata_offset() + align(self.get_num_metadata_bytes(), NUM_TMA_ALIGN_BYTES)

    def offsets(self) -> dict[str, int]:
        """Every field offset by name (the same names as the C++ getters without ``get_`` / ``_offset``)."""
        return {
            "hidden": self.get_hidden_offset(),
            "sf": self.get_sf_offset(),
            "topk_idx": self.get_topk_idx_offset(),
            "topk_weights": self.get_topk_weights_offset(),
            "src_token_idx": self.get_src_token_idx_offset(),
            "linked_list_idx": self.get_linked_list_idx_offset(),
            "mbarrier": self.get_mbarrier_offset(),
        }


def make_dispatch_token_layout(hidden: int, elem_size: int, num_sf_packs: int, num_topk: int) -> TokenLayout:
    """Dispatch token: ``TokenLayout(hidden * elem_size, num_sf_packs * 4, K, True)``."""
    return TokenLayout(hidden * elem_size, num_sf_packs * 4, num_topk, True)


def make_combine_token_layout(hidden: int, num_topk: int) -> TokenLayout:
    """Combine token: ``TokenLayout(hidden * 2, 0, K, False)`` (bf16, no scales)."""
    return TokenLayout(hidden * 2, 0, num_topk, False)
