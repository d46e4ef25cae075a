"""Issue 14 (collective safety) on 2 gloo processes through ``ep_torch.ElasticBuffer`` (CPU reference backend).

Every case runs in a child process group started by this file as a script, under a wall-clock limit: a regression
(a hang) fails the test instead of blocking CI. Each rank writes what it saw to a JSON file that the test checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

M, H, K, E = 8, 32, 2, 8


def _run(mode: str, tmp_path: Path, limit: float = 90.0, world: int = 2) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [mode, str(tmp_path)], limit, what=f"{mode}: ")
    assert code == 0, out[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side (run in the spawned processes)


def _inputs(world: int, seed: int, num_experts: int = E):
    from ep_core import routing

    return routing.make_inputs(world, 6, H, num_experts, K, seed=seed)


def _tensors(inp, r: int):
    import torch
    from ep_torch._convert import from_numpy

    x = from_numpy(inp.xs[r], torch.bfloat16)
    i = torch.from_numpy(np.ascontiguousarray(inp.topk_idxs[r]).astype(np.int64))
    w = torch.from_numpy(np.ascontiguousarray(inp.topk_weights[r]).astype(np.float32))
    return x, i, w


def _want(inp, r: int, num_experts: int = E):
    from ep_core import reference

    return reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=num_experts, num_max_tokens_per_rank=M
    )[r]


def _same(res, want) -> bool:
    from ep_torch._convert import to_numpy

    recv_x = to_numpy(res[0])
    return recv_x.shape == want.recv_x.shape and recv_x.tobytes() == want.recv_x.tobytes()


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _buffer(timeout: float = 20):
    from ep_torch import ElasticBuffer

    return ElasticBuffer(
        None,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=K,
        num_cpu_timeout_secs=timeout,
        explicitly_destroy=True,
    )


def _case_announce(rank: int, world: int, seen: dict) -> None:
    """The issue's example: a one-rank error outside the exchange, then a valid call."""
    buf = _buffer()
    a, b = _inputs(world, 1), _inputs(world, 2)
    x, i, w = _tensors(a, rank)
    if rank == 0:
        seen["bad_event"] = _outcome(
            lambda: buf.dispatch(
                x,
                topk_idx=i,
                topk_weights=w,
                num_experts=E,
                previous_event=object(),
                allocate_on_comm_stream=True,
            )
        )
    else:
        seen["bad_event"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    x2, i2, w2 = _tensors(b, rank)
    seen["next_ok"] = _same(buf.dispatch(x2, topk_idx=i2, topk_weights=w2, num_experts=E), _want(b, rank))
    # routing error of rank 0 (expert id out of range / -5) reported on rank 1 as EPPeerError naming rank 0
    for name, value in (("out_of_range", E + 1), ("minus_five", -5)):
        bad = i.clone()
        if rank == 0:
            bad[3, 1] = value
        seen[name] = _outcome(lambda bad=bad: buf.dispatch(x, topk_idx=bad, topk_weights=w, num_experts=E))
    # disagreements: num_experts, hidden, operation
    seen["num_experts"] = _outcome(
        lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=16 if rank == 0 else 8)
    )
    seen["refused"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    buf.reset()
    xh = x[:, : H // 2].contiguous() if rank == 1 else x
    seen["hidden"] = _outcome(lambda: buf.dispatch(xh, topk_idx=i, topk_weights=w, num_experts=E))
    buf.reset()
    recv, _, _, handle, _ = buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E)
    if rank == 0:
        seen["operation"] = _outcome(lambda: buf.combine(recv, handle))
    else:
        seen["operation"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    buf.reset()
    seen["after_ok"] = _same(buf.dispatch(x2, topk_idx=i2, topk_weights=w2, num_experts=E), _want(b, rank))
    buf.destroy()
    seen["after_destroy"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))


def _case_random(rank: int, world: int, seen: dict) -> None:
    """Valid calls mixed with one-rank errors: every valid call still equals the reference."""
    import torch
    from ep_torch import EventHandle

    buf = _buffer()
    rng = np.random.default_rng(7)  # same stream on every rank: the plan is shared
    results = []
    for step in range(12):
        inp = _inputs(world, 100 + step)
        x, i, w = _tensors(inp, rank)
        kind = int(rng.integers(0, 4))
        culprit = int(rng.integers(0, world))
        if kind == 0 or rank != culprit:
            if kind == 0:
                results.append(
                    _same(buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E), _want(inp, rank))
                )
            else:
                results.append(
                    _outcome(
                        lambda x=x, i=i, w=w: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E)
                    )[:12]
                )
            continue
        if kind == 1:
            bad = dict(previous_event=object(), allocate_on_comm_stream=True)
        elif kind == 2:
            bad = dict(previous_event=EventHandle(device="cpu"))  # requires allocate_on_comm_stream
        else:
            i = torch.full_like(i, -7)
            bad = {}
        results.append(
            _outcome(
                lambda x=x, i=i, w=w, bad=bad: buf.dispatch(
                    x, topk_idx=i, topk_weights=w, num_experts=E, **bad
                )
            ).split(":")[0]
        )
    seen["results"] = results
    buf.destroy()


