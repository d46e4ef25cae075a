"""The planner view of one buffer: ep-core's topology and planner, fed with what torch knows about the group.

Nothing here computes sizes or SM counts itself: it finds the inputs (ranks per NVLink domain, device SMs,
bandwidths) and calls ``ep_core.topology`` / ``ep_core.planner`` with the buffer's policy (V2 for
``ElasticBuffer``, V2.5 for ``EPBuffer``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import _env

PlannerPolicyName = Literal["V2", "V2_5"]


def _planner() -> Any:
    from ep_core import planner

    return planner


def _topology_cls() -> Any:
    from ep_core.topology import Topology

    return Topology


@dataclass(frozen=True)
class TopologyView:
    """(rdma, nvlink) physical and (scale-out, scale-up) logical domain sizes, plus ep-core's object."""

    core: Any
    physical: tuple[int, int]
    logical: tuple[int, int]


@dataclass
class Planning:
    topology: TopologyView
    policy: PlannerPolicyName
    reference: bool

    def _policy(self) -> Any:
        return getattr(_planner().PlannerPolicy, self.policy)

    def buffer_size_hint(
        self,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        use_fp8_dispatch: bool,
        allow_multiple_reduction: bool,
    ) -> int:
        return int(
            _planner().get_buffer_size_hint(
                self.topology.core,
                num_max_tokens_per_rank,
                hidden,
                num_topk=num_topk,
                use_fp8_dispatch=use_fp8_dispatch,
                allow_multiple_reduction=allow_multiple_reduction,
            )
        )

    def dispatch_bytes(
        self, num_max_tokens_per_rank: int, hidden_bytes: int, num_sf_packs: int, num_topk: int
    ) -> int:
        """Bytes of the dispatch buffers for these sizes (ep-layout's byte math, through ep-core's topology)."""
        import ep_layout

        token = ep_layout.TokenLayout(hidden_bytes, num_sf_packs * 4, num_topk, True)
        return int(
            ep_layout.dispatch_buffer_bytes(token, self.topology.core.to_layout(), num_max_tokens_per_rank)
        )

    def combine_bytes(
        self, num_max_tokens_per_rank: int, hidden: int, num_topk: int, allow_multiple_reduction: bool
    ) -> int:
        """Bytes of the combine buffers (bf16 rows)."""
        import ep_layout

        token = ep_layout.TokenLayout(hidden * 2, 0, num_topk, False)
        return int(
            ep_layout.combine_buffer_bytes(
                token, self.topology.core.to_layout(), num_max_tokens_per_rank, allow_multiple_reduction
            )
        )

    def num_sms(
        self, num_experts: int, num_topk: int, *, prefer_overlap_with_compute: bool, **kw: Any
    ) -> int:
        planner = _planner()
        if self.reference:
            device_sms = _env.reference_num_sms()
            if not kw.get("nvlink_gbs"):
                kw["nvlink_gbs"] = _env.reference_nvlink_gbs()
        else:
            device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return int(
            planner.get_theoretical_num_sms(
                self.topology.core,
                num_experts,
                num_topk,
                num_device_sms=device_sms,
                prefer_overlap_with_compute=prefer_overlap_with_compute,
                policy=self._policy(),
                **kw,
            )
        )

    def num_qps(self, num_sms: int, num_allocated_qps: int) -> int:
        return int(_planner().get_theoretical_num_qps(self.topology.core, num_sms, num_allocated_qps))

    def default_num_allocated_qps(self) -> int:
        return int(_planner().default_num_allocated_qps(self.topology.core))


def _num_nvlink_ranks(bootstrap: Any, reference: bool) -> int:
    """Ranks of one NVLink (LSA) domain: all of them on the reference backend; else the ranks of this host."""
    if reference or bootstrap.size == 1:
        return bootstrap.size
    hosts = [h.decode() for h in bootstrap.allgather(socket.gethostname().encode())]
    per_host = hosts.count(hosts[bootstrap.rank])
    if any(hosts.count(h) != per_host for h in hosts):
        raise ValueError(f"group: every host must hold the same number of ranks, got {sorted(set(hosts))}")
    return per_host


def planning_for_group(
    bootstrap: Any, *, allow_hybrid_mode: bool, policy: PlannerPolicyName, reference: bool
) -> Planning:
    """Topology + planner for the group behind ``bootstrap`` (a collective on non-reference groups)."""
    nvl = _num_nvlink_ranks(bootstrap, reference)
    core = _topology_cls()(bootstrap.size, nvl, allow_hybrid_mode)
    view = TopologyView(
        core=core, physical=tuple(core.physical_domain_size), logical=tuple(core.logical_domain_size)
    )
    return Planning(topology=view, policy=policy, reference=reference)
