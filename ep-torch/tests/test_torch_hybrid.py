"""Emulated nodes through ``ep_torch.ElasticBuffer`` on the CPU reference backend (issue 15, item 3).

``EPKIT_SCALEUP_RANKS=2`` on 4 gloo processes makes 2 nodes of 2 ranks: dispatch and combine of a deterministic
buffer must equal ``ep_core.reference`` with ``num_scaleup_ranks=2`` and ``deterministic=True`` (rows sorted by the
source token's global index, as DeepEP's deterministic mode sorts them (issue 42); S_u region prefix sums, the
per-node level-2 reduction), and differ from direct mode on these inputs (so the test can fail). The domain sizes, the size hint, the old name
``EPKIT_TORCH_REFERENCE_NVLINK_RANKS`` and a bad value are checked in the same processes. The ranks run in a child
process group started by this file as a script, under a wall-clock limit; each writes what it saw to a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

N, SU, M, H, K, E = 4, 2, 16, 64, 4, 16


def _run(tmp_path: Path, limit: float = 150.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ, EPKIT_SCALEUP_RANKS=str(SU))
    env.pop("EPKIT_TORCH_REFERENCE_NVLINK_RANKS", None)
    env.pop("EPKIT_TORCH_TRANSPORT", None)
    code, out = run_script(__file__, [str(tmp_path)], limit, env=env)
    assert code == 0, out[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(N)]


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side (run in the spawned processes)


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _case(rank: int, do_expand: bool, seen: dict) -> None:
    import torch
    from ep_core import reference, routing
    from ep_torch import ElasticBuffer
    from ep_torch._convert import from_numpy, to_numpy

    tag = "expand" if do_expand else "rank"
    inp = routing.make_inputs(N, [M, 11, M, 5], H, E, K, seed=7)
    buf = ElasticBuffer(None, num_max_tokens_per_rank=M, hidden=H, num_topk=K, deterministic=True)
    seen[f"{tag}.transport"] = buf.transport
    seen[f"{tag}.domains"] = [
        list(buf.get_physical_domain_size()),
        list(buf.get_logical_domain_size()),
        [buf.scaleout_rank_idx, buf.scaleup_rank_idx],
    ]
    x = from_numpy(inp.xs[rank], torch.bfloat16)
    i = torch.from_numpy(np.ascontiguousarray(inp.topk_idxs[rank]).astype(np.int64))
    w = torch.from_numpy(np.ascontiguousarray(inp.topk_weights[rank]).astype(np.float32))
    recv_x, recv_i, recv_w, handle, _ = buf.dispatch(
        x, topk_idx=i, topk_weights=w, num_experts=E, do_expand=do_expand
    )
    kw = dict(num_experts=E, num_max_tokens_per_rank=M, do_expand=do_expand)
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_scaleup_ranks=SU, deterministic=True, **kw
    )
    direct = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, deterministic=True, **kw)
    want = ref[rank]
    got_x = to_numpy(recv_x)
    seen[f"{tag}.recv_x"] = got_x.shape == want.recv_x.shape and _bits(got_x) == _bits(want.recv_x)
    seen[f"{tag}.psum"] = [
        np.asarray(handle.psum_num_recv_tokens_per_scaleup_rank).tolist(),
        np.asarray(want.handle.psum_num_recv_tokens_per_scaleup_rank).tolist(),
    ]
    if not do_expand:
        seen[f"{tag}.recv_topk_idx"] = _bits(to_numpy(recv_i)) == _bits(want.recv_topk_idx)
    seen[f"{tag}.recv_topk_weights"] = _bits(to_numpy(recv_w)) == _bits(want.recv_topk_weights)
    d = direct[rank]
    # the rows are direct mode's (deterministic: by global index); the S_u region prefix sums differ
    seen[f"{tag}.dispatch_differs_from_direct"] = (
        got_x.shape != d.recv_x.shape
        or _bits(got_x) != _bits(d.recv_x)
        or _bits(handle.psum_num_recv_tokens_per_scaleup_rank)
        != _bits(d.handle.psum_num_recv_tokens_per_scaleup_rank)
    )

    # combine: every rank's expert outputs are random bf16 rows (known to all ranks: seeded by the rank)
    ys = [routing.random_bf16((ref[r].recv_x.shape[0], H), np.random.default_rng(100 + r)) for r in range(N)]
    ws = [ref[r].recv_topk_weights for r in range(N)]
    comb_x, comb_w, _ = buf.combine(from_numpy(ys[rank], torch.bfloat16), handle, topk_weights=recv_w)
    handles = [o.handle for o in ref]
    want_c = reference.combine(ys, handles, topk_weights=ws, num_scaleup_ranks=SU)[rank]
    direct_c = reference.combine(ys, handles, topk_weights=ws, num_scaleup_ranks=N)[rank]
    got_c = to_numpy(comb_x)
    seen[f"{tag}.combined_x"] = _bits(got_c) == _bits(want_c.combined_x)
    seen[f"{tag}.combined_w"] = _bits(to_numpy(comb_w)) == _bits(want_c.combined_topk_weights)
    seen[f"{tag}.combine_differs_from_direct"] = _bits(got_c) != _bits(direct_c.combined_x)


def _outcome(fn) -> str:
    try:
        return repr(fn())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _knobs(rank: int, seen: dict) -> None:
    """Other values of the knob, read at construction (each needs no collective before ep-core's envelope)."""
    from ep_core.planner import get_buffer_size_hint
    from ep_core.topology import Topology
    from ep_torch import ElasticBuffer

    big = (4096, 7168, 8)  # large enough for hybrid and direct sizes to differ after 2 MiB rounding
    seen["size_hint"] = [
        ElasticBuffer.get_buffer_size_hint(None, *big),
        get_buffer_size_hint(Topology(N, SU), *big),
        get_buffer_size_hint(Topology(N), *big),
    ]

    def domains() -> list:
        buf = ElasticBuffer(None, num_max_tokens_per_rank=M, hidden=H, num_topk=K)
        return [list(buf.get_physical_domain_size()), list(buf.get_logical_domain_size())]

    os.environ["EPKIT_SCALEUP_RANKS"] = "3"
    seen["three"] = _outcome(domains)
    os.environ["EPKIT_SCALEUP_RANKS"] = "-2"
    seen["negative"] = _outcome(domains)
    os.environ["EPKIT_SCALEUP_RANKS"] = str(N)
    seen["all_ranks"] = _outcome(domains)
    del os.environ["EPKIT_SCALEUP_RANKS"]
    os.environ["EPKIT_TORCH_REFERENCE_NVLINK_RANKS"] = str(SU)
    seen["old_name"] = _outcome(domains)
    os.environ["EPKIT_SCALEUP_RANKS"] = str(N)
    seen["names_disagree"] = _outcome(domains)


def _worker(rank: int, world: int, out: str) -> None:
    seen: dict = {}
    try:
        _case(rank, False, seen)
        _case(rank, True, seen)
        _knobs(rank, seen)
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(seen))


