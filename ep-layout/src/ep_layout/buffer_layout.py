"""``BufferLayout``: a dense ``[num_ranks][num_tokens_per_rank]`` array of tokens (``ep_layout/buffer_layout.cuh``)."""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int
from .token_layout import TokenLayout

__all__ = ["BufferLayout"]


@dataclass(frozen=True)
class BufferLayout:
    """Offsets of a ``[num_ranks][num_tokens_per_rank]`` token buffer.

    ``with_mbarrier`` mirrors ``BufferLayout<true>`` (shared-memory staging); symmetric buffers never use it.
    """

    token_layout: TokenLayout
    num_ranks: int
    num_tokens_per_rank: int
    with_mbarrier: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.token_layout, TokenLayout):
            raise TypeError(f"token_layout: expected a TokenLayout, got {type(self.token_layout).__name__}")
        object.__setattr__(self, "num_ranks", check_int("num_ranks", self.num_ranks))
        object.__setattr__(
            self, "num_tokens_per_rank", check_int("num_tokens_per_rank", self.num_tokens_per_rank)
        )
        object.__setattr__(self, "with_mbarrier", bool(self.with_mbarrier))

    def get_num_bytes_per_token(self) -> int:
        return self.token_layout.get_num_bytes(with_mbarrier=self.with_mbarrier)

    def get_num_bytes_per_rank(self) -> int:
        return self.get_num_bytes_per_token() * self.num_tokens_per_rank

    def get_num_bytes(self) -> int:
        """``num_ranks * num_tokens_per_rank * token_bytes``."""
        return self.get_num_bytes_per_rank() * self.num_ranks

    def get_rank_offset(self, rank: int) -> int:
        return self.get_num_bytes_per_rank() * rank

    def get_token_offset(self, rank: int, token: int) -> int:
        return self.get_rank_offset(rank) + self.get_num_bytes_per_token() * token

    def get_channel_offset(self, channel: int, num_tokens_per_channel: int) -> int:
        """Base shift of the channel view: channel ``c`` owns slots ``[c*T, (c+1)*T)`` of every rank region."""
        return self.get_num_bytes_per_token() * channel * num_tokens_per_channel
