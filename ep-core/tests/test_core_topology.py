"""Topology: physical/logical domains, rank decomposition, expert ownership, limits."""

from __future__ import annotations

import pytest
from ep_core.errors import EPConfigError
from ep_core.topology import Topology


def test_direct_one_node():
    t = Topology(8)
    assert t.physical_domain_size == (1, 8)
    assert t.logical_domain_size == (1, 8)
    assert not t.is_hybrid and t.is_scaleup_nvlink


def test_hybrid_and_forced_direct():
    t = Topology(32, 8)
    assert t.physical_domain_size == (4, 8)
    assert t.logical_domain_size == (4, 8) and t.is_hybrid and t.is_scaleup_nvlink
    assert [t.scaleout_idx(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert [t.scaleup_idx(r) for r in (0, 7, 8, 31)] == [0, 7, 0, 7]
    assert t.global_rank(3, 7) == 31
    d = Topology(32, 8, allow_hybrid_mode=False)
    assert d.logical_domain_size == (1, 32) and not d.is_hybrid and not d.is_scaleup_nvlink


def test_experts():
    t = Topology(4)
    assert t.experts_of_rank(2, 16) == range(8, 12)
    assert t.rank_of_expert(15, 16) == 3
    assert t.num_experts_per_rank(16) == 4
    with pytest.raises(EPConfigError, match="num_experts"):
        t.check_num_experts(10)
    with pytest.raises(EPConfigError, match="experts per rank"):
        Topology(1).check_num_experts(512)
    with pytest.raises(EPConfigError, match="at most 2048"):
        Topology(2).check_num_experts(4096)
    with pytest.raises(EPConfigError, match="<= 128"):
        Topology(16, 8).check_num_experts(2048)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [((0,), "num_ranks"), ((2048,), "num_ranks"), ((8, 3), "num_nvlink_ranks"), ((64 * 2, 2), "hybrid mode")],
)
def test_bad_topologies(args, fragment):
    with pytest.raises(EPConfigError, match=fragment):
        Topology(*args)


def test_rank_range_and_layout_interop():
    t = Topology(16, 8)
    with pytest.raises(EPConfigError, match="rank"):
        t.scaleup_idx(16)
    lt = t.to_layout()
    assert (lt.num_ranks, lt.num_scaleup_ranks, lt.is_scaleup_nvlink) == (16, 8, True)
