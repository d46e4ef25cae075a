"""Importing ep_symmem needs no GPU; GPU calls without a usable driver raise errors that say what is missing."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import ep_symmem as sm
import pytest

# Runs in a fresh interpreter so that EPKIT_SYMMEM_LIBCUDA applies (the driver is loaded once per process).
_PROBE = textwrap.dedent(
    """
    import json, ep_symmem as sm
    out = {"available": sm.is_available()}
    for attempt in range(2):
        try:
            sm.SymmetricAllocation.create(1 << 20)
        except sm.SymmemError as e:
            out[f"error{attempt}"] = [type(e).__name__, str(e), e.call, isinstance(e, sm.NoDeviceError)]
    print(json.dumps(out))
    """
)


def _probe(libcuda: str) -> dict:
    env = dict(os.environ, EPKIT_SYMMEM_LIBCUDA=libcuda)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_exposes_public_api() -> None:
    assert sm.__version__ == "0.1.0"
    for name in sm.__all__:
        assert hasattr(sm, name), name
    assert sm.ALIGNMENT_BYTES == 2 << 20
    assert issubclass(sm.DriverNotFoundError, sm.NoDeviceError)
    assert issubclass(sm.NoDeviceError, sm.SymmemError)
    assert issubclass(sm.DescriptorVersionError, sm.DescriptorError)
    assert issubclass(sm.DescriptorError, ValueError)
    assert issubclass(sm.BootstrapTimeoutError, TimeoutError)


def test_import_does_not_load_the_driver() -> None:
    code = "import ep_symmem, ep_symmem._C as c; print(c.driver_loaded(), c.driver_library())"
    env = dict(os.environ, EPKIT_SYMMEM_LIBCUDA="/nonexistent/libcuda.so.1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["False", "/nonexistent/libcuda.so.1"]


def test_missing_driver_names_the_library_and_the_fix() -> None:
    out = _probe("/nonexistent/libcuda.so.1")
    assert out["available"] is False
    name, message, call, is_no_device = out["error0"]
    assert name == "DriverNotFoundError"
    assert is_no_device is True
    assert call == "dlopen"
    assert "/nonexistent/libcuda.so.1" in message
    assert "EPKIT_SYMMEM_LIBCUDA" in message
    # The failure is remembered: the second call raises the same error without retrying.
    assert out["error1"] == out["error0"]


def test_library_that_is_not_a_driver() -> None:
    out = _probe("libc.so.6")
    name, message, call, _ = out["error0"]
    assert name == "DriverNotFoundError"
    assert call == "dlsym"
    assert "cuGetProcAddress_v2" in message


_STUBS = sorted(
    glob.glob("/usr/local/cuda*/lib64/stubs/libcuda.so")
    + glob.glob("/usr/local/cuda*/targets/*/lib/stubs/libcuda.so")
)


@pytest.mark.skipif(not _STUBS, reason="no CUDA toolkit stub libcuda.so on this machine")
def test_stub_library_is_reported_as_stub() -> None:
    out = _probe(_STUBS[0])
    name, message, call, _ = out["error0"]
    assert name == "DriverNotFoundError"
    assert call == "cuInit"
    assert "STUB" in message


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_gpu_bytes": 0}, "num_gpu_bytes must be > 0"),
        ({"num_gpu_bytes": -5}, "num_gpu_bytes must be > 0"),
        ({"num_gpu_bytes": 1.5}, "num_gpu_bytes must be an int"),
        ({"num_gpu_bytes": True}, "num_gpu_bytes must be an int"),
        ({"num_gpu_bytes": 1 << 20, "num_host_bytes": -1}, "num_host_bytes must be >= 0"),
        ({"num_gpu_bytes": 1 << 20, "handle_type": "ipc"}, "handle_type must be one of"),
        ({"num_gpu_bytes": 1 << 20, "require_rdma": 1}, "require_rdma must be a bool"),
        ({"num_gpu_bytes": 1 << 20, "device": -1}, "device must be >= 0"),
    ],
)
def test_create_validates_arguments_before_touching_the_driver(kwargs: dict, fragment: str) -> None:
    with pytest.raises(sm.SymmemValueError, match=fragment):
        sm.SymmetricAllocation.create(**kwargs)


def test_env_knobs_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from ep_symmem import _env

    monkeypatch.setenv("EPKIT_SYMMEM_SAME_PROCESS_IMPORT", "dup")
    with pytest.raises(sm.SymmemValueError, match="retain"):
        _env.same_process_import()
    monkeypatch.setenv("EPKIT_SYMMEM_ALLOW_PTRACE", "maybe")
    with pytest.raises(sm.SymmemValueError, match="0 or 1"):
        _env.allow_ptrace()
    monkeypatch.setenv("EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT", "-3")
    with pytest.raises(sm.SymmemValueError, match="> 0"):
        _env.bootstrap_timeout_s()
    monkeypatch.setenv("EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT", "2.5")
    assert _env.bootstrap_timeout_s() == 2.5
    for name, knob in _env.KNOBS.items():
        assert name.startswith("EPKIT_SYMMEM_") and knob.doc


def test_native_errors_carry_call_and_code() -> None:
    error = sm.CudaError("cuMemCreate failed", call="cuMemCreate", code=2)
    assert (error.call, error.code, str(error)) == ("cuMemCreate", 2, "cuMemCreate failed")


def test_duplicate_own_fd_through_pidfd(tmp_path) -> None:
    """pidfd_open + pidfd_getfd on this process (the path used for same-host peers) needs no GPU."""
    from ep_symmem import _C

    path = tmp_path / "f.bin"
    path.write_bytes(b"symmetric")
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            dup = _C.duplicate_peer_fd(os.getpid(), fd)
        except sm.PeerAccessError as error:  # kernels without pidfd_getfd, or seccomp-restricted sandboxes
            pytest.skip(f"pidfd unavailable here: {error}")
        try:
            assert os.fstat(dup).st_ino == os.fstat(fd).st_ino
            assert os.pread(dup, 9, 0) == b"symmetric"
        finally:
            os.close(dup)
    finally:
        os.close(fd)
    with pytest.raises(sm.PeerAccessError, match="pidfd_getfd"):
        _C.duplicate_peer_fd(os.getpid(), 987654)


def test_pidfd_of_missing_process_says_so() -> None:
    from ep_symmem import _C

    with pytest.raises(sm.PeerAccessError, match=r"no longer exists|pidfd_open") as info:
        _C.duplicate_peer_fd(2**22 + 12345, 3)
    assert info.value.call == "pidfd_open"
