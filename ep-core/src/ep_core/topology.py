"""`Topology`: physical and logical domains of an EP group, rank decomposition and expert ownership.

Physical: `num_nvlink_ranks` consecutive ranks share one NVLink (LSA) domain; `num_rdma_ranks = N /
num_nvlink_ranks` such domains are connected by RDMA. Logical (what the kernels use): hybrid mode (`S_o > 1`) iff
`allow_hybrid_mode` and there is more than one NVLink domain, then `(S_o, S_u) = (num_rdma_ranks,
num_nvlink_ranks)`; otherwise direct mode `(1, N)`. Global rank = `scaleout_idx * S_u + scaleup_idx`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ep_core.errors import EPConfigError

__all__ = [
    "MAX_EXPERTS",
    "MAX_EXPERTS_PER_RANK",
    "MAX_RANKS",
    "MAX_TOPK",
    "Topology",
    "resolve_scaleup_ranks",
]

MAX_RANKS = 1024
MAX_EXPERTS = 2048
MAX_EXPERTS_PER_RANK = 256
MAX_TOPK = 32
MAX_HYBRID_SCALEOUT_RANKS = 32
MAX_HYBRID_SCALEUP_RANKS = 64


@dataclass(frozen=True)
class Topology:
    """An EP group of `num_ranks` ranks in NVLink domains of `num_nvlink_ranks` consecutive ranks."""

    num_ranks: int
    num_nvlink_ranks: int | None = None
    allow_hybrid_mode: bool = True

    def __post_init__(self) -> None:
        n = self.num_ranks
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_RANKS:
            raise EPConfigError(f"num_ranks: expected an int in [1, {MAX_RANKS}], got {n!r}")
        nvl = n if self.num_nvlink_ranks is None else self.num_nvlink_ranks
        if not isinstance(nvl, int) or isinstance(nvl, bool) or nvl < 1 or n % nvl:
            raise EPConfigError(
                f"num_nvlink_ranks: expected a divisor of num_ranks={n} (the size of one NVLink domain), got {nvl!r}"
            )
        object.__setattr__(self, "num_nvlink_ranks", nvl)
        object.__setattr__(self, "allow_hybrid_mode", bool(self.allow_hybrid_mode))
        if self.is_hybrid:
            so, su = self.logical_domain_size
            if so > MAX_HYBRID_SCALEOUT_RANKS or su > MAX_HYBRID_SCALEUP_RANKS:
                raise EPConfigError(
                    f"topology: hybrid mode supports at most {MAX_HYBRID_SCALEOUT_RANKS} scale-out x "
                    f"{MAX_HYBRID_SCALEUP_RANKS} scale-up ranks, got {so} x {su}; use allow_hybrid_mode=False"
                )

    # physical ------------------------------------------------------------------------------------------------
    @property
    def num_rdma_ranks(self) -> int:
        """Number of NVLink domains (physical scale-out size)."""
        return self.num_ranks // self._nvl

    @property
    def physical_domain_size(self) -> tuple[int, int]:
        """`(num_rdma_ranks, num_nvlink_ranks)`."""
        return self.num_rdma_ranks, self._nvl

    # logical -------------------------------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Hybrid mode: RDMA across NVLink domains, then NVLink forwarding."""
        return self.allow_hybrid_mode and self.num_rdma_ranks > 1

    @property
    def logical_domain_size(self) -> tuple[int, int]:
        """`(S_o, S_u)`: `(num_rdma_ranks, num_nvlink_ranks)` in hybrid mode, else `(1, N)`."""
        return (self.num_rdma_ranks, self._nvl) if self.is_hybrid else (1, self.num_ranks)

    @property
    def num_scaleout_ranks(self) -> int:
        return self.logical_domain_size[0]

    @property
    def num_scaleup_ranks(self) -> int:
        return self.logical_domain_size[1]

    @property
    def is_scaleup_nvlink(self) -> bool:
        """Whether every scale-up peer is reachable over NVLink (False: direct mode across nodes)."""
        return self.num_scaleup_ranks == self._nvl

    def scaleout_idx(self, rank: int) -> int:
        return self._check_rank(rank) // self.num_scaleup_ranks

    def scaleup_idx(self, rank: int) -> int:
        return self._check_rank(rank) % self.num_scaleup_ranks

    def global_rank(self, scaleout_idx: int, scaleup_idx: int) -> int:
        return scaleout_idx * self.num_scaleup_ranks + scaleup_idx

    # experts -------------------------------------------------------------------------------------------------
    def check_num_experts(self, num_experts: int) -> int:
        """Validate `num_experts` for this group; returns experts per rank."""
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise EPConfigError(f"num_experts: expected a positive int, got {num_experts!r}")
        if num_experts % self.num_ranks:
            raise EPConfigError(
                f"num_experts: expected a multiple of the number of ranks ({self.num_ranks}), got {num_experts}"
            )
        if num_experts > MAX_EXPERTS:
            raise EPConfigError(f"num_experts: expected at most {MAX_EXPERTS}, got {num_experts}")
        epr = num_experts // self.num_ranks
        if epr > MAX_EXPERTS_PER_RANK:
            raise EPConfigError(
                f"num_experts: at most {MAX_EXPERTS_PER_RANK} experts per rank are supported, got {epr} "
                f"({num_experts} experts over {self.num_ranks} ranks)"
            )
        if self.is_hybrid and self.num_scaleup_ranks + epr > 128:
            raise EPConfigError(
                f"num_experts: hybrid mode needs num_scaleup_ranks + experts per rank <= 128, got "
                f"{self.num_scaleup_ranks} + {epr}"
            )
        return epr

    def num_experts_per_rank(self, num_experts: int) -> int:
        return self.check_num_experts(num_experts)

    def experts_of_rank(self, rank: int, num_experts: int) -> range:
        """Global expert ids owned by `rank`: `[rank*epr, (rank+1)*epr)`."""
        epr = self.check_num_experts(num_experts)
        r = self._check_rank(rank)
        return range(r * epr, (r + 1) * epr)

    def rank_of_expert(self, expert: int, num_experts: int) -> int:
        epr = self.check_num_experts(num_experts)
        if not 0 <= expert < num_experts:
            raise EPConfigError(f"expert: expected an id in [0, {num_experts}), got {expert}")
        return expert // epr

    # interop -------------------------------------------------------------------------------------------------
    def to_layout(self):
        """The matching `ep_layout.Topology` (logical sizes + whether scale-up is NVLink)."""
        import ep_layout

        return ep_layout.Topology(self.num_ranks, self.num_scaleup_ranks, self.is_scaleup_nvlink)

    @property
    def _nvl(self) -> int:
        assert self.num_nvlink_ranks is not None
        return self.num_nvlink_ranks

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.num_ranks:
            raise EPConfigError(f"rank: expected a rank in [0, {self.num_ranks}), got {rank}")
        return rank


def resolve_scaleup_ranks(
    num_ranks: int, num_scaleup_ranks: int | None = None, *, use_env: bool = False
) -> int:
    """Ranks per node (S_u): `num_scaleup_ranks`, else `EPKIT_SCALEUP_RANKS` when `use_env` and set, else
    `num_ranks` (one node, direct mode). Must divide `num_ranks`: ranks `r // S_u` form a node, as DeepEP's
    `rank = rdma_rank * S_u + nvl_rank`."""
    su = num_scaleup_ranks
    source = "num_scaleup_ranks"
    if su is None and use_env:
        from ep_core._env import knobs

        su = knobs.scaleup_ranks or None
        source = "EPKIT_SCALEUP_RANKS"
    if su is None:
        return int(num_ranks)
    if isinstance(su, bool) or not isinstance(su, int) or su < 1 or num_ranks % su:
        raise EPConfigError(
            f"{source}: expected a divisor of num_ranks={num_ranks} (the ranks of one node), got {su!r}"
        )
    return su
