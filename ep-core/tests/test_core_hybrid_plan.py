"""CPU: the hybrid configurations of the kernel planner (`KernelConfig(num_scaleup_ranks=...)`), the byte plan of
the hybrid regions (mirror of include/ep_core/hybrid.cuh `HybridRegions`), the scratch, and the size hint."""

from __future__ import annotations

import ep_layout
import pytest
from ep_core import planner
from ep_core.errors import EPConfigError
from ep_core.kernels.plan import HybridRegions, KernelConfig, plan_regions, scratch_bytes
from ep_core.topology import Topology


def test_direct_configs_are_unchanged() -> None:
    assert KernelConfig(8, 8, 7168) == KernelConfig(8, 8, 7168, num_scaleup_ranks=8)
    d = KernelConfig(8, 8, 7168)
    assert not d.is_hybrid and d.scaleout == "" and d.num_nodes == 1
    assert "EP_CORE_NUM_SCALEUP_RANKS" not in d.defines()
    assert plan_regions(d, 64, 128) == plan_regions(KernelConfig(8, 8, 7168, num_scaleup_ranks=8), 64, 128)


def test_hybrid_config() -> None:
    h = KernelConfig(8, 8, 1024, num_scaleup_ranks=2)
    assert h.is_hybrid and h.num_nodes == 4 and h.scaleout == "emulated"
    assert h.defines()["EP_CORE_SCALEOUT"] == "ep_core::EmulatedScaleout"
    assert KernelConfig(8, 8, 1024, transport="nccl", num_scaleup_ranks=2).scaleout == "gin"
    assert (
        KernelConfig(8, 8, 1024, transport="nccl", num_scaleup_ranks=2, scaleout="emulated").scaleout
        == "emulated"
    )
    # the shared-memory slot holds the message (token + K slots)
    assert h.smem_slot_bytes == ep_layout.align(h.dispatch_token.get_num_bytes() + 32, 128)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_scaleup_ranks": 3}, "num_scaleup_ranks: expected a divisor of num_ranks=8"),
        ({"num_scaleup_ranks": 2, "scaleout": "rdma"}, "scaleout: expected one of"),
        ({"num_scaleup_ranks": 2, "scaleout": "gin"}, "scaleout: 'gin' needs transport='nccl'"),
        ({"scaleout": "emulated"}, "scaleout: only hybrid configurations"),
    ],
)
def test_hybrid_config_refused(kw, match) -> None:
    with pytest.raises(EPConfigError, match=match):
        KernelConfig(8, 8, 1024, **kw)


@pytest.mark.parametrize("scaleout", ["emulated", "gin"])
def test_hybrid_regions(scaleout: str) -> None:
    n, su, k, m, e = 8, 2, 8, 64, 32
    cfg = KernelConfig(n, k, 1024, transport="nccl" if scaleout == "gin" else "ipc", num_scaleup_ranks=su)
    r = HybridRegions.of(cfg, e, m)
    tok = cfg.dispatch_token.get_num_bytes()
    comb = cfg.combine_token.get_num_bytes()
    msg = tok + ep_layout.align(4 * k, 32)
    cnt = ep_layout.align(4 * (su + su * (e // n)), 32)
    so = n // su
    assert cfg.message_bytes == msg
    assert r.tokens == n * m * tok  # direct mode's landing layout
    assert r.messages == so * m * msg and r.count_blocks == so * cnt
    assert r.combine_stage == k * so * m * comb and r.combine_final == k * m * comb
    gin = scaleout == "gin"
    assert r.send_stage == ((so * m * msg + so * cnt) if gin else 0)
    assert r.combine_send_stage == (so * k * m * comb if gin else 0)
    plan = plan_regions(cfg, e, m)
    assert plan.dispatch_bytes == r.dispatch_bytes and plan.combine_bytes == r.combine_bytes
    with pytest.raises(EPConfigError, match="buffer: the GPU buffer holds"):
        plan_regions(cfg, e, m, r.combine_bytes - 1)
    assert plan.scratch_bytes == scratch_bytes(n, e, m) + 8 * n


def test_size_hint_covers_the_hybrid_kernels() -> None:
    for n, su in ((8, 4), (4, 2), (16, 8)):
        topo = Topology(n, su)
        hint = planner.get_buffer_size_hint(topo, 256, 1024, 8)
        assert hint >= planner.hybrid_kernel_bytes(topo, 256, 1024, 8)
        assert hint % ep_layout.NUM_SYMMETRIC_ALIGN_BYTES == 0
    # direct mode keeps ep_layout's hint
    assert planner.get_buffer_size_hint(Topology(8), 256, 1024, 8) == ep_layout.size_hint_bytes(
        8, 256, 1024, 8
    )
