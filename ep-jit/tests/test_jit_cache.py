"""CPU tests of the compile cache with real nvcc compiles: hits, keys, concurrency, crashes, corruption, eviction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import ep_jit
import pytest
from ep_jit._compiler import NvccBackend, NvrtcBackend
from ep_jit._cubin import is_cubin, kernel_names

ARCH = "sm_90a"

KERNEL = r"""
extern "C" __global__ void scale(float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
template <int N> __global__ void add_n(int* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += N;
}
template __global__ void add_n<3>(int*, int);
"""


def _real_nvcc() -> str:
    try:
        return NvccBackend.locate().path
    except ep_jit.JitError as e:
        pytest.skip(f"nvcc not available: {e}")


@pytest.fixture(autouse=True)
def _fresh_memo():
    ep_jit.clear_memo()
    yield
    ep_jit.clear_memo()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(d))
    monkeypatch.delenv("EPKIT_JIT_ALWAYS_COMPILE", raising=False)
    monkeypatch.delenv("EPKIT_JIT_EXTRA_FLAGS", raising=False)
    monkeypatch.delenv("EPKIT_JIT_BACKEND", raising=False)
    return d


@pytest.fixture
def counting_nvcc(tmp_path, monkeypatch):
    """An nvcc wrapper that records every compile (not --version) and can hang on request, then runs nvcc."""
    real = _real_nvcc()
    log = tmp_path / "nvcc-calls.log"
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" != "--version" ]; then
              echo "$$" >> "{log}"
              if [ -n "$EP_JIT_TEST_HANG_MARKER" ]; then touch "$EP_JIT_TEST_HANG_MARKER"; sleep 120; fi
            fi
            exec "{real}" "$@"
            """
        )
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("EPKIT_JIT_NVCC", str(wrapper))
    log.touch()
    return log


def _calls(log: Path) -> int:
    return len(log.read_text().split())


def _unique_kernel() -> str:
    return f"// {uuid.uuid4()}\n{KERNEL}"


def test_compile_then_hit_without_compiler_run(cache_dir, counting_nvcc):
    art = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    assert not art.from_cache
    assert _calls(counting_nvcc) == 1
    data = art.cubin_path.read_bytes()
    assert is_cubin(data)
    assert art.cubin_path.parent.parent == cache_dir / "entries"
    assert art.meta["key"] == art.key and len(art.key) == 64
    assert art.meta["kernels"] == sorted(["scale", "_Z5add_nILi3EEvPii"])
    assert set(art.meta["key_record"]) >= {"schema", "source_sha256", "includes", "compiler", "flags", "arch"}
    assert "scale" in art.meta["resources"] and art.meta["resources"]["scale"]["registers"] > 0
    assert "nvcc" in art.meta["command"] and art.meta["compile_seconds"] > 0
    for f in ("kernel.cu", "kernel.cubin", "meta.json", "compile.log"):
        assert (art.entry_dir / f).is_file()

    # Same process, memo: no hashing, no file I/O at all.
    again = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    assert again.from_cache and again.key == art.key

    # Fresh memo (as a new process would be): a verified disk hit, and no compiler run.
    ep_jit.clear_memo()
    hit = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    assert hit.from_cache and hit.key == art.key and hit.cubin_path == art.cubin_path
    assert _calls(counting_nvcc) == 1


def test_memo_hit_touches_no_file(cache_dir, counting_nvcc, monkeypatch):
    ep_jit.compile(KERNEL, name="scale", arch=ARCH)

    def boom(*a, **k):
        raise AssertionError("file system touched on a memo hit")

    monkeypatch.setattr("ep_jit._build.include_closure", boom)
    monkeypatch.setattr("ep_jit._cache.Cache.verify", boom)
    t0 = time.perf_counter()
    for _ in range(1000):
        ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    per_call_us = (time.perf_counter() - t0) * 1e3
    assert per_call_us < 200, per_call_us  # generous: a dict lookup plus an env snapshot


