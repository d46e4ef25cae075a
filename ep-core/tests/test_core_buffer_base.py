"""BufferAllocator (plan, cross-rank check, views), BufferBase lifecycle, bootstraps."""

from __future__ import annotations

import time

import ep_core as ec
import numpy as np
import pytest
from ep_core.errors import EPConfigError, EPPlanMismatchError, EPStateError, EPTimeoutError, EPValueError


def run_threads(n, fn):
    """Each rank's result (an exception in its place) and the exceptions raised."""
    out = ec.ThreadGroup(n, timeout_secs=30).run(fn, raise_first=False)
    return out, [x for x in out if isinstance(x, BaseException)]


def test_plan_offsets_and_alignment():
    a = ec.BufferAllocator()
    s1 = a.tensor("counts", (3,), "int32", alignment=16)
    s2 = a.tensor("rows", (5, 7), "bfloat16", alignment=256)
    s3 = a.tensor("flag", (1,), "uint8", alignment=1)
    assert (s1.offset, s2.offset, s3.offset) == (0, 256, 256 + 70)
    assert a.num_bytes == 256 + 71
    with pytest.raises(EPConfigError, match="name"):
        a.tensor("rows", (1,), "int32")
    with pytest.raises(EPConfigError, match="power of two"):
        a.tensor("x", (1,), "int32", alignment=3)
    with pytest.raises(ec.EPTypeError, match="dtype"):
        a.tensor("y", (1,), "float128")


def test_materialize_views_share_storage():
    a = ec.BufferAllocator()
    a.tensor("a", (4,), "int32")
    a.tensor("b", (2, 3), "float32", alignment=64)
    storage = ec.HostStorage(4096)
    views = a.materialize(storage, base_offset=128)
    assert views["a"].ptr == storage.ptr + 128 and views["b"].ptr == storage.ptr + 128 + 64
    ec.to_numpy(views["a"])[:] = [1, 2, 3, 4]
    raw = np.frombuffer(storage._raw, dtype=np.uint8)[storage._offset + 128 : storage._offset + 144]
    assert raw.view(np.int32).tolist() == [1, 2, 3, 4]
    with pytest.raises(EPStateError, match="already materialized"):
        a.tensor("c", (1,), "int32")
    too_big = ec.BufferAllocator()
    too_big.tensor("x", (8192,), "uint8")
    with pytest.raises(EPConfigError, match="allocate a larger buffer"):
        too_big.materialize(ec.HostStorage(4096))


def test_plan_check_across_ranks():
    def same(r, boot):
        a = ec.BufferAllocator()
        a.tensor("x", (8, 16), "bfloat16")
        a.tensor("y", (8,), "int32")
        a.check(boot)
        return True

    out, errors = run_threads(3, same)
    assert out == [True] * 3 and not errors

    def differ(r, boot):
        a = ec.BufferAllocator()
        a.tensor("x", (8, 16), "bfloat16")
        a.tensor("y", (8 if r != 2 else 9,), "int32")
        a.check(boot)

    _, errors = run_threads(3, differ)
    assert len(errors) == 3 and all(isinstance(e, EPPlanMismatchError) for e in errors)
    msg = str(errors[0])
    assert "'y'" in msg and "rank 0" in msg and "rank 2" in msg and "(9,)" in msg

    def missing(r, boot):
        a = ec.BufferAllocator()
        a.tensor("x", (1,), "int32")
        if r == 0:
            a.tensor("extra", (1,), "int32")
        a.check(boot, domain=[0, 1])

    _, errors = run_threads(2, missing)
    assert errors and "'extra'" in str(errors[0]) and "absent" in str(errors[0])


