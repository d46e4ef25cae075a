"""GPU tests (marker gpu): world-size-1 NCCL communicator, ncclMemAlloc + window, device communicator with an
LSA barrier, a JIT kernel writing through sym_ptr(..., self), torch's ProcessGroupNCCL communicator wrapped;
and, with two or more GPUs, two ranks writing into each other's windows through LSA pointers.

NCCL refuses two ranks on one GPU, so one-GPU machines run the world-size-1 tests only.
"""

from __future__ import annotations

import array
import ctypes
import random
import socket
import sys
from pathlib import Path

import ep_nccl_gin
import pytest

pytestmark = pytest.mark.gpu


class _Cuda:
    """The few CUDA driver calls the tests use to move bytes (ctypes on libcuda.so.1; no other dependency)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        self._check(self.lib.cuInit(0), "cuInit")

    @staticmethod
    def _check(res: int, call: str) -> None:
        if res != 0:
            raise RuntimeError(f"{call} failed: CUresult {res}")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def upload(self, dst: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        self._check(self.lib.cuMemcpyHtoD_v2(dst, buf, len(data)), "cuMemcpyHtoD")

    def download(self, src: int, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        self._check(self.lib.cuMemcpyDtoH_v2(buf, src, nbytes), "cuMemcpyDtoH")
        return buf.raw

    def memset(self, dst: int, value: int, nbytes: int) -> None:
        self._check(self.lib.cuMemsetD8_v2(dst, value, nbytes), "cuMemsetD8")

    def synchronize(self) -> None:
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


def _cuda_or_none() -> _Cuda | None:
    try:
        cuda = _Cuda()
    except (OSError, RuntimeError):
        return None
    return cuda if cuda.device_count() > 0 else None


_CUDA = _cuda_or_none()
needs_gpu = pytest.mark.skipif(_CUDA is None, reason="no NVIDIA GPU / driver")


def _nccl_unavailable() -> str | None:
    try:
        ep_nccl_gin.load()
    except ep_nccl_gin.NcclGinError as exc:
        return f"no NCCL library: {exc}"
    return None


_NO_NCCL = _nccl_unavailable()
needs_nccl = pytest.mark.skipif(_NO_NCCL is not None, reason=_NO_NCCL or "")

WINDOW_BYTES = 1 << 21
GRID, BLOCK, PER_THREAD = 4, 256, 8
N = GRID * BLOCK * PER_THREAD  # uint32 elements written by the kernel
MASK = 0x5A5A5A5A

KERNEL = r"""
#include <ep_nccl_gin/device.cuh>

