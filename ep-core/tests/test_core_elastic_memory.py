"""Elastic memory (issue 20): receive regions that do not fit the GPU part spill into the host part
(`num_cpu_bytes`) instead of being refused; `planner.explain_memory` shows what that costs. CPU: the reference
backend (threads) against ep_core.reference, the planner's arithmetic, the ipc transport's collective fallback."""

from __future__ import annotations

import warnings

import ep_core as ec
import ep_layout
import numpy as np
import pytest
from ep_core import elastic_memory, planner, routing
from ep_core import reference as ref
from ep_core.errors import EPConfigError, EPValueError
from ep_core.topology import Topology

MiB = 1 << 20
N, M, H, E, K = 2, 512, 2048, 8, 2


def run_ranks(fn, n=N):
    return ec.ThreadGroup(n, timeout_secs=120).run(fn)


def _need() -> int:
    return planner.get_buffer_size_hint(Topology(N, N, True), M, H, K)


def test_regions_larger_than_the_gpu_part_spill_into_the_host_part():
    need = _need()
    num_bytes = ep_layout.align(need, 2 * MiB)
    cpu = num_bytes - 2 * MiB  # a 2 MiB GPU part: most of the receive region lives in the host part
    assert need > num_bytes - cpu
    inp = routing.make_inputs(N, [M, M - 7], H, E, K, seed=3)

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport="reference",
            num_bytes=num_bytes,
            num_cpu_bytes=cpu,
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
            deterministic=True,
            explicitly_destroy=True,
        )
        out = buf.dispatch(
            ec.host_array(inp.xs[r], "bfloat16"),
            ec.host_array(inp.topk_idxs[r]),
            ec.host_array(inp.topk_weights[r]),
            num_experts=E,
        )
        comb = buf.combine(out.recv_x, out.handle, out.recv_topk_weights)
        buf.destroy()
        return np.array(ec.to_numpy(out.recv_x)), np.array(ec.to_numpy(comb.combined_x))

    got = run_ranks(rank_fn)
    want = ref.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M)
    want_c = ref.combine(
        [w.recv_x for w in want], [w.handle for w in want], topk_weights=[w.recv_topk_weights for w in want]
    )
    for r in range(N):
        assert got[r][0].tobytes() == want[r].recv_x.tobytes()
        assert got[r][1].tobytes() == want_c[r].combined_x.tobytes()


def test_a_region_larger_than_gpu_and_host_parts_is_refused():
    num_bytes = ep_layout.align(_need(), 2 * MiB) - 2 * MiB
    inp = routing.make_inputs(N, [M, M], H, E, K, seed=4)

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport="reference",
            num_bytes=num_bytes,
            num_cpu_bytes=2 * MiB,
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
        )
        with pytest.raises(EPValueError, match=r"GPU \+ 2097152 host"):
            buf.dispatch(
                ec.host_array(inp.xs[r], "bfloat16"),
                ec.host_array(inp.topk_idxs[r]),
                ec.host_array(inp.topk_weights[r]),
                num_experts=E,
            )
        return True

    assert all(run_ranks(rank_fn))


# ---------------------------------------------------------------------------------------------------------------
# the planner's placement and cost


def _tok() -> int:
    return ep_layout.get_sizing_dispatch_token(H, K, False).get_num_bytes()


def test_explain_memory_fits_gpu_without_host_bytes():
    t = Topology(N, N, True)
    p = planner.explain_memory(t, M, H, K, ep_layout.align(_need(), 2 * MiB), 0)
    assert p.fits_gpu and p.dispatch_host_bytes == p.combine_host_bytes == 0
    assert p.dispatch_host_us == 0 and p.hbm_gbs == 0  # nothing to detect


def test_explain_memory_places_the_tail_in_host_memory_and_costs_it():
    t = Topology(N, N, True)
    num_bytes = ep_layout.align(_need(), 2 * MiB)
    cpu = num_bytes - 2 * MiB
    p = planner.explain_memory(t, M, H, K, num_bytes, cpu, num_experts=E, hbm_gbs=4000, host_gbs=50)
    tok = _tok()
    assert p.num_gpu_bytes == 2 * MiB and not p.fits_gpu
    assert p.dispatch_host_bytes == p.dispatch_bytes - 2 * MiB
    # uniform routing: each source fills M * ekt / N rows of its block, from the front
    rows = M * planner.expected_num_groups(E, K, N) / N * tok
    want = sum(
        max(0.0, min(s * M * tok + rows, p.dispatch_bytes) - max(s * M * tok, 2 * MiB)) for s in range(N)
    )
    assert p.expected_dispatch_host_bytes == pytest.approx(want)
    assert 0 < p.expected_dispatch_host_bytes < p.dispatch_host_bytes
    assert p.dispatch_host_us == pytest.approx(2 * p.dispatch_host_bytes / 50 / 1e3)
    assert p.dispatch_hbm_us == pytest.approx(2 * p.dispatch_host_bytes / 4000 / 1e3)
    assert p.host_path == "argument" and p.as_dict()["host_gbs"] == 50