def _case_timeout(rank: int, world: int, seen: dict) -> None:
    buf = _buffer(timeout=1.5)
    inp = _inputs(world, 3)
    x, i, w = _tensors(inp, rank)
    if rank == 1:
        time.sleep(3.5)  # never calls: rank 0 must give up after num_cpu_timeout_secs
        return
    t0 = time.monotonic()
    seen["timeout"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    seen["waited"] = time.monotonic() - t0


def _case_timeout_reset(rank: int, world: int, seen: dict) -> None:
    """Rank 1 is late for a dispatch: rank 0 times out; every later call fails at once until reset(), which
    resynchronises the ranks (through the store: the group's own collectives are out of step) and the buffer is
    exact again."""
    buf = _buffer(timeout=2)
    inp, nxt = _inputs(world, 5), _inputs(world, 6)
    x, i, w = _tensors(inp, rank)
    if rank == 1:
        time.sleep(3)  # late: its dispatch meets rank 0's abandoned one, then times out itself
    seen["late"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    t0 = time.monotonic()
    seen["refused"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    seen["refused_secs"] = time.monotonic() - t0
    if rank == 0:
        time.sleep(2.5)  # reset() is a collective: both ranks within the timeout of each other
    seen["reset"] = _outcome(buf.reset)
    x2, i2, w2 = _tensors(nxt, rank)
    seen["after"] = [
        _same(buf.dispatch(x2, topk_idx=i2, topk_weights=w2, num_experts=E), _want(nxt, rank))
        for _ in range(2)
    ]
    if rank == 0:
        time.sleep(1)  # rank 0 holds the group's store: the peer may still read the last step's keys


def _case_dead(rank: int, world: int, seen: dict, out: Path) -> None:
    buf = _buffer(timeout=30)
    inp = _inputs(world, 4)
    x, i, w = _tensors(inp, rank)
    if rank == 1:
        (out / "1.json").write_text(json.dumps({}))
        time.sleep(0.5)  # let rank 0 finish the constructor's barrier first
        os._exit(0)  # dies without a word
    t0 = time.monotonic()
    seen["dead"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E))
    seen["waited"] = time.monotonic() - t0


def _case_dead3(rank: int, world: int, seen: dict, out: Path) -> None:
    """3 ranks, rank 2 dies: ranks 0 and 1 name rank 2 and only rank 2."""
    buf = _buffer(timeout=30)
    inp = _inputs(world, 4, num_experts=6)
    x, i, w = _tensors(inp, rank)
    if rank == 2:
        (out / "2.json").write_text(json.dumps({}))
        time.sleep(0.5)
        os._exit(0)
    t0 = time.monotonic()
    seen["dead"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=6))
    seen["waited"] = time.monotonic() - t0
    seen["next"] = _outcome(lambda: buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=6))
    if rank == 0:
        time.sleep(3)  # rank 0 holds the store: rank 1 may still be naming the dead rank through it


