"""GPU tests (marker gpu): allocation layout, elastic host part GPU<->CPU, loopback ranks as threads, 4 processes
on one GPU through FileBootstrap, error paths, and 200-cycle leak checks (device memory and fds)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import ep_symmem as sm
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sm.is_available(), reason="needs an NVIDIA GPU and driver"),
]

MiB = 1 << 20
# Leak checks allow this much drift of cuMemGetInfo's free memory over 200 cycles (driver pools, module data);
# leaking one allocation per cycle would lose >= 200 * 4 MiB.
LEAK_TOLERANCE = 32 * MiB
HERE = Path(__file__).parent
WORKER = HERE / "symmem_worker.py"


def _load_worker():
    spec = importlib.util.spec_from_file_location("symmem_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


def _threads(size: int, fn) -> list:
    """Run fn(bootstrap) for `size` ranks as threads of this process; re-raise the first failure (a failing rank
    aborts the group so that the others stop waiting at once)."""
    group = sm.LocalBootstrap.create_group(size, timeout=60)
    results: list = [None] * size
    errors: list[BaseException] = []

    def body(b: sm.LocalBootstrap) -> None:
        try:
            results[b.rank] = fn(b)
        except BaseException as error:
            errors.append(error)
            b.abort()

    threads = [threading.Thread(target=body, args=(b,)) for b in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return results


def _processes(tmp_path: Path, size: int, *args: str, timeout: float = 540) -> list[dict]:
    """Run symmem_worker.py as `size` processes sharing a FileBootstrap directory; return each RESULT. When one
    rank fails, the others are killed instead of waiting for their bootstrap timeout."""
    directory = tmp_path / "bootstrap"
    logs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(size)]
    procs = []
    for r in range(size):
        cmd = [
            sys.executable,
            str(WORKER),
            *args,
            "--dir",
            str(directory),
            "--rank",
            str(r),
            "--size",
            str(size),
        ]
        with open(logs[r][0], "w") as out, open(logs[r][1], "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=dict(os.environ)))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, p in enumerate(procs):
        out, err = (path.read_text() for path in logs[rank])
        assert p.returncode == 0, f"rank {rank} failed (rc {p.returncode}):\n{err[-4000:]}"
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no RESULT:\n{out[-2000:]}\n{err[-2000:]}"
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def test_device_info() -> None:
    info = sm.device_info(0)
    print(info)
    assert info.vmm_supported and info.posix_fd_supported
    assert len(info.uuid) == 16 and info.name
    free, total = sm.device_memory_info(0)
    assert 0 < free <= total


def test_create_layout_and_descriptor() -> None:
    before = sm.device_memory_info(0).free
    with sm.SymmetricAllocation.create(3 * MiB + 1, MiB, device=0) as buf:
        assert buf.alignment % (2 * MiB) == 0
        assert buf.num_gpu_bytes == -(-(3 * MiB + 1) // buf.alignment) * buf.alignment
        assert buf.num_host_bytes == buf.alignment
        assert buf.num_bytes == buf.num_gpu_bytes + buf.num_host_bytes
        assert buf.ptr % buf.alignment == 0
        assert buf.host_ptr == buf.ptr + buf.num_gpu_bytes
        assert buf.device == 0 and buf.rank is None and buf.num_ranks is None
        assert buf.host_numa_id is not None and buf.host_numa_id >= 0
        assert sm.device_memory_info(0).free <= before - buf.num_gpu_bytes
        desc = sm.Descriptor.decode(buf.export())
        assert desc == buf.descriptor()
        assert desc.pid == os.getpid() and desc.token == buf._native.token
        assert (desc.num_gpu_bytes, desc.num_host_bytes) == (buf.num_gpu_bytes, buf.num_host_bytes)
        assert desc.gpu_fd >= 0 and desc.host_fd >= 0
        assert desc.device_uuid == sm.device_info(0).uuid
        print(buf, "notes:", buf.notes or "-", "fabric:", buf.fabric_exportable, "rdma:", buf.rdma_capable)
    assert buf.closed
    with pytest.raises(sm.AllocationClosedError):
        _ = buf.ptr
    buf.close()  # idempotent


def test_gpu_part_kernel_and_copies() -> None:
    with sm.SymmetricAllocation.create(4 * MiB) as buf:
        n = buf.num_gpu_bytes // 4
        sm.fill_u32(buf.ptr, n, 0x12345678, 0x9E3779B1)
        got = sm.copy_from_device(buf.ptr, buf.num_gpu_bytes)
        assert got == worker._sequence(0x12345678, 0x9E3779B1, n)
        data = random.Random(7).randbytes(MiB)
        sm.copy_to_device(buf.ptr + MiB, data)
        sm.copy_device(buf.ptr + 3 * MiB, buf.ptr + MiB, MiB)
        assert sm.copy_from_device(buf.ptr + 3 * MiB, MiB) == data
        sm.memset_device(buf.ptr, 0xAB, 4096)
        assert sm.copy_from_device(buf.ptr, 4096) == b"\xab" * 4096


def test_elastic_host_part_gpu_to_cpu_and_back() -> None:
    with sm.SymmetricAllocation.create(2 * MiB, 4 * MiB) as buf:
        assert buf.host_cpu_accessible, buf._native.host_cpu_access_error
        view = buf.host_view()
        assert len(view) == buf.num_host_bytes and not view.readonly
        n = buf.num_host_bytes // 4
        # GPU -> CPU: a kernel stores into the host part; the CPU reads it through host_view().
        sm.fill_u32(buf.host_ptr, n, 0xDEADBEEF, 12345)
        assert bytes(view) == worker._sequence(0xDEADBEEF, 12345, n)
        # GPU -> CPU by copy engine: GPU part -> host part.
        data = random.Random(11).randbytes(buf.num_gpu_bytes)
        sm.copy_to_device(buf.ptr, data)
        sm.copy_device(buf.host_ptr + MiB, buf.ptr, buf.num_gpu_bytes)
        assert bytes(view[MiB : MiB + buf.num_gpu_bytes]) == data
        # CPU -> GPU: the CPU writes the host part; the device copies it into the GPU part and reads it directly.
        data2 = random.Random(12).randbytes(buf.num_host_bytes)
        view[:] = data2
        assert sm.copy_from_device(buf.host_ptr, buf.num_host_bytes) == data2
        sm.copy_device(buf.ptr, buf.host_ptr + 3 * MiB, MiB)
        assert sm.copy_from_device(buf.ptr, MiB) == data2[3 * MiB : 4 * MiB]
        del view


def test_require_rdma_matches_the_device_attribute() -> None:
    if sm.device_info(0).rdma_with_vmm_supported:
        with sm.SymmetricAllocation.create(2 * MiB, require_rdma=True) as buf:
            assert buf.rdma_capable
    else:
        with pytest.raises(sm.UnsupportedError, match="GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"):
            sm.SymmetricAllocation.create(2 * MiB, require_rdma=True)


def test_handle_types() -> None:
    with sm.SymmetricAllocation.create(2 * MiB, handle_type="posix_fd") as buf:
        assert not buf.fabric_exportable
    try:
        with sm.SymmetricAllocation.create(2 * MiB, handle_type="fabric") as buf:
            assert buf.fabric_exportable
            print("fabric handles available")
    except sm.UnsupportedError as error:
        print("fabric unavailable (expected without IMEX):", error)
    with sm.SymmetricAllocation.create(2 * MiB, handle_type="auto") as buf:
        print("auto: fabric", buf.fabric_exportable, "notes:", buf.notes or "-")


def test_import_peers_errors() -> None:
    with (
        sm.SymmetricAllocation.create(2 * MiB) as a,
        sm.SymmetricAllocation.create(2 * MiB) as b,
        sm.SymmetricAllocation.create(4 * MiB) as c,
        sm.SymmetricAllocation.create(2 * MiB, 2 * MiB) as d,
    ):
        descs = [a.export(), b.export()]
        with pytest.raises(sm.ExchangeError, match="not this allocation's descriptor"):
            a.import_peers(descs, 1)
        with pytest.raises(sm.ExchangeError, match="same sizes"):
            a.import_peers([a.export(), c.export()], 0)
        with pytest.raises(sm.ExchangeError, match="same sizes"):
            a.import_peers([a.export(), d.export()], 0)
        with pytest.raises(sm.ExchangeError, match="same allocation"):
            a.import_peers([a.export(), a.export()], 0)
        with pytest.raises(sm.SymmemValueError, match="my_rank"):
            a.import_peers(descs, 2)
        with pytest.raises(sm.DescriptorError, match="rank 1"):
            a.import_peers([descs[0], b"garbage"], 0)
        with pytest.raises(sm.ExchangeError, match="import_peers"):
            a.peer_ptr(0)
        with pytest.raises(sm.SymmemValueError, match="no host part"):
            a.host_view()
        a.import_peers(descs, 0)
        b.import_peers(descs, 1)
        assert a.peer_ptr(0) == a.ptr and b.peer_ptr(1) == b.ptr
        with pytest.raises(IndexError):
            a.peer_ptr(2)
        with pytest.raises(sm.ExchangeError, match="already called"):
            a.import_peers(descs, 0)
        # The loopback mapping aliases the owner's memory: a write through one is seen through the other.
        sm.fill_u32(a.peer_ptr(1), 1024, 777, 3)
        assert sm.copy_from_device(b.ptr, 4096) == worker._sequence(777, 3, 1024)


@pytest.mark.parametrize("same_process", ["retain", "posix_fd"])
def test_exchange_local_single_thread(monkeypatch: pytest.MonkeyPatch, same_process: str) -> None:
    """The loopback domain without threads: N allocations of this process mapped to each other in one call."""
    monkeypatch.setenv("EPKIT_SYMMEM_SAME_PROCESS_IMPORT", same_process)
    fds = sm.open_fd_count()
    bufs = [sm.SymmetricAllocation.create(4 * MiB, 2 * MiB) for _ in range(3)]
    try:
        sm.exchange_local(bufs)
        for writer, buf in enumerate(bufs):
            for owner in range(3):
                sm.fill_u32(buf.peer_ptr(owner) + writer * MiB, MiB // 4, 1000 * writer + owner, 7)
                host = buf.peer_ptr(owner) + buf.num_gpu_bytes + writer * 4096
                sm.fill_u32(host, 1024, 5000 * writer + owner, 3)
        for owner, buf in enumerate(bufs):
            view = buf.host_view()
            for writer in range(3):
                got = sm.copy_from_device(buf.ptr + writer * MiB, MiB)
                assert got == worker._sequence(1000 * writer + owner, 7, MiB // 4)
                assert bytes(view[writer * 4096 : (writer + 1) * 4096]) == worker._sequence(
                    5000 * writer + owner, 3, 1024
                )
            del view
            table = sm.copy_from_device(buf.peer_ptr_table, 8 * 3)
            assert list(memoryview(table).cast("Q")) == buf.peer_ptrs
    finally:
        for buf in bufs:
            buf.close()
    assert sm.open_fd_count() == fds


@pytest.mark.parametrize("same_process", ["retain", "posix_fd"])
def test_loopback_ranks_as_threads(monkeypatch: pytest.MonkeyPatch, same_process: str) -> None:
    """4 ranks as threads of this process (the loopback domain): peers of the same process are mapped by
    retaining their handles, or (posix_fd) through pidfd_getfd on this very process."""
    monkeypatch.setenv("EPKIT_SYMMEM_SAME_PROCESS_IMPORT", same_process)
    results = _threads(4, lambda b: worker.run_pattern(b, 8 * MiB, 4 * MiB, "auto"))
    for r in results:
        assert r["errors"] == [], r["errors"]
    assert len({p for r in results for p in r["ptrs"]}) == 16  # every mapping has its own address


def test_four_processes_on_one_gpu(tmp_path: Path) -> None:
    results = _processes(tmp_path, 4, "pattern", "--gpu-bytes", str(8 * MiB), "--host-bytes", str(4 * MiB))
    for r in results:
        assert r["errors"] == [], r["errors"]
    print("exchange seconds per rank:", [round(r["exchange_s"], 4) for r in results])


def test_leak_200_cycles_threads() -> None:
    """200 create/exchange/close cycles of 4 loopback ranks leave device memory and fds where they started."""

    def cycles(n: int):
        return lambda b: worker.run_leak(b, 4 * MiB, 2 * MiB, n, "auto")

    results = _threads(4, cycles(200))
    for r in results:
        assert r["fds_after"] == r["fds_before"], r
        assert r["free_after"] >= r["free_before"] - LEAK_TOLERANCE, r
    print("threads: 200 cycles in", round(results[0]["seconds"], 2), "s")


@pytest.mark.slow
def test_leak_200_cycles_processes(tmp_path: Path) -> None:
    """The same across 4 processes (fds exported, duplicated with pidfd_getfd, imported and closed each cycle)."""
    results = _processes(
        tmp_path, 4, "leak", "--gpu-bytes", str(4 * MiB), "--host-bytes", str(2 * MiB), "--cycles", "200"
    )
    for r in results:
        assert r["fds_after"] == r["fds_before"], r
        assert r["free_after"] >= r["free_before"] - LEAK_TOLERANCE, r
    print("processes: 200 cycles in", round(max(r["seconds"] for r in results), 2), "s")


def test_bench_script_runs(tmp_path: Path) -> None:
    script = HERE.parent / "benchmarks" / "bench_symmem.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--ranks", "2", "--iters", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    assert (tmp_path / "bench_symmem.json").exists()
