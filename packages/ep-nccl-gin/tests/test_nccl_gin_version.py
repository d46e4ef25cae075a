"""Version codes, feature gates and NCCL's header/library rule (SPEC §8)."""

from __future__ import annotations

from pathlib import Path

import ep_nccl_gin
import pytest
from ep_nccl_gin import FEATURES, NcclVersion, NcclVersionError
from ep_nccl_gin._loader import LoadedNccl
from ep_nccl_gin.communicator import Communicator, Window
from ep_nccl_gin.version import check_header_runtime, parse_header_version, require

V = NcclVersion.parse


@pytest.mark.parametrize(
    ("code", "version"),
    [
        (22809, (2, 28, 9)),
        (22803, (2, 28, 3)),
        (22807, (2, 28, 7)),
        (23203, (2, 32, 3)),
        (21903, (2, 19, 3)),
        (2804, (2, 8, 4)),
        (2708, (2, 7, 8)),
        (30001, (3, 0, 1)),
    ],
)
def test_version_code_round_trip(code: int, version: tuple[int, int, int]) -> None:
    v = NcclVersion.from_code(code)
    assert v.as_tuple() == version
    assert v.code == code
    assert NcclVersion(*version) == v
    assert str(v) == ".".join(map(str, version))


def test_version_parse_and_order() -> None:
    assert V("2.28.9-1").as_tuple() == (2, 28, 9)
    assert V("2.30.3+cuda13.0") == NcclVersion(2, 30, 3)
    assert V("2.28.9") < V("2.28.10") < V("2.29.2") < V("3.0.0")
    for bad in ("2.28", "v2.28.9", "", "2.x.1"):
        with pytest.raises(ValueError, match="text"):
            V(bad)
    for bad_code in (0, -1, True, "22809"):
        with pytest.raises(ValueError, match="code"):
            NcclVersion.from_code(bad_code)  # type: ignore[arg-type]


def test_feature_table_matches_spec() -> None:
    expected = {
        "mem_alloc": "2.19.0",
        "window": "2.27.0",
        "device_api": "2.28.3",
        "gin": "2.28.7",
        "host_peer_pointer": "2.29.2",
        "comm_properties": "2.29.2",
        "gin_connection_options": "2.29.7",
        "gin_traffic_class": "2.30.3",
        "runtime_version_devcomm": "2.31.0",
    }
    assert {k: str(f.since) for k, f in FEATURES.items()} == expected


def test_require_names_feature_and_version_found() -> None:
    require("device_api", V("2.28.3"))
    require("gin", V("2.28.9"), V("2.28.9"))
    with pytest.raises(NcclVersionError) as info:
        require("gin", V("2.28.3"))
    msg = str(info.value)
    assert "GIN" in msg and "2.28.7" in msg and "2.28.3" in msg
    with pytest.raises(NcclVersionError) as info:
        require("gin_traffic_class", V("2.32.3"), V("2.28.9"))
    msg = str(info.value)
    assert "gin_traffic_class" in msg and "headers 2.28.9" in msg and "2.30.3" in msg
    with pytest.raises(ValueError, match="feature"):
        require("teleport", V("2.32.3"))


def test_header_runtime_rule() -> None:
    assert check_header_runtime(V("2.28.9"), V("2.28.9"), what="x") is False
    assert check_header_runtime(V("2.31.0"), V("2.32.3"), what="x") is True
    with pytest.raises(
        NcclVersionError, match=r"compiled against NCCL headers 2\.28\.9 .* library is 2\.29\.2"
    ):
        check_header_runtime(V("2.28.9"), V("2.29.2"), what="kernels")
    with pytest.raises(NcclVersionError, match="same version"):
        check_header_runtime(V("2.30.7"), V("2.31.0"), what="kernels")
    with pytest.raises(NcclVersionError, match="newer than the loaded"):
        check_header_runtime(V("2.32.3"), V("2.31.1"), what="kernels")