def test_explain_memory_counts_a_ranks_own_rows_as_tails():
    """The direct dispatch stores a row its rank keeps without the hidden part: with `rank`, that source block's
    expected host bytes shrink to the tails; the combine's slots are used with a token's chance to visit a rank."""
    t = Topology(N, N, True)
    num_bytes = ep_layout.align(_need(), 2 * MiB)
    cpu = num_bytes - 2 * MiB
    kw = dict(num_experts=E, hbm_gbs=4000, host_gbs=50)
    whole = planner.explain_memory(t, M, H, K, num_bytes, cpu, **kw)
    tok = _tok()
    tail = (tok - ep_layout.get_sizing_dispatch_token(H, K, False).num_hidden_bytes) / tok
    rows = M * planner.expected_num_groups(E, K, N) / N * tok
    for rank in range(N):
        p = planner.explain_memory(t, M, H, K, num_bytes, cpu, rank=rank, **kw)
        own = max(0.0, min(rank * M * tok + rows, p.dispatch_bytes) - max(rank * M * tok, 2 * MiB))
        assert p.expected_dispatch_host_bytes == pytest.approx(
            whole.expected_dispatch_host_bytes - own * (1 - tail)
        )
    p_visit = planner.expected_num_groups(E, K, N) / N
    assert whole.expected_combine_host_bytes == pytest.approx(whole.combine_host_bytes * p_visit)
    one = Topology(1, 1, True)  # EP1: every row is kept, only tails are stored
    m1 = planner.get_buffer_size_hint(one, M, H, K)
    p1 = planner.explain_memory(one, M, H, K, m1, m1 - 2 * MiB, rank=0, **kw)
    assert p1.dispatch_host_bytes > 0
    assert p1.expected_dispatch_host_bytes == pytest.approx(p1.dispatch_host_bytes * tail)
    assert p1.expected_combine_host_bytes == p1.combine_host_bytes
    with pytest.raises(EPConfigError, match="rank: expected"):
        planner.explain_memory(t, M, H, K, num_bytes, cpu, rank=N, **kw)


def test_explain_memory_without_host_memory_costs_nothing():
    t = Topology(N, N, True)
    num_bytes = ep_layout.align(_need(), 2 * MiB)
    p = planner.explain_memory(t, M, H, K, num_bytes, num_bytes - 2 * MiB, host_memory=False)
    assert p.dispatch_host_bytes > 0 and p.dispatch_host_us == 0 and p.host_gbs == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_bytes=2 * MiB, num_cpu_bytes=0), "more than the buffer's"),
        (dict(num_bytes=4 * MiB, num_cpu_bytes=8 * MiB), "num_cpu_bytes: expected"),
        (dict(num_bytes=0, num_cpu_bytes=0), "num_bytes: expected a positive int"),
    ],
)
def test_explain_memory_refuses_bad_sizes(kwargs, match):
    with pytest.raises(EPConfigError, match=match):
        planner.explain_memory(Topology(N, N, True), M, H, K, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# allocation


class _Transport:
    def __init__(self, host: bool) -> None:
        self.calls: list = []
        if host:
            self.supports_host_memory = True

    def allocate(self, bootstrap, num_bytes, **kw):
        self.calls.append((num_bytes, kw))
        return object()


def test_allocate_storage_asks_for_host_memory_only_where_supported():
    with_host, without = _Transport(True), _Transport(False)
    elastic_memory.allocate_storage(with_host, None, 8 * MiB, 4 * MiB)
    elastic_memory.allocate_storage(with_host, None, 8 * MiB, 0)
    elastic_memory.allocate_storage(without, None, 8 * MiB, 4 * MiB)
    assert with_host.calls == [(8 * MiB, {"num_host_bytes": 4 * MiB}), (8 * MiB, {})]
    assert without.calls == [(8 * MiB, {})]
    assert elastic_memory.host_bytes(object()) == 0


class _Boot:
    def __init__(self, others: list[bytes]) -> None:
        self.others = others

    def allgather(self, mine: bytes) -> list[bytes]:
        return [mine, *self.others]


def test_ipc_host_part_falls_back_to_gpu_memory_on_every_rank_when_one_rank_cannot_map_it(monkeypatch):
    ep_symmem = pytest.importorskip("ep_symmem")
    from ep_core.transports import ipc

    made: list = []

    class _Alloc:
        def close(self) -> None:
            made.append("closed")

    monkeypatch.setattr(ipc, "_current_device", lambda: 0)
    monkeypatch.setattr(
        ep_symmem.SymmetricAllocation,
        "create",
        classmethod(lambda cls, *a, **kw: made.append(kw) or _Alloc()),
    )
    # this rank could build it, rank 1 could not: both fall back
    with pytest.warns(UserWarning, match=r"rank 1 cannot map host NUMA memory \(no NUMA\)"):
        assert ipc.IpcBuffer._create_elastic(_Boot([b"no NUMA"]), 8 * MiB, 4 * MiB) is None
    assert made == [{"num_host_bytes": 4 * MiB, "device": 0}, "closed"]
    made.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(ipc.IpcBuffer._create_elastic(_Boot([b""]), 8 * MiB, 4 * MiB), _Alloc)
    # no GPU part left: refused on this rank, so everyone falls back
    with pytest.warns(UserWarning, match="leaves no GPU part"):
        assert ipc.IpcBuffer._create_elastic(_Boot([b""]), 4 * MiB, 4 * MiB) is None
