"""Emulated nodes on the GPU through ``ep_torch.ElasticBuffer`` (issue 15, item 3; marker gpu).

4 processes share GPU 0 (a gloo group, the ipc transport) as 2 nodes x 2 ranks with ``EPKIT_SCALEUP_RANKS=2``: the
buffer runs the hybrid kernels (emulated scale-out put). Deterministic dispatch and combine, non-expand and expand,
are bitwise equal to ``ep_core.reference`` with ``num_scaleup_ranks=2``. With ``allow_hybrid_mode=False`` the same
2 x 2 nodes run direct mode across nodes (a put straight to every remote rank; issue 15, item 5): the reference is
then plain direct mode (``num_scaleup_ranks=N``) and the logical domain ``(1, N)``. The ranks run in a child process group
started by this file as a script, under a wall-clock limit (a hang fails the test); each writes what it saw to a
JSON file. Device arrays come back with ``.cpu()``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

N, SU, M, H, K, E = 4, 2, 64, 512, 8, 32


def _run(tmp_path: Path, hybrid: bool, limit: float = 400.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ, EPKIT_SCALEUP_RANKS=str(SU))
    # ranks sharing one GPU have no NVLink or NIC to detect: give the planner bandwidths (num_sms is fixed anyway)
    env.setdefault("EPKIT_NVLINK_GBS", "450")
    env.setdefault("EPKIT_RDMA_GBS", "50")
    for name in ("EPKIT_TORCH_REFERENCE_NVLINK_RANKS", "EPKIT_TORCH_TRANSPORT"):
        env.pop(name, None)
    code, text = run_script(__file__, [str(tmp_path), "hybrid" if hybrid else "direct"], limit, env=env)
    seen = [
        json.loads(p.read_text()) if p.exists() else {} for p in (tmp_path / f"{r}.json" for r in range(N))
    ]
    errors = [f"rank {r}: {s['error']}" for r, s in enumerate(seen) if s.get("error")]
    assert not errors, "\n".join(errors) + "\n" + text[-2000:]
    assert code == 0, text[-3000:]
    return seen


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side (run in the spawned processes)


def _np(t) -> np.ndarray:
    """A torch tensor (any device) as numpy; bf16 as its uint16 bits."""
    from ep_torch._convert import to_numpy

    return to_numpy(t.cpu()) if t is not None else None


def _diff(name: str, got: np.ndarray, want: np.ndarray) -> str:
    """ "" when equal bit for bit, else what differs (shapes, or the first differing rows)."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, want {want.shape}"
    if got.size == 0:
        return ""
    g, w = got.reshape(got.shape[0], -1).view(np.uint8), want.reshape(want.shape[0], -1).view(np.uint8)
    rows = np.flatnonzero((g != w).any(axis=1))
    if rows.size == 0:
        return ""
    r = int(rows[0])
    return (
        f"{name}: {rows.size} of {got.shape[0]} rows differ, first {rows[:8].tolist()}; row {r}: got "
        f"{got[r].ravel()[:8]} want {want[r].ravel()[:8]}"
    )


