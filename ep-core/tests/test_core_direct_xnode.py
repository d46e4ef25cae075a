"""CPU: direct mode across nodes (`allow_hybrid_mode=False` with several nodes; include/ep_core/direct_xnode.cuh).

- `KernelConfig(num_nvlink_ranks=...)`: validation, the defines that pick the kernels, the scale-out put per
  transport, the regions (direct mode's; gin adds DeepEP's send buffers, at the offsets the kernels use);
- the loopback domain and ProcessRank keyword (`allow_hybrid_mode`): checked before any GPU work, the ranks get
  one logical domain of N ranks with nodes of S_u;
- the compile command (`python -m ep_core compile --no-hybrid ...`) builds the instances over ipc and nccl (GIN,
  against NCCL's device headers), with real nvcc.
"""

from __future__ import annotations

import os
import shutil

import ep_layout
import pytest
from ep_core import loopback, prebuild
from ep_core.__main__ import main
from ep_core.errors import EPConfigError, EPValueError
from ep_core.kernels.plan import KernelConfig, plan_regions

ep_jit = pytest.importorskip("ep_jit")


def _have_nvcc() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("EPKIT_SCALEUP_RANKS", raising=False)
    ep_jit.clear_memo()


# --- the kernel configuration ------------------------------------------------------------------------------------
def test_config_picks_the_direct_kernels_across_nodes() -> None:
    c = KernelConfig(8, 8, 1024, num_nvlink_ranks=2)
    assert c.is_direct_xnode and not c.is_hybrid
    assert c.num_scaleup_ranks == 8 and c.num_nodes == 4 and c.scaleout == "emulated"
    d = c.defines()
    assert d["EP_CORE_NUM_NODE_RANKS"] == 2 and "EP_CORE_NUM_SCALEUP_RANKS" not in d
    assert (
        d["EP_CORE_SCALEOUT"] == "ep_core::EmulatedScaleout"
        and d["EP_CORE_TRANSPORT"] == "ep_core::IpcTransport"
    )
    g = KernelConfig(8, 8, 1024, transport="nccl", num_nvlink_ranks=4)
    assert g.scaleout == "gin" and g.defines()["EP_CORE_SCALEOUT"] == "ep_core::GinScaleout"
    assert g.defines()["EP_CORE_TRANSPORT"] == "ep_core::NodeLsaTransport<4>"
    # one node, and hybrid mode, are what they were
    assert not KernelConfig(8, 8, 1024, num_nvlink_ranks=8).is_direct_xnode
    assert KernelConfig(8, 8, 1024) == KernelConfig(8, 8, 1024, num_nvlink_ranks=8)
    h = KernelConfig(8, 8, 1024, num_scaleup_ranks=2)
    assert h.is_hybrid and not h.is_direct_xnode and h.num_nvlink_ranks == 2
    # the smem slot and the warps are direct mode's
    assert c.smem_slot_bytes == KernelConfig(8, 8, 1024).smem_slot_bytes
    assert c.num_warps == KernelConfig(8, 8, 1024).num_warps


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_nvlink_ranks": 3}, "num_nvlink_ranks: expected a divisor of num_ranks=8"),
        ({"num_nvlink_ranks": True}, "num_nvlink_ranks: expected a divisor"),
        ({"num_scaleup_ranks": 2, "num_nvlink_ranks": 4}, "num_nvlink_ranks: hybrid mode forwards"),
        ({"num_nvlink_ranks": 2, "scaleout": "gin"}, "scaleout: 'gin' needs transport='nccl'"),
        ({"num_nvlink_ranks": 2, "scaleout": "rdma"}, "scaleout: expected one of"),
        ({"scaleout": "emulated"}, "scaleout: only hybrid configurations or direct mode across nodes"),
    ],
)
def test_config_refused(kw, match) -> None:
    with pytest.raises(EPConfigError, match=match):
        KernelConfig(8, 8, 1024, **kw)


def test_regions() -> None:
    m, e = 96, 64
    direct = KernelConfig(4, 8, 1024)
    emu = KernelConfig(4, 8, 1024, num_nvlink_ranks=2)
    assert plan_regions(emu, e, m) == plan_regions(direct, e, m)  # load/store everywhere: nothing staged
    gin = KernelConfig(4, 8, 1024, transport="nccl", num_nvlink_ranks=2)
    tok = gin.dispatch_token.get_num_bytes()
    comb = gin.combine_token.get_num_bytes()
    # dispatch: recv [N][M], then the send stage [M] (direct_xnode.cuh: after N * M tokens)
    assert plan_regions(gin, e, m, op="dispatch").dispatch_bytes == (4 * m + m) * tok
    topo = ep_layout.Topology(4, is_scaleup_nvlink=False)
    for amr in (True, False):
        bufs = ep_layout.DirectCombineBuffers(gin.combine_token, topo, m, amr)
        # the kernel's send stage starts after the receive slots (N in the rank layout, else K)
        slots = 4 if ep_layout.combine_uses_rank_layout(4, 8, amr) else 8
        assert bufs.get_send_offset() == slots * m * comb
        assert bufs.get_num_bytes() == slots * m * comb + 4 * m * (1 if amr else 8) * comb
        plan = plan_regions(gin, e, m, op="combine", allow_multiple_reduction=amr)
        assert plan.combine_bytes == bufs.get_num_bytes()
    with pytest.raises(EPConfigError, match="buffer: the GPU buffer holds"):
        plan_regions(gin, e, m, plan_regions(direct, e, m).dispatch_bytes, op="dispatch")


