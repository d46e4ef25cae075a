"""Issue 41 on 2 gloo processes: one-rank errors on every surface (V1 normal and low-latency, V2, construction,
AGRS, PP, BucketBuffer, EngramBuffer, resize, the LB collectives, DeepEP 2.5's EPBuffer, comm.barrier, V1
internode_*) raise on every rank naming the culprit, nothing pairs silently, nothing waits unbounded, and a random
interleaving of valid calls with one-rank errors keeps every valid result exact.

The cases and their verdicts are collective_safety_survey.py's (run as a script in its own process group, under a
wall-clock limit: a hang fails the test instead of blocking CI).
"""

from __future__ import annotations

import json
from pathlib import Path

SURVEY = str(Path(__file__).with_name("collective_safety_survey.py"))


def _survey():
    import importlib.util

    spec = importlib.util.spec_from_file_location("collective_safety_survey", SURVEY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(args: list[str], tmp_path: Path, limit: float) -> list:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(SURVEY, [*args[:1], str(tmp_path), *args[1:]], limit, what=f"{args[0]}: ")
    assert code == 0, out[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_one_rank_errors_on_every_surface_are_clear_and_leave_the_ranks_in_step(tmp_path):
    survey = _survey()
    r0, r1 = _run(["chain"], tmp_path, 240)
    bad = []
    for case in survey.CHAIN:
        v, why = survey.verdict(case, [r0.get(case, {}), r1.get(case, {})])
        if v != "clear":
            bad.append(f"{case}: {v}: {why}")
    assert not bad, "\n".join(bad)


def test_round3_surfaces_one_rank_errors_and_disagreements_are_clear(tmp_path):
    """V1 LogFMT on one rank only (plain and rank-masked), resize, the LB collectives and the float32 combine
    output: a one-rank refusal is announced, ranks that disagree all raise, the rounds after are exact."""
    survey = _survey()
    r0, r1 = _run(["chain", *survey.CHAIN_ROUND3], tmp_path, 120)
    bad = []
    for case in survey.CHAIN_ROUND3:
        v, why = survey.verdict(case, [r0.get(case, {}), r1.get(case, {})])
        if v != "clear":
            bad.append(f"{case}: {v}: {why}")
    assert not bad, "\n".join(bad)


def test_session5_surfaces_one_rank_refusals_are_announced(tmp_path):
    """DeepEP 2.5's EPBuffer (defer_epilogue / borrow_recv refusals, a negative num_sms, calls while a receive view
    is out, barrier(context_idx)), comm.barrier over EngramBuffer / BucketBuffer (a bad context, a skipped
    barrier) and V1 internode_* on one NVLink domain: the peer raises naming the culprit, the rounds after are
    exact."""
    survey = _survey()
    r0, r1 = _run(["chain", *survey.CHAIN_SESSION5], tmp_path, 120)
    bad = []
    for case in survey.CHAIN_SESSION5:
        v, why = survey.verdict(case, [r0.get(case, {}), r1.get(case, {})])
        if v != "clear":
            bad.append(f"{case}: {v}: {why}")
        peer = (r1 if survey.CULPRIT == 0 else r0).get(case, {})
        if v == "clear" and peer.get("fault_secs", 0) > 1.0:
            bad.append(f"{case}: the peer raised after {peer['fault_secs']:.1f} s")
    assert not bad, "\n".join(bad)


def test_random_interleaving_of_valid_calls_and_one_rank_errors(tmp_path):
    r0, r1 = _run(["random", "7", "24"], tmp_path, 240)
    assert len(r0) == len(r1) == 24
    for a, b in zip(r0, r1):
        if a["case"].endswith(".valid"):
            assert a["out"] == b["out"] == "ok" and a["exact"] and b["exact"], (a, b)
            continue
        culprit = a["culprit"]
        for rec in (a, b):  # every rank raised; the others name the culprit
            assert rec["out"] != "ok" and rec["out"].startswith("EP"), (a, b)
        peer = b if culprit == 0 else a
        assert f"rank {culprit}" in peer["out"], (a, b)
        for rec in (a, b):
            assert rec.get("reset", "ok") == "ok", rec


def test_a_peer_that_never_calls_times_out_within_the_timeout(tmp_path):
    survey = _survey()
    for case in ("v1.peer_never_calls", "bucket.send_recv_peer_never_calls"):
        r0, r1 = _run([case], tmp_path, 60)
        v, why = survey.verdict(case, [r0, r1])
        assert v == "clear", why


def test_agrs_all_gather_outside_a_session_ends_the_peers_session_at_once(tmp_path):
    """The peer inside a session gets the culprit's refusal at once and its session end does not wait for a
    culprit that began no session (both sessions count on no rank: the next rounds pair and are exact)."""
    survey = _survey()
    case = "agrs.all_gather_outside_session"
    r0, r1 = _run([case], tmp_path, 60)
    v, why = survey.verdict(case, [r0, r1])
    assert v == "clear", why
    peer = r1 if survey.CULPRIT == 0 else r0
    assert peer["fault"].startswith("EPPeerError") and peer["fault_secs"] < 1.0, peer
    assert [out for out, _ in peer["rounds"]] == ["ok", "ok"], peer