def test_parse_header_version(tmp_path: Path) -> None:
    (tmp_path / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_VERSION_CODE 22809\n")
    assert parse_header_version(tmp_path) == V("2.28.9")
    (tmp_path / "nccl.h").write_text("/* nothing */\n")
    with pytest.raises(ValueError, match="NCCL_VERSION_CODE"):
        parse_header_version(tmp_path)
    with pytest.raises(FileNotFoundError):
        parse_header_version(tmp_path / "missing")


# ---- gates of the API, checked before any NCCL call (a Communicator shell with a chosen version) ----

needs_extension = pytest.mark.skipif(not ep_nccl_gin.is_available(), reason="no NCCL library / extension")


def _shell(runtime: str, header: str | None = None) -> Communicator:
    comm = Communicator.__new__(Communicator)
    comm._nccl = LoadedNccl("fake", V(runtime), V(header or runtime), False)
    comm._ptr = 0xDEAD0000  # never dereferenced: every test below fails a gate first
    comm._owned = False
    comm._finalizer = None
    return comm


@needs_extension
def test_gate_window_registration() -> None:
    with pytest.raises(NcclVersionError, match=r"window registration.*2\.27\.0.*2\.26\.2"):
        _shell("2.26.2").register_window(1 << 21, 4096)


@needs_extension
def test_gate_device_api() -> None:
    with pytest.raises(NcclVersionError, match=r"device API.*2\.28\.3.*2\.27\.7"):
        _shell("2.27.7").create_dev_comm(lsa_barrier_count=1)


@needs_extension
def test_gate_dev_comm_needs_matching_headers_before_2_31() -> None:
    with pytest.raises(NcclVersionError, match=r"headers 2\.32\.3 .* library is 2\.28\.9"):
        _shell("2.28.9", "2.32.3").create_dev_comm(lsa_barrier_count=1)


@needs_extension
@pytest.mark.parametrize(
    ("kwargs", "needle", "since"),
    [
        ({"gin_signal_count": 4}, "GIN", "2.28.7"),
        ({"gin_contexts": 2}, "GIN", "2.28.7"),
    ],
)
def test_gate_gin_on_2_28_3(kwargs: dict[str, object], needle: str, since: str) -> None:
    with pytest.raises(NcclVersionError) as info:
        _shell("2.28.3").create_dev_comm(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value) and since in str(info.value) and "2.28.3" in str(info.value)


@needs_extension
@pytest.mark.parametrize(
    ("kwargs", "since"),
    [
        ({"gin_traffic_class": 3}, "2.30.3"),
        ({"gin_queue_depth": 1024}, "2.29.7"),
        ({"gin_exclusive_contexts": True}, "2.29.7"),
        ({"gin_connection_type": "rail"}, "2.29.7"),
    ],
)
def test_gate_newer_gin_options_on_2_28_9(kwargs: dict[str, object], since: str) -> None:
    with pytest.raises(NcclVersionError) as info:
        _shell("2.28.9").create_dev_comm(**kwargs)  # type: ignore[arg-type]
    assert since in str(info.value) and "2.28.9" in str(info.value)


@needs_extension
def test_dev_comm_argument_validation() -> None:
    comm = _shell("2.32.3")
    with pytest.raises(ValueError, match="lsa_barrier_count"):
        comm.create_dev_comm(lsa_barrier_count=-1)
    with pytest.raises(ValueError, match="gin_connection_type"):
        comm.create_dev_comm(gin_connection_type="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gin_queue_depth"):
        comm.create_dev_comm(gin_queue_depth=0)


@needs_extension
def test_gate_host_lsa_pointer_layout_on_mismatched_2_28() -> None:
    win = Window(_shell("2.28.9", "2.29.2"), 0xBEEF000, 1 << 21, 1 << 21, False)
    with pytest.raises(NcclVersionError, match="ncclWindow_vidmem"):
        win.lsa_ptr(0)
    with pytest.raises(ValueError, match="offset"):
        win.lsa_ptr(0, 1 << 21)
    win._handle = None


@needs_extension
def test_window_alignment_is_checked() -> None:
    with pytest.raises(ValueError, match="NCCL_WIN_REQUIRED_ALIGNMENT"):
        _shell("2.32.3").register_window((1 << 21) + 8, 4096)
