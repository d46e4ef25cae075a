"""The GPU half of ``BucketBuffer.send_recv`` (``ep_torch.bucket_send_recv._gpu_transfers``: the "dsts free" and
"arrived" signal words, the copies into the receiver's storage at its offsets) on the host model of streams of
``test_torch_elastic_protocol.py`` (N ranks in one process, each rank's copies, signal writes and waits run in
stream order, a wait holding its stream): rings, swaps, a send to itself, idle ranks, several operations in a row
with the receiver late, and a wait that expires naming the peer. Wrong bytes or streams that never drain (a
deadlock) show a protocol error without a GPU (issue 42)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ep_core.errors import EPTimeoutError
from ep_torch.bucket_send_recv import _gpu_transfers


def _model():
    """The host model of streams and backends (``_Streams``, ``_ranks``) of the elastic protocol tests, loaded by
    path (the test folder is not importable by name)."""
    name = "ep_torch_tests_elastic_protocol"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("test_torch_elastic_protocol.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class _Ranks:
    """N ranks of BucketBuffer look-alikes over the host model: what ``_gpu_transfers`` reads of a buffer."""

    def __init__(self, n: int) -> None:
        self.streams, backends, (self.regions, _sigs) = _model()._ranks(n)
        self._keep = _sigs
        self.bufs = [
            SimpleNamespace(
                _backend=backends[r], rank_idx=r, _ops=0, storage=torch.from_numpy(self.regions[r])
            )
            for r in range(n)
        ]

    def region(self, r: int, off: int, count: int) -> torch.Tensor:
        return torch.from_numpy(self.regions[r][off : off + 4 * count].view(np.float32))

    def call(self, r: int, xs, ds_offs, dst, src, dst_offs) -> None:
        """Rank r's call after the agreement: its operation count, then the GPU half."""
        buf = self.bufs[r]
        buf._ops += 1
        ds = [self.region(r, off, count) for off, count in ds_offs]
        _gpu_transfers(buf, xs, ds, [off for off, _ in ds_offs], dst, src, dst_offs)


def _src(r: int, salt: int, count: int = 6) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) + 100 * r + 1000 * salt


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rings_swaps_self_and_idle_ranks(n: int) -> None:
    m = _Ranks(n)
    srcs: list = []  # alive until the queued copies ran
    for salt, step in ((1, 1), (2, -1)):  # rings both ways, into two dsts at different offsets
        for r in range(n):
            a, b = _src(r, salt), _src(r, salt + 10, 4)
            srcs += [a, b]
            dst, src = (r + step) % n, (r - step) % n
            m.call(r, [a, b], [(64, 6), (4096, 4)], dst, src, [64, 4096])
        m.streams.run()
        assert m.streams.idle()
        for r in range(n):
            q = (r - step) % n
            assert torch.equal(m.region(r, 64, 6), _src(q, salt)), (salt, r)
            assert torch.equal(m.region(r, 4096, 4), _src(q, salt + 10, 4))
    # a swap of pairs (an odd rank out stays idle), and the idle rank's storage untouched
    before = m.region(n - 1, 64, 6).clone()
    for r in range(n):
        mate = r ^ 1
        if mate < n:
            a = _src(r, 3)
            srcs.append(a)
            m.call(r, [a], [(64, 6)], mate, mate, [64])
        else:
            m.call(r, [], [], None, None, [])
    m.streams.run()
    assert m.streams.idle()
    for r in range(n):
        want = _src(r ^ 1, 3) if (r ^ 1) < n else before
        assert torch.equal(m.region(r, 64, 6), want)
    # to itself (a device copy, no signal) next to a transfer between two others
    for r in range(n):
        a = _src(r, 4)
        srcs.append(a)
        if r == 0:
            m.call(r, [a], [(256, 6)], 0, 0, [256])
        elif n > 2 and r == 1:
            m.call(r, [a], [], 2, None, [512])
        elif n > 2 and r == 2:
            m.call(r, [], [(512, 6)], None, 1, [])
        else:
            m.call(r, [], [], None, None, [])
    m.streams.run()
    assert m.streams.idle()
    assert torch.equal(m.region(0, 256, 6), _src(0, 4))
    if n > 2:
        assert torch.equal(m.region(2, 512, 6), _src(1, 4))


def test_the_sender_waits_until_the_receiver_arrives() -> None:
    """Two operations in a row from rank 0 to rank 1, rank 1 late: nothing lands in rank 1's dsts before rank 1
    reached the operation (its dsts may still be in use), and the second copy waits for the second arrival."""
    m = _Ranks(2)
    a1, a2 = _src(0, 1), _src(0, 2)
    m.region(1, 64, 6).fill_(-7.0)
    m.call(0, [a1], [], 1, None, [64])
    m.call(0, [a2], [], 1, None, [64])
    m.streams.run()
    assert not m.streams.idle()  # rank 0 waits for rank 1's "dsts free"
    assert torch.equal(m.region(1, 64, 6), torch.full((6,), -7.0))
    m.call(1, [], [(64, 6)], None, 0, [])
    m.streams.run()
    assert not m.streams.idle()  # rank 0's second send still waits for rank 1's second arrival
    assert torch.equal(m.region(1, 64, 6), a1)
    m.region(1, 64, 6).fill_(-7.0)  # rank 1 reads its first result, then reuses the dsts
    m.call(1, [], [(64, 6)], None, 0, [])
    m.streams.run()
    assert m.streams.idle()
    assert torch.equal(m.region(1, 64, 6), a2)


def test_a_sender_that_never_comes_times_out_naming_it() -> None:
    m = _Ranks(2)
    m.call(1, [], [(64, 6)], None, 0, [])  # rank 0 never sends
    m.streams.run()
    assert not m.streams.idle()
    m.streams.expire()
    assert m.streams.idle()
    with pytest.raises(EPTimeoutError) as info:
        m.bufs[1]._backend.check()  # what the next call of the buffer runs first
    err = info.value
    assert err.rank == 1 and "send_recv: operation 1, the srcs of rank 0" in err.tag
    assert "waiting for rank 0" in str(err)
    m.bufs[0]._backend.check()  # the other rank recorded nothing
