"""ep_core.rank_mask (issue 44): the per-rank mask and the masked exchange over a key-value store (threads as ranks,
an in-memory store with TCPStore's five calls): masked ranks are skipped both ways, a peer that does not arrive is
masked with a warning naming it, counters stay in step across masked steps, disagreements and aborts are raised."""

from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
from ep_core.errors import EPMismatchError, EPPeerError, EPValueError
from ep_core.rank_mask import MaskedExchange, RankMask, RankMaskedWarning

TIMEOUT = 1.0  # the exchange's bound (s): generous on a loaded machine, small for the test's time


class DictStore:
    """TCPStore's set/get/check/compare_set/wait/delete_key over a dict (threads share it)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cv:
            self.data[key] = bytes(value)
            self.cv.notify_all()

    def get(self, key: str) -> bytes:
        with self.cv:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.cv:
            return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError("Wait timeout")

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        with self.cv:
            cur = self.data.get(key)
            if cur is None and expected == "":
                self.data[key] = cur = bytes(desired)
                self.cv.notify_all()
            return cur if cur is not None else expected.encode()

    def delete_key(self, key: str) -> bool:
        with self.cv:
            return self.data.pop(key, None) is not None


def _run(n, fn, store=None):
    """``fn(rank, exchange)`` on ``n`` threads; returns the results and re-raises the first error."""
    store = store or DictStore()
    out, errs = [None] * n, [None] * n

    def body(r):
        ex = MaskedExchange(store, RankMask(r, n), "t", TIMEOUT)
        try:
            out[r] = fn(r, ex)
        except BaseException as exc:  # returned to the test, which asserts there is none
            errs[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errs, store


def test_mask_state_update_query_clean_drop_lanes():
    m = RankMask(1, 4)
    assert not m.any() and m.unmasked_peers() == [0, 2, 3]
    m.update(2, True)
    assert m.flags.tolist() == [0, 0, 1, 0] and m.masked_ranks() == {2: "user"}
    idx = np.array([[0, 4, 5, -1], [7, 6, 1, 3]])  # 8 experts, 2 per rank: rank 2 holds 4 and 5
    assert m.drop_lanes(idx, 8).tolist() == [[0, -1, -1, -1], [7, 6, 1, 3]]
    assert m.merge(np.array([1, 0, 1, 0])) == [0] and m.masked_ranks() == {0: "timeout", 2: "user"}
    m.update(2, False)
    assert m.unmasked_peers() == [2, 3]
    m.clean()
    assert not m.any() and m.unmasked_peers() == [0, 2, 3]
    for bad in (-1, 4, 1.0, True, "2"):
        with pytest.raises(EPValueError, match="rank_to_mask"):
            m.update(bad, True)
    with pytest.raises(EPValueError, match="reason"):
        m.update(0, True, "why")


def test_exchange_skips_masked_and_keeps_counters_in_step():
    """Three ranks: a step with everyone, two steps where rank 2 sits out (masked on every rank), then all again:
    every rank reads exactly its peers' payloads of the same step, and no key is left behind."""

    def fn(r, ex):
        seen = [ex.exchange("op", {"a": 1}, {p: (r, p, 0) for p in range(3)})]
        ex.mask.update(2, True)
        if r != 2:
            for step in (1, 2):
                seen.append(ex.exchange("op", {"a": 1}, {p: (r, p, step) for p in range(3)}))
        ex.mask.clean()
        seen.append(ex.exchange("op", {"a": 1}, {p: (r, p, 3) for p in range(3)}))
        return seen

    out, errs, store = _run(3, fn)
    assert errs == [None] * 3, errs
    for r in range(3):
        steps = [0, 1, 2, 3] if r != 2 else [0, 3]
        for got, step in zip(out[r], steps):
            peers = [p for p in range(3) if p != r and (step in (0, 3) or p != 2)]
            assert got == {p: (p, r, step) for p in peers}, (r, step, got)
    assert store.data == {}, f"keys left behind: {sorted(store.data)}"


def test_lost_peer_is_masked_with_a_warning_and_the_rest_continue():
    def fn(r, ex):
        ex.exchange("op", {}, {p: r for p in range(4)})
        if r == 3:
            return None  # stops calling
        t0 = time.monotonic()
        got = ex.exchange("op", {}, {p: r for p in range(4)})
        waited = time.monotonic() - t0
        assert sorted(got) == [p for p in range(3) if p != r]
        assert ex.mask.masked_ranks() == {3: "timeout"}
        assert waited < 3 * TIMEOUT, f"waited {waited:.2f} s (bound {TIMEOUT} s)"
        t0 = time.monotonic()
        got = ex.exchange("op", {}, {p: r for p in range(4)})  # masked: not waited for any more
        assert sorted(got) == [p for p in range(3) if p != r] and time.monotonic() - t0 < TIMEOUT
        return True

    with warnings.catch_warnings(record=True) as caught:  # process-wide: the threads' warnings land here
        warnings.simplefilter("always")
        out, errs, _ = _run(4, fn)
    assert errs == [None] * 4, errs
    assert out[:3] == [True] * 3
    said = sorted(str(w.message).split(":")[0] for w in caught if issubclass(w.category, RankMaskedWarning))
    assert said == ["rank 0", "rank 1", "rank 2"], said
    assert all("rank 3 did not arrive" in str(w.message) for w in caught if w.category is RankMaskedWarning)


def test_disagreement_and_abort_are_raised_on_every_rank():
    def fn(r, ex):
        with pytest.raises(EPMismatchError, match="disagree"):
            ex.exchange("op", {"hidden": 128 if r else 256}, {})
        if r == 1:
            ex.announce("op", EPValueError("bad x"))
        else:
            with pytest.raises(EPPeerError, match="rank 1 abandoned") as info:
                ex.exchange("op", {}, {})
            assert info.value.announced and info.value.ranks == (1,)
        return ex.exchange("op", {}, {p: r for p in range(3)})  # still in step

    out, errs, _ = _run(3, fn)
    assert errs == [None] * 3, errs
    assert out == [{1: 1, 2: 2}, {0: 0, 2: 2}, {0: 0, 1: 1}]


def test_a_late_message_is_given_up_never_read_later():
    """Rank 1 is late for a step (past the bound): rank 0 gives up its message and masks it (timeout); rank 1, writing
    late, learns it and masks rank 0 (peer), dropping rank 0's message of that step. After clean() on both, the next
    step pairs the next messages: nothing of the late step is read."""

    def fn(r, ex):
        if r == 1:
            time.sleep(TIMEOUT * 1.5)
        got = ex.exchange("op", {}, {1 - r: ("late step", r)})
        masked = ex.mask.masked_ranks()
        ex.mask.clean()
        time.sleep(TIMEOUT * 0.5 if r == 0 else 0.0)  # both past the late step before the next
        return got, masked, ex.exchange("op", {}, {1 - r: ("next step", r)})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, errs, store = _run(2, fn)
    assert errs == [None] * 2, errs
    assert out[0] == ({}, {1: "timeout"}, {1: ("next step", 1)}), out[0]
    assert out[1] == ({}, {0: "peer"}, {0: ("next step", 0)}), out[1]
    said = sorted(str(w.message) for w in caught if issubclass(w.category, RankMaskedWarning))
    assert len(said) == 2 and "rank 1 did not arrive" in said[0] and "rank 0 gave up" in said[1], said
    assert not [k for k in store.data if not k.endswith("/c")], sorted(store.data)
