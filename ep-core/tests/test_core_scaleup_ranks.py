"""CPU: ranks per node (`num_scaleup_ranks`, `EPKIT_SCALEUP_RANKS`): validated before any GPU work; S_u = N is
direct mode; S_u < N (emulated nodes) goes on to the GPU with the hybrid kernels; a non-divisor is refused naming
the argument."""

from __future__ import annotations

import pytest
from ep_core import loopback
from ep_core.errors import EPConfigError
from ep_core.topology import resolve_scaleup_ranks


class _PastValidation(Exception):
    """Raised by the first GPU step: validation let the configuration through."""


def _stop(*_a, **_k):
    raise _PastValidation


@pytest.fixture(autouse=True)
def _no_knob(monkeypatch):
    monkeypatch.delenv("EPKIT_SCALEUP_RANKS", raising=False)


def test_resolve() -> None:
    assert resolve_scaleup_ranks(8) == 8
    assert resolve_scaleup_ranks(8, 4) == 4
    assert resolve_scaleup_ranks(8, 8) == 8
    for bad in (3, 0, -2, 16, True, 2.0):
        with pytest.raises(EPConfigError, match="num_scaleup_ranks: expected a divisor of num_ranks=8"):
            resolve_scaleup_ranks(8, bad)


def test_knob(monkeypatch) -> None:
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    assert resolve_scaleup_ranks(8, use_env=True) == 2
    assert resolve_scaleup_ranks(8) == 8  # the knob is read only where processes ask for it
    assert resolve_scaleup_ranks(8, 4, use_env=True) == 4  # an explicit argument wins
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "3")
    with pytest.raises(
        EPConfigError,
        match=r"EPKIT_SCALEUP_RANKS: expected a divisor of num_ranks=8 \(the ranks of one node\), got 3",
    ):
        resolve_scaleup_ranks(8, use_env=True)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "two")
    with pytest.raises(EPConfigError, match="EPKIT_SCALEUP_RANKS: expected a int"):
        resolve_scaleup_ranks(8, use_env=True)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "0")
    assert resolve_scaleup_ranks(8, use_env=True) == 8


def test_loopback_domain(monkeypatch) -> None:
    monkeypatch.setattr(loopback._cuda, "num_device_sms", _stop)
    kw = {"num_max_tokens_per_rank": 8, "hidden": 256, "num_topk": 2}
    with pytest.raises(EPConfigError, match="num_scaleup_ranks: expected a divisor of num_ranks=4"):
        loopback.LoopbackDomain(4, num_scaleup_ranks=3, **kw)
    for su in (None, 4, 2, 1):  # direct mode and emulated nodes go on to the GPU
        with pytest.raises(_PastValidation):
            loopback.LoopbackDomain(4, num_scaleup_ranks=su, **kw)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")  # a loopback domain takes its nodes from the argument only
    with pytest.raises(_PastValidation):
        loopback.LoopbackDomain(4, **kw)


class _Boot:
    size = 4
    rank = 1


def test_process_rank_reads_the_knob(monkeypatch) -> None:
    monkeypatch.setattr(loopback.IpcBuffer, "create_exchanged", _stop)
    kw = {"num_max_tokens_per_rank": 8, "hidden": 256, "num_topk": 2}
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    with pytest.raises(_PastValidation):  # 2 emulated nodes x 2
        loopback.ProcessRank(_Boot(), **kw)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "3")
    with pytest.raises(EPConfigError, match="EPKIT_SCALEUP_RANKS: expected a divisor of num_ranks=4"):
        loopback.ProcessRank(_Boot(), **kw)
    with pytest.raises(_PastValidation):
        loopback.ProcessRank(_Boot(), num_scaleup_ranks=4, **kw)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "4")
    with pytest.raises(_PastValidation):
        loopback.ProcessRank(_Boot(), **kw)
