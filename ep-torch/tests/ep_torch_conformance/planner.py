"""Conformance ``planner``: the buffers answer with ep-core's planner under their policy."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from ep_torch.buffer import ElasticBuffer, EPBuffer

from ._common import _Checks

# --------------------------------------------------------------------------------------------------------------------
# planner and domains: the buffers answer with ep-core's planner under their policy


def check_planner(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    from ep_core import planner
    from ep_core.topology import Topology

    n = cfg["world"]
    hint = ElasticBuffer.get_buffer_size_hint(
        dist.group.WORLD, cfg["tokens"], cfg["hidden"], num_topk=cfg["topk"]
    )
    hint_v25 = EPBuffer.get_buffer_size_hint(
        dist.group.WORLD, cfg["tokens"], cfg["hidden"], num_topk=cfg["topk"]
    )

    def check() -> None:
        el, ep = buffers["Elastic"], buffers["EP-deterministic-single-reduction"]
        assert type(el).policy is planner.PlannerPolicy.V2 and type(ep).policy is planner.PlannerPolicy.V2_5
        topo = el.runtime.topology
        assert topo.num_ranks == n
        assert el.get_physical_domain_size() == topo.physical_domain_size
        assert el.get_logical_domain_size() == topo.logical_domain_size
        assert (el.num_scaleout_ranks, el.num_scaleup_ranks) == topo.logical_domain_size
        assert el.scaleup_rank_idx == cfg["rank"] % el.num_scaleup_ranks
        want = planner.get_buffer_size_hint(
            Topology(n, topo.num_nvlink_ranks, True), cfg["tokens"], cfg["hidden"], cfg["topk"]
        )
        assert hint == hint_v25 == want and hint % (2 << 20) == 0, (hint, hint_v25, want)
        assert el.num_bytes == want, "the constructor sizes the buffer with the hint"
        for buf in (el, ep):
            ex = buf.runtime.executor
            for e, k in ((8 * n, 4), (256 if n <= 8 else 32 * n, 8)):
                got = buf.get_theoretical_num_sms(e, k)
                ref = planner.get_theoretical_num_sms(
                    topo,
                    e,
                    k,
                    num_device_sms=ex.num_device_sms,
                    nvlink_gbs=getattr(ex, "nvlink_gbs", None),
                    rdma_gbs=getattr(ex, "rdma_gbs", None),
                    prefer_overlap_with_compute=buf.prefer_overlap_with_compute,
                    policy=type(buf).policy,
                )
                assert got == ref, (type(buf).__name__, e, k, got, ref)
            assert buf.get_theoretical_num_qps(4) == planner.get_theoretical_num_qps(
                topo, 4, buf.num_allocated_qps
            )

    checks.run("planner/buffers use ep-core's planner with their policy", check)

    def placement() -> None:
        # the copy epilogue's SMs follow prefer_overlap_with_compute (GPU executors only: the reference has none)
        for buf in buffers.values():
            rank = getattr(buf.runtime.executor, "rank", None)
            if rank is None:
                continue
            ex = buf.runtime.executor
            want = 0 if buf.prefer_overlap_with_compute else ex.num_device_sms
            assert rank.epilogue_sms == want, (type(buf).__name__, rank.epilogue_sms, want)

    checks.run("planner/the copy epilogue's SMs follow prefer_overlap_with_compute", placement)
