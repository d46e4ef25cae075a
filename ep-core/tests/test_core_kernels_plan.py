"""CPU: host-side planning of the direct-mode kernels (compile keys, regions, scratch, launch geometry)."""

from __future__ import annotations

import ep_layout
import pytest
from ep_core.errors import EPConfigError, EPValueError
from ep_core.kernels import KernelConfig, check_coresident, launch_geometry, plan_regions, scratch_bytes
from ep_core.kernels._args import FLAGS, OP_ARGS_FIELDS, pack_op_args


def test_kernel_config_defines_and_tokens() -> None:
    cfg = KernelConfig(8, 8, 7168)
    d = cfg.defines()
    assert d["EP_CORE_HIDDEN_BYTES"] == 14336 and d["EP_CORE_COMBINE_HIDDEN_BYTES"] == 14336
    assert cfg.dispatch_token.get_num_bytes() == 14464  # SPEC §4 worked example
    assert cfg.combine_token.get_num_bytes() == 14400
    fp8 = KernelConfig(8, 8, 7168, 1, 56)
    assert fp8.defines()["EP_CORE_HIDDEN_BYTES"] == 7168 and fp8.defines()["EP_CORE_NUM_SF_PACKS"] == 56
    assert (
        KernelConfig(2, 4, 512, transport="nccl").defines()["EP_CORE_TRANSPORT"] == "ep_core::NcclTransport"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_ranks": 0, "num_topk": 8, "hidden": 512},
        {"num_ranks": 2, "num_topk": 33, "hidden": 512},
        {"num_ranks": 2, "num_topk": 8, "hidden": 520},
        {"num_ranks": 2, "num_topk": 8, "hidden": 512, "elem_size": 2, "num_sf_packs": 4},
        {"num_ranks": 2, "num_topk": 8, "hidden": 512, "transport": "tcp"},
    ],
)
def test_kernel_config_rejects(kwargs) -> None:
    with pytest.raises(EPConfigError):
        KernelConfig(**kwargs)


def test_regions_ep8_example() -> None:
    plan = plan_regions(KernelConfig(8, 8, 7168), 256, 4096)
    assert plan.recv_offset == ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
    assert plan.dispatch_bytes == 8 * 4096 * 14464
    assert plan.combine_bytes == 8 * 4096 * 14400
    assert plan.scratch_offset == ep_layout.WorkspaceLayout.RESERVED_OFFSET
    assert plan.scratch_bytes == scratch_bytes(8, 256, 4096) <= ep_layout.NUM_RESERVED_BYTES
    assert plan.total_bytes == plan.recv_offset + max(plan.dispatch_bytes, plan.combine_bytes)
    # the size hint of ep_layout covers both regions
    assert ep_layout.size_hint_bytes(8, 4096, 7168, 8) >= max(plan.dispatch_bytes, plan.combine_bytes)


def test_regions_small_rank_count_uses_topk_slots() -> None:
    plan = plan_regions(KernelConfig(2, 8, 512), 16, 64)
    assert plan.combine_bytes == 8 * 64 * KernelConfig(2, 8, 512).combine_token.get_num_bytes()
    with pytest.raises(EPConfigError):
        plan_regions(KernelConfig(2, 8, 512), 16, 64, data_bytes=1024)
    with pytest.raises(EPConfigError):
        plan_regions(KernelConfig(3, 8, 512), 16, 64)


def test_scratch_falls_back_when_large() -> None:
    plan = plan_regions(KernelConfig(8, 8, 512), 2048, 65536)
    assert plan.scratch_offset == -1 and plan.scratch_bytes > ep_layout.NUM_RESERVED_BYTES


def test_launch_geometry_and_coresidency() -> None:
    cfg = KernelConfig(8, 8, 7168)
    geo = launch_geometry(cfg, 16, 132)
    assert cfg.num_warps == 15 and cfg.smem_slot_bytes == 14464  # 15 token slots fit in 227 KiB
    assert (geo.grid, geo.block, geo.shared_mem) == (16, 480, 15 * 14464)
    assert KernelConfig(8, 8, 7168, 1, 56).num_warps == 16
    with pytest.raises(EPConfigError):
        KernelConfig(8, 8, 7168, num_warps=16)
    with pytest.raises(EPValueError):
        launch_geometry(cfg, 0, 132)
    with pytest.raises(EPValueError):
        launch_geometry(cfg, 133, 132)
    check_coresident(8, 16, 132)
    with pytest.raises(EPConfigError, match="co-resident"):
        check_coresident(8, 17, 132)


def test_op_args_mirror() -> None:
    assert len(OP_ARGS_FIELDS) == 44 and len(set(OP_ARGS_FIELDS)) == 44
    raw = pack_op_args(rank=3, flags=FLAGS["expand"] | FLAGS["cached"], workspace=0xFFFF_FFFF_FFFF_FFF0)
    assert len(raw) == 44 * 8
    assert int.from_bytes(raw[6 * 8 : 7 * 8], "little") == 3
    assert int.from_bytes(raw[11 * 8 : 12 * 8], "little") == 3
    with pytest.raises(KeyError):
        pack_op_args(bogus=1)
