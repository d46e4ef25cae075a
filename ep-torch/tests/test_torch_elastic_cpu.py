"""Issue 20 on the CPU reference backend: PP send/recv, Engram write/fetch and AGRS all-gather sessions of
``ep_torch.ElasticBuffer`` on 2-4 gloo processes, against ep-core's numpy references, bad inputs included.

Every case runs in a process group started by this file as a script under a wall-clock limit (a hang fails the
test); each rank writes what it saw to a JSON file that the test checks. The cases of one group size share one
process group (`_MODES`, run in that order by the first test that needs them): starting torch in every rank is
most of a case's time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

MiB = 1 << 20


# The cases that share one process group per group size, run in this order (each case's buffers use the group in
# turn). The PP cases run alone: a PP buffer of an earlier case in the same group would take the later one's
# messages, and pp_timeout leaves the group unusable (gloo closes the pair whose receive timed out).
_BATCHED = {
    2: ["engram", "agrs", "reduce_scatter", "bucket", "destroy", "pp_buffer"],
    3: ["engram", "reduce_scatter", "bucket", "pp_buffer"],
}
_groups: dict[
    tuple[str, int], tuple[Path, int, str]
] = {}  # (cases, n) -> (output folder, exit status, output)


def _run(mode: str, n: int, tmp_path: Path, limit: float = 120.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    modes = ",".join(_BATCHED[n]) if mode in _BATCHED.get(n, ()) else mode
    if (modes, n) not in _groups:
        count = modes.count(",") + 1
        code, out = run_script(
            __file__, [modes, str(n), str(tmp_path)], limit + 20 * count, what=f"{modes}: "
        )
        _groups[modes, n] = (tmp_path, code, out)
    folder, code, out = _groups[modes, n]
    assert code == 0, out[-3000:]
    return [json.loads((folder / f"{mode}.{r}.json").read_text()) for r in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _buffer(num_bytes: int = 4 * MiB, num_cpu_bytes: int = 0, timeout: float = 30):
    from ep_torch import ElasticBuffer

    return ElasticBuffer(
        None,
        num_bytes=num_bytes,
        num_cpu_bytes=num_cpu_bytes,
        num_cpu_timeout_secs=timeout,
        transport="reference",
    )


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _payload(src: int, dst: int, seq: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 * src + 100 * dst + seq)
    shape = (3, 8) if seq % 2 == 0 else (24,)
    x = torch.randn(shape, generator=g) * 100
    return x.to(dtype)


def _pp(rank: int, n: int, out: dict) -> None:
    import torch

    buf = _buffer()
    out["before_config"] = _raises(lambda: buf.pp_send(torch.zeros(4), (rank + 1) % n))
    buf.pp_set_config(96, 2)
    dtypes = [torch.float32, torch.bfloat16, torch.int32]
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    sent: dict[int, int] = {}
    recvd: dict[int, int] = {}
    ok = True
    for step in range(4):
        dt = dtypes[step % 3]
        for dst in (nxt, prv):
            seq = sent.get(dst, 0)
            buf.pp_send(_payload(rank, dst, seq, dt), dst)
            sent[dst] = seq + 1
        for src in (prv, nxt):
            seq = recvd.get(src, 0)
            want = _payload(src, rank, seq, dt)
            got = torch.empty_like(want)
            buf.pp_recv(got, src)
            recvd[src] = seq + 1
            ok = ok and bool(torch.equal(got, want))
    out["round_trip"] = ok
    out["wrong_peer"] = _raises(lambda: buf.pp_send(torch.zeros(4), (rank + 2) % n)) if n == 4 else "skip"
    out["too_big"] = _raises(lambda: buf.pp_send(torch.zeros(25), nxt))
    out["not_contiguous"] = _raises(lambda: buf.pp_send(torch.zeros(4, 4).t(), nxt))
    out["bad_config"] = _raises(lambda: buf.pp_set_config(MiB, 4))
    buf.bootstrap.barrier()


def _pp_inflight(rank: int, n: int, out: dict) -> None:
    import torch

    buf = _buffer()
    buf.pp_set_config(64, 2)
    if rank == 0:
        times = []
        for i in range(3):
            t0 = time.monotonic()
            buf.pp_send(torch.full((16,), float(i)), 1)
            times.append(time.monotonic() - t0)
        out["times"] = times
        # a size mismatch: rank 1 receives this 64-byte tensor into a 32-byte one
        buf.pp_send(torch.full((16,), 7.0), 1)
        buf.pp_send(torch.full((16,), 8.0), 1)
    else:
        time.sleep(1.5)
        got = []
        for _ in range(3):
            t = torch.empty(16)
            buf.pp_recv(t, 0)
            got.append(float(t[0]))
        out["got"] = got
        out["mismatch"] = _raises(lambda: buf.pp_recv(torch.empty(8), 0))
        t = torch.empty(16)
        buf.pp_recv(t, 0)
        out["after_mismatch"] = float(t[0])
    buf.bootstrap.barrier()


def _pp_timeout(rank: int, n: int, out: dict) -> None:
    import torch

    buf = _buffer(timeout=2)
    buf.pp_set_config(64, 1)
    if rank == 1:
        t0 = time.monotonic()
        out["recv_nothing"] = _raises(lambda: buf.pp_recv(torch.empty(16), 0))
        out["waited"] = time.monotonic() - t0
    else:
        time.sleep(4)  # idle until rank 1 gave up
    # gloo closes the pair whose receive timed out: the group is unusable, so leave without its exit barrier
    Path(sys.argv[3], f"pp_timeout.{rank}.json").write_text(json.dumps(out))
    os._exit(0)


def _pp_gpu_scenario(rank: int, n: int, out: dict) -> None:
    import elastic_pp_scenario  # next to this file (its directory is sys.path[0] in the ranks)
    import torch

    res: list = []
    buf = _buffer()
    try:
        elastic_pp_scenario.run(buf, rank, n, torch.device("cpu"), res)
    except Exception as exc:  # reported, not hidden
        res.append(("pp/raised", False, f"{type(exc).__name__}: {exc}"))
    out["res"] = res
    buf.bootstrap.barrier()  # every rank's receives are done before any buffer goes


def _destroy_case(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_torch import ElasticBuffer

    buf = ElasticBuffer(None, num_bytes=4 * MiB, explicitly_destroy=True, transport="reference")
    buf.pp_set_config(64, 2)
    out["state_before"] = "_elastic_state" in buf.__dict__
    buf.destroy()
    out["state_after"] = "_elastic_state" in buf.__dict__
    out["send_after"] = _raises(lambda: buf.pp_send(torch.zeros(4), (rank + 1) % n))


def _pp_peer_refuses(rank: int, n: int, out: dict) -> None:
    buf = _buffer()
    # rank 1 asks for more than the buffer holds: it raises, and rank 0 learns it instead of waiting
    out["config"] = _raises(lambda: buf.pp_set_config(64 if rank == 0 else MiB, 2))


def _engram_case(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_core import engram
    from ep_torch._convert import from_numpy, to_numpy

    gpu, cpu = _buffer().get_engram_storage_size_hint(5, 16, 64)
    buf = _buffer(num_bytes=gpu + cpu, num_cpu_bytes=cpu)
    out["before_write"] = _raises(lambda: buf.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)))
    storages = [np.random.default_rng(r).integers(0, 1 << 15, (5, 16)).astype(np.uint16) for r in range(n)]
    buf.engram_write(from_numpy(storages[rank], torch.bfloat16))
    idx = np.random.default_rng(50 + rank).integers(0, 5 * n, (7, 3)).astype(np.int32)
    hook = buf.engram_fetch(torch.from_numpy(idx))
    data, sf = hook()
    want, _ = engram.fetch_reference(storages, idx)
    # DeepEP 2.0's shape: [T, k * hidden], the bytes of the reference's [T * k, hidden]
    out["bf16"] = (
        data.shape == (7, 48) and sf is None and np.array_equal(to_numpy(data).reshape(want.shape), want)
    )
    out["out_of_range"] = _raises(lambda: buf.engram_fetch(torch.tensor([[5 * n]], dtype=torch.int32)))
    out["int64"] = _raises(lambda: buf.engram_fetch(torch.zeros(2, 2, dtype=torch.int64)))
    out["too_many"] = _raises(lambda: buf.engram_fetch(torch.zeros(gpu // 32 + 1, 1, dtype=torch.int32)))
    # FP8 with replicated scaling factors
    fp8 = [np.random.default_rng(10 + r).integers(0, 120, (5, 32)).astype(np.uint8) for r in range(n)]
    sf_table = np.random.default_rng(99).standard_normal((5 * n, 2)).astype(np.float32)
    buf.engram_write(from_numpy(fp8[rank], torch.float8_e4m3fn), torch.from_numpy(sf_table))
    for col in (False, True):
        data, sf = buf.engram_fetch(torch.from_numpy(idx), use_tma_aligned_col_major_sf=col)()
        want, want_sf = engram.fetch_reference(fp8, idx, sf_table, col)
        out[f"fp8_col{int(col)}"] = (
            data.dtype == torch.float8_e4m3fn
            and data.shape == (7, 96)
            and np.array_equal(to_numpy(data).reshape(want.shape), want)
            and np.array_equal(sf.numpy(), want_sf)
            and (sf.stride() == (1, 8)) == col
        )
    out["fp8_without_sf"] = _raises(lambda: buf.engram_write(from_numpy(fp8[rank], torch.float8_e4m3fn)))
    buf.bootstrap.barrier()
    big = torch.zeros(cpu // 32 + 1, 16, dtype=torch.bfloat16)
    out["too_big"] = _raises(lambda: buf.engram_write(big))


def _agrs_case(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_torch import ElasticBuffer

    shapes = [(3, 5), (2, 4), (7,), (4, 4)]
    need = ElasticBuffer.get_agrs_num_max_session_bytes(None, shapes, torch.float32)
    buf = _buffer(num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(None, need))
    out["before_config"] = _raises(lambda: buf.all_gather(torch.zeros(2)))
    buf.agrs_set_config(need, 3)
    out["outside_session"] = _raises(lambda: buf.all_gather(torch.zeros(2)))

    def part(r: int, i: int, shape, dtype, session: int):
        g = torch.Generator().manual_seed(7 * r + 31 * i + 1000 * session)
        return (torch.randn(shape, generator=g) * 50).to(dtype)

    ok = True
    for session in range(2):
        with buf.agrs_new_session():
            x = part(rank, 0, shapes[0], torch.float32, session)
            got, handle = buf.all_gather(x)
            handle()
            want = torch.stack([part(r, 0, shapes[0], torch.float32, session) for r in range(n)])
            ok = ok and torch.equal(got, want)
            a = part(rank, 1, shapes[1], torch.bfloat16, session)
            b = part(rank, 2, shapes[2], torch.int32, session)
            ga, gb, handle = buf.all_gather([a, b])
            handle()
            ok = ok and torch.equal(
                ga, torch.stack([part(r, 1, shapes[1], torch.bfloat16, session) for r in range(n)])
            )
            ok = ok and torch.equal(
                gb, torch.stack([part(r, 2, shapes[2], torch.int32, session) for r in range(n)])
            )
            ip = buf.agrs_get_inplace_tensor(shapes[3], torch.float32)
            ip.copy_(part(rank, 3, shapes[3], torch.float32, session))
            gi, handle = buf.all_gather(ip)
            handle()
            ok = ok and torch.equal(
                gi, torch.stack([part(r, 3, shapes[3], torch.float32, session) for r in range(n)])
            )
            out[f"full_{session}"] = _raises(lambda: buf.all_gather(torch.zeros(1)))
        out["late_handle"] = _raises(handle)
    out["values"] = bool(ok)
    with buf.agrs_new_session():
        out["nested"] = _raises(buf.create_agrs_session)
        out["too_big"] = _raises(lambda: buf.all_gather(torch.zeros(need)))
        ip = buf.agrs_get_inplace_tensor([(2,), (3,)], torch.float32)
        out["inplace_order"] = _raises(lambda: buf.all_gather(ip[1]))
        # ranks disagreeing on the shapes of one all-gather: every rank raises
        out["mismatch"] = _raises(lambda: buf.all_gather(torch.zeros(2 + (rank == 0))))
    out["destroy_twice"] = _raises(buf.destroy_agrs_session)


def _pp_buffer(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_torch import PPBuffer

    buf = PPBuffer(None, 256, 2, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=30)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ok = True
    for seq in range(3):
        buf.send(_payload(rank, nxt, seq, torch.float32), nxt)
        want = _payload(prv, rank, seq, torch.float32)
        got = torch.empty_like(want)
        buf.recv(got, prv)
        ok = ok and bool(torch.equal(got, want))
    out["ring"] = ok
    out["too_big"] = _raises(lambda: buf.send(torch.zeros(65), nxt))
    out["storage"] = [str(buf.storage.dtype), int(buf.storage.numel()) >= 256 * 2 * 4]
    buf.destroy()
    out["after_destroy"] = _raises(lambda: buf.send(torch.zeros(4), nxt))


def _reduce_scatter_case(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_core import agrs

    buf = _buffer()
    buf.agrs_set_config(1 << 20, 4)

    def inp(r: int, dtype):
        g = torch.Generator().manual_seed(r + 17)
        return (torch.randn(3 * n, 5, generator=g) * 10).to(dtype)

    ok = True
    with buf.agrs_new_session():
        for dtype in (torch.float32, torch.bfloat16):
            got = buf.reduce_scatter(inp(rank, dtype))
            want = agrs.reduce_scatter_reference([inp(r, dtype).float().numpy() for r in range(n)], rank)
            ok = ok and got.shape == (3, 5) and torch.equal(got, torch.from_numpy(want).to(dtype))
        kept = buf.reduce_scatter(inp(rank, torch.float32))
        # the session's space overwritten: the result is not a view of it (float32 once aliased it)
        buf.__dict__["_elastic_state"].backend.region().fill_(0xFF)
        want = agrs.reduce_scatter_reference([inp(r, torch.float32).numpy() for r in range(n)], rank)
        out["owned"] = bool(torch.equal(kept, torch.from_numpy(want)))
        out["indivisible"] = _raises(lambda: buf.reduce_scatter(torch.zeros(3 * n + 1)))
        out["int"] = _raises(lambda: buf.reduce_scatter(torch.zeros(n, dtype=torch.int32)))
    out["values"] = bool(ok)
    out["outside"] = _raises(lambda: buf.reduce_scatter(torch.zeros(n)))


def _bucket_case(rank: int, n: int, out: dict) -> None:
    import torch
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    plan = BufferAllocator()
    plan.tensor("ag", (n * 8,), "float32")
    plan.tensor("rs", (n * 6, 4), "float32")
    plan.tensor("ar", (10,), "bfloat16")
    plan.tensor("spare", (1024,), "float32")  # room for the session below (it allocates from the front)
    buf = BucketBuffer(None, plan, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=30)

    def val(r: int, shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(r * 13 + 5)
        return (torch.randn(shape, generator=g) * 10).to(dtype)

    ok = True
    shard = buf.tensors["ag"].view(n, 8)[rank]
    shard.copy_(val(rank, (8,)))
    got = buf.all_gather(shard).wait()
    ok = ok and torch.equal(got, torch.cat([val(r, (8,)) for r in range(n)]))
    with buf.session() as s:
        dst = s.allocate((n * 5,), torch.float32)
        got = buf.all_gather(val(rank, (5,)), dsts=dst).wait()
        ok = ok and torch.equal(got, torch.cat([val(r, (5,)) for r in range(n)]))
    out["all_gather"] = bool(ok)
    rs = buf.tensors["rs"]
    rs.copy_(val(rank, (n * 6, 4)))
    got = buf.reduce_scatter(rs, scale=0.5).wait()
    acc = val(0, (n * 6, 4)).reshape(-1)[rank * 24 : (rank + 1) * 24].clone()
    for r in range(1, n):
        acc += val(r, (n * 6, 4)).reshape(-1)[rank * 24 : (rank + 1) * 24]
    out["reduce_scatter"] = bool(
        torch.equal(got, acc * 0.5) and torch.equal(rs.reshape(-1)[rank * 24 : (rank + 1) * 24], acc * 0.5)
    )
    ar = buf.tensors["ar"]
    ar.copy_(val(rank, (10,), torch.bfloat16))
    got = buf.all_reduce(ar).wait()
    acc = val(0, (10,), torch.bfloat16).float()
    for r in range(1, n):
        acc += val(r, (10,), torch.bfloat16).float()
    out["all_reduce"] = bool(
        torch.equal(got, acc.to(torch.bfloat16)) and torch.equal(ar, acc.to(torch.bfloat16))
    )
    out["outside"] = _raises(lambda: buf.all_reduce(torch.zeros(4)))
    out["precision"] = _raises(lambda: buf.reduce_scatter(rs, comm_precision="fp16"))
    out["int"] = _raises(lambda: buf.all_reduce(buf.storage[:8]))
    # a session: the collectives take tensors outside the storage (staged in session storage)
    with buf.session():
        ext = torch.empty(n * 3)
        got = buf.all_gather(val(rank, (3,)), ext).wait()
        want = torch.cat([val(r, (3,)) for r in range(n)])
        sess = bool(got is ext and torch.equal(ext, want))
        got = buf.reduce_scatter(val(rank, (n * 2,)), scale=2.0).wait()
        acc = sum(val(r, (n * 2,)) for r in range(n))
        sess = sess and torch.equal(got, (acc * 2.0)[rank * 2 : (rank + 1) * 2])
        got = buf.all_reduce([val(rank, (4,)), val(rank + 7, (3,))]).wait()
        sess = sess and torch.equal(got[0], sum(val(r, (4,)) for r in range(n)))
        sess = sess and torch.equal(got[1], sum(val(r + 7, (3,)) for r in range(n)))
        out["nested"] = _raises(lambda: buf.session().__enter__())
    out["session"] = bool(sess)
    out["outside_after_session"] = _raises(lambda: buf.all_reduce(torch.zeros(4)))
    out["sms"] = [
        buf.get_theoretical_num_sms("all_gather"),
        _raises(lambda: buf.get_theoretical_num_sms("x")),
    ]
    buf.destroy()


_CASES = {
    "bucket": _bucket_case,
    "reduce_scatter": _reduce_scatter_case,
    "pp_buffer": _pp_buffer,
    "pp": _pp,
    "pp_inflight": _pp_inflight,
    "pp_timeout": _pp_timeout,
    "pp_peer_refuses": _pp_peer_refuses,
    "pp_gpu_scenario": _pp_gpu_scenario,
    "destroy": _destroy_case,
    "engram": _engram_case,
    "agrs": _agrs_case,
}


def _worker(rank: int, n: int, modes: str, out_dir: str) -> None:
    import torch.distributed as dist

    for mode in modes.split(","):
        out: dict = {}
        _CASES[mode](rank, n, out)
        Path(out_dir, f"{mode}.{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # the next case starts together on every rank


# ---------------------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pp_ring_round_trip_and_bad_inputs(n: int, tmp_path: Path) -> None:
    for r, out in enumerate(_run("pp", n, tmp_path)):
        assert out["round_trip"], (r, out)
        assert out["before_config"].startswith("EPStateError") and "pp_set_config" in out["before_config"]
        if n == 4:
            assert out["wrong_peer"].startswith("EPValueError") and f"rank {r} can only" in out["wrong_peer"]
        assert "exceed num_max_tensor_bytes (96" in out["too_big"], out["too_big"]
        assert "contiguous" in out["not_contiguous"]
        assert "exceed the buffer" in out["bad_config"] and f"rank {r}" in out["bad_config"]


@pytest.mark.serial  # a timing assertion: not beside other tests (xdist)
def test_pp_inflight_limit_blocks_the_sender(tmp_path: Path) -> None:
    sender, receiver = _run("pp_inflight", 2, tmp_path)
    t = sender["times"]
    assert t[0] < 1.0 and t[1] < 1.0 and t[2] > 1.0, t  # the third send waits for the receiver's release
    assert receiver["got"] == [0.0, 1.0, 2.0]
    assert "receives 32 bytes but rank 0 sent 64" in receiver["mismatch"]
    assert receiver["after_mismatch"] == 8.0  # the FIFO stays in step after the refused receive


@pytest.mark.serial  # a timing assertion: not beside other tests (xdist)
def test_pp_recv_without_sender_times_out(tmp_path: Path) -> None:
    out = _run("pp_timeout", 2, tmp_path)[1]
    assert out["recv_nothing"].startswith("EPTimeoutError") and "rank 1" in out["recv_nothing"]
    assert out["waited"] < 10


def test_pp_config_refused_on_one_rank_reaches_the_other(tmp_path: Path) -> None:
    a, b = _run("pp_peer_refuses", 2, tmp_path)
    assert b["config"].startswith("EPValueError") and "rank 1" in b["config"]
    assert a["config"].startswith("EPPeerError") and "rank 1" in a["config"]


@pytest.mark.parametrize("n", [2, 3])
def test_pp_gpu_scenario_on_the_reference_backend(n: int, tmp_path: Path) -> None:
    """The GPU test's PP scenario (elastic_pp_scenario.py) on CPU: each phase's tensors fit its configuration."""
    per_rank = [out["res"] for out in _run("pp_gpu_scenario", n, tmp_path)]
    failures = [
        f"rank {r}: {name}: {detail}" for r, res in enumerate(per_rank) for name, ok, detail in res if not ok
    ]
    assert per_rank[0] and not failures, "\n".join(failures)
    names = {name for name, _, _ in per_rank[0]}
    assert {"pp/ring"} <= names and (n != 2 or "pp/ping-pong" in names), names


def test_destroy_drops_the_elastic_state(tmp_path: Path) -> None:
    for out in _run("destroy", 2, tmp_path):
        assert out["state_before"] and not out["state_after"], out
        assert out["send_after"].startswith("EPStateError") and "destroy" in out["send_after"], out


@pytest.mark.parametrize("n", [2, 3])
def test_pp_buffer_ring(n: int, tmp_path: Path) -> None:
    for out in _run("pp_buffer", n, tmp_path):
        assert out["ring"], out
        assert "exceed num_max_tensor_bytes (256" in out["too_big"]
        assert out["after_destroy"].startswith("EPStateError")
        assert out["storage"] == ["torch.uint8", True], out


@pytest.mark.parametrize("n", [2, 3])
def test_engram_fetch_matches_reference(n: int, tmp_path: Path) -> None:
    for r, out in enumerate(_run("engram", n, tmp_path)):
        assert out["bf16"] and out["fp8_col0"] and out["fp8_col1"], out
        assert out["before_write"].startswith("EPStateError")
        assert "outside [0," in out["out_of_range"] and f"rank {r}" in out["out_of_range"]
        assert out["int64"].startswith("EPTypeError")
        assert "fetch area" in out["too_many"]
        assert "sf: required iff" in out["fp8_without_sf"]
        assert "num_cpu_bytes" in out["too_big"] and f"rank {r}" in out["too_big"]


@pytest.mark.parametrize("n", [2, 4])
def test_agrs_sessions_match_reference(n: int, tmp_path: Path) -> None:
    for out in _run("agrs", n, tmp_path):
        assert out["values"], out
        assert "agrs_set_config" in out["before_config"]
        assert "not inside an AGRS session" in out["outside_session"]
        assert "already ran 3" in out["full_0"] and "already ran 3" in out["full_1"]
        assert "already ended" in out["late_handle"]
        assert out["nested"].startswith("EPStateError")
        assert "num_max_session_bytes" in out["too_big"]
        assert "same order" in out["inplace_order"]
        assert out["mismatch"].startswith("EPMismatchError"), out["mismatch"]
        assert out["destroy_twice"].startswith("EPStateError")


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_matches_reference(n: int, tmp_path: Path) -> None:
    for out in _run("reduce_scatter", n, tmp_path):
        assert out["values"], out
        assert out["owned"], out
        assert "divisible" in out["indivisible"] and out["int"].startswith("EPTypeError")
        assert "not inside" in out["outside"]


@pytest.mark.parametrize("n", [2, 3])
def test_bucket_buffer_collectives(n: int, tmp_path: Path) -> None:
    for out in _run("bucket", n, tmp_path):
        assert out["all_gather"] and out["reduce_scatter"] and out["all_reduce"], out
        assert "inside this BucketBuffer" in out["outside"]
        assert "expected 'fp32' or 'bf16'" in out["precision"]
        assert out["int"].startswith("EPTypeError")
        assert out["session"], out
        assert "do not nest" in out["nested"], out
        assert "inside this BucketBuffer" in out["outside_after_session"]
        assert out["sms"][0] == 0 and "op: expected" in out["sms"][1]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(_worker, int(sys.argv[2]), sys.argv[1], sys.argv[3])


def test_nccl_buffers_take_the_copy_engine_within_one_lsa_team(monkeypatch):
    """PP, Engram and AGRS over nccl: the copy-engine backend where NCCL's LSA team is the whole group (the peers'
    windows through their LSA pointers); across nodes every rank raises naming the team and the rank."""
    from types import SimpleNamespace

    from ep_core.errors import EPConfigError
    from ep_torch import elastic_copy_engine
    from ep_torch.elastic_ops import ElasticOps

    monkeypatch.setattr(
        elastic_copy_engine.CopyEngineBackend, "from_buffer", classmethod(lambda cls, buf: "ce")
    )

    def buf(lsa: int):
        rt = SimpleNamespace(storage=SimpleNamespace(lsa_size=lsa))
        return SimpleNamespace(transport="nccl", num_ranks=4, rank_idx=1, _rt=lambda: rt)

    assert ElasticOps._make_elastic_backend(buf(4)) == "ce"
    with pytest.raises(EPConfigError, match=r"2 of the 4 ranks are \(rank 1\)"):
        ElasticOps._make_elastic_backend(buf(2))