def test_buffer_base_lifecycle():
    storage = ec.HostStorage(8192)
    b = ec.BufferBase(ec.LocalBootstrap(), storage, num_workspace_bytes=4096)
    assert b.workspace.nbytes == 4096 and b.data.ptr == storage.ptr + 4096 and b.data.nbytes == 4096
    assert (b.rank, b.num_ranks) == (0, 1)
    b.barrier()
    b.destroy()
    assert storage.closed and b.destroyed
    with pytest.raises(EPStateError):
        b.barrier()
    with pytest.raises(EPStateError):
        b.destroy()
    s2 = ec.HostStorage(4096)
    with ec.BufferBase(ec.LocalBootstrap(), s2, num_workspace_bytes=0) as b2:
        assert not b2.destroyed
    assert s2.closed
    s3 = ec.HostStorage(4096)
    b3 = ec.BufferBase(ec.LocalBootstrap(), s3, num_workspace_bytes=0)
    del b3  # automatic destroy: local release only
    assert s3.closed
    with pytest.raises(EPConfigError, match="num_workspace_bytes"):
        ec.BufferBase(ec.LocalBootstrap(), ec.HostStorage(16), num_workspace_bytes=32)


def test_bootstraps():
    assert ec.LocalBootstrap().allgather(b"x") == [b"x"]
    out, errors = run_threads(4, lambda r, boot: boot.allgather(bytes([r])))
    assert not errors and out == [[b"\x00", b"\x01", b"\x02", b"\x03"]] * 4
    # run(): results by rank; the exception raised first is re-raised once every thread ended, or kept in place
    assert ec.ThreadGroup(3).run(lambda r, boot: (r, boot.rank, boot.size)) == [
        (0, 0, 3),
        (1, 1, 3),
        (2, 2, 3),
    ]

    def one_fails(r, boot):
        if r == 1:
            raise EPValueError("rank 1 fails")
        boot.barrier()  # its peer never arrives: a ThreadGroup timeout

    with pytest.raises(EPValueError, match="rank 1 fails"):
        ec.ThreadGroup(2, timeout_secs=0.2).run(one_fails)
    kept = ec.ThreadGroup(2, timeout_secs=0.2).run(one_fails, raise_first=False)
    assert isinstance(kept[0], EPTimeoutError) and isinstance(kept[1], EPValueError)
    with pytest.raises(EPTimeoutError, match="still runs"):  # a rank that never returns: the join bound
        ec.ThreadGroup(1).run(lambda r, boot: time.sleep(0.5), join_timeout_secs=0.05)
    group = ec.ThreadGroup(2, timeout_secs=0.2)
    with pytest.raises(EPTimeoutError) as err:
        group.bootstraps()[0].barrier()
    assert err.value.rank == 0 and err.value.tag == "bootstrap.barrier"

    class Bad:
        rank = 3
        size = 2

        def allgather(self, data):
            return [data]

        def barrier(self):
            return None

    with pytest.raises(EPValueError, match="rank"):
        ec.BufferBase(Bad(), ec.HostStorage(16), num_workspace_bytes=0)


def test_timeout_error_pickles():
    import pickle

    e = EPTimeoutError(3, "dispatch.notify", 7, 42)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.rank, e2.tag, e2.counter, e2.value, str(e2)) == (3, "dispatch.notify", 7, 42, str(e))
    assert isinstance(e2, TimeoutError) and isinstance(e2, ec.EPError)


def test_alignment_constants_and_aligned_plan_size():
    from ep_core.buffer_base import (
        NUM_ALLOCATION_ALIGN_BYTES,
        NUM_RDMA_ALIGN_BYTES,
        NUM_TMA_ALIGN_BYTES,
        BufferAllocator,
        align,
    )

    assert (NUM_ALLOCATION_ALIGN_BYTES, NUM_RDMA_ALIGN_BYTES, NUM_TMA_ALIGN_BYTES) == (2 << 20, 64, 32)
    assert (
        NUM_ALLOCATION_ALIGN_BYTES % NUM_RDMA_ALIGN_BYTES == 0
        and NUM_RDMA_ALIGN_BYTES % NUM_TMA_ALIGN_BYTES == 0
    )
    plan = BufferAllocator()
    assert plan.num_aligned_bytes == 0
    plan.tensor("a", (3,), "float32")
    assert plan.num_bytes == 12 and plan.num_aligned_bytes == 2 << 20
    assert align(0, 64) == 0 and align(65, 64) == 128