# --- loopback / ProcessRank keyword ------------------------------------------------------------------------------
class _PastValidation(Exception):
    pass


def _stop(*_a, **_k):
    raise _PastValidation


def test_loopback_keyword(monkeypatch) -> None:
    monkeypatch.setattr(loopback._cuda, "num_device_sms", lambda: 132)
    seen = []

    class _Buffers:
        bases = tuple(0x1000 * (r + 1) for r in range(8))
        peer_table = 0x9000

    class _Rank:
        def __init__(self, res, **kw) -> None:
            seen.append((res.rank, kw["num_scaleup_ranks"], kw["num_nvlink_ranks"]))

    monkeypatch.setattr(loopback.IpcBuffer, "create_loopback", lambda *a, **k: _Buffers())
    monkeypatch.setattr(loopback, "Stream", lambda: None)
    monkeypatch.setattr(loopback, "RankDriver", _Rank)
    kw = {"num_max_tokens_per_rank": 8, "hidden": 256, "num_topk": 2}
    dom = loopback.LoopbackDomain(4, num_scaleup_ranks=2, allow_hybrid_mode=False, **kw)
    assert dom.num_scaleup_ranks == 2 and dom.allow_hybrid_mode is False
    assert seen == [(r, 4, 2) for r in range(4)]  # one logical domain of 4 ranks, nodes of 2
    seen.clear()
    loopback.LoopbackDomain(4, num_scaleup_ranks=2, **kw)  # hybrid mode (the default)
    assert seen == [(r, 2, 2) for r in range(4)]
    seen.clear()
    loopback.LoopbackDomain(4, allow_hybrid_mode=False, **kw)  # one node: direct mode
    assert seen == [(r, 4, 4) for r in range(4)]
    with pytest.raises(EPValueError, match="allow_hybrid_mode: expected a bool, got 0"):
        loopback.LoopbackDomain(4, num_scaleup_ranks=2, allow_hybrid_mode=0, **kw)
    with pytest.raises(EPConfigError, match="num_scaleup_ranks: expected a divisor of num_ranks=4"):
        loopback.LoopbackDomain(4, num_scaleup_ranks=3, allow_hybrid_mode=False, **kw)


class _Boot:
    size = 4
    rank = 1


def test_process_rank_keyword(monkeypatch) -> None:
    monkeypatch.setattr(loopback.IpcBuffer, "create_exchanged", _stop)
    kw = {"num_max_tokens_per_rank": 8, "hidden": 256, "num_topk": 2}
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    with pytest.raises(_PastValidation):
        loopback.ProcessRank(_Boot(), allow_hybrid_mode=False, **kw)
    with pytest.raises(EPValueError, match="allow_hybrid_mode: expected a bool"):
        loopback.ProcessRank(_Boot(), allow_hybrid_mode="no", **kw)
    assert loopback._logical_ranks(4, 2, False) == (4, 2)
    assert loopback._logical_ranks(4, 2, True) == (2, 2)
    assert loopback._logical_ranks(4, 4, False) == (4, 4)


# --- the compile command -----------------------------------------------------------------------------------------
def test_plan_instances() -> None:
    inst = prebuild.plan_instances(
        num_ranks=4,
        num_scaleup_ranks=2,
        hidden=1024,
        num_topk=8,
        num_experts=32,
        allow_hybrid_mode=False,
        fp8=True,
    )
    assert [i.config for i in inst] == [
        KernelConfig(4, 8, 1024, num_nvlink_ranks=2),
        KernelConfig(4, 8, 1024, 1, 8, num_nvlink_ranks=2),
        KernelConfig(4, 8, 1024, 1, 2, num_nvlink_ranks=2),
    ]
    assert all(i.config.is_direct_xnode and i.config.scaleout == "emulated" for i in inst)
    gin = prebuild.plan_instances(
        num_ranks=4,
        num_scaleup_ranks=2,
        hidden=1024,
        num_topk=8,
        num_experts=32,
        transport="nccl",
        allow_hybrid_mode=False,
    )
    assert gin[0].config.scaleout == "gin"
    one = prebuild.plan_instances(
        num_ranks=4, hidden=1024, num_topk=8, num_experts=32, allow_hybrid_mode=False
    )
    assert one[0].config == KernelConfig(4, 8, 1024)


@needs_nvcc
def test_cli_builds_ipc(capsys) -> None:
    rc = main(
        [
            "compile",
            "--num-ranks",
            "4",
            "--num-scaleup-ranks",
            "2",
            "--no-hybrid",
            "--hidden",
            "256",
            "--num-topk",
            "2",
            "--num-experts",
            "8",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "direct mode across nodes: 2 nodes x 2, scale-out put emulated" in out
    assert "ep_core_direct_n4_k2_h256" in out and "_xn2_emu" in out
    assert "1 instance(s) ready (1 built, 0 cached)" in out


@needs_nvcc
def test_cli_builds_nccl_gin(capsys) -> None:
    ep_nccl_gin = pytest.importorskip("ep_nccl_gin")
    try:
        ep_nccl_gin.include_dirs(check=False)
    except Exception as e:  # no NCCL headers on this machine
        pytest.skip(f"no NCCL device headers: {e}")
    argv = "compile --num-ranks 4 --num-scaleup-ranks 2 --no-hybrid --hidden 256 --num-topk 2 --num-experts 8"
    assert main([*argv.split(), "--transport", "nccl"]) == 0
    out = capsys.readouterr().out
    assert "direct mode across nodes: 2 nodes x 2, scale-out put gin" in out
    assert "_nccl_xn2_gin." in out and "1 instance(s) ready (1 built, 0 cached)" in out
