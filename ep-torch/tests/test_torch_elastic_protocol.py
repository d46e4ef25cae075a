"""The GPU backend's protocol (``ep_torch.elastic_copy_engine``: slots, signal words, their values) on a host
model of streams: N ranks in one process, each rank's copies, signal writes and waits queued on its stream and run
in stream order, a wait holding its stream until the value is reached. A protocol error shows as wrong bytes or as
streams that can never finish (a deadlock), without a GPU."""

from __future__ import annotations

import ctypes
from collections import deque

import numpy as np
import pytest
import torch
from ep_core import agrs, engram, pp, signal_wait
from ep_core.errors import EPTimeoutError
from ep_torch.elastic_copy_engine import CopyEngineBackend, byte_view

MiB = 1 << 20


def _u64(addr: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(addr)


class _Streams:
    """One FIFO of operations per rank; `run()` executes heads until nothing can progress. `expire()` plays the
    bounded wait kernel's timeout (signal_wait.cuh) on every stuck stream: the head wait fills the rank's record,
    and that rank's later waits return at once."""

    def __init__(self, n: int) -> None:
        self.queues = [deque() for _ in range(n)]
        self.records = [np.zeros(signal_wait.RECORD_WORDS, np.int64) for _ in range(n)]
        self.claimed = [False] * n

    def expire(self) -> None:
        self.run()
        for r, q in enumerate(self.queues):
            if q and q[0][0] == "wait" and not self.claimed[r]:
                _, addr, value, wait_id = q[0]
                rec = self.records[r]
                rec[signal_wait.RECORD_WAIT_ID] = wait_id
                rec[signal_wait.RECORD_VALUE] = _u64(addr).value
                rec[signal_wait.RECORD_EXPECTED] = value
                rec[signal_wait.RECORD_ELAPSED_NS] = 1_000_000_000
                rec[signal_wait.RECORD_STATE] = signal_wait.STATE_TIMED_OUT
                self.claimed[r] = True
        self.run()

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r, q in enumerate(self.queues):
                while q:
                    op = q[0]
                    if op[0] == "wait" and _u64(op[1]).value < op[2] and not self.claimed[r]:
                        break
                    q.popleft()
                    progress = True
                    if op[0] == "copy":
                        ctypes.memmove(op[1], op[2], op[3])
                    elif op[0] == "write":
                        _u64(op[1]).value = op[2]
                    elif op[0] == "call":  # a kernel's model
                        op[1]()

    def idle(self) -> bool:
        return not any(self.queues)


class _HostOps:
    def __init__(self, streams: _Streams, rank: int) -> None:
        self.q = streams.queues[rank]
        self.timeouts = signal_wait.TimeoutRecord(streams.records[rank], rank, 1.0)

    def current_stream(self) -> int:
        return 0

    def comm_stream(self) -> int:  # one queue: the comm stream is ordered after the current one anyway
        return 0

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self.q.append(("copy", dst, src, nbytes))

    def write(self, addr: int, value: int, stream: int) -> None:
        self.q.append(("write", addr, value))

    def wait(self, addr: int, value: int, stream: int, peer: int, what: str) -> None:
        self.q.append(("wait", addr, value, self.timeouts.log.add(peer, what)))

    def check(self) -> None:
        self.timeouts.check()

    def view(self, ptr: int, nbytes: int) -> torch.Tensor:
        return byte_view(ptr, nbytes, torch.device("cpu"))  # the GPU path's DLPack view, labelled cpu here

    def keep(self, tensors) -> None:
        pass

    def record(self):
        return None

    def wait_event(self, event) -> None:
        pass


def _ranks(n: int, data_bytes: int = 4 * MiB, gpu_bytes: int | None = None):
    streams = _Streams(n)
    regions = [np.zeros(data_bytes, np.uint8) for _ in range(n)]
    sigs = [np.zeros(2 * MiB, np.uint8) for _ in range(n)]
    data = [int(a.ctypes.data) for a in regions]
    sig = [int(a.ctypes.data) for a in sigs]
    backends = [
        CopyEngineBackend(
            r,
            n,
            data,
            sig,
            torch.from_numpy(regions[r]),
            gpu_bytes or data_bytes,
            _HostOps(streams, r),
            lambda: None,
        )
        for r in range(n)
    ]
    return streams, backends, (regions, sigs)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_pp_ring_in_stream_order(n: int) -> None:
    streams, bs, _keep = _ranks(n)
    cfgs = [pp.make_pp_config(r, n, 4 * MiB, 256, 2) for r in range(n)]
    sent, recvd = {}, []
    for step in range(3):
        for r in range(n):
            for dst in ((r + 1) % n, (r - 1) % n):
                x = torch.full((64,), float(100 * r + 10 * dst + step))
                sent.setdefault((r, dst), []).append(x)
                bs[r].pp_send(cfgs[r], x, dst)
        for r in range(n):
            for src in ((r - 1) % n, (r + 1) % n):
                out = torch.empty(64)
                recvd.append((src, r, out))
                bs[r].pp_recv(cfgs[r], out, src)
        streams.run()
    assert streams.idle(), "deadlock"
    seen: dict = {}
    for src, dst, out in recvd:
        i = seen.get((src, dst), 0)
        seen[(src, dst)] = i + 1
        assert torch.equal(out, sent[(src, dst)][i]), (src, dst, i)


def test_pp_sender_waits_for_the_slot_release() -> None:
    streams, bs, _keep = _ranks(2)
    cfgs = [pp.make_pp_config(r, 2, 4 * MiB, 64, 2) for r in range(2)]
    xs = [torch.full((16,), float(i)) for i in range(3)]
    for x in xs:
        bs[0].pp_send(cfgs[0], x, 1)
    streams.run()
    assert not streams.idle()  # the third send waits: no slot was released
    outs = [torch.empty(16) for _ in range(3)]
    for o in outs:
        bs[1].pp_recv(cfgs[1], o, 0)
    streams.run()
    assert streams.idle()
    assert [float(o[0]) for o in outs] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_gather_sessions_in_stream_order(n: int) -> None:
    streams, bs, _keep = _ranks(n)
    sessions = [agrs.AGRSSession(r) for r in range(n)]
    for r, s in enumerate(sessions):
        s.configure(agrs.make_agrs_config(r, n, n, 4 * MiB, 64 * 1024, 4))
    for round_ in range(3):
        outs = []
        parts = [[torch.full((5, 7), float(r + 10 * round_ + 100 * i)) for i in range(2)] for r in range(n)]
        for r in range(n):
            sessions[r].create()
            offs, slot = sessions[r].plan_all_gather([x.nbytes for x in parts[r]], [None, None])
            outs.append(bs[r].all_gather(parts[r], offs, [None, None], slot, sessions[r].session_idx))
        streams.run()
        assert streams.idle(), "deadlock"
        for r in range(n):
            for i in range(2):
                assert torch.equal(outs[r][i], torch.stack([parts[q][i] for q in range(n)]))
        for r in range(n):
            bs[r].agrs_end_session(sessions[r].destroy())
        streams.run()
        assert streams.idle()


def test_session_end_holds_until_every_peer_ends() -> None:
    streams, bs, _keep = _ranks(2)
    bs[0].agrs_end_session(1)
    streams.run()
    assert not streams.idle()  # rank 1 has not ended session 1
    bs[1].agrs_end_session(1)
    streams.run()
    assert streams.idle()


def test_engram_fetch_reads_every_owner() -> None:
    n, rows, hidden = 3, 6, 16
    gpu = 2 * MiB
    streams, bs, _keep = _ranks(n, data_bytes=4 * MiB, gpu_bytes=gpu)
    rng = np.random.default_rng(0)
    storages = [rng.integers(0, 1 << 15, (rows, hidden)).astype(np.uint16) for _ in range(n)]
    tables = [engram.make_engram_table(r, n, (rows, hidden), "bfloat16", 2 * MiB, None) for r in range(n)]
    ts = [torch.from_numpy(s).view(torch.bfloat16) for s in storages]
    for r in range(n):
        bs[r].engram_write(tables[r], ts[r], None)
    streams.run()
    idx = rng.integers(0, rows * n, (5, 2)).astype(np.int32)
    data, sf = bs[1].engram_fetch(tables[1], torch.from_numpy(idx), False)()
    want, _ = engram.fetch_reference(storages, idx)
    assert sf is None and np.array_equal(data.view(torch.int16).numpy().view(np.uint16), want)


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_chunks_land_in_rank_order(n: int) -> None:
    streams, bs, _keep = _ranks(n)
    sessions = [agrs.AGRSSession(r) for r in range(n)]
    xs = [torch.arange(4 * n, dtype=torch.float32).reshape(2 * n, 2) + 100 * r for r in range(n)]
    parts = []
    for r in range(n):
        sessions[r].configure(agrs.make_agrs_config(r, n, n, 4 * MiB, 64 * 1024, 4))
        sessions[r].create()
        cb = xs[r].nbytes // n
        (off,), slot = sessions[r].plan_all_gather([cb], [None])
        parts.append(bs[r].reduce_scatter(xs[r], off, cb, slot, sessions[r].session_idx))
    streams.run()
    assert streams.idle()
    for r in range(n):
        for q in range(n):
            assert torch.equal(parts[r][q], xs[q][2 * r : 2 * r + 2])


def test_byte_view_aliases_the_memory() -> None:
    a = np.arange(64, dtype=np.uint8)
    t = byte_view(int(a.ctypes.data), 64, torch.device("cpu"))
    assert t.dtype == torch.uint8 and t.shape == (64,) and t.data_ptr() == a.ctypes.data
    t[3] = 77
    assert a[3] == 77


@pytest.mark.parametrize("n", [2, 3])
def test_bucket_reductions_read_before_anyone_writes(n: int) -> None:
    streams, bs, (regions, _sigs) = _ranks(n)
    views = [torch.from_numpy(regions[r][: 4 * 6 * n].view(np.float32)) for r in range(n)]
    for r in range(n):
        views[r].copy_(torch.arange(6 * n, dtype=torch.float32) + 100 * r)
    want = sum(torch.arange(6 * n, dtype=torch.float32) + 100 * r for r in range(n))
    outs = [bs[r].bucket_reduce([(views[r], 0)], 1, 1.0, scatter=False) for r in range(n)]
    streams.run()
    assert streams.idle()
    for r in range(n):
        assert torch.equal(views[r], want) and torch.equal(outs[r][0], want)
    # reduce-scatter next: shard r of every rank's (now reduced) source
    outs = [bs[r].bucket_reduce([(views[r], 0)], 2, 2.0, scatter=True) for r in range(n)]
    streams.run()
    assert streams.idle()
    for r in range(n):
        assert torch.equal(outs[r][0], (want * n * 2.0)[6 * r : 6 * r + 6])


def test_bucket_all_gather_in_place() -> None:
    n = 3
    streams, bs, (regions, _sigs) = _ranks(n)
    views = [torch.from_numpy(regions[r][: 4 * 5 * n].view(np.float32)).view(n, 5) for r in range(n)]
    for r in range(n):
        views[r][r] = float(r + 1)
    for r in range(n):
        bs[r].bucket_all_gather([(views[r][r], 0)], 1)
    streams.run()
    assert streams.idle()
    for r in range(n):
        assert torch.equal(views[r][:, 0], torch.tensor([1.0, 2.0, 3.0]))


def test_a_timed_out_wait_raises_at_the_next_call_naming_rank_peer_and_signal() -> None:
    streams, bs, _keep = _ranks(2)
    cfgs = [pp.make_pp_config(r, 2, 4 * MiB, 256, 2) for r in range(2)]
    outs = [torch.empty(16) for _ in range(2)]  # alive until the queued copies ran
    bs[1].pp_recv(cfgs[1], outs[0], 0)  # rank 0 never sends
    streams.run()
    assert not streams.idle()
    bs[1].pp_recv(cfgs[1], outs[1], 0)  # queued behind the stuck wait: no error recorded yet
    streams.expire()
    assert streams.idle()  # the streams drain: the later wait returned at once
    with pytest.raises(EPTimeoutError) as info:
        bs[1].pp_send(cfgs[1], outs[0], 0)
    err = info.value
    assert err.rank == 1 and err.counter == 0 and "pp_recv: tensor 0 from rank 0" in err.tag
    assert (
        "rank 1 timed out" in str(err)
        and "waiting for rank 0" in str(err)
        and "num_gpu_timeout_secs" in str(err)
    )
    with pytest.raises(EPTimeoutError, match="tensor 0 from rank 0"):  # sticky: every later call raises it
        bs[1].barrier()
    bs[0].barrier()  # the other rank recorded nothing


@pytest.mark.parametrize("n", [2, 3])
def test_a_session_end_without_the_peers_times_out_naming_one(n: int) -> None:
    streams, bs, _keep = _ranks(n)
    bs[0].agrs_end_session(1)
    streams.expire()
    with pytest.raises(EPTimeoutError) as info:
        bs[0].agrs_end_session(2)
    assert info.value.counter == 1 and "destroy_agrs_session: the end of session 1" in info.value.tag


def test_close_releases_the_backend_allocations() -> None:
    _streams, bs, _keep = _ranks(2)
    closed = []

    class _Alloc:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    b = bs[0]
    b._sig_alloc, b._host_alloc = _Alloc("signals"), _Alloc("host storage")
    b.ops.close = lambda: closed.append("waiter")
    b.close()
    assert closed == ["signals", "host storage", "waiter"]
    assert not hasattr(b, "_sig_alloc") and not hasattr(b, "_host_alloc")
