"""Planner: published points (SPEC §5, behaviour doc §2.4/§3), properties, QP rules, bandwidth detection."""

from __future__ import annotations

import math

import pytest
from ep_core import planner
from ep_core.errors import EPConfigError
from ep_core.planner import PlannerPolicy
from ep_core.topology import Topology
from hypothesis import given, settings
from hypothesis import strategies as st

NVLINK = 18 * 26.562 * 0.9  # 430.3 GB/s, H100/H800 NVLink4 x 18 links
RDMA = 50.0
MIB = 2**20


def sms(n, nvl=8, policy=PlannerPolicy.V2_5, **kw):
    kw = {"nvlink_gbs": NVLINK, "rdma_gbs": RDMA, "num_device_sms": 132} | kw
    return planner.get_theoretical_num_sms(Topology(n, nvl), 256, 8, policy=policy, **kw)


# V2: DeepEP V2's published table. V2_5: DeepEP 2.5's `EPBuffer.get_theoretical_num_sms` (`deep_ep/buffers/ep.py`,
# `utils/envs.py`): per-SM rates 180 / 45 GB/s and the combine's two terms (the seeds' 16, 12, 8 used V2's 200 / 50
# and the dispatch's terms alone; the 2x8 hybrid row is the one that moves, its combine term (read + nvl) / write
# rate being the largest)
@pytest.mark.parametrize(
    ("policy", "want"), [(PlannerPolicy.V2, [14, 12, 6]), (PlannerPolicy.V2_5, [16, 16, 8])]
)
def test_published_sm_counts(policy, want):
    assert [sms(n, policy=policy) for n in (8, 16, 32)] == want


@pytest.mark.parametrize(
    ("policy", "want"), [(PlannerPolicy.V2, [9.84, 8.55, 3.38]), (PlannerPolicy.V2_5, [11.63, 9.7, 4.5])]
)
def test_published_raw_values(policy, want):
    raw = [
        planner.explain(
            Topology(n, 8), 256, 8, num_device_sms=132, nvlink_gbs=NVLINK, rdma_gbs=RDMA, policy=policy
        ).raw_num_sms
        for n in (8, 16, 32)
    ]
    assert [round(r, 2) for r in raw] == want


def test_a_zero_per_sm_rate_is_the_policys():
    for policy in PlannerPolicy:
        read, write = policy.sm_gbs
        assert sms(8, policy=policy) == sms(8, policy=policy, sm_read_gbs=read, sm_write_gbs=write)
        assert sms(8, policy=policy, sm_read_gbs=0) == sms(8, policy=policy)
    assert PlannerPolicy.V2.sm_gbs == (200.0, 50.0) and PlannerPolicy.V2_5.sm_gbs == (180.0, 45.0)
    with pytest.raises(EPConfigError, match="sm_read_gbs"):
        sms(8, sm_read_gbs=-1)


def test_explain_intermediates():
    p = planner.explain(Topology(32, 8), 256, 8, num_device_sms=132, nvlink_gbs=NVLINK, rdma_gbs=RDMA)
    assert (p.num_scaleout_ranks, p.num_scaleup_ranks) == (4, 8)
    assert p.bound == "rdma" and p.bound_gbs == RDMA
    assert math.isclose(p.expected_rank_groups, planner.expected_num_groups(256, 8, 32))
    assert p.as_dict()["num_sms"] == p.num_sms == 8
    direct = planner.explain(Topology(8), 256, 8, num_device_sms=132, nvlink_gbs=NVLINK)
    assert direct.bound == "nvlink" and direct.rdma_traffic == 0


@pytest.mark.parametrize(
    ("kw", "mib"),
    [
        ({}, 452),
        ({"use_fp8_dispatch": True}, 450),
        ({"num_topk": 0}, 462),
    ],
)
def test_published_size_hints(kw, mib):
    args = {"num_topk": 8} | kw
    hint = planner.get_buffer_size_hint(Topology(8), 4096, 7168, **args)
    assert hint == mib * MIB


def test_size_hint_is_2mib_aligned_and_monotone():
    prev = 0
    for m in (1, 128, 1000, 4096):
        h = planner.get_buffer_size_hint(Topology(8), m, 4096, 8)
        assert h % (2 * MIB) == 0 and h >= prev
        prev = h
    with pytest.raises(EPConfigError, match="hidden"):
        planner.get_buffer_size_hint(Topology(8), 128, 7000, 8)
    with pytest.raises(EPConfigError, match="num_max_tokens_per_rank"):
        planner.get_buffer_size_hint(Topology(8), 0, 7168, 8)
    with pytest.raises(EPConfigError, match="num_topk"):
        planner.get_buffer_size_hint(Topology(8), 128, 7168, 33)


