"""GPU tests: load and launch through the driver (pointer, scalar, struct args; cooperative, cluster, PDL)."""

from __future__ import annotations

import array
import struct

import ep_jit
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def drv():
    try:
        from ep_jit._driver import driver, ensure_context

        ensure_context()
        return driver()
    except ep_jit.NoDeviceError as e:
        pytest.skip(f"no GPU: {e}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("jit-cache-gpu")
    with ep_jit._env.scope(EPKIT_JIT_CACHE_DIR=str(d)):
        yield d


def _ok(res):
    assert not res[0], res[0]
    return res[1] if len(res) == 2 else res[1:]


class DeviceBuffer:
    def __init__(self, drv, nbytes):
        self.drv = drv
        self.nbytes = nbytes
        self.ptr = int(_ok(drv.cuMemAlloc(nbytes)))
        _ok((drv.cuMemsetD8(self.ptr, 0, nbytes)[0], None))

    def upload(self, data: bytes):
        assert len(data) == self.nbytes
        _ok((self.drv.cuMemcpyHtoD(self.ptr, data, len(data))[0], None))

    def download(self) -> bytes:
        out = bytearray(self.nbytes)
        _ok((self.drv.cuMemcpyDtoH(out, self.ptr, self.nbytes)[0], None))
        return bytes(out)

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def free(self):
        self.drv.cuMemFree(self.ptr)


def _sync(drv):
    _ok((drv.cuCtxSynchronize()[0], None))


ARGS_SRC = r"""
struct Params { int a; float b; double c; long long d; };
static_assert(sizeof(Params) == 24, "mirrored in the test");
extern "C" __global__ void axpb(float* out, const float* in, float scale, int n, Params p,
                                unsigned long long u, bool flag) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * scale + p.a + p.b + (float)p.c + (float)p.d + (float)(u & 0xff) + (flag ? 1000.f : 0.f);
}
template <int N> __global__ void add_n(int* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += N;
}
template __global__ void add_n<7>(int*, int);
extern "C" __global__ void big_smem(float* out, int n) {
  extern __shared__ float buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (float)i;
  __syncthreads();
  if (threadIdx.x == 0) { float s = 0; for (int i = 0; i < n; ++i) s += buf[i]; out[blockIdx.x] = s; }
}
"""


def test_pointer_scalar_struct_args(drv, cache_dir):
    art = ep_jit.compile(ARGS_SRC, name="args")
    mod = ep_jit.load(art)
    k = mod.function("axpb")
    assert k.param_sizes in (None, (8, 8, 4, 4, 24, 8, 1))
    n = 1000
    src = [((i * 37) % 101) * 0.25 - 7.0 for i in range(n)]
    inp = DeviceBuffer(drv, 4 * n)
    out = DeviceBuffer(drv, 4 * n)
    inp.upload(array.array("f", src).tobytes())
    params = struct.pack("<ifdq", 3, 0.5, 1.25, -2)
    k.launch(
        (n + 127) // 128,
        128,
        [
            out,
            ep_jit.pointer(inp.ptr),
            ep_jit.float32(1.5),
            ep_jit.int32(n),
            ep_jit.struct(params, align=8),
            ep_jit.uint64(0x1234),
            ep_jit.bool_(True),
        ],
    )
    _sync(drv)
    got = array.array("f", out.download())
    for i in range(n):
        want = array.array("f", [src[i] * 1.5 + 3 + 0.5 + 1.25 - 2 + 0x34 + 1000.0])[0]
        assert abs(got[i] - want) <= 1e-4 * abs(want), (i, got[i], want)
    # wrong argument count / size is caught before the launch when the driver reports parameter info
    if k.param_sizes is not None:
        with pytest.raises(TypeError, match="takes 7 arguments"):
            k.launch(1, 1, [out])
        with pytest.raises(TypeError, match="argument 3"):
            k.launch(
                1,
                1,
                [
                    out,
                    inp,
                    ep_jit.float32(1),
                    ep_jit.int64(1),
                    ep_jit.struct(params),
                    ep_jit.uint64(1),
                    ep_jit.bool_(False),
                ],
            )
    with pytest.raises(TypeError, match=r"argument 2 is a bare Python float.*ep_jit.int32"):
        k.launch(1, 1, [out, inp, 1.0, n, ep_jit.struct(params), ep_jit.uint64(1), ep_jit.bool_(False)])
    with pytest.raises(TypeError, match=r"argument 3 is a bare Python int"):
        k.launch(
            1, 1, [out, inp, ep_jit.float32(1), n, ep_jit.struct(params), ep_jit.uint64(1), ep_jit.bool_(0)]
        )
    inp.free()
    out.free()


def test_mangled_name_lookup_and_streams(drv, cache_dir):
    mod = ep_jit.load(ep_jit.compile(ARGS_SRC, name="args"))
    k = mod.function("add_n")  # unique template instantiation -> its mangled name
    assert k.name.startswith("_Z5add_nILi7EEvPii")
    assert mod.function(k.name) is k
    with pytest.raises(ep_jit.JitError, match="available: "):
        mod.function("no_such_kernel")
    n = 256
    x = DeviceBuffer(drv, 4 * n)
    x.upload(array.array("i", range(n)).tobytes())
    stream = _ok(drv.cuStreamCreate(0))
    k.launch(2, 128, [x, ep_jit.int32(n)], stream=stream)  # CUstream object
    k.launch(2, 128, [ep_jit.pointer(x), ep_jit.int32(n)], stream=int(stream))  # int handle

    class ProtoStream:
        def __cuda_stream__(self):
            return (0, int(stream))

    k.launch(2, 128, [x, ep_jit.int32(n)], stream=ProtoStream())
    _ok((drv.cuStreamSynchronize(stream)[0], None))
    assert list(array.array("i", x.download())) == [i + 21 for i in range(n)]
    drv.cuStreamDestroy(stream)
    x.free()


def test_dynamic_shared_memory_above_48k(drv, cache_dir):
    k = ep_jit.load(ep_jit.compile(ARGS_SRC, name="args")).function("big_smem")
    n = 100 * 1024 // 4
    out = DeviceBuffer(drv, 4 * 4)
    for _ in range(2):  # second launch reuses the opt-in
        k.launch(4, 256, [out, ep_jit.int32(n)], shared_mem=4 * n)
    _sync(drv)
    # Thread 0 adds the n floats in order in fp32: replay exactly that order on the host (a float32 running sum
    # of 0..n-1 drifts far from the exact integer sum, so the exact value is the only right expectation).
    want = 0.0
    for i in range(n):
        want = struct.unpack("f", struct.pack("f", want + float(i)))[0]
    assert list(array.array("f", out.download())) == [want] * 4
    out.free()


COOP_SRC = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
extern "C" __global__ void grid_sum(int* partial, int* total) {
  cg::grid_group grid = cg::this_grid();
  if (threadIdx.x == 0) partial[blockIdx.x] = blockIdx.x + 1;
  grid.sync();
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
    int s = 0;
    for (int b = 0; b < gridDim.x; ++b) s += partial[b];
    *total = s;
  }
}
extern "C" __global__ void cluster_info(int* out) {
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ int mine;
  if (threadIdx.x == 0) mine = blockIdx.x * 10;
  cluster.sync();
  int peer = (cluster.block_rank() + 1) % cluster.num_blocks();
  int* remote = cluster.map_shared_rank(&mine, peer);
  if (threadIdx.x == 0) {
    out[3 * blockIdx.x + 0] = (int)cluster.num_blocks();
    out[3 * blockIdx.x + 1] = (int)cluster.block_rank();
    out[3 * blockIdx.x + 2] = *remote;
  }
  cluster.sync();
}
extern "C" __global__ void pdl_producer(int* buf, int n, int spin) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  if (i < n) buf[i] = 3 * i + 1;
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
extern "C" __global__ void pdl_consumer(const int* buf, int* out, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = buf[i] * 2;
}
"""


def test_cooperative_launch(drv, cache_dir):
    mod = ep_jit.load(ep_jit.compile(COOP_SRC, name="coop"))
    k = mod.function("grid_sum")
    assert k.attribute("num_regs") > 0 and k.attribute("max_threads_per_block") >= 64
    assert k.max_active_blocks_per_sm(64) >= 1
    blocks = 16
    partial = DeviceBuffer(drv, 4 * blocks)
    total = DeviceBuffer(drv, 4)
    k.launch(blocks, 64, [partial, total], cooperative=True)
    _sync(drv)
    assert struct.unpack("<i", total.download())[0] == blocks * (blocks + 1) // 2
    partial.free()
    total.free()


def test_cluster_launch(drv, cache_dir):
    mod = ep_jit.load(ep_jit.compile(COOP_SRC, name="coop"))
    k = mod.function("cluster_info")
    blocks = 8
    out = DeviceBuffer(drv, 4 * 3 * blocks)
    k.launch(blocks, 32, [out], cluster_dim=2)
    _sync(drv)
    vals = array.array("i", out.download())
    for b in range(blocks):
        size, rank, remote = vals[3 * b : 3 * b + 3]
        assert size == 2 and rank == b % 2
        peer_block = b - rank + (rank + 1) % 2
        assert remote == peer_block * 10
    with pytest.raises(ValueError, match="multiple"):
        k.launch(3, 32, [out], cluster_dim=2)
    out.free()


def test_pdl_launch(drv, cache_dir):
    mod = ep_jit.load(ep_jit.compile(COOP_SRC, name="coop"))
    producer = mod.function("pdl_producer")
    consumer = mod.function("pdl_consumer")
    n = 4096
    buf = DeviceBuffer(drv, 4 * n)
    out = DeviceBuffer(drv, 4 * n)
    stream = _ok(drv.cuStreamCreate(1))
    for _ in range(3):
        producer.launch(n // 256, 256, [buf, ep_jit.int32(n), ep_jit.int32(200000)], stream=stream)
        consumer.launch(n // 256, 256, [buf, out, ep_jit.int32(n)], stream=stream, pdl=True)
    _ok((drv.cuStreamSynchronize(stream)[0], None))
    assert list(array.array("i", out.download())) == [(3 * i + 1) * 2 for i in range(n)]
    drv.cuStreamDestroy(stream)
    buf.free()
    out.free()


def test_torch_tensor_args_if_available(drv, cache_dir):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    k = ep_jit.get_kernel(ARGS_SRC, name="args", kernel="add_n")
    x = torch.arange(300, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        k.launch(3, 128, [x, ep_jit.int32(300)], stream=s)
    s.synchronize()
    assert torch.equal(x.cpu(), torch.arange(300, dtype=torch.int32) + 7)
