"""The bounded signal wait (``include/ep_core/signal_wait.cuh``, ``ep_core.signal_wait``) without a GPU: the kernel
compiles with nvcc, the header's record layout is the one the host decodes, and a published record becomes an
``EPTimeoutError`` naming the rank, the peer and the signal."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from ep_core import signal_wait as sw
from ep_core.errors import EPTimeoutError, EPValueError

HEADER = Path(sw.get_include()) / "ep_core" / "signal_wait.cuh"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_wait_kernel_compiles(arch: str) -> None:
    art = sw.compile_signal_wait(arch)
    assert sw.KERNEL_NAME in art.kernel_names
    res = art.meta["resources"][sw.KERNEL_NAME]
    assert res["spill_stores"] == 0 and res["stack_bytes"] == 0


def test_the_header_record_layout_matches_the_host() -> None:
    text = HEADER.read_text()
    words = dict(re.findall(r"k(State|WaitId|Value|Expected|ElapsedNs|NumRecordWords) = (\d+)", text))
    assert words == {
        "State": str(sw.RECORD_STATE),
        "WaitId": str(sw.RECORD_WAIT_ID),
        "Value": str(sw.RECORD_VALUE),
        "Expected": str(sw.RECORD_EXPECTED),
        "ElapsedNs": str(sw.RECORD_ELAPSED_NS),
        "NumRecordWords": str(sw.RECORD_WORDS),
    }
    assert f"kTimedOut = {sw.STATE_TIMED_OUT}" in text


def _record(wait_id: int, value: int = 3, expected: int = 5) -> np.ndarray:
    rec = np.zeros(sw.RECORD_WORDS, np.int64)
    rec[[sw.RECORD_WAIT_ID, sw.RECORD_VALUE, sw.RECORD_EXPECTED, sw.RECORD_ELAPSED_NS]] = [
        wait_id,
        value,
        expected,
        2_500_000_000,
    ]
    rec[sw.RECORD_STATE] = sw.STATE_TIMED_OUT
    return rec


def test_a_published_record_names_rank_peer_and_signal() -> None:
    log = sw.WaitLog()
    log.add(1, "pp_send: the release of tensor 0 by rank 1")
    wid = log.add(3, "pp_recv: tensor 7 from rank 3")
    err = sw.decode_timeout(_record(wid, 7, 8).tolist(), log, 2, 2.5)
    assert isinstance(err, EPTimeoutError) and isinstance(err, TimeoutError)
    assert err.rank == 2 and err.counter == 3 and err.value == 7
    assert err.tag == "gpu.signal_wait: pp_recv: tensor 7 from rank 3"
    text = str(err)
    assert "rank 2 timed out on the GPU after 2.5 s" in text and "waiting for rank 3" in text
    assert "expected >= 8" in text and "num_gpu_timeout_secs=2.5" in text


def test_no_record_no_error_and_a_dropped_name_still_raises() -> None:
    log = sw.WaitLog(capacity=2)
    assert sw.decode_timeout(np.zeros(sw.RECORD_WORDS, np.int64).tolist(), log, 0, 1.0) is None
    first = log.add(1, "a")
    log.add(1, "b")
    log.add(1, "c")  # overwrites the first
    assert log.get(first) is None
    err = sw.decode_timeout(_record(first).tolist(), log, 0, 1.0)
    assert err is not None and "was dropped" in str(err) and err.counter == "?"


def test_timeout_record_is_sticky() -> None:
    rec = np.zeros(sw.RECORD_WORDS, np.int64)
    tr = sw.TimeoutRecord(rec, 4, 10.0)
    tr.check()  # nothing yet
    wid = tr.log.add(5, "all_gather: slot 0 of session 1")
    rec[:] = _record(wid)
    with pytest.raises(EPTimeoutError, match="rank 4 timed out") as first:
        tr.check()
    rec[:] = 0  # the record is not re-read: the error stays
    with pytest.raises(EPTimeoutError) as again:
        tr.check()
    assert again.value is first.value


def test_bad_bounds_and_capacities() -> None:
    with pytest.raises(EPValueError, match="num_gpu_timeout_secs"):
        sw.TimeoutRecord(np.zeros(sw.RECORD_WORDS, np.int64), 0, 0)
    with pytest.raises(EPValueError, match="capacity"):
        sw.WaitLog(0)