def test_expected_groups():
    # K=1: always exactly one group; g=1: one group
    assert planner.expected_num_groups(256, 1, 8) == pytest.approx(1.0)
    assert planner.expected_num_groups(256, 8, 1) == pytest.approx(1.0)
    # K=E: every group
    assert planner.expected_num_groups(16, 16, 4) == pytest.approx(4.0)
    with pytest.raises(EPConfigError):
        planner.expected_num_groups(250, 8, 8)


@settings(max_examples=200, deadline=None)
@given(
    nvl=st.sampled_from([1, 2, 4, 8]),
    so=st.sampled_from([1, 2, 4]),
    epr=st.sampled_from([1, 2, 4, 8, 16]),
    k=st.integers(1, 16),
    device_sms=st.integers(4, 160),
    nvlink=st.floats(10, 2000),
    rdma=st.floats(5, 400),
    overlap=st.booleans(),
    policy=st.sampled_from(list(PlannerPolicy)),
    hybrid=st.booleans(),
)
def test_sm_properties(nvl, so, epr, k, device_sms, nvlink, rdma, overlap, policy, hybrid):
    n = nvl * so
    e = n * epr
    k = min(k, e)
    topo = Topology(n, nvl, hybrid)
    p = planner.explain(
        topo,
        e,
        k,
        num_device_sms=device_sms,
        nvlink_gbs=nvlink,
        rdma_gbs=rdma,
        prefer_overlap_with_compute=overlap,
        policy=policy,
    )
    cap = policy.cap(device_sms)
    assert 1 <= p.num_sms <= cap
    # below the cap the result is aligned, floored at 4 (and 64 without overlap) and covers the margin
    if p.num_sms < cap:
        assert p.num_sms % policy.sm_alignment == 0
        assert p.num_sms >= 4 and (overlap or p.num_sms >= 64)
        assert p.num_sms >= policy.margin * p.raw_num_sms - 1e-9
    if policy is PlannerPolicy.V2_5:
        assert p.num_sms % 2 == 0
    # more SMs on the device never reduces the count; faster links never reduce it either
    bigger = planner.explain(
        topo,
        e,
        k,
        num_device_sms=device_sms + 8,
        nvlink_gbs=nvlink,
        rdma_gbs=rdma,
        prefer_overlap_with_compute=overlap,
        policy=policy,
    )
    assert bigger.num_sms >= p.num_sms
    faster = planner.explain(
        topo,
        e,
        k,
        num_device_sms=device_sms,
        nvlink_gbs=nvlink * 2,
        rdma_gbs=rdma * 2,
        prefer_overlap_with_compute=overlap,
        policy=policy,
    )
    assert faster.num_sms >= p.num_sms
    if not overlap:
        assert p.num_sms == min(max(p.num_sms, 64), cap)


def test_no_traffic_uses_device_sms():
    p = planner.explain(Topology(1), 8, 2, num_device_sms=132, policy=PlannerPolicy.V2)
    assert p.bound == "none" and p.num_sms == 132
    assert planner.explain(Topology(1), 8, 2, num_device_sms=131, policy=PlannerPolicy.V2_5).num_sms == 130


def test_sm_argument_errors():
    with pytest.raises(EPConfigError, match="num_scaleout_topk"):
        sms(8, num_scaleout_topk=2)
    with pytest.raises(EPConfigError, match="num_experts"):
        planner.get_theoretical_num_sms(Topology(8), 250, 8, num_device_sms=132, nvlink_gbs=NVLINK)
    with pytest.raises(EPConfigError, match="num_device_sms"):
        sms(8, num_device_sms=0)
    with pytest.raises(EPConfigError, match="num_topk"):
        planner.get_theoretical_num_sms(Topology(8), 256, 33, num_device_sms=132, nvlink_gbs=NVLINK)


