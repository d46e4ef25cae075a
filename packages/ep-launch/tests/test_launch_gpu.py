"""GPU tests of ep_launch: a prepared launch writes its patched words, cooperative launches run, errors come back
as CUresult codes, and record_wait orders one stream after another."""

from __future__ import annotations

import struct

import pytest

pytestmark = pytest.mark.gpu

SRC = r"""
struct Words { long long w[6]; };
extern "C" __global__ void copy_words(Words a) {
  long long* out = reinterpret_cast<long long*>(a.w[0]);
  if (threadIdx.x < 5) out[blockIdx.x * 5 + threadIdx.x] = a.w[1 + threadIdx.x];
}
extern "C" __global__ void spin_then_set(long long* flag, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
  *flag = 1;
}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ep_jit = pytest.importorskip("ep_jit")
    import ep_launch

    try:
        from ep_jit._driver import driver, ensure_context

        ensure_context()
        drv = driver()
    except ep_jit.NoDeviceError as e:
        pytest.skip(f"no GPU: {e}")
    assert ep_launch.available(), ep_launch.unavailable_reason()
    with ep_jit._env.scope(EPKIT_JIT_CACHE_DIR=str(tmp_path_factory.mktemp("jit"))):
        mod = ep_jit.load(ep_jit.compile(SRC, name="ep_launch_test"))
        yield drv, mod


def _alloc(drv, nbytes):
    err, ptr = drv.cuMemAlloc(nbytes)
    assert not err
    assert not drv.cuMemsetD8(ptr, 0, nbytes)[0]
    return int(ptr)


def _read(drv, ptr, count):
    buf = bytearray(8 * count)
    assert not drv.cuCtxSynchronize()[0]
    assert not drv.cuMemcpyDtoH(buf, ptr, len(buf))[0]
    return list(struct.unpack(f"<{count}q", bytes(buf)))


def test_patched_launch_writes_its_words(env):
    import ep_launch

    drv, mod = env
    k = mod.function("copy_words")
    out = _alloc(drv, 8 * 5 * 2)
    base = struct.pack("<6q", out, 10, 11, 12, 13, 14)
    err, stream = drv.cuStreamCreate(0)
    assert not err
    for cooperative, pdl in ((False, False), (True, False), (False, True)):
        launch = ep_launch.Launch(int(k._func), 2, 32, 0, cooperative, base, [2, 4], pdl)
        assert launch.pdl is pdl
        assert launch(int(stream), (-5, (1 << 64) - 1)) == 0
        assert not drv.cuStreamSynchronize(stream)[0]
        assert _read(drv, out, 10) == [10, -5, 12, -1, 14] * 2


def test_a_failed_launch_returns_its_code(env):
    import ep_launch

    _drv, mod = env
    k = mod.function("copy_words")
    base = struct.pack("<6q", 0, 0, 0, 0, 0, 0)
    too_big = ep_launch.Launch(int(k._func), 1, 4096, 0, False, base, [])  # > 1024 threads per block
    code = too_big(0, ())
    assert code != 0
    assert ep_launch.error_name(code).startswith("CUDA_ERROR")


def test_record_wait_orders_streams(env):
    import ep_launch

    drv, mod = env
    spin = mod.function("spin_then_set")
    copy = mod.function("copy_words")
    flag = _alloc(drv, 8)
    out = _alloc(drv, 8 * 5)
    a = int(drv.cuStreamCreate(1)[1])  # non-blocking streams: only the event orders them
    b = int(drv.cuStreamCreate(1)[1])
    err, ev = drv.cuEventCreate(2)  # CU_EVENT_DISABLE_TIMING
    assert not err
    import ep_jit

    spin.launch(1, 1, [ep_jit.pointer(flag), ep_jit.int64(50_000_000)], stream=a)
    assert ep_launch.record_wait(int(ev), a, b) == 0
    # b copies the flag's word only after a set it: copy_words reads w[1..5] from its argument, so read the flag
    # through a second launch that runs on b after the wait
    probe = ep_launch.Launch(int(copy._func), 1, 32, 0, False, struct.pack("<6q", out, 7, 7, 7, 7, 7), [])
    assert probe(b, ()) == 0
    assert not drv.cuStreamSynchronize(b)[0]
    # when b finished, a had finished too (the wait), so the flag is set
    assert drv.cuStreamQuery(a)[0] == drv.CUresult.CUDA_SUCCESS
    assert _read(drv, flag, 1) == [1]


def test_launch_with_wait_and_signal_pairs(env):
    """A launch that first waits for stream `a` (a slow kernel there) and then makes stream `c` wait for it: when
    `c` drains, both earlier kernels have run."""
    import ep_jit
    import ep_launch

    drv, mod = env
    spin = mod.function("spin_then_set")
    copy = mod.function("copy_words")
    flag = _alloc(drv, 8)
    out = _alloc(drv, 8 * 5)
    a, b, c = (int(drv.cuStreamCreate(1)[1]) for _ in range(3))
    e1 = int(drv.cuEventCreate(2)[1])
    e2 = int(drv.cuEventCreate(2)[1])
    spin.launch(1, 1, [ep_jit.pointer(flag), ep_jit.int64(50_000_000)], stream=a)
    words = struct.pack("<6q", out, 1, 2, 3, 4, 5)
    launch = ep_launch.Launch(int(copy._func), 1, 32, 0, False, words, [1])
    assert launch(b, (42,), e1, a, e2, c) == 0
    assert not drv.cuStreamSynchronize(c)[0]  # c waited for b, which waited for a
    assert drv.cuStreamQuery(a)[0] == drv.CUresult.CUDA_SUCCESS
    assert drv.cuStreamQuery(b)[0] == drv.CUresult.CUDA_SUCCESS
    assert _read(drv, out, 5) == [42, 2, 3, 4, 5] and _read(drv, flag, 1) == [1]
