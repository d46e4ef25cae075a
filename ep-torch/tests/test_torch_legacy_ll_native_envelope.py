"""Issue 41 on V1 low-latency mode's native road (``ll_native=True``). The host agrees what every rank must share
(``LowLatencyMode._agree_native``): once per signature change by default, every call with
``ll_native_agree="call"``. The kernels carry an envelope too (every flag holds the call's envelope bits, compared by
each receive; a rank that refuses its call runs ``ep_lln_abort`` so that its peers' waits end): in the default mode a
disagreement or a one-rank refusal is raised on every rank at the next call, and every rank refuses until reset().

On the CPU the kernels are replaced by ``ll_native_standin.py`` (an exchange through files with the kernels'
semantics: their envelope, bounded waits, what a receive records raised at the next call); the cases are
collective_safety_survey.py's ``lln.*`` / ``llnd.*`` / ``llnc.*``. The kernels themselves run on host threads
(``ll_native_emulation.cpp``: a mismatch and an abort). The GPU tests run some cases on the real kernels (2
processes sharing GPU 0, ipc transport)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ep_core.errors import EPStateError
from ep_core.rank_state import RankState

SURVEY = str(Path(__file__).with_name("collective_safety_survey.py"))
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _survey():
    import importlib.util

    spec = importlib.util.spec_from_file_location("collective_safety_survey", SURVEY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _chain(cases: list[str], tmp_path: Path, limit: float, env: dict | None = None) -> list[str]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    survey = _survey()
    code, out = run_script(SURVEY, ["chain", str(tmp_path), *cases], limit, what="chain: ", env=env)
    assert code == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    bad = []
    for case in cases:
        v, why = survey.verdict(case, [r0.get(case, {}), r1.get(case, {})])
        if v != "clear":
            bad.append(f"{case}: {v}: {why}")
    return bad


# every one-rank refusal and disagreement of the native road, with a host step every call (peer_never_calls: in the
# survey, it sleeps past the timeout)
CALL_CASES = [
    "llnc.x_dtype",
    "llnc.too_many_tokens",
    "llnc.stats_shape",
    "llnc.combine_x_shape",
    "llnc.combine_foreign_handle",
    "llnc.combine_logfmt_bad_hidden",
    "llnc.combine_logfmt_one_rank_alone",
    "llnc.dispatch_fp8_one_rank_alone",
    "llnc.dispatch_m_one_rank_alone",
    "llnc.combine_other_dispatch_one_rank",
    # the default mode: a disagreement the kernels' envelope finds inside the faulty step (the FP8 dispatch's
    # combine is its next call)
    "lln.dispatch_fp8_one_rank_alone",
]


def test_native_road_refusals_and_disagreements_are_clear_on_the_cpu_stand_in(tmp_path):
    bad = _chain(CALL_CASES, tmp_path, 180)
    assert not bad, "\n".join(bad)


# the default mode with the kernels' envelope: raised at the next call on every rank, then reset()
NEXT_CALL_CASES = [
    "llnd.x_dtype",
    "llnd.combine_logfmt_one_rank",
    "llnd.expert_id_out_of_range",
    "llnd.combine_weights_dtype",
    "llnd.combine_logfmt_one_rank_alone",
    "llnd.dispatch_fp8_one_rank_alone",
    "llnd.combine_other_dispatch_one_rank",
]


def test_default_mode_refusals_and_disagreements_are_raised_at_the_next_call(tmp_path):
    bad = _chain(NEXT_CALL_CASES, tmp_path, 180)
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# the envelope's host side: the bits and what a record raises


def test_envelope_bits_name_the_fields_and_never_equal_the_abort():
    from ep_core.errors import EPMismatchError, EPPeerError
    from ep_torch.legacy import ll_kernels

    base = ll_kernels.dispatch_env(8, 12, 512, 3, True, False, False)
    assert 0 <= base < 0xFFFF and base & 7 == 1
    assert ll_kernels.dispatch_env(8, 12, 512, 3, True, True, True) & 7 == 7
    assert ll_kernels.dispatch_env(16, 12, 512, 3, True, False, False) >> 3 != base >> 3
    c = ll_kernels.combine_env(8, 12, 512, 3, True, 1)
    assert -(1 << 31) <= c < (1 << 31) and c != -1 and c & 0x1FF == 0b11
    n = 2
    # a dispatch: rank 1 used FP8, this rank 0 did not (words as the kernel records them: bits << 16)
    mine, theirs = ll_kernels.dispatch_env(8, 12, 512, 3, False, False, False), base
    with pytest.raises(EPMismatchError, match=r"use_fp8: rank 1 True, rank 0 False") as info:
        ll_kernels.raise_envelope("low_latency_dispatch", 2, [0, 1, 1], [theirs << 16, mine << 16, 5, 5])
    assert info.value.fields == {"use_fp8": {1: True, 0: False}}
    # a combine of another dispatch's handle, then one a call ahead
    a, b = ll_kernels.combine_env(8, 12, 512, 3, False, 1), ll_kernels.combine_env(8, 12, 512, 3, False, 0)
    with pytest.raises(EPMismatchError, match=r"handle \(dispatches since it\): rank 1 1, rank 0 0"):
        ll_kernels.raise_envelope("low_latency_combine", 2, [0, 1, 2], [a, b, 3, 3])
    with pytest.raises(EPMismatchError, match="call number: rank 1 4, rank 0 3"):
        ll_kernels.raise_envelope("low_latency_combine", 2, [0, 1, 2], [b, b, 4, 3])
    with pytest.raises(EPPeerError, match="rank 1 abandoned the operation") as info:
        ll_kernels.raise_envelope("low_latency_dispatch", 3, [0, 1, 1], [-65536, mine << 16, 5, 5])
    assert info.value.ranks == (1,) and not info.value.announced  # the ranks are out of step: reset()
    del n


def test_region_check_raises_the_kernels_records():
    """``NativeRegion.check`` reads the host-mapped record (no sync): code 3 names the refusing rank, code 2 the
    field, both sticky (the device error word stays raised until the region is rebuilt)."""
    from ep_core.errors import EPMismatchError, EPPeerError
    from ep_torch.legacy import ll_kernels

    n = 2
    reg = SimpleNamespace(herr=torch.zeros(8 + n, dtype=torch.int32))
    ll_kernels.NativeRegion.check(reg, "low_latency_dispatch")  # nothing recorded
    reg.herr[:4] = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    reg.herr[-4:] = torch.tensor([-1, 5, 2, 2], dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(EPPeerError, match=r"rank 0 abandoned the operation .* low_latency_combine"):
            ll_kernels.NativeRegion.check(reg, "low_latency_dispatch")
    reg.herr[0] = 2
    reg.herr[-4:] = torch.tensor([5, 4, 2, 2], dtype=torch.int32)
    with pytest.raises(EPMismatchError, match="use_logfmt: rank 0 True, rank 1 False"):
        ll_kernels.NativeRegion.check(reg, "low_latency_dispatch")


def test_a_refusal_runs_the_abort_and_the_refusing_rank_refuses_until_reset(monkeypatch):
    from ep_torch.legacy import guard, ll_kernels

    ran = []
    monkeypatch.setattr(ll_kernels, "native_abort", lambda reg, which: ran.append((reg, which)))
    state = RankState(0)
    reg = object()
    buf = SimpleNamespace(
        _ll_region=reg,
        _ll_inner=SimpleNamespace(runtime=object()),
        ll_native_agree="change",
        _shrink=None,
        _ll_native_on_cpu=True,
        _state=state,
    )
    target, _ = guard._ll_target(buf, (), {})
    err = ValueError("bad x")
    target.announce_error("low_latency_combine", err, None)
    assert ran == [(reg, 1)] and state.failure is err and state.failed_op == "low_latency_combine"
    target.announce_error("low_latency_dispatch", err, None)
    assert ran[-1] == (reg, 0)
    buf._shrink = object()  # rank masking: the peers mask a rank that does not arrive
    target.announce_error("low_latency_dispatch", err, None)
    buf._shrink, buf._ll_inner = None, SimpleNamespace(runtime=None)  # destroyed, or dropped by reset()
    target.announce_error("low_latency_dispatch", err, None)
    assert len(ran) == 2


# ---------------------------------------------------------------------------------------------------------------
# the kernels' envelope on host threads (ll_native_emulation.cpp: the real kernels' code, CUDA's names shimmed)


@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    import shutil
    import subprocess

    from ep_core.kernels._source import get_include

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    exe = tmp_path_factory.mktemp("emu") / "ll_native_emulation"
    src = os.path.join(os.path.dirname(__file__), "ll_native_emulation.cpp")
    cmd = [gxx, "-std=c++20", "-O1", "-pthread", "-I", get_include(), src, "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode and "barrier" in proc.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


@pytest.mark.parametrize("fault", [0, 1, 2, 3, 4])
def test_kernels_envelope_on_host_threads(emulation, tmp_path, fault):
    """3 ranks, rank 1 the culprit: 1 / 3 its dispatch / combine carries other envelope bits (every rank records a
    mismatch), 2 / 4 it refuses its dispatch / combine (ep_lln_abort: the peers record its abort). The waits end at
    once (a 60 s timeout is never reached) and nothing is paired."""
    import subprocess
    import time

    import numpy as np

    n, e, t, k, h, m, culprit = 3, 6, 5, 2, 128, 8, 1
    g = torch.Generator().manual_seed(41 + fault)
    x = (torch.rand(n, t, h, generator=g) - 0.5).to(torch.bfloat16)
    idx = torch.stack([torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) for _ in range(n)])
    w = torch.rand(n, t, k, generator=g)
    x.view(torch.int16).numpy().tofile(tmp_path / "x1")
    idx.numpy().astype(np.int64).tofile(tmp_path / "idx1")
    w.numpy().astype(np.float32).tofile(tmp_path / "w1")
    np.zeros((n, n), np.int32).tofile(tmp_path / "umask")
    args = [
        str(emulation),
        str(tmp_path),
        *map(str, (n, e, t, k, h, m, 0, culprit if fault else -1, 0, 0, 60000, 1, 0, fault)),
    ]
    start = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - start < 50, "a wait ran into its timeout"
    epr = e // n
    for r in range(n):
        herr = np.fromfile(tmp_path / f"herr1_{r}", np.int32)
        err = int(np.fromfile(tmp_path / f"err1_{r}", np.int32)[0])
        count = np.fromfile(tmp_path / f"r1_count_{r}", np.int32)
        want = [
            sum(int((idx[s, tok] == r * epr + j).any()) for s in range(n) for tok in range(t))
            for j in range(epr)
        ]
        what = f"fault {fault}, rank {r}: herr {herr.tolist()}"
        if fault == 0 or (fault in (2, 4) and r == culprit):
            assert herr[0] == 0 and err == 0, what
            if fault == 0:
                assert count.tolist() == want, what
            continue
        code, tag = (2, 1) if fault == 1 else (3, 1) if fault == 2 else (2, 2) if fault == 3 else (3, 2)
        assert err == 1 and herr[0] == code and herr[1] == r and herr[3] == tag, what
        if r != culprit:
            assert herr[2] == culprit, what
        theirs, mine, their_epoch, epoch = (int(v) for v in herr[-4:])
        assert their_epoch == epoch == 1, what
        if code == 3:
            assert theirs == (-65536 if tag == 1 else -1), what
        else:
            assert (theirs ^ mine) & 0xFFFFFFFF == (1 << 16 if tag == 1 else 1) or r == culprit, what
        if tag == 2:  # the dispatch before was exact
            assert count.tolist() == want, what


# ---------------------------------------------------------------------------------------------------------------
# _agree_native's host logic alone (a recording channel, no ranks)


class _Channel:
    def __init__(self) -> None:
        self.state = RankState(0)
        self.steps: list[tuple[str, dict]] = []

    def exchange(self, op: str, config: dict) -> list:
        self.steps.append((op, config))
        return [None]


def _mode(agree: str = "change"):
    from ep_torch.legacy.ll_mode import LowLatencyMode

    obj = object.__new__(LowLatencyMode)
    obj._channel, obj._shrink, obj.rank = _Channel(), None, 0
    obj.ll_native_agree = agree
    return obj


NAMES = ("a", "b")


def test_agreed_once_per_signature_change():
    m = _mode()
    for sig in [(1, 2), (1, 2), (1, 2), (1, 3), (1, 3), (1, 2)]:
        m._agree_native("low_latency_dispatch", NAMES, sig, False)
    assert [c for _, c in m._channel.steps] == [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 2}]
    assert {op for op, _ in m._channel.steps} == {"low_latency_dispatch.native"}
    m._agree_native("low_latency_combine", NAMES, (1, 2), False)  # each operation has its own signature
    assert len(m._channel.steps) == 4
    m._channel.state.new_generation()  # reset(): every rank agrees again
    m._agree_native("low_latency_dispatch", NAMES, (1, 2), False)
    assert len(m._channel.steps) == 5


def test_two_batches_in_flight_take_no_step_once_agreed():
    """Dispatch A, dispatch B, combine A (one dispatch ago), combine B (none), repeated: each handle age is agreed
    once (the combine's key is per age)."""
    m = _mode()
    for _ in range(4):
        for lag in (1, 0):
            m._agree_native("low_latency_combine", NAMES, (7, lag), False, ("combine", lag))
    assert [c for _, c in m._channel.steps] == [{"a": 7, "b": 1}, {"a": 7, "b": 0}]


def test_every_call_is_agreed_in_call_mode():
    m = _mode("call")
    for _ in range(3):
        m._agree_native("low_latency_combine", NAMES, (1, 2), False)
    assert len(m._channel.steps) == 3


@pytest.mark.parametrize("agree", ["change", "call"])
def test_no_step_under_graph_capture(monkeypatch, agree):
    """A replay runs no Python: a signature agreed before capture is accepted without a step, a new one refused."""
    m = _mode(agree)
    m._agree_native("low_latency_dispatch", NAMES, (1, 2), False)
    m._agree_native("low_latency_dispatch", NAMES, (1, 3), False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    m._agree_native("low_latency_dispatch", NAMES, (1, 2), True)
    m._agree_native("low_latency_dispatch", NAMES, (1, 3), True)
    assert len(m._channel.steps) == 2
    with pytest.raises(EPStateError, match="before CUDA-graph capture"):
        m._agree_native("low_latency_dispatch", NAMES, (1, 4), True)


def test_no_step_without_a_host_channel_or_with_rank_masking():
    m = _mode()
    m._shrink = object()  # masked ranks sit out: no host step could meet them
    m._agree_native("low_latency_dispatch", NAMES, (1, 2), False)
    assert m._channel.steps == []
    m._channel = None  # a loopback group
    m._agree_native("low_latency_dispatch", NAMES, (1, 2), False)


def test_refusals_on_the_native_road_are_announced_where_the_peers_wait():
    from ep_torch.legacy import guard

    buf = SimpleNamespace(_ll_region=None, _ll_inner="adapter", ll_native_agree="change")
    assert guard._ll_target(buf, (), {}) == ("adapter", False)  # the adapter: its inner buffer's step
    buf._ll_region = object()
    target, host = guard._ll_target(
        buf, (), {}
    )  # the peers' kernels wait on the device: an abort kernel tells them
    assert isinstance(target, guard._NativeAbort) and target.buf is buf and not host
    assert guard._ll_target(buf, (), {})[0] is target  # one per buffer (the hot path allocates nothing)
    buf.ll_native_agree = "call"
    assert guard._ll_target(buf, (), {}) == (None, True)  # the peers wait in this buffer's host step


# ---------------------------------------------------------------------------------------------------------------
# the real kernels


@pytest.mark.gpu
@gpu
def test_native_road_disagreements_on_the_gpu(tmp_path):
    """2 processes sharing GPU 0 (ipc transport, gloo group), the native kernels: every rank raises, the two valid
    rounds after each case are exact."""
    cases = [
        "llnc.x_dtype",
        "llnc.combine_logfmt_one_rank_alone",
        "llnc.dispatch_fp8_one_rank_alone",
        "llnc.combine_other_dispatch_one_rank",
    ]
    bad = _chain(cases, tmp_path, 420, env={**os.environ, "EP_SURVEY_DEVICE": "cuda"})
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@gpu
def test_default_mode_kernels_envelope_on_the_gpu(tmp_path):
    """The default mode on the real kernels (2 processes sharing GPU 0, ipc): a one-rank refusal (the abort kernel)
    and a one-rank FP8 / LogFMT / handle disagreement (the flags' envelope bits) are raised on every rank at the next
    call naming the culprit, and the two valid rounds after reset() are exact."""
    cases = [
        "llnd.x_dtype",
        "llnd.combine_weights_dtype",
        "llnd.dispatch_fp8_one_rank_alone",
        "llnd.combine_logfmt_one_rank_alone",
        "llnd.combine_other_dispatch_one_rank",
    ]
    bad = _chain(cases, tmp_path, 420, env={**os.environ, "EP_SURVEY_DEVICE": "cuda"})
    assert not bad, "\n".join(bad)
