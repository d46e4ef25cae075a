"""ep_core.agrs: size functions, configuration checks and the session state machine."""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import agrs
from ep_core.bootstrap import ThreadGroup
from ep_core.errors import EPStateError, EPValueError

MiB = 1 << 20


def test_sizes_match_deepep_formulas() -> None:
    assert agrs.get_agrs_num_max_session_bytes(4, (3, 5), 2) == 128  # align(4*15*2, 32)
    assert agrs.get_agrs_num_max_session_bytes(4, [(3, 5), (1,)], 2) == 128 + 32
    assert agrs.get_agrs_buffer_size_hint(1) == 2 * MiB
    assert agrs.get_agrs_buffer_size_hint(2 * MiB + 1) == 4 * MiB
    with pytest.raises(EPValueError, match="num_max_session_bytes"):
        agrs.get_agrs_buffer_size_hint(0)
    assert agrs.normalize_shapes((2, 3)) == ([(2, 3)], False)
    assert agrs.normalize_shapes([(2, 3), (4,)]) == ([(2, 3), (4,)], True)


def test_config_checks() -> None:
    c = agrs.make_agrs_config(1, 4, 4, 2 * MiB, 100, 3)
    assert c.num_max_session_bytes == 128
    with pytest.raises(EPValueError, match="at least 2 ranks"):
        agrs.make_agrs_config(0, 1, 1, MiB, 100, 3)
    with pytest.raises(EPValueError, match="one NVLink domain"):
        agrs.make_agrs_config(0, 4, 2, MiB, 100, 3)
    with pytest.raises(EPValueError, match=r"exceeds the buffer .* rank 2"):
        agrs.make_agrs_config(2, 4, 4, MiB, MiB + 1, 3)
    with pytest.raises(EPValueError, match="<= 32"):
        agrs.make_agrs_config(0, 4, 4, MiB, 100, 33)


def test_session_state_machine() -> None:
    s = agrs.AGRSSession(rank=1)
    with pytest.raises(EPStateError, match="agrs_set_config"):
        s.inplace_offsets([4])
    s.configure(agrs.make_agrs_config(1, 2, 2, MiB, 256, 2))
    with pytest.raises(EPStateError, match="not inside"):
        s.plan_all_gather([4], [None])
    with pytest.raises(EPStateError, match="not inside"):
        s.destroy()
    s.create()
    with pytest.raises(EPStateError, match="already inside"):
        s.create()
    assert s.inplace_offsets([40, 8]) == [40, 96 + 8]  # rank 1's part; align(80, 32) = 96
    offs, slot = s.plan_all_gather([40], [40])
    assert offs == [0] and slot == 0
    with pytest.raises(EPValueError, match="same order"):
        s.plan_all_gather([8], [0])
    with pytest.raises(EPValueError, match="more than num_max_session_bytes"):
        s.plan_all_gather([100], [None])
    s.plan_all_gather([8], [None])
    with pytest.raises(EPValueError, match="already ran 2"):
        s.plan_all_gather([1], [None])
    assert s.destroy() == 1
    s.create()
    assert s.session_idx == 2 and s.offset == 0 and s.slot == 0
    with pytest.raises(EPStateError, match="inside a session"):
        s.configure(agrs.make_agrs_config(1, 2, 2, MiB, 256, 2))


def test_reference_stacks_parts() -> None:
    parts = [np.full((2, 3), r, np.int32) for r in range(3)]
    out = agrs.all_gather_reference(parts)
    assert out.shape == (3, 2, 3) and (out[2] == 2).all()


def test_reduce_scatter_reference_sums_in_rank_order() -> None:
    xs = [np.arange(12, dtype=np.float32).reshape(6, 2) * (r + 1) for r in range(3)]
    out = agrs.reduce_scatter_reference(xs, 1)
    assert out.shape == (2, 2) and np.array_equal(out, xs[0][2:4] * 6)


def _threads(n: int, fn) -> list:
    return ThreadGroup(n, timeout_secs=30).run(
        lambda r, boot: fn(boot), raise_first=False, join_timeout_secs=60
    )


@pytest.mark.parametrize("n", [2, 3])
def test_host_agrs_over_a_bootstrap(n: int) -> None:
    def part(r: int, i: int) -> np.ndarray:
        return np.random.default_rng(10 * r + i).standard_normal((3, 4)).astype(np.float32)

    def rank(boot):
        h = agrs.HostAGRS(boot, 2 * MiB)
        h.set_config(64 * 1024, 4)
        h.create_session()
        a = h.all_gather(part(boot.rank, 0))
        ip = h.get_inplace((3, 4), np.float32)
        ip[...] = part(boot.rank, 1)
        b, c = h.all_gather([ip, part(boot.rank, 2)])
        rs = h.reduce_scatter(np.concatenate([part(boot.rank, 3)] * n))
        h.destroy_session()
        return a.copy(), b.copy(), c.copy(), rs

    for r, res in enumerate(_threads(n, rank)):
        assert not isinstance(res, Exception), res
        a, b, c, rs = res
        for i, got in enumerate((a, b, c)):
            assert np.array_equal(got, agrs.all_gather_reference([part(q, i) for q in range(n)]))
        want = agrs.reduce_scatter_reference([np.concatenate([part(q, 3)] * n) for q in range(n)], r)
        assert np.array_equal(rs, want)