# ---------------------------------------------------------------------------------------------------------------
# the test


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("tag", ["rank", "expand"])
def test_dispatch_and_combine_equal_the_hybrid_reference(ranks, tag):
    for r, seen in enumerate(ranks):
        assert seen[f"{tag}.transport"] == "reference", seen
        assert seen[f"{tag}.domains"] == [[N // SU, SU], [N // SU, SU], [r // SU, r % SU]], (r, seen)
        got, want = seen[f"{tag}.psum"]
        assert got == want and len(got) == SU, (r, got, want)  # one region per scale-up index
        for name in ("recv_x", "recv_topk_weights", "combined_x", "combined_w"):
            assert seen[f"{tag}.{name}"] is True, f"rank {r}: {tag} {name} differs from the hybrid reference"
        if tag == "rank":
            assert seen["rank.recv_topk_idx"] is True, f"rank {r}: recv_topk_idx"
    # hybrid mode is observable on these inputs: the regions (and non-expand row order), the level-2 reduction
    assert any(s[f"{tag}.dispatch_differs_from_direct"] for s in ranks), "hybrid and direct row orders agree"
    assert any(s[f"{tag}.combine_differs_from_direct"] for s in ranks), "hybrid and direct reductions agree"


def test_size_hint_follows_the_knob(ranks):
    for seen in ranks:
        hint, hybrid, direct = seen["size_hint"]
        assert hint == hybrid, seen["size_hint"]
        assert hybrid != direct  # else the check above says nothing


def test_other_values(ranks):
    for r, seen in enumerate(ranks):
        assert seen["three"].startswith("EPConfigError: EPKIT_SCALEUP_RANKS=3 (rank"), seen["three"]
        assert f"(rank {r})" in seen["three"] and "divisor of the group size 4" in seen["three"]
        assert seen["negative"].startswith("EPConfigError: EPKIT_SCALEUP_RANKS=-2"), seen["negative"]
        assert f"(rank {r})" in seen["negative"]
        assert seen["all_ranks"] == repr([[1, N], [1, N]]), seen["all_ranks"]  # one node: direct mode
        assert seen["old_name"] == repr([[N // SU, SU], [N // SU, SU]]), seen["old_name"]
        assert seen["names_disagree"].startswith("EPConfigError") and "disagree" in seen["names_disagree"]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(_worker, N, sys.argv[1])
