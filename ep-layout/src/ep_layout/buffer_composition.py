"""Direct and hybrid dispatch/combine buffer compositions and the size hint (``ep_layout/buffer_composition.cuh``).

Offsets are relative to the start of the GPU buffer, which follows the 2 MiB-aligned workspace in the symmetric
allocation ``[workspace | GPU buffer | CPU buffer]``. Parts follow each other in the listed order, without padding:

- direct dispatch: ``recv [N][M]`` then ``send [nvl ? 0 : 1][M]``;
- direct combine: ``recv [slots(N)][M]`` then ``send [nvl ? 0 : N][M * (amr ? 1 : K)]``;
- hybrid dispatch: ``scaleup_recv [S_u][S_o*M]``, ``scaleout_send [1][M]``, ``scaleout_recv [S_o][M + 1280]``;
- hybrid combine: ``scaleup_recv [slots(S_u)][S_o*M]``, ``scaleout_recv [slots(S_o)][M]``,
  ``scaleout_send [S_o][(amr ? 1 : K) * (M + 1280)]``;

with ``slots(R) = R if amr and R <= K else K``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int
from ._math import NUM_SYMMETRIC_ALIGN_BYTES, align, ceil_div
from .buffer_layout import BufferLayout
from .errors import LayoutValueError
from .token_layout import NUM_MAX_TOPK, TokenLayout, make_combine_token_layout, make_dispatch_token_layout

__all__ = [
    "NUM_MAX_HYBRID_CHANNELS",
    "DirectCombineBuffers",
    "DirectDispatchBuffers",
    "HybridCombineBuffers",
    "HybridDispatchBuffers",
    "Topology",
    "combine_buffer_bytes",
    "combine_buffers",
    "combine_uses_rank_layout",
    "dispatch_buffer_bytes",
    "dispatch_buffers",
    "get_combine_num_recv_slots",
    "get_num_fp8_sf_packs",
    "get_sizing_combine_token",
    "get_sizing_dispatch_token",
    "get_sizing_num_topk",
    "size_hint_bytes",
]

NUM_MAX_HYBRID_CHANNELS = 1280
"""8 channels per SM x 160 SMs (``kNumMaxHybridChannels``); pads the hybrid scale-out buffers."""

_NUM_MAX_RANKS = 1024


@dataclass(frozen=True)
class Topology:
    """Logical rank arrangement: ``num_ranks`` = N, ``num_scaleup_ranks`` = S_u (default N: direct mode)."""

    num_ranks: int
    num_scaleup_ranks: int | None = None
    is_scaleup_nvlink: bool = True

    def __post_init__(self) -> None:
        n = check_int("num_ranks", self.num_ranks, lo=1, hi=_NUM_MAX_RANKS)
        su = (
            n
            if self.num_scaleup_ranks is None
            else check_int("num_scaleup_ranks", self.num_scaleup_ranks, lo=1)
        )
        if n % su:
            raise LayoutValueError(
                f"num_scaleup_ranks: expected a divisor of num_ranks={n}, got {su}; "
                "pass the size of one NVLink domain"
            )
        object.__setattr__(self, "num_ranks", n)
        object.__setattr__(self, "num_scaleup_ranks", su)
        object.__setattr__(self, "is_scaleup_nvlink", bool(self.is_scaleup_nvlink))

    def get_num_scaleout_ranks(self) -> int:
        """S_o = N / S_u."""
        return self.num_ranks // self._su

    def is_hybrid(self) -> bool:
        return self.get_num_scaleout_ranks() > 1

    @property
    def _su(self) -> int:
        assert self.num_scaleup_ranks is not None
        return self.num_scaleup_ranks


def combine_uses_rank_layout(num_ranks: int, num_topk: int, allow_multiple_reduction: bool) -> bool:
    """The combine "rank layout" (one slot per source rank) is used iff ``amr and num_ranks <= num_topk``."""
    return bool(allow_multiple_reduction) and num_ranks <= num_topk


def get_combine_num_recv_slots(num_ranks: int, num_topk: int, allow_multiple_reduction: bool) -> int:
    """Receive slots per token of a combine: ``num_ranks`` in the rank layout, else ``num_topk``."""
    return num_ranks if combine_uses_rank_layout(num_ranks, num_topk, allow_multiple_reduction) else num_topk


class _Composition:
    """Named parts laid out one after another."""

    _PARTS: tuple[str, ...] = ()

    def parts(self) -> tuple[tuple[str, int, BufferLayout], ...]:
        """``(name, offset, layout)`` of every part in memory order."""
        result = []
        offset = 0
        for name in self._PARTS:
            layout: BufferLayout = getattr(self, name)
            result.append((name, offset, layout))
            offset += layout.get_num_bytes()
        return tuple(result)

    def get_offset(self, name: str) -> int:
        for part, offset, _ in self.parts():
            if part == name:
                return offset
        raise LayoutValueError(f"part: expected one of {self._PARTS}, got {name!r}")

    def get_num_bytes(self) -> int:
        return sum(layout.get_num_bytes() for _, _, layout in self.parts())

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{name}=[{layout.num_ranks}][{layout.num_tokens_per_rank}]@{offset}"
            for name, offset, layout in self.parts()
        )
        return f"{type(self).__name__}({inner}, num_bytes={self.get_num_bytes()})"


class DirectDispatchBuffers(_Composition):
    """``recv [N][M]`` at 0, then ``send [nvl ? 0 : 1][M]``."""

    _PARTS = ("recv", "send")

    def __init__(self, token: TokenLayout, topology: Topology, num_max_tokens_per_rank: int) -> None:
        m = num_max_tokens_per_rank
        self.recv = BufferLayout(token, topology.num_ranks, m)
        self.send = BufferLayout(token, 0 if topology.is_scaleup_nvlink else 1, m)

    def get_recv_offset(self) -> int:
        return 0

    def get_send_offset(self) -> int:
        return self.recv.get_num_bytes()


class DirectCombineBuffers(_Composition):
    """``recv [slots(N)][M]`` at 0, then ``send [nvl ? 0 : N][M * (amr ? 1 : K)]``."""

    _PARTS = ("recv", "send")

    def __init__(
        self,
        token: TokenLayout,
        topology: Topology,
        num_max_tokens_per_rank: int,
        allow_multiple_reduction: bool = True,
    ) -> None:
        m, k, amr = num_max_tokens_per_rank, token.num_topk, allow_multiple_reduction
        self.recv = BufferLayout(token, get_combine_num_recv_slots(topology.num_ranks, k, amr), m)
        self.send = BufferLayout(
            token, 0 if topology.is_scaleup_nvlink else topology.num_ranks, m * (1 if amr else k)
        )

    def get_recv_offset(self) -> int:
        return 0

    def get_send_offset(self) -> int:
        return self.recv.get_num_bytes()


class HybridDispatchBuffers(_Composition):
    """``scaleup_recv [S_u][S_o*M]``, ``scaleout_send [1][M]``, ``scaleout_recv [S_o][M + 1280]``."""

    _PARTS = ("scaleup_recv", "scaleout_send", "scaleout_recv")

    def __init__(self, token: TokenLayout, topology: Topology, num_max_tokens_per_rank: int) -> None:
        m, so = num_max_tokens_per_rank, topology.get_num_scaleout_ranks()
        self.scaleup_recv = BufferLayout(token, topology.num_ranks // so, so * m)
        self.scaleout_send = BufferLayout(token, 1, m)
        self.scaleout_recv = BufferLayout(token, so, m + NUM_MAX_HYBRID_CHANNELS)

    def get_scaleup_recv_offset(self) -> int:
        return 0

    def get_scaleout_send_offset(self) -> int:
        return self.scaleup_recv.get_num_bytes()

    def get_scaleout_recv_offset(self) -> int:
        return self.get_scaleout_send_offset() + self.scaleout_send.get_num_bytes()


class HybridCombineBuffers(_Composition):
    """``scaleup_recv [slots(S_u)][S_o*M]``, ``scaleout_recv [slots(S_o)][M]``,
    ``scaleout_send [S_o][(amr ? 1 : K) * (M + 1280)]``."""

    _PARTS = ("scaleup_recv", "scaleout_recv", "scaleout_send")

    def __init__(
        self,
        token: TokenLayout,
        topology: Topology,
        num_max_tokens_per_rank: int,
        allow_multiple_reduction: bool = True,
    ) -> None:
        m, k, amr = num_max_tokens_per_rank, token.num_topk, allow_multiple_reduction
        so = topology.get_num_scaleout_ranks()
        su = topology.num_ranks // so
        self.scaleup_recv = BufferLayout(token, get_combine_num_recv_slots(su, k, amr), so * m)
        self.scaleout_recv = BufferLayout(token, get_combine_num_recv_slots(so, k, amr), m)
        self.scaleout_send = BufferLayout(token, so, (1 if amr else k) * (m + NUM_MAX_HYBRID_CHANNELS))

    def get_scaleup_recv_offset(self) -> int:
        return 0

    def get_scaleout_recv_offset(self) -> int:
        return self.scaleup_recv.get_num_bytes()

    def get_scaleout_send_offset(self) -> int:
        return self.get_scaleout_recv_offset() + self.scaleout_recv.get_num_bytes()


def _topology(topology: Topology | int) -> Topology:
    if isinstance(topology, Topology):
        return topology
    return Topology(check_int("topology", topology, lo=1, hi=_NUM_MAX_RANKS))


def dispatch_buffers(
    token: TokenLayout, topology: Topology | int, num_max_tokens_per_rank: int
) -> DirectDispatchBuffers | HybridDispatchBuffers:
    """The dispatch composition (hybrid iff ``topology.is_hybrid()``); an int topology means N NVLink ranks."""
    topo = _topology(topology)
    m = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    if topo.is_hybrid():
        return HybridDispatchBuffers(token, topo, m)
    return DirectDispatchBuffers(token, topo, m)


def combine_buffers(
    token: TokenLayout,
    topology: Topology | int,
    num_max_tokens_per_rank: int,
    allow_multiple_reduction: bool = True,
) -> DirectCombineBuffers | HybridCombineBuffers:
    """The combine composition; ``token`` is the combine token (its ``num_topk`` is K)."""
    topo = _topology(topology)
    m = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    if topo.is_hybrid():
        return HybridCombineBuffers(token, topo, m, allow_multiple_reduction)
    return DirectCombineBuffers(token, topo, m, allow_multiple_reduction)


def dispatch_buffer_bytes(token: TokenLayout, topology: Topology | int, num_max_tokens_per_rank: int) -> int:
    """Bytes of the dispatch buffers (direct or hybrid)."""
    return dispatch_buffers(token, topology, num_max_tokens_per_rank).get_num_bytes()


def combine_buffer_bytes(
    token: TokenLayout,
    topology: Topology | int,
    num_max_tokens_per_rank: int,
    allow_multiple_reduction: bool = True,
) -> int:
    """Bytes of the combine buffers (direct or hybrid)."""
    return combine_buffers(token, topology, num_max_tokens_per_rank, allow_multiple_reduction).get_num_bytes()


def get_num_fp8_sf_packs(hidden: int) -> int:
    """One 4-byte scale pack per 32 hidden elements: ``ceil(hidden / 32)``."""
    return ceil_div(hidden, 32)


def get_sizing_num_topk(num_topk: int) -> int:
    """``K == 0`` (unknown) is sized as 32."""
    return NUM_MAX_TOPK if num_topk == 0 else num_topk


def get_sizing_dispatch_token(hidden: int, num_topk: int, use_fp8: bool = False) -> TokenLayout:
    """Dispatch token used for sizing: bf16, or FP8 with ``ceil(hidden/32)`` scale packs; metadata on."""
    packs = get_num_fp8_sf_packs(hidden) if use_fp8 else 0
    return make_dispatch_token_layout(hidden, 1 if use_fp8 else 2, packs, get_sizing_num_topk(num_topk))


def get_sizing_combine_token(hidden: int, num_topk: int) -> TokenLayout:
    """Combine token used for sizing: bf16, no scales, metadata off."""
    return make_combine_token_layout(hidden, get_sizing_num_topk(num_topk))


def size_hint_bytes(
    topology: Topology | int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    use_fp8: bool = False,
    allow_multiple_reduction: bool = True,
) -> int:
    """Bytes of the GPU buffer: ``align(max(dispatch_bytes, combine_bytes), 2 MiB)``.

    The workspace (``WorkspaceLayout.get_num_aligned_bytes()``) and CPU bytes come on top. ``topology`` may be an
    int N (direct, one NVLink domain). Example: ``size_hint_bytes(8, 4096, 7168, 8) == 452 * 2**20``.
    """
    topo = _topology(topology)
    m = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, lo=1)
    h = check_int("hidden", hidden, lo=1)
    k = check_int("num_topk", num_topk, hi=NUM_MAX_TOPK)
    if get_num_fp8_sf_packs(h) * 4 > h:
        raise LayoutValueError(
            f"hidden: expected ceil(hidden / 32) * 4 <= hidden, got hidden={h}; use hidden >= 4"
        )
    granule = 32 if use_fp8 else 16
    if h % granule:
        raise LayoutValueError(
            f"hidden: expected a multiple of {granule} ({'fp8' if use_fp8 else 'bf16'} rows are 32-byte aligned), "
            f"got {h}"
        )
    dispatch = dispatch_buffer_bytes(get_sizing_dispatch_token(h, k, use_fp8), topo, m)
    combine = combine_buffer_bytes(get_sizing_combine_token(h, k), topo, m, allow_multiple_reduction)
    return align(max(dispatch, combine), NUM_SYMMETRIC_ALIGN_BYTES)
