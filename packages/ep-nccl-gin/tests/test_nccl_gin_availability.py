"""GIN availability (`gin_support`, `require_gin`) with a faked NCCL library and a faked sysfs: CPU only."""

from __future__ import annotations

from pathlib import Path

import ep_nccl_gin
import pytest
from ep_nccl_gin import GinUnavailableError, NcclNotFoundError, NcclVersion, gin_support, require_gin
from ep_nccl_gin import gin_availability as gs
from ep_nccl_gin._loader import LoadedNccl
from ep_nccl_gin.communicator import Communicator

V = NcclVersion.parse


def _nic(root: Path, name: str, state: str = "4: ACTIVE") -> None:
    port = root / name / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    monkeypatch.setenv("EPKIT_RDMA_SYSFS_DIR", str(root))
    monkeypatch.delenv("EPKIT_DISABLE_GIN", raising=False)
    return root


def _fake_nccl(monkeypatch: pytest.MonkeyPatch, runtime: str, header: str | None = None) -> None:
    nccl = LoadedNccl("/fake/libnccl.so.2", V(runtime), V(header or runtime), False)
    monkeypatch.setattr(gs, "load", lambda: nccl)


def test_available_with_new_nccl_and_active_nic(sysfs, monkeypatch) -> None:
    _fake_nccl(monkeypatch, "2.30.3")
    _nic(sysfs, "mlx5_0")
    _nic(sysfs, "mlx5_1", "1: DOWN")
    s = gin_support(hybrid=True)
    assert s.available and s.missing == ()
    assert s.rdma_devices == ("mlx5_0",)
    assert s.runtime == V("2.30.3")
    assert require_gin() is not None


def test_no_nic(sysfs, monkeypatch) -> None:
    _fake_nccl(monkeypatch, "2.30.3")
    _nic(sysfs, "mlx5_0", "1: DOWN")
    with pytest.raises(GinUnavailableError, match="no RDMA NIC with an active port") as e:
        require_gin()
    assert len(e.value.missing) == 1
    assert gin_support(sysfs_dir=sysfs / "absent").rdma_devices == ()


@pytest.mark.parametrize(
    ("runtime", "header", "hybrid", "match"),
    [
        (
            "2.28.3",
            None,
            False,
            r"GIN, GPU-initiated networking .* needs NCCL >= 2.28.7, the loaded library is 2.28.3",
        ),
        ("2.30.3", "2.28.3", False, r"needs NCCL headers >= 2.28.7, ep_nccl_gin was compiled against 2.28.3"),
        ("2.28.9", None, True, r"gin_connection_type='rail'.* needs NCCL >= 2.29.7"),
    ],
)
def test_nccl_too_old(sysfs, monkeypatch, runtime, header, hybrid, match) -> None:
    _fake_nccl(monkeypatch, runtime, header)
    _nic(sysfs, "mlx5_0")
    with pytest.raises(GinUnavailableError, match=match):
        require_gin(hybrid=hybrid)
    if hybrid:  # 2.28.9 is enough for GIN over a FULL connection
        assert gin_support(hybrid=False).available


def test_disabled_by_knob_names_every_missing_piece(sysfs, monkeypatch) -> None:
    _fake_nccl(monkeypatch, "2.28.3")
    monkeypatch.setenv("EPKIT_DISABLE_GIN", "1")
    s = gin_support()
    assert not s.available
    assert len(s.missing) == 4  # the knob, the library and header versions, the NIC
    assert "EPKIT_DISABLE_GIN=1" in s.missing[0]
    monkeypatch.setenv("EPKIT_DISABLE_GIN", "maybe")
    with pytest.raises(ValueError, match="EPKIT_DISABLE_GIN"):
        gin_support()


def test_no_nccl_library(sysfs, monkeypatch) -> None:
    def missing() -> LoadedNccl:
        raise NcclNotFoundError("no NCCL library found by cuda.pathfinder (fake)")

    monkeypatch.setattr(gs, "load", missing)
    _nic(sysfs, "mlx5_0")
    with pytest.raises(GinUnavailableError, match=r"no usable NCCL library \(no NCCL library found"):
        require_gin()


@pytest.mark.skipif(not ep_nccl_gin.is_available(), reason="no NCCL library / extension")
def test_dev_comm_refuses_gin_when_disabled(monkeypatch) -> None:
    comm = Communicator.__new__(Communicator)  # a shell: the refusal comes before any NCCL call
    comm._nccl = LoadedNccl("fake", V("2.30.3"), V("2.30.3"), False)
    comm._ptr = 0xDEAD0000
    comm._owned = False
    comm._finalizer = None
    monkeypatch.setenv("EPKIT_DISABLE_GIN", "1")
    with pytest.raises(GinUnavailableError, match="EPKIT_DISABLE_GIN=1"):
        comm.create_dev_comm(gin_signal_count=4)


def test_exported() -> None:
    assert gs.gin_support is gin_support
    for name in ("gin_support", "require_gin", "GinSupport", "GinUnavailableError", "rdma_devices"):
        assert name in ep_nccl_gin.__all__
