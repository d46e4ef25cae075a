"""Import and loading, with and without NCCL (absence simulated in subprocesses)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import textwrap

import ep_nccl_gin
import pytest
from ep_nccl_gin import NcclCallError, NcclNotFoundError


def _gpu_count() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if cuda.cuInit(0) != 0:
        return 0
    n = ctypes.c_int(0)
    return n.value if cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    full_env = dict(os.environ)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def test_public_api() -> None:
    assert ep_nccl_gin.__version__ == "0.1.0"
    for name in ep_nccl_gin.__all__:
        assert hasattr(ep_nccl_gin, name), name


def test_import_and_use_with_nccl_disabled() -> None:
    proc = _run(
        """
        import ep_nccl_gin as g
        assert not g.is_available()
        for call in (g.nccl_version, g.get_unique_id, g.load, lambda: g.mem_alloc(4096),
                     lambda: g.Communicator(bytes(128), 1, 0)):
            try:
                call()
            except g.NcclNotFoundError as e:
                assert "EPKIT_NCCL_GIN_DISABLE" in str(e), e
            else:
                raise AssertionError("expected NcclNotFoundError")
        print("ok")
        """,
        EPKIT_NCCL_GIN_DISABLE="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_and_use_when_pathfinder_finds_no_nccl() -> None:
    proc = _run(
        """
        import ep_nccl_gin as g
        from ep_nccl_gin import _loader
        from cuda.pathfinder import DynamicLibNotFoundError

        def missing(name):
            raise DynamicLibNotFoundError(f"Failure finding lib{name}.so")

        _loader._load_nvidia_dynamic_lib = missing
        assert not g.is_available()
        try:
            g.nccl_version()
        except g.NcclNotFoundError as e:
            assert "ep-nccl-gin[cu13]" in str(e) and "libnccl" in str(e), e
            assert isinstance(e.__cause__, DynamicLibNotFoundError)
        else:
            raise AssertionError("expected NcclNotFoundError")
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_when_the_extension_is_missing() -> None:
    proc = _run(
        """
        import sys
        sys.modules["ep_nccl_gin._impl"] = None  # makes `from . import _impl` raise ImportError
        import ep_nccl_gin as g
        assert g.own_include_dir()
        try:
            g.get_unique_id()
        except g.NcclNotFoundError as e:
            assert "ep_nccl_gin._impl" in str(e), e
        else:
            raise AssertionError("expected NcclNotFoundError")
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_bad_disable_knob_is_an_error() -> None:
    proc = _run("import ep_nccl_gin as g; g.load()", EPKIT_NCCL_GIN_DISABLE="maybe")
    assert proc.returncode != 0
    assert "EPKIT_NCCL_GIN_DISABLE" in proc.stderr and "maybe" in proc.stderr


# ---- with the real library (the cu13 extra installs it; skipped only where no NCCL wheel exists) ----

needs_nccl = pytest.mark.skipif(not ep_nccl_gin.is_available(), reason="no NCCL library installed")


def _installed_nccl_wheel_versions() -> set[str]:
    found = set()
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.add(importlib.metadata.version(dist))
    return found


@needs_nccl
def test_nccl_version_is_the_loaded_wheels() -> None:
    version = ep_nccl_gin.nccl_version()
    assert isinstance(version, tuple) and len(version) == 3 and all(isinstance(v, int) for v in version)
    assert version >= (2, 19, 0)
    loaded = ep_nccl_gin.load()
    assert loaded.runtime.as_tuple() == version
    if "site-packages/nvidia/nccl/lib" in loaded.path:
        wheels = {ep_nccl_gin.NcclVersion.parse(v).as_tuple() for v in _installed_nccl_wheel_versions()}
        assert version in wheels, (version, wheels)


@needs_nccl
def test_get_unique_id() -> None:
    a, b = ep_nccl_gin.get_unique_id(), ep_nccl_gin.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b


@needs_nccl
@pytest.mark.skipif(_gpu_count() > 0, reason="checks the error path of a machine without a GPU")
def test_call_error_names_the_nccl_call_without_gpu() -> None:
    with pytest.raises(NcclCallError) as info:
        ep_nccl_gin.mem_alloc(1 << 21)
    assert info.value.call == "ncclMemAlloc"
    assert info.value.result == 1  # ncclUnhandledCudaError: no driver
    assert "ncclMemAlloc failed: ncclUnhandledCudaError" in str(info.value)


@needs_nccl
def test_argument_validation_before_any_nccl_call() -> None:
    uid = bytes(128)
    with pytest.raises(ValueError, match="unique_id"):
        ep_nccl_gin.Communicator(b"short", 1, 0)
    with pytest.raises(TypeError, match="unique_id"):
        ep_nccl_gin.Communicator("x" * 128, 1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        ep_nccl_gin.Communicator(uid, 2, 2)
    with pytest.raises(ValueError, match="nranks"):
        ep_nccl_gin.Communicator(uid, 0, 0)
    with pytest.raises(TypeError, match="nranks"):
        ep_nccl_gin.Communicator(uid, 1.0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        ep_nccl_gin.mem_alloc(0)
    with pytest.raises(ValueError, match="ptr"):
        ep_nccl_gin.Communicator.from_pointer(0)


def test_errors_hierarchy() -> None:
    for cls in (
        NcclNotFoundError,
        NcclCallError,
        ep_nccl_gin.NcclVersionError,
        ep_nccl_gin.NcclHeadersNotFoundError,
    ):
        assert issubclass(cls, ep_nccl_gin.NcclGinError)
        assert issubclass(cls, RuntimeError)
    err = NcclCallError("ncclX failed", "ncclX", 5)
    assert (err.call, err.result, str(err)) == ("ncclX", 5, "ncclX failed")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_extension_links_neither_nccl_nor_cuda() -> None:
    spec = importlib.util.find_spec("ep_nccl_gin._impl")
    if spec is None or spec.origin is None:
        pytest.skip("the extension is not built")
    out = subprocess.run(["readelf", "-d", spec.origin], capture_output=True, text=True, check=True).stdout
    needed = [line for line in out.splitlines() if "(NEEDED)" in line]
    assert needed, out
    for lib in ("libnccl", "libcudart", "libcuda."):
        assert not any(lib in line for line in needed), needed