def test_key_covers_headers_defines_arch_flags(tmp_path, cache_dir, counting_nvcc):
    inc = tmp_path / "inc"
    (inc / "proj").mkdir(parents=True)
    (inc / "proj" / "outer.cuh").write_text('#pragma once\n#include "inner.cuh"\n')
    (inc / "proj" / "inner.cuh").write_text("#pragma once\nconstexpr int kValue = 1;\n")
    src = "#include <proj/outer.cuh>\n#include <cstdint>\n" + KERNEL

    def key(**kw):
        args = {"name": "k", "include_dirs": [inc], "arch": ARCH} | kw
        return ep_jit.compute_key(src if "source" not in kw else kw.pop("source"), **args).key

    base = key()
    assert key() == base
    rec = ep_jit.compute_key(src, name="k", include_dirs=[inc], arch=ARCH).record
    assert [n for n, _ in rec["includes"]] == ["0:proj/inner.cuh", "0:proj/outer.cuh"]

    # transitively included header content
    (inc / "proj" / "inner.cuh").write_text("#pragma once\nconstexpr int kValue = 2;\n")
    changed_header = key()
    assert changed_header != base
    # defines (order-insensitive), arch, flags, name, key_extra, backend-visible lineinfo
    assert key(defines={"A": 1, "B": "x"}) == key(defines={"B": "x", "A": 1}) != changed_header
    assert key(defines={"A": 2, "B": "x"}) != key(defines={"A": 1, "B": "x"})
    assert key(arch="sm_80") != changed_header
    assert key(arch="90a") == changed_header
    assert key(flags=("-O1",)) != changed_header
    assert key(flags=("-O1", "-DX")) != key(flags=("-DX", "-O1"))
    assert key(name="other") != changed_header
    assert key(key_extra={"ep_layout": "0.1.0"}) != changed_header
    assert key(lineinfo=True) != changed_header
    # the same header tree at another prefix keeps the key (content, not location, matters)
    moved = tmp_path / "elsewhere"
    (moved / "proj").mkdir(parents=True)
    for f in ("outer.cuh", "inner.cuh"):
        (moved / "proj" / f).write_text((inc / "proj" / f).read_text())
    assert key(include_dirs=[moved]) == changed_header
    assert _calls(counting_nvcc) == 0  # computing keys compiles nothing

    # and a real compile through the include dir, which is then a hit; editing the header misses again
    art = ep_jit.compile(src, name="k", include_dirs=[inc], arch=ARCH)
    assert art.key == changed_header and not art.from_cache
    ep_jit.clear_memo()
    assert ep_jit.compile(src, name="k", include_dirs=[inc], arch=ARCH).from_cache
    (inc / "proj" / "inner.cuh").write_text("#pragma once\nconstexpr int kValue = 3;\n")
    ep_jit.clear_memo()
    assert not ep_jit.compile(src, name="k", include_dirs=[inc], arch=ARCH).from_cache
    assert _calls(counting_nvcc) == 2


def test_computed_include_hashes_whole_include_dir(tmp_path, cache_dir, counting_nvcc):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "a.cuh").write_text("#pragma once\n")
    (inc / "b.cuh").write_text("#pragma once\n")
    src = "#define HDR <a.cuh>\n#include HDR\n" + KERNEL
    k1 = ep_jit.compute_key(src, name="k", include_dirs=[inc], arch=ARCH).key
    (inc / "b.cuh").write_text("#pragma once\n// changed\n")
    assert ep_jit.compute_key(src, name="k", include_dirs=[inc], arch=ARCH).key != k1


def test_default_flags_and_overrides(cache_dir, counting_nvcc):
    rec = ep_jit.compute_key(KERNEL, name="k", arch=ARCH)
    assert rec.canonical_flags[:4] == ["-arch=sm_90a", "-std=c++17", "-O3", "--expt-relaxed-constexpr"]
    over = ep_jit.compute_key(KERNEL, name="k", arch=ARCH, flags=("-O0", "-std=c++20"), defines={"Z": None})
    assert "-O3" not in over.canonical_flags and "-std=c++17" not in over.canonical_flags
    assert over.canonical_flags[-3:] == ["-DZ", "-O0", "-std=c++20"]
    with pytest.raises(ValueError, match="arch"):
        ep_jit.compute_key(KERNEL, name="k", arch="compute_90")
    with pytest.raises(TypeError, match="flags"):
        ep_jit.compute_key(KERNEL, name="k", arch=ARCH, flags="-O0")
    with pytest.raises(ValueError, match="backend"):
        ep_jit.compute_key(KERNEL, name="k", arch=ARCH, backend="clang")


_CHILD = r"""
import json, os, sys, time
start = sys.argv[1]
while not os.path.exists(start):
    time.sleep(0.005)
import ep_jit
src = open(sys.argv[2]).read()
art = ep_jit.compile(src, name="race", arch="sm_90a")
data = art.cubin_path.read_bytes()
import hashlib
print(json.dumps({"from_cache": art.from_cache, "key": art.key, "sha": hashlib.sha256(data).hexdigest(),
                  "meta_sha": art.meta["cubin_sha256"]}))
"""


