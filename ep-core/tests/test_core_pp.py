"""ep_core.pp: the PP size hint, configuration checks, ring sides and the numpy reference of the protocol."""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import pp
from ep_core.errors import EPStateError, EPTimeoutError, EPValueError

MiB = 1 << 20


def test_size_hint_matches_deepep_formula() -> None:
    assert pp.get_pp_buffer_size_hint(1, 1) == 2 * MiB
    assert pp.get_pp_buffer_size_hint(100, 3) == 2 * MiB  # align(100, 32) * 3 * 4 = 1536
    assert pp.get_pp_buffer_size_hint(1 << 20, 2) == 8 * MiB
    assert pp.get_pp_buffer_size_hint((1 << 20) + 1, 2) == 10 * MiB
    with pytest.raises(EPValueError, match="num_max_inflight_tensors"):
        pp.get_pp_buffer_size_hint(16, 0)


def test_config_checks_name_argument_and_rank() -> None:
    cfg = pp.make_pp_config(2, 4, 2 * MiB, 100, 3)
    assert cfg.num_max_tensor_bytes == 128 and (cfg.prev_rank, cfg.next_rank) == (1, 3)
    with pytest.raises(EPValueError, match=r"exceed the buffer .* rank 1"):
        pp.make_pp_config(1, 4, 2 * MiB, MiB, 1)
    with pytest.raises(EPValueError, match=r"dst_rank_idx: rank 2 .* got 0"):
        cfg.check_peer("dst_rank_idx", 0)
    with pytest.raises(EPValueError, match="num_max_tensor_bytes"):
        cfg.check_nbytes("t", 129)
    with pytest.raises(EPStateError, match="pp_set_config"):
        pp.require_config(None, "pp_send", 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sides_pair_sender_and_receiver(n: int) -> None:
    # the receive array a sender targets is the one the receiver reads: every (src, dst) pair of the ring uses
    # a distinct receive array on dst
    for dst in range(n):
        used = {}
        for src in {(dst - 1) % n, (dst + 1) % n}:
            used[src] = pp.recv_side(dst, src, n)
        assert len(set(used.values())) == len(used)
    assert pp.send_side(0, 1 % n, n) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reference_ring_round_trip(n: int) -> None:
    rng = np.random.default_rng(n)
    ring = pp.PPReferenceRing(n, 96, 2)
    sent = {}
    for step in range(2):
        for r in range(n):
            for dst in {(r + 1) % n, (r - 1) % n}:
                x = rng.integers(0, 255, size=80 + 4 * step, dtype=np.uint8)
                ring.send(r, x, dst)
                sent.setdefault((r, dst), []).append(x)
    for (src, dst), xs in sent.items():
        for x in xs:
            out = np.empty_like(x)
            ring.recv(dst, out, src)
            assert np.array_equal(out, x)


def test_reference_ring_inflight_limit_and_misuse() -> None:
    ring = pp.PPReferenceRing(3, 64, 2)
    x = np.arange(16, dtype=np.float32)
    ring.send(0, x, 1)
    ring.send(0, x, 1)
    with pytest.raises(EPTimeoutError, match="in flight"):
        ring.send(0, x, 1)
    out = np.empty_like(x)
    ring.recv(1, out, 0)
    ring.send(0, x + 1, 1)  # one slot released
    ring.recv(1, out, 0)
    assert np.array_equal(out, x)
    ring.recv(1, out, 0)
    assert np.array_equal(out, x + 1)
    with pytest.raises(EPTimeoutError, match="wait forever"):
        ring.recv(1, out, 0)
    with pytest.raises(EPValueError, match="exceed num_max_tensor_bytes"):
        ring.send(0, np.zeros(17, np.float32), 1)
    ring.send(0, np.zeros(8, np.float32), 1)
    with pytest.raises(EPValueError, match="same size"):
        ring.recv(1, out, 0)
