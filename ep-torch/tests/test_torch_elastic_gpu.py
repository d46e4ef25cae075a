"""Issue 20 on the GPU (marker gpu): PP send/recv, Engram and AGRS of ``ElasticBuffer`` over the ipc transport with
several processes sharing GPU 0 (a gloo bootstrap; NCCL refuses two ranks on one GPU), against ep-core's numpy
references. Skipped without a GPU.

Each case runs in a process group started by this file as a script under a wall-clock limit (the stream waits on
peers are bounded by num_gpu_timeout_secs, 100 s by default: the limit catches a hang of anything else).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

MiB = 1 << 20


def _run(
    mode: str, n: int, tmp_path: Path, limit: float = 180.0, wait: str = "kernel", transport: str = "ipc"
) -> list[list]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    # the bounded wait kernel, or stream waits + host watchdog; the transport (nccl: an nccl process group)
    env = dict(os.environ, EPKIT_ELASTIC_WAIT=wait, EP_TEST_ELASTIC_TRANSPORT=transport)
    env.pop("EPKIT_TORCH_TRANSPORT", None)
    code, out = run_script(__file__, [mode, str(n), str(tmp_path)], limit, env=env, what=f"{mode}: ")
    assert code == 0, out[-3000:]
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]
    failures = [
        f"rank {r}: {name}: {detail}" for r, res in enumerate(per_rank) for name, ok, detail in res if not ok
    ]
    assert per_rank[0], "no checks ran"
    assert not failures, "\n".join(failures[:10])
    return per_rank


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _buffer(num_bytes: int = 8 * MiB, num_cpu_bytes: int = 0, num_gpu_timeout_secs: float = 100):
    from ep_torch import ElasticBuffer

    torch.cuda.set_device(0)
    return ElasticBuffer(
        None,
        num_bytes=num_bytes,
        num_cpu_bytes=num_cpu_bytes,
        num_gpu_timeout_secs=num_gpu_timeout_secs,
        transport=os.environ.get("EP_TEST_ELASTIC_TRANSPORT", "ipc"),
    )


def _payload(src: int, dst: int, seq: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 100 * dst + seq)
    return (torch.randn(numel, generator=g) * 100).to(dtype).cuda()


def _pp(rank: int, n: int, res: list) -> None:
    import elastic_pp_scenario  # next to this file (its directory is sys.path[0] in the ranks)

    elastic_pp_scenario.run(_buffer(), rank, n, torch.device("cuda", 0), res)


_TIMEOUT_SECS = 2.0


def _pp_timeout(rank: int, n: int, res: list) -> None:
    """Rank 1 receives from rank 0, which sends nothing: the bounded wait gives up after num_gpu_timeout_secs, the
    stream drains, and the next call raises EPTimeoutError naming rank 1, rank 0 and the tensor."""
    from ep_core.errors import EPTimeoutError

    buf = _buffer(num_gpu_timeout_secs=_TIMEOUT_SECS)
    buf.pp_set_config(4096, 2)
    if rank == 1:
        t = torch.empty(1024, device="cuda")
        t0 = time.monotonic()
        buf.pp_recv(t, 0)
        buf.pp_recv(t, 0)  # queued behind the first: returns at once after the timeout
        torch.cuda.synchronize()  # returns: the wait is bounded
        waited = time.monotonic() - t0
        res.append(
            ("pp timeout/stream drains within the bound", waited < _TIMEOUT_SECS + 5, f"{waited:.2f} s")
        )
        res.append(("pp timeout/bounded, not instant", waited >= _TIMEOUT_SECS * 0.9, f"{waited:.2f} s"))
        err = ""
        try:
            buf.pp_recv(t, 0)
        except EPTimeoutError as exc:
            err = f"{exc.rank}|{exc.counter}|{exc}"
        res.append(("pp timeout/next call raises EPTimeoutError", err.startswith("1|0|"), err))
        res.append(("pp timeout/names the signal", "pp_recv: tensor 0 from rank 0" in err, err))
        again = ""
        try:  # any later PP/AGRS call raises it (ElasticBuffer.barrier is the runtime's, not this record's)
            buf.pp_send(t, 0)
        except EPTimeoutError as exc:
            again = str(exc)
        res.append(("pp timeout/sticky", "tensor 0 from rank 0" in again, again))
    else:
        time.sleep(_TIMEOUT_SECS + 3)  # sends nothing
        res.append(("pp timeout/sender idle", True, ""))
    # the group is broken (rank 1 will not pair a barrier): leave without the exit collectives
    Path(sys.argv[3], f"{rank}.json").write_text(json.dumps(res))
    os._exit(0)


def _agrs(rank: int, n: int, res: list) -> None:
    from ep_torch import ElasticBuffer

    shapes = [(64, 128), (33,), (16, 16)]
    need = ElasticBuffer.get_agrs_num_max_session_bytes(None, shapes, torch.float32)
    buf = _buffer(num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(None, need))
    buf.agrs_set_config(need, 3)

    def part(r: int, i: int, session: int, dtype=torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 * r + 31 * i + 1000 * session)
        return (torch.randn(shapes[i], generator=g) * 50).to(dtype).cuda()

    ok = True
    for session in range(3):
        with buf.agrs_new_session():
            got, handle = buf.all_gather(part(rank, 0, session))
            handle()
            want = torch.stack([part(r, 0, session) for r in range(n)])
            ok = ok and bool(torch.equal(got, want))
            a, b, handle = buf.all_gather([part(rank, 1, session, torch.bfloat16), part(rank, 2, session)])
            handle()
            ok = ok and bool(
                torch.equal(a, torch.stack([part(r, 1, session, torch.bfloat16) for r in range(n)]))
            )
            ok = ok and bool(torch.equal(b, torch.stack([part(r, 2, session) for r in range(n)])))
            torch.cuda.synchronize()
    res.append(("agrs/all_gather", ok, f"{n} ranks, 3 sessions"))
    ok = True
    with buf.agrs_new_session():
        ip = buf.agrs_get_inplace_tensor(shapes[0], torch.float32)
        ip.copy_(part(rank, 0, 9))
        got, handle = buf.all_gather(ip)
        handle()
        ok = bool(torch.equal(got, torch.stack([part(r, 0, 9) for r in range(n)])))
        torch.cuda.synchronize()
    res.append(("agrs/in place", ok, ""))
    from ep_core import agrs

    def rs_in(r: int, dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(r + 17)
        return (torch.randn(8 * n, 64, generator=g) * 10).to(dtype).cuda()

    ok = True
    with buf.agrs_new_session():
        for dtype in (torch.float32, torch.bfloat16):
            got = buf.reduce_scatter(rs_in(rank, dtype))
            want = agrs.reduce_scatter_reference(
                [rs_in(r, dtype).float().cpu().numpy() for r in range(n)], rank
            )
            ok = ok and bool(torch.equal(got.cpu(), torch.from_numpy(want).to(dtype)))
        torch.cuda.synchronize()
    res.append(("agrs/reduce_scatter", ok, ""))


def _engram(rank: int, n: int, res: list) -> None:
    from ep_core import engram
    from ep_torch._convert import from_numpy, to_numpy

    gpu, cpu = engram.get_engram_storage_size_hint(64, 256, 128)
    buf = _buffer(num_bytes=gpu + cpu, num_cpu_bytes=cpu)
    storages = [np.random.default_rng(r).integers(0, 1 << 15, (64, 256)).astype(np.uint16) for r in range(n)]
    buf.engram_write(from_numpy(storages[rank], torch.bfloat16).cuda())
    idx = np.random.default_rng(50 + rank).integers(0, 64 * n, (32, 4)).astype(np.int32)
    data, sf = buf.engram_fetch(torch.from_numpy(idx).cuda())()
    torch.cuda.synchronize()
    want, _ = engram.fetch_reference(storages, idx)
    res.append(
        (
            "engram/bf16 fetch",
            sf is None
            and data.shape == (32, 4 * 256)
            and np.array_equal(to_numpy(data).reshape(want.shape), want),
            str(tuple(data.shape)),
        )
    )
    backend = buf.__dict__["_elastic_state"].backend
    res.append(
        ("engram/storage in host NUMA memory", backend.engram_storage == "host", backend.engram_storage)
    )
    if backend.engram_storage == "host":
        # the CPU sees what engram_write copied into this rank's host part
        host = np.frombuffer(backend.host_view(), dtype=np.uint16, count=storages[rank].size)
        res.append(("engram/host part holds the storage", np.array_equal(host, storages[rank].ravel()), ""))


def _bucket(rank: int, n: int, res: list) -> None:
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    torch.cuda.set_device(0)
    plan = BufferAllocator()
    plan.tensor("ag", (n * 4096,), "bfloat16")
    plan.tensor("red", (n * 1024,), "float32")
    buf = BucketBuffer(None, plan, transport="ipc")

    def val(r: int, numel: int, dtype=torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(r * 13 + 5)
        return (torch.randn(numel, generator=g) * 10).to(dtype).cuda()

    shard = buf.tensors["ag"].view(n, 4096)[rank]
    shard.copy_(val(rank, 4096, torch.bfloat16))
    got = buf.all_gather(shard).wait()
    want = torch.cat([val(r, 4096, torch.bfloat16) for r in range(n)])
    res.append(("bucket/all_gather", bool(torch.equal(got, want)), ""))
    red = buf.tensors["red"]
    red.copy_(val(rank, n * 1024))
    got = buf.all_reduce(red, scale=0.5).wait()
    acc = val(0, n * 1024)
    for r in range(1, n):
        acc = acc + val(r, n * 1024)
    res.append(("bucket/all_reduce", bool(torch.equal(got, acc * 0.5)), ""))
    got = buf.reduce_scatter(red).wait()
    res.append(
        (
            "bucket/reduce_scatter",
            bool(torch.equal(got, (acc * 0.5 * n)[rank * 1024 : (rank + 1) * 1024])),
            "",
        )
    )
    torch.cuda.synchronize()
    with buf.session():  # tensors outside the storage, staged in session storage
        ext = torch.empty(n * 1024, device="cuda")
        got = buf.all_gather(val(rank, 1024), ext).wait()
        want = torch.cat([val(r, 1024) for r in range(n)])
        res.append(
            ("bucket/session all_gather (unregistered)", got is ext and bool(torch.equal(ext, want)), "")
        )
        got = buf.all_reduce(val(rank, 777)).wait()
        acc = val(0, 777)
        for r in range(1, n):
            acc = acc + val(r, 777)
        res.append(("bucket/session all_reduce (unregistered)", bool(torch.equal(got, acc)), ""))
    torch.cuda.synchronize()


_CASES = {"pp": _pp, "pp_timeout": _pp_timeout, "agrs": _agrs, "engram": _engram, "bucket": _bucket}


def _worker(rank: int, n: int, mode: str, out_dir: str) -> None:
    res: list = []
    try:
        _CASES[mode](rank, n, res)
    except Exception as exc:  # reported, not hidden
        res.append((f"{mode}/raised", False, f"{type(exc).__name__}: {exc}"))
    Path(out_dir, f"{rank}.json").write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pp_on_shared_gpu(n: int, tmp_path: Path) -> None:
    _run("pp", n, tmp_path)


def test_pp_recv_without_sender_times_out_on_the_gpu(tmp_path: Path) -> None:
    _run("pp_timeout", 2, tmp_path, limit=120.0)


@pytest.mark.parametrize("mode", ["pp", "agrs", "bucket"])
def test_stream_waits_on_shared_gpu(mode: str, tmp_path: Path) -> None:
    """EPKIT_ELASTIC_WAIT=stream: cuStreamWaitValue64 bounded by the host watchdog (elastic_stream_wait)."""
    _run(mode, 2, tmp_path, wait="stream")


def test_stream_wait_without_sender_times_out_on_the_gpu(tmp_path: Path) -> None:
    _run("pp_timeout", 2, tmp_path, limit=120.0, wait="stream")


@pytest.mark.parametrize("n", [2, 4])
def test_agrs_on_shared_gpu(n: int, tmp_path: Path) -> None:
    _run("agrs", n, tmp_path)


@pytest.mark.parametrize("n", [1, 2])
def test_engram_on_shared_gpu(n: int, tmp_path: Path) -> None:
    _run("engram", n, tmp_path)


@pytest.mark.parametrize("n", [2, 3])
def test_bucket_on_shared_gpu(n: int, tmp_path: Path) -> None:
    _run("bucket", n, tmp_path)


@pytest.mark.parametrize("mode", ["pp", "agrs", "engram"])
def test_one_rank_over_nccl(mode: str, tmp_path: Path) -> None:
    """The same primitives over the nccl transport (one rank on an nccl process group: NCCL's LSA team is the whole
    group), through the window's LSA pointers."""
    _run(mode, 1, tmp_path, transport="nccl")


if __name__ == "__main__":
    from ep_torch import launch

    nccl = os.environ.get("EP_TEST_ELASTIC_TRANSPORT") == "nccl"
    launch.spawn(_worker, int(sys.argv[2]), sys.argv[1], sys.argv[3], backend="nccl" if nccl else "gloo")