def test_eight_processes_one_key_compile_once(tmp_path, cache_dir, counting_nvcc):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    src = tmp_path / "src.cu"
    src.write_text(_unique_kernel())
    start = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(start), str(src)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    time.sleep(0.5)
    start.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(not r["from_cache"] for r in results) == 1
    assert len({r["key"] for r in results}) == 1
    assert all(r["sha"] == r["meta_sha"] for r in results)
    assert len({r["sha"] for r in results}) == 1
    assert _calls(counting_nvcc) == 1
    assert not any((cache_dir / "tmp").iterdir())


def test_sigkilled_builder_does_not_block_the_next(tmp_path, cache_dir, counting_nvcc, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    src = tmp_path / "src.cu"
    src.write_text(_unique_kernel())
    start = tmp_path / "go"
    start.touch()
    marker = tmp_path / "compiler-started"
    env = dict(os.environ, EP_JIT_TEST_HANG_MARKER=str(marker))
    victim = subprocess.Popen(
        [sys.executable, str(script), str(start), str(src)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert victim.poll() is None, "builder exited before reaching the compiler"
        assert time.monotonic() < deadline, "builder never started compiling"
        time.sleep(0.02)
    # The victim holds the key's lock and is inside the compiler: kill it (and its hanging compiler).
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    monkeypatch.setenv("EPKIT_JIT_LOCK_TIMEOUT", "60")
    t0 = time.monotonic()
    art = ep_jit.compile(src.read_text(), name="race", arch=ARCH)
    assert time.monotonic() - t0 < 45
    assert not art.from_cache and is_cubin(art.cubin_path.read_bytes())
    assert _calls(counting_nvcc) == 2
    # the dead builder's temp dir is left behind until the stale sweep removes it
    leftovers = list((cache_dir / "tmp").iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith("build.")
    assert ep_jit.cache().sweep_tmp(older_than=0) == 1


def test_truncated_or_incomplete_entry_is_rebuilt(cache_dir, counting_nvcc):
    art = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    good = art.cubin_path.read_bytes()
    art.cubin_path.write_bytes(good[: len(good) // 2])
    ep_jit.clear_memo()
    with pytest.warns(ep_jit.CacheCorruptionWarning, match="kernel.cubin has"):
        again = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    assert not again.from_cache and again.cubin_path.read_bytes() == good
    # same size, flipped bytes: caught by the checksum
    flipped = bytearray(good)
    flipped[-8:] = bytes(b ^ 0xFF for b in flipped[-8:])
    art.cubin_path.write_bytes(bytes(flipped))
    ep_jit.clear_memo()
    with pytest.warns(ep_jit.CacheCorruptionWarning, match="sha256"):
        assert not ep_jit.compile(KERNEL, name="scale", arch=ARCH).from_cache
    # missing meta.json
    (art.entry_dir / "meta.json").unlink()
    ep_jit.clear_memo()
    with pytest.warns(ep_jit.CacheCorruptionWarning, match="meta.json"):
        assert not ep_jit.compile(KERNEL, name="scale", arch=ARCH).from_cache
    ep_jit.clear_memo()
    assert ep_jit.compile(KERNEL, name="scale", arch=ARCH).from_cache
    assert _calls(counting_nvcc) == 4


def test_eviction_honours_the_cap_lru(cache_dir, counting_nvcc, monkeypatch):
    monkeypatch.setenv("EPKIT_JIT_CACHE_MAX_BYTES", "0")
    a = ep_jit.compile(KERNEL, name="a", arch=ARCH)
    one = ep_jit.cache().total_bytes()
    cap = int(one * 2.5)
    monkeypatch.setenv("EPKIT_JIT_CACHE_MAX_BYTES", str(cap))
    b = ep_jit.compile(KERNEL, name="b", arch=ARCH)
    time.sleep(0.05)
    os.utime(b.entry_dir, (time.time() - 100, time.time() - 100))  # b: least recently used
    ep_jit.clear_memo()
    assert ep_jit.compile(KERNEL, name="a", arch=ARCH).from_cache  # a: touched now
    c = ep_jit.compile(KERNEL, name="c", arch=ARCH)
    names = {e.name for e in ep_jit.cache().list_entries()}
    assert names == {"a", "c"}, names
    assert ep_jit.cache().total_bytes() <= cap
    assert not b.entry_dir.exists() and a.entry_dir.exists() and c.entry_dir.exists()


def test_compile_error_surfaces_compiler_output(cache_dir, counting_nvcc):
    bad = KERNEL + "\n__global__ void broken(int* x) { x[0] = undeclared_thing_42; }\n"
    with pytest.raises(ep_jit.CompileError) as info:
        ep_jit.compile(bad, name="broken", arch=ARCH)
    err = info.value
    assert "undeclared_thing_42" in str(err) and "undeclared_thing_42" in err.output
    assert "nvcc" in err.command
    assert err.log_path and "undeclared_thing_42" in Path(err.log_path).read_text()
    assert not any((cache_dir / "entries").iterdir())
    assert not any((cache_dir / "tmp").iterdir())


def _nvrtc_or_skip() -> None:
    try:
        NvrtcBackend.locate().identity()
    except ep_jit.JitError as e:
        pytest.skip(f"NVRTC library not found by cuda.pathfinder (install nvidia-cuda-nvrtc): {e}")


def test_nvrtc_backend_compiles_the_same_kernel(cache_dir, counting_nvcc):
    _nvrtc_or_skip()
    art = ep_jit.compile(KERNEL, name="scale", arch=ARCH, backend="nvrtc")
    assert not art.from_cache and art.meta["key_record"]["backend"] == "nvrtc"
    data = art.cubin_path.read_bytes()
    assert is_cubin(data)
    nv = ep_jit.compile(KERNEL, name="scale", arch=ARCH, backend="nvcc")
    assert kernel_names(data) == kernel_names(nv.cubin_path.read_bytes())
    assert art.key != nv.key
    assert "scale" in art.meta["resources"]
    ep_jit.clear_memo()
    assert ep_jit.compile(KERNEL, name="scale", arch=ARCH, backend="nvrtc").from_cache
    with pytest.raises(ep_jit.CompileError, match="undeclared_thing_7"):
        ep_jit.compile(
            KERNEL + "__global__ void f(int* x) { *x = undeclared_thing_7; }",
            name="e",
            arch=ARCH,
            backend="nvrtc",
        )


def test_no_gpu_paths_say_so(cache_dir):
    from ep_jit._driver import driver

    try:
        driver()
    except ep_jit.NoDeviceError:
        pass
    else:
        pytest.skip("a GPU driver is present")
    with pytest.raises(ep_jit.NoDeviceError, match="arch="):
        ep_jit.compile(KERNEL, name="scale")
    art = ep_jit.compile(KERNEL, name="scale", arch=ARCH)
    with pytest.raises(ep_jit.NoDeviceError, match="GPU"):
        ep_jit.load(art)


def test_threads_of_one_process_compile_once(cache_dir, counting_nvcc):
    import threading

    src = _unique_kernel()
    results: list = []
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        results.append(ep_jit.compile(src, name="threads", arch=ARCH))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 4 and len({a.key for a in results}) == 1
    assert sum(not a.from_cache for a in results) == 1
    assert _calls(counting_nvcc) == 1


def test_failure_of_another_builder_is_reused_not_recompiled(cache_dir, counting_nvcc):
    bad = "__global__ void f(int* x) { *x = undeclared_thing_9; }\n"
    key = ep_jit.compute_key(bad, name="bad", arch=ARCH).key
    cache = ep_jit.cache()
    log_path = cache.write_failure(
        "bad", key, "kernel.cu(1): error: identifier undeclared_thing_9 is undefined\n"
    )
    with pytest.raises(ep_jit.CompileError, match="another process") as info:
        ep_jit.compile(bad, name="bad", arch=ARCH)
    assert "undeclared_thing_9" in info.value.output
    assert _calls(counting_nvcc) == 0
    # an old failure log is not trusted: the compiler runs again (and fails for real)
    old = time.time() - 60
    os.utime(log_path, (old, old))
    with pytest.raises(ep_jit.CompileError, match="nvcc failed"):
        ep_jit.compile(bad, name="bad", arch=ARCH)
    assert _calls(counting_nvcc) == 1


def test_package_versions_enter_the_key_and_bad_cache_dir_is_explained(
    tmp_path, cache_dir, counting_nvcc, monkeypatch
):
    k0 = ep_jit.compute_key(KERNEL, name="k", arch=ARCH).key
    k1 = ep_jit.compute_key(KERNEL, name="k", arch=ARCH, package_versions={"ep_layout": "0.1.0"}).key
    k2 = ep_jit.compute_key(KERNEL, name="k", arch=ARCH, package_versions={"ep_layout": "0.2.0"}).key
    assert len({k0, k1, k2}) == 3
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ep_jit.JitError, match="EPKIT_JIT_CACHE_DIR"):
        ep_jit.compile(KERNEL, name="k", arch=ARCH)