def _case(rank: int, do_expand: bool, hybrid: bool, seen: dict) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist
    from ep_core import reference, routing
    from ep_torch import ElasticBuffer
    from ep_torch._convert import from_numpy

    tag = "expand" if do_expand else "rank"
    su = SU if hybrid else N  # the reference's scale-up domain: direct mode across nodes is plain direct mode
    dev = torch.device("cuda", 0)
    buf = ElasticBuffer(
        None,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=K,
        deterministic=True,
        explicitly_destroy=True,
        num_gpu_timeout_secs=30,
        num_cpu_timeout_secs=60,
        transport="ipc",
        allow_hybrid_mode=hybrid,
    )
    seen[f"{tag}.setup"] = [
        buf.transport,
        buf.transport_choice.scaleup_ranks,
        list(buf.get_physical_domain_size()),
        list(buf.get_logical_domain_size()),
    ]
    inp = routing.make_inputs(N, [M, 40, 23, 0], H, E, K, seed=21, masked_ratio=0.2)
    x = from_numpy(inp.xs[rank], torch.bfloat16, dev)
    i = torch.from_numpy(np.ascontiguousarray(inp.topk_idxs[rank]).astype(np.int64)).to(dev)
    w = torch.from_numpy(np.ascontiguousarray(inp.topk_weights[rank]).astype(np.float32)).to(dev)
    recv_x, recv_i, recv_w, handle, _ = buf.dispatch(
        x, topk_idx=i, topk_weights=w, num_experts=E, num_sms=4, do_expand=do_expand
    )
    ref = reference.dispatch(
        inp.xs,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        num_max_tokens_per_rank=M,
        do_expand=do_expand,
        deterministic=True,
        num_scaleup_ranks=su,
    )
    want = ref[rank]
    nv = want.num_valid_rows
    got_x, got_w = _np(recv_x), _np(recv_w)
    meta, psum = _np(handle.recv_src_metadata), _np(handle.psum_num_recv_tokens_per_scaleup_rank)
    problems = [
        _diff(
            "psum_num_recv_tokens_per_scaleup_rank", psum, want.handle.psum_num_recv_tokens_per_scaleup_rank
        ),
        _diff("recv_src_metadata", meta[:nv], np.asarray(want.handle.recv_src_metadata)[:nv]),
    ]
    if do_expand:
        v = want.valid_expanded_rows  # a mask over the reference's rows (the kernels' output may be longer)
        if got_x.shape[0] < v.shape[0] or got_w.shape[0] < v.shape[0]:
            problems.append(f"expand rows: got {got_x.shape[0]} / {got_w.shape[0]}, want >= {v.shape[0]}")
        else:
            problems += [
                _diff("recv_x", got_x[: v.shape[0]][v], want.recv_x[v]),
                _diff("recv_topk_weights", got_w[: v.shape[0]][v], want.recv_topk_weights[v]),
            ]
    else:
        problems += [
            _diff("recv_x", got_x[:nv], want.recv_x[:nv]),
            _diff("recv_topk_idx", _np(recv_i)[:nv], want.recv_topk_idx[:nv]),
            _diff("recv_topk_weights", got_w[:nv], want.recv_topk_weights[:nv]),
        ]

    # combine what was received (with its weights): the reference reads the kernels' rows through their metadata
    comb_x, comb_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, num_sms=4)
    everyone: list = [None] * N
    dist.all_gather_object(everyone, (got_x, got_w, meta, psum))
    handles = [
        dataclasses.replace(ref[d].handle, recv_src_metadata=e[2], psum_num_recv_tokens_per_scaleup_rank=e[3])
        for d, e in enumerate(everyone)
    ]
    want_c = reference.combine(
        [e[0] for e in everyone], handles, topk_weights=[e[1] for e in everyone], num_scaleup_ranks=su
    )[rank]
    problems += [
        _diff("combined_x", _np(comb_x), want_c.combined_x),
        _diff("combined_topk_weights", _np(comb_w), want_c.combined_topk_weights),
    ]
    seen[f"{tag}.problems"] = [p for p in problems if p]
    buf.destroy()


def _worker(rank: int, world: int, out: str, mode: str) -> None:
    import traceback

    import torch

    torch.cuda.set_device(0)
    seen: dict = {}
    try:
        _case(rank, False, mode == "hybrid", seen)
        _case(rank, True, mode == "hybrid", seen)
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(seen))
    if "error" in seen:
        os._exit(0)  # the group may be out of step: leave without the launcher's closing barrier


# ---------------------------------------------------------------------------------------------------------------
# the test

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[True, False], ids=["hybrid", "direct-xnode"])
def ranks(request, tmp_path_factory) -> tuple[bool, list[dict]]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    pytest.importorskip("ep_symmem")
    return request.param, _run(tmp_path_factory.mktemp("hybrid-gpu"), request.param)


@pytest.mark.parametrize("tag", ["rank", "expand"])
def test_processes_share_gpu_as_two_nodes(ranks, tag):
    hybrid, ranks = ranks
    logical = [N // SU, SU] if hybrid else [1, N]
    for r, seen in enumerate(ranks):
        assert seen[f"{tag}.setup"] == ["ipc", SU, [N // SU, SU], logical], (r, seen[f"{tag}.setup"])
        assert not seen[f"{tag}.problems"], f"rank {r} ({tag}):\n" + "\n".join(seen[f"{tag}.problems"])


def test_conformance_modes_on_emulated_nodes(monkeypatch):
    """The conformance suite's mode matrix (dispatch, cached dispatch, combine; bf16/FP8, expand, alignments) on the
    same 2 x 2 emulated nodes: its reference uses the buffer's num_scaleup_ranks."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from ep_torch_conformance.conformance import run_spawned

    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", str(SU))
    monkeypatch.setenv("EPKIT_RDMA_GBS", os.environ.get("EPKIT_RDMA_GBS", "50"))
    per_rank = run_spawned(N, {"backend": "cuda-shared", "scenarios": ["modes"]})
    failures = [f"rank {r}: {n}\n{d}" for r, res in enumerate(per_rank) for n, ok, d in res if not ok]
    assert per_rank and per_rank[0], "no checks ran"
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:10])


if __name__ == "__main__":
    from ep_torch import launch

    launch.spawn(_worker, N, sys.argv[1], sys.argv[2])