def test_bandwidth_env_overrides_and_detection_failure(monkeypatch):
    monkeypatch.setattr(planner, "_run", lambda cmd: "")
    monkeypatch.setenv("EPKIT_NIC_NAME", "no_such_nic_for_tests")
    monkeypatch.delenv("EPKIT_NVLINK_GBS", raising=False)
    monkeypatch.delenv("EPKIT_RDMA_GBS", raising=False)
    with pytest.raises(EPConfigError, match="EPKIT_NVLINK_GBS"):
        planner.get_theoretical_num_sms(Topology(8), 256, 8, num_device_sms=132)
    with pytest.raises(EPConfigError, match="EPKIT_RDMA_GBS"):
        planner.get_theoretical_num_sms(Topology(16, 8), 256, 8, num_device_sms=132, nvlink_gbs=NVLINK)
    monkeypatch.setenv("EPKIT_NVLINK_GBS", str(NVLINK))
    monkeypatch.setenv("EPKIT_RDMA_GBS", str(RDMA))
    assert planner.get_theoretical_num_sms(Topology(32, 8), 256, 8, num_device_sms=132) == 8
    assert (
        planner.get_theoretical_num_sms(Topology(8), 256, 8, num_device_sms=132, policy=PlannerPolicy.V2)
        == 14
    )
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "fast")
    with pytest.raises(EPConfigError, match="EPKIT_NVLINK_GBS"):
        planner.get_theoretical_num_sms(Topology(8), 256, 8, num_device_sms=132)


def test_single_rank_needs_no_bandwidth(monkeypatch):
    monkeypatch.setattr(planner, "_run", lambda cmd: "")
    monkeypatch.delenv("EPKIT_NVLINK_GBS", raising=False)
    assert planner.get_theoretical_num_sms(Topology(1), 8, 2, num_device_sms=132) == 132


NVSMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)
\t Link 0: 26.562 GB/s
"""

IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tPort 1:
\t\tState: Active
\t\tRate: 400
CA 'mlx5_1'
\tCA type: MT4131
\tPort 1:
\t\tRate: 200
"""


def test_parsers(monkeypatch):
    assert planner.parse_nvidia_smi_nvlink(NVSMI) == pytest.approx(2 * 26.562)
    assert planner.parse_ibstat(IBSTAT, "mlx5_0") == (400.0, "MT4129")
    assert planner.parse_ibstat(IBSTAT, "mlx5_1") == (200.0, "MT4131")
    assert planner.parse_ibstat(IBSTAT, "mlx5_9") == (0.0, "")
    monkeypatch.delenv("EPKIT_NVLINK_GBS", raising=False)
    monkeypatch.delenv("EPKIT_RDMA_GBS", raising=False)
    monkeypatch.setenv("EPKIT_NIC_NAME", "mlx5_1")
    monkeypatch.setattr(planner, "_run", lambda cmd: NVSMI if cmd[0] == "nvidia-smi" else IBSTAT)
    assert planner.detect_nvlink_gbs() == pytest.approx(2 * 26.562 * 0.9)
    assert planner.detect_rdma_gbs() in (25.0, pytest.approx(25.0))  # unless sysfs has a real mlx5_1
    assert planner.detect_fast_rdma_atomics() is True
    assert planner.default_num_allocated_qps(Topology(16, 8)) == 65
    monkeypatch.setenv("EPKIT_NIC_NAME", "mlx5_0")
    assert planner.default_num_allocated_qps(Topology(16, 8)) == 129


@pytest.mark.parametrize("num_sms", [1, 4, 9, 10, 24, 132])
def test_qp_rules(num_sms):
    direct = Topology(8, 8, allow_hybrid_mode=False)
    hybrid_flag = Topology(8, 8, allow_hybrid_mode=True)  # one node, but the flag decides (quirk 9)
    assert planner.default_num_allocated_qps(direct) == 17
    assert planner.get_theoretical_num_qps(direct, num_sms) == min(num_sms, 9)
    assert planner.get_theoretical_num_qps(direct, num_sms, 4) == min(num_sms, 9, 4)
    assert planner.default_num_allocated_qps(hybrid_flag, fast_rdma_atomics=True) == 65
    assert planner.default_num_allocated_qps(hybrid_flag, fast_rdma_atomics=False) == 129
    assert planner.get_theoretical_num_qps(hybrid_flag, num_sms, 129) == min(16 * num_sms + 1, 129)
    assert planner.get_theoretical_num_qps(hybrid_flag, num_sms, 65) == min(16 * num_sms + 1, 65)
    with pytest.raises(EPConfigError, match="num_sms"):
        planner.get_theoretical_num_qps(direct, 0)
    with pytest.raises(EPConfigError, match="num_allocated_qps"):
        planner.get_theoretical_num_qps(direct, 4, -1)