def _worker(rank: int, world: int, mode: str, out: str) -> None:
    seen: dict = {}
    try:
        if mode == "dead3":
            _case_dead3(rank, world, seen, Path(out))
        elif mode == "dead":
            _case_dead(rank, world, seen, Path(out))
        else:
            {
                "announce": _case_announce,
                "random": _case_random,
                "timeout": _case_timeout,
                "timeout_reset": _case_timeout_reset,
            }[mode](rank, world, seen)
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(seen))
    if mode in ("timeout", "dead", "timeout_reset", "dead3"):
        os._exit(0)  # the group is out of step: leave without the launcher's closing barrier


# ---------------------------------------------------------------------------------------------------------------
# the tests


def test_one_rank_error_is_announced_and_disagreements_raise_on_every_rank(tmp_path):
    r0, r1 = _run("announce", tmp_path)
    assert r0["bad_event"].startswith("EPTypeError: previous_event"), r0
    assert r1["bad_event"].startswith("EPPeerError") and "rank 0" in r1["bad_event"], r1
    assert r0["next_ok"] and r1["next_ok"]  # in step again: no silently paired calls
    for name in ("out_of_range", "minus_five"):
        assert r0[name].startswith("EPValueError: topk_idx[3, 1]"), r0[name]
        assert r1[name].startswith("EPPeerError") and "rank 0" in r1[name] and "token 3, lane 1" in r1[name]
    assert "other negative ids are rejected" in r0["minus_five"]
    for r in (r0, r1):
        assert r["num_experts"].startswith("EPMismatchError") and "num_experts differs" in r["num_experts"]
        assert "rank 0: 16, rank 1: 8" in r["num_experts"]
        assert r["refused"].startswith("EPStateError") and "until reset()" in r["refused"], r["refused"]
        assert r["hidden"].startswith("EPMismatchError") and "hidden differs" in r["hidden"], r["hidden"]
        assert r["operation"].startswith("EPMismatchError") and "operation differs" in r["operation"]
        assert r["after_ok"]
        assert r["after_destroy"].startswith("EPStateError"), r["after_destroy"]


def test_random_one_rank_errors_keep_valid_calls_exact(tmp_path):
    r0, r1 = _run("random", tmp_path)
    assert len(r0["results"]) == len(r1["results"]) == 12
    for a, b in zip(r0["results"], r1["results"]):
        if a is True or b is True:
            assert a is True and b is True, (a, b)
        else:  # one rank's own error, the other's EPPeerError
            assert "EPPeerError" in (a, b) or a.startswith("EPPeerError") or b.startswith("EPPeerError"), (
                a,
                b,
            )


@pytest.mark.serial  # a timing assertion: not beside other tests (xdist)
def test_cpu_wait_is_bounded_by_num_cpu_timeout_secs(tmp_path):
    r0, _ = _run("timeout", tmp_path)
    assert r0["timeout"].startswith("EPTimeoutError"), r0
    assert "waiting for rank 1" in r0["timeout"] and "num_cpu_timeout_secs" in r0["timeout"]
    assert r0["waited"] < 5


def test_after_a_timeout_calls_fail_fast_and_reset_recovers(tmp_path):
    for r in _run("timeout_reset", tmp_path):
        assert r["late"].startswith("EPTimeoutError"), r
        assert r["refused"].startswith("EPStateError") and "until reset()" in r["refused"], r
        assert r["refused_secs"] < 0.5, r
        assert r["reset"] == "ok" and r["after"] == [True, True], r


def test_dead_peer_is_named(tmp_path):
    r0, _ = _run("dead", tmp_path)
    assert r0["dead"].startswith(("EPPeerError", "EPTimeoutError")) and "rank 1" in r0["dead"], r0
    assert r0["waited"] < 30


def test_killed_peer_is_named_exactly(tmp_path):
    r0, r1, _ = _run("dead3", tmp_path, world=3)
    for r in (r0, r1):
        assert r["dead"].startswith("EPPeerError"), r
        assert "because rank 2 left" in r["dead"], r["dead"]
        assert r["waited"] < 10, r
        assert r["next"].startswith("EPStateError") and "refused" in r["next"], r  # no second wait


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(_worker, 3 if sys.argv[1] == "dead3" else 2, sys.argv[1], sys.argv[2])
