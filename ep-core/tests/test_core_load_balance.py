"""`ep_core.load_balance`: mapping checks, the per-rank routes against a brute-force reading of the mapping, the
references, the LB SM estimate."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from ep_core.errors import EPValueError
from ep_core.load_balance import (
    check_redundancy_mapping,
    lb_num_sms,
    lb_routes,
    plan_redundancy_mapping,
    prefetch_reference,
    reduce_grads_reference,
)

MAPPING = np.array([[3, -1, 0, 3], [1, 2, -1, -1], [5, 4, 3, 0]], dtype=np.int32)  # 3 LSA ranks, L = 2, R = 4


def test_check_mapping():
    assert check_redundancy_mapping(MAPPING, 3, 2).dtype == np.int64
    with pytest.raises(EPValueError, match="num_nvlink_ranks=2"):
        check_redundancy_mapping(MAPPING, 2, 2)
    with pytest.raises(EPValueError, match="int32"):
        check_redundancy_mapping(MAPPING.astype(np.int64), 3, 2)
    bad = MAPPING.copy()
    bad[1, 2] = 6
    with pytest.raises(EPValueError, match=r"redundancy_mapping\[1, 2\] = 6"):
        check_redundancy_mapping(bad, 3, 2)
    bad[1, 2] = -2
    with pytest.raises(EPValueError, match="-2"):
        check_redundancy_mapping(bad, 3, 2)


def test_routes_read_the_mapping():
    m = check_redundancy_mapping(MAPPING, 3, 2)
    for me in range(3):
        r = lb_routes(m, me, 2)
        for dst in range(3):
            want = [(int(e) % 2, c) for c, e in enumerate(m[dst]) if e >= 0 and e // 2 == me]
            assert list(r.send[dst]) == want
        for src in range(3):
            assert list(r.recv[src]) == [c for c, e in enumerate(m[me]) if e >= 0 and e // 2 == src]
        # what one rank sends to another is what that one receives from it
        for other in range(3):
            assert [c for _, c in r.send[other]] == list(lb_routes(m, other, 2).recv[me])
    assert lb_routes(m, 1, 2).send_counts == [2, 1, 1] and lb_routes(m, 0, 2).recv_counts == [1, 2, 0]


def test_references():
    rng = np.random.default_rng(0)
    experts = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]
    redundant = [np.full((4, 5), 7.0, dtype=np.float32) for _ in range(3)]
    got = prefetch_reference(redundant, experts, MAPPING)
    assert np.array_equal(got[0][0], experts[1][1]) and np.array_equal(got[0][1], redundant[0][1])
    assert np.array_equal(got[2][0], experts[2][1]) and np.array_equal(got[2][3], experts[0][0])
    grads = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]
    red_g = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(3)]
    out = reduce_grads_reference(red_g, grads, MAPPING)
    # expert 3 (rank 1, local 1) sits in slots (0, 0), (0, 3), (2, 2): added in that order
    want = ((grads[1][1] + red_g[0][0]).astype(np.float32) + red_g[0][3]).astype(np.float32) + red_g[2][2]
    assert np.array_equal(out[1][1], want.astype(np.float32))
    assert np.array_equal(out[2][0], grads[2][0] + red_g[2][1])  # expert 4: slot (2, 1) only
    assert np.array_equal(grads[1][1], grads[1][1])  # inputs untouched


def test_lb_num_sms():
    assert lb_num_sms(450) == 10  # ceil(max(450/200, 450/50)) = 9, rounded up to even
    assert lb_num_sms(400, 200, 50) == 8
    assert lb_num_sms(1) == 2
    with pytest.raises(EPValueError):
        lb_num_sms(0)


def greedy_reference(loads: np.ndarray, num_redundant: int) -> np.ndarray:
    """An independent reading of `plan_redundancy_mapping`'s rule: each step takes the lexicographically smallest
    (-share of the expert, expert, load of the rank, rank) over every (expert with load, rank that may host it)."""
    nvl, num_local = loads.shape
    flat = [int(v) for v in loads.reshape(-1)]
    inst = {e: [e // num_local] for e in range(len(flat))}  # ranks holding an instance of e
    out = np.full((nvl, num_redundant), -1, dtype=np.int32)
    fill = [0] * nvl
    while True:

        def load_of(r):
            return sum((Fraction(flat[e], len(inst[e])) for e in inst if r in inst[e]), Fraction(0))

        pairs = [
            (-Fraction(flat[e], len(inst[e])), e, load_of(r), r)
            for e in inst
            if flat[e] > 0
            for r in range(nvl)
            if fill[r] < num_redundant and r not in inst[e]
        ]
        if not pairs:
            return out
        _, e, _, r = min(pairs)
        out[r, fill[r]] = e
        fill[r] += 1
        inst[e].append(r)


@pytest.mark.parametrize("seed", range(12))
def test_plan_redundancy_mapping_against_reference(seed):
    rng = np.random.default_rng(seed)
    nvl, num_local, num_red = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(0, 5))
    loads = rng.integers(0, 50, size=(nvl, num_local)) * (rng.random((nvl, num_local)) < 0.8)
    if seed == 0:
        loads[:] = 7  # ties everywhere
    got = plan_redundancy_mapping(loads, num_red)
    assert got.dtype == np.int32 and got.shape == (nvl, num_red)
    assert np.array_equal(got, greedy_reference(loads, num_red))
    # a valid mapping: never a rank's own expert, never twice on a rank, filled slots first
    check_redundancy_mapping(got, nvl, num_local)
    for r in range(nvl):
        row = [int(e) for e in got[r] if e >= 0]
        assert all(e // num_local != r for e in row) and len(set(row)) == len(row)
        assert all(e >= 0 for e in got[r][: len(row)])
        assert all(loads.reshape(-1)[e] > 0 for e in row)


def test_plan_redundancy_mapping_edges():
    assert (
        plan_redundancy_mapping(np.zeros((3, 2), dtype=np.int64), 2) == -1
    ).all()  # no load: nothing copied
    assert plan_redundancy_mapping(np.ones((2, 2), dtype=np.int32), 0).shape == (2, 0)
    assert (plan_redundancy_mapping(np.array([[5, 1]]), 3) == -1).all()  # one rank: nowhere to copy to
    # the hot expert goes first to the least loaded ranks (ties: the smaller rank), then the next one where room is
    assert plan_redundancy_mapping(np.array([[100, 0], [1, 1], [2, 0]]), 1).tolist() == [[4], [0], [0]]
    assert plan_redundancy_mapping(np.array([[100, 0], [1, 1], [3, 0]]), 1).tolist() == [[4], [0], [0]]
    assert plan_redundancy_mapping(np.array([[9, 0], [5, 0]]), 2).tolist() == [[2, -1], [0, -1]]
    with pytest.raises(EPValueError, match="loads"):
        plan_redundancy_mapping(np.ones((2, 2)), 1)  # float counts
    with pytest.raises(EPValueError, match="loads"):
        plan_redundancy_mapping(-np.ones((2, 2), dtype=np.int64), 1)
    with pytest.raises(EPValueError, match="num_redundant_experts"):
        plan_redundancy_mapping(np.ones((2, 2), dtype=np.int64), -1)