// Window layout (uint32): [0, n) destination, [n, 2n) source, [2n, 2n + 4) status.
// status[0]: mismatches seen after the barrier; status[1]: blocks past the barrier;
// status[2]: sym_ptr of an out-of-range peer was null; status[3]: sym_ptr(self) was non-null.
extern "C" __global__ void nccl_gin_sym_write(ep_nccl_gin::Context ctx, unsigned int n, unsigned int peer) {
  ep_nccl_gin::Transport t(ctx);
  unsigned int* local = reinterpret_cast<unsigned int*>(ctx.base);
  const unsigned int* src = local + n;
  unsigned int* status = local + 2 * n;
  unsigned int* dst = t.sym_ptr(local, peer);
  unsigned int stride = gridDim.x * blockDim.x;
  unsigned int base = blockIdx.x * blockDim.x;
  if (dst != nullptr) {
    for (unsigned int i = base + threadIdx.x; i < n; i += stride) dst[i] = src[i] ^ (0x5a5a5a5au + t.rank());
  }
  t.barrier(blockIdx.x);
  // Check what another thread of this block (and, with peers, the peer's same block) wrote, through the local
  // address: the barrier made it visible.
  unsigned int mismatches = 0;
  unsigned int writer_rank = (unsigned int)(t.num_ranks() > 1 ? (t.rank() + t.num_ranks() - 1) % t.num_ranks()
                                                               : t.rank());
  for (unsigned int i = base + (blockDim.x - 1 - threadIdx.x); i < n; i += stride) {
    unsigned int expected = src[i] ^ (0x5a5a5a5au + writer_rank);
    if (t.num_ranks() == 1 && local[i] != expected) ++mismatches;
  }
  if (mismatches) atomicAdd(&status[0], mismatches);
  if (threadIdx.x == 0) {
    atomicAdd(&status[1], 1u);
    if (blockIdx.x == 0) {
      status[2] = t.sym_ptr(local, t.num_ranks()) == nullptr ? 1u : 0u;
      status[3] = dst != nullptr ? 1u : 0u;
    }
  }
}
"""


def _words(data: bytes) -> array.array:
    a = array.array("I")
    a.frombytes(data)
    return a


def _random_words(seed: int, n: int) -> bytes:
    rng = random.Random(seed)
    return array.array("I", (rng.randrange(1, 1 << 32) for _ in range(n))).tobytes()


@pytest.fixture(scope="module")
def comm() -> ep_nccl_gin.Communicator:
    if _CUDA is None:
        pytest.skip("no NVIDIA GPU / driver")
    if _NO_NCCL is not None:
        pytest.skip(_NO_NCCL)
    c = ep_nccl_gin.Communicator(ep_nccl_gin.get_unique_id(), 1, 0, device=0)
    yield c
    c.destroy()


@needs_gpu
@needs_nccl
def test_world_size_one(comm: ep_nccl_gin.Communicator) -> None:
    assert (comm.rank, comm.nranks, comm.device) == (0, 1, 0)
    assert comm.owned
    assert comm.async_error() == 0
    assert comm.lsa_team() == ep_nccl_gin.Team(1, 0, 1)
    assert comm.world_team().nranks == 1


@needs_gpu
@needs_nccl
def test_mem_alloc_and_window(comm: ep_nccl_gin.Communicator) -> None:
    assert _CUDA is not None
    ptr = ep_nccl_gin.mem_alloc(WINDOW_BYTES)
    try:
        assert ptr % 4096 == 0
        with comm.register_window(ptr, WINDOW_BYTES) as win:
            assert win.registered and win.handle != 0 and win.ptr == ptr and win.nbytes == WINDOW_BYTES
            assert len(win.handle_bytes()) == 8
            alias = win.lsa_ptr(0)
            assert alias != 0
            assert win.peer_ptr(0) == alias
            assert win.lsa_ptr(0, 4096) == alias + 4096
            # The LSA pointer of this rank aliases the registered memory.
            data = _random_words(1, 4096)
            _CUDA.upload(alias + 8192, data)
            assert _CUDA.download(ptr + 8192, len(data)) == data
            data2 = _random_words(2, 1024)
            _CUDA.upload(ptr, data2)
            assert _CUDA.download(alias, len(data2)) == data2
            with pytest.raises(ValueError, match="peer"):
                win.lsa_ptr(1)
        assert not win.registered
        win.deregister()  # idempotent
    finally:
        ep_nccl_gin.mem_free(ptr)


@needs_gpu
@needs_nccl
def test_dev_comm_with_lsa_barrier(comm: ep_nccl_gin.Communicator) -> None:
    from ep_nccl_gin import _impl

    dc = comm.create_dev_comm(lsa_barrier_count=GRID)
    try:
        assert (dc.lsa_size, dc.lsa_rank) == (1, 0)
        raw = dc.as_bytes()
        loaded = ep_nccl_gin.load()
        if loaded.header == loaded.runtime:
            assert len(raw) == _impl.dev_comm_header_size()
            assert not dc.runtime_versioned
        assert isinstance(dc.gin_available, bool)
    finally:
        dc.destroy()
    dc.destroy()  # idempotent
    with pytest.raises(ep_nccl_gin.NcclGinError, match="destroyed"):
        dc.as_bytes()


@needs_gpu
@needs_nccl
def test_jit_kernel_writes_through_sym_ptr_and_runs_lsa_barrier(comm: ep_nccl_gin.Communicator) -> None:
    ep_jit = pytest.importorskip("ep_jit")
    assert _CUDA is not None
    ptr = ep_nccl_gin.mem_alloc(WINDOW_BYTES)
    try:
        with (
            comm.register_window(ptr, WINDOW_BYTES) as win,
            comm.create_dev_comm(lsa_barrier_count=GRID) as dc,
        ):
            src = _random_words(3, N)
            _CUDA.memset(ptr, 0, WINDOW_BYTES)
            _CUDA.upload(ptr + 4 * N, src)
            ctx = dc.context_bytes(win)
            assert len(ctx) == (dc.nbytes + 7) // 8 * 8 + 24
            art = ep_jit.compile(
                KERNEL, name="nccl_gin_sym_write", include_dirs=ep_nccl_gin.include_dirs(), arch="sm_90a"
            )
            kernel = ep_jit.load(art).function("nccl_gin_sym_write")
            kernel.launch(
                GRID, BLOCK, [ep_jit.struct(ctx), ep_jit.uint32(N), ep_jit.uint32(comm.rank)], stream=0
            )
            _CUDA.synchronize()
            got = _words(_CUDA.download(ptr, 4 * N))
            expected = array.array("I", (w ^ MASK for w in _words(src)))
            assert got == expected
            status = list(_words(_CUDA.download(ptr + 8 * N, 16)))
            assert status == [0, GRID, 1, 1], status
    finally:
        ep_nccl_gin.mem_free(ptr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_gpu
@needs_nccl
def test_wrap_torch_process_group_nccl() -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("torch without CUDA or NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        t = torch.ones(16, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        if not hasattr(backend, "_comm_ptr"):
            pytest.skip("this torch's ProcessGroupNCCL has no _comm_ptr()")
        comm = ep_nccl_gin.Communicator.from_pointer(int(backend._comm_ptr()))
        assert not comm.owned
        assert (comm.rank, comm.nranks, comm.device) == (0, 1, 0)
        # Sharing a communicator needs one libnccl in the process: cuda.pathfinder took torch's.
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
        mapped = {f[-1] for f in maps if len(f) >= 6 and Path(f[-1]).name.startswith("libnccl.so")}
        assert len(mapped) == 1, mapped
        assert Path(ep_nccl_gin.load().path).resolve() == Path(next(iter(mapped))).resolve()
        ptr = ep_nccl_gin.mem_alloc(WINDOW_BYTES)
        try:
            with (
                comm.register_window(ptr, WINDOW_BYTES) as win,
                comm.create_dev_comm(lsa_barrier_count=1) as dc,
            ):
                assert (dc.lsa_size, dc.lsa_rank) == (1, 0)
                assert win.lsa_ptr(0) != 0
        finally:
            ep_nccl_gin.mem_free(ptr)
        comm.destroy()  # borrowed: drops the reference only
        with pytest.raises(ep_nccl_gin.NcclGinError, match="borrowed"):
            ep_nccl_gin.Communicator.from_pointer(int(backend._comm_ptr())).abort()
        dist.all_reduce(t)  # torch's communicator is still alive
        torch.cuda.synchronize()
        assert t.tolist() == [1.0] * 16
    finally:
        dist.destroy_process_group()


# ---- two or more GPUs: ranks write into each other's windows through LSA pointers ----


def _two_rank_worker(rank: int, uid: bytes) -> dict[str, object]:
    """One rank of the two-GPU test (run in its own process: `python this_file.py --worker RANK UIDHEX`)."""
    import ep_jit

    cuda = _Cuda()
    comm = ep_nccl_gin.Communicator(uid, 2, rank, device=rank)
    ptr = ep_nccl_gin.mem_alloc(WINDOW_BYTES)
    src = _random_words(10 + rank, N)
    cuda.memset(ptr, 0, WINDOW_BYTES)
    cuda.upload(ptr + 4 * N, src)
    cuda.synchronize()
    win = comm.register_window(
        ptr, WINDOW_BYTES
    )  # collective with a barrier: both windows are ready after it
    dc = comm.create_dev_comm(lsa_barrier_count=GRID)
    result: dict[str, object] = {"lsa_size": dc.lsa_size}
    if dc.lsa_size == 2:
        art = ep_jit.compile(
            KERNEL, name="nccl_gin_sym_write", include_dirs=ep_nccl_gin.include_dirs(), arch="sm_90a"
        )
        kernel = ep_jit.load(art).function("nccl_gin_sym_write")
        args = [ep_jit.struct(dc.context_bytes(win)), ep_jit.uint32(N), ep_jit.uint32(1 - rank)]
        kernel.launch(GRID, BLOCK, args)
        cuda.synchronize()
        result["received"] = cuda.download(ptr, 4 * N).hex()
        result["status"] = list(_words(cuda.download(ptr + 8 * N, 16)))
        peer = win.peer_ptr(1 - rank)
        result["peer_ptr_differs"] = peer is not None and peer != ptr
    dc.destroy()
    win.deregister()
    ep_nccl_gin.mem_free(ptr)
    comm.destroy()
    return result


@needs_nccl
@pytest.mark.skipif(
    _CUDA is None or _CUDA.device_count() < 2, reason="needs two GPUs (NCCL refuses 2 ranks/GPU)"
)
def test_two_ranks_write_each_other_through_lsa() -> None:
    import json
    import subprocess
    import sys

    pytest.importorskip("ep_jit")
    uid = ep_nccl_gin.get_unique_id().hex()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), uid],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = {}
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results[r] = json.loads(out.strip().splitlines()[-1])
    if results[0]["lsa_size"] != 2:
        pytest.skip("the two GPUs are not P2P-connected (LSA team of 1)")
    for rank in range(2):
        writer = 1 - rank
        src = _words(_random_words(10 + writer, N))
        expected = array.array("I", (w ^ (MASK + writer) for w in src))
        assert _words(bytes.fromhex(results[rank]["received"])) == expected
        assert results[rank]["status"][1:] == [GRID, 1, 1]
        assert results[rank]["peer_ptr_differs"]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    import json

    print(json.dumps(_two_rank_worker(int(sys.argv[2]), bytes.fromhex(sys.argv[3]))))
