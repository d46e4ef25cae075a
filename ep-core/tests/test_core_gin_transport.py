"""CPU: the GIN host side of the nccl transport (several nodes), without a GPU or an RDMA NIC.

Against the recording ep_nccl_gin double of test_core_nccl_transport.py:
- hybrid mode: `create_executor` checks GIN on every rank, then replaces the LSA-only device communicator by one
  with the GIN requirements (contexts = allocated QPs, exclusive, queue depth, traffic class = sl_idx, signals,
  connection) and hands a device copy of it to the executor's storage (`nccl_devcomm`);
- refusals, on every rank with the same message and before any collective: GIN missing on one rank (e.g.
  EPKIT_DISABLE_GIN=1 through the real `gin_support`), NCCL too old for the traffic class, a window without
  strict ordering, `num_nvlink_ranks` that is not the LSA team;
- direct mode across nodes (`allow_hybrid_mode=False`): the same GIN device communicator with a FULL connection
  (a put to every rank of another node), GIN checked without the RAIL options;
- the pointer reaches the packed `OpArgs` (slot `nccl_devcomm`) and the JIT picks the gin scale-out for it; the
  gin kernels of that configuration compile (test_core_kernels_compile.py::test_hybrid_gin_scaleout_compiles).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import SimpleNamespace

import pytest
from ep_core import planner
from ep_core.errors import EPConfigError
from ep_core.kernels import gpu_executor
from ep_core.kernels._args import OP_ARGS_FIELDS, pack_op_args
from ep_core.kernels.rank_driver import RankDriver, RankResources
from ep_core.topology import Topology
from ep_core.transports import nccl as nccl_transport
from ep_core.transports.nccl import NcclStorage, NcclTransport, gin_requirements

_spec = importlib.util.spec_from_file_location(
    "_nccl_fakes", pathlib.Path(__file__).with_name("test_core_nccl_transport.py")
)
_fakes = sys.modules.setdefault("_nccl_fakes", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_fakes)
_V, _run_ranks, WS, MIB2 = _fakes._V, _fakes._run_ranks, _fakes.WS, _fakes.MIB2


class _Copy:
    def __init__(self, raw: bytes, log: list) -> None:
        self.ptr, self.raw, self._log = 0xD0C0_0000 + len(log) * 0x1000, raw, log
        log.append(("upload", self.ptr))

    def close(self) -> None:
        self._log.append(("free", self.ptr))


@pytest.fixture
def fake(monkeypatch):
    f = _fakes._FakeNccl(runtime=_V(2, 30, 3))
    f.lsa_size = 2
    f.uploads = []
    monkeypatch.setattr(nccl_transport, "_import_nccl_gin", lambda: f)
    monkeypatch.setattr(nccl_transport, "_current_device", _fakes._rank_of_thread)
    monkeypatch.setattr(nccl_transport, "_device_sms", lambda: 132)
    monkeypatch.setattr(nccl_transport, "_zero", lambda ptr, n: None)
    monkeypatch.setattr(nccl_transport, "_upload", lambda raw: _Copy(raw, f.uploads))
    monkeypatch.setattr(planner, "detect_fast_rdma_atomics", lambda: False)
    made = []

    class _Exec:  # GpuExecutor needs CUDA: record what it is given
        def __init__(self, config, storage, bootstrap) -> None:
            made.append((config.rank, storage.nccl_devcomm))

    monkeypatch.setattr(gpu_executor, "GpuExecutor", _Exec)
    f.executors = made
    return f


def _config(rank: int, n: int = 4, nvl: int = 2, hybrid: bool = True, qps: int = 0, sl: int = 3):
    return SimpleNamespace(rank=rank, topology=Topology(n, nvl, hybrid), num_allocated_qps=qps, sl_idx=sl)


def _setup(n: int = 4, **cfg):
    """Every rank: allocate, then create_executor (what EPBuffer does); returns (transport, storage) or the error."""

    def body(b):
        tr = NcclTransport()
        st = tr.allocate(b, WS + MIB2)
        buffer = SimpleNamespace(storage=st, bootstrap=b)
        try:
            tr.create_executor(_config(b.rank, n, **cfg), buffer)
        except BaseException:
            st.release_local()
            raise
        return tr, st

    return _run_ranks(n, body)


# --- the requirements ----------------------------------------------------------------------------------------
def test_gin_requirements_hybrid() -> None:
    reqs = gin_requirements(Topology(16, 8, True), num_allocated_qps=65, sl_idx=5, lsa_barrier_count=132)
    assert reqs == {
        "lsa_barrier_count": 132,
        "gin_contexts": 65,
        "gin_exclusive_contexts": True,
        "gin_queue_depth": nccl_transport.GIN_QUEUE_DEPTH,
        "gin_signal_count": nccl_transport.GIN_SIGNAL_COUNT,
        "gin_connection_type": "rail",  # the hybrid kernels (barrier included) reach rail peers only
        "gin_traffic_class": 5,
    }
    assert nccl_transport.GIN_QUEUE_DEPTH == 1024 and nccl_transport.GIN_KERNEL_PEERS == "rail"
    direct = gin_requirements(Topology(16, 8, False), num_allocated_qps=17, sl_idx=5, lsa_barrier_count=132)
    assert direct["gin_connection_type"] == "full"  # direct mode across nodes puts to every rank


def test_hybrid_barrier_is_rail_only_under_gin() -> None:
    """The RAIL connection holds only while the hybrid kernels meet node + rail peers in their barrier."""
    from ep_core.kernels._source import get_include

    inc = pathlib.Path(get_include()) / "ep_core"  # the installed headers (nox installs the package)
    hybrid = (inc / "hybrid.cuh").read_text()
    assert hybrid.count("hybrid_barrier<kSu, true>(") == 4 and "hybrid_barrier<kSu>(" not in hybrid
    assert "hybrid_barrier<kNvl>(" in (inc / "direct_xnode.cuh").read_text()  # full barrier, FULL connection


def test_gin_requirements_full_when_kernels_reach_every_rank(monkeypatch) -> None:
    monkeypatch.setattr(nccl_transport, "GIN_KERNEL_PEERS", "world")
    hybrid = gin_requirements(Topology(16, 8, True), num_allocated_qps=65, sl_idx=3, lsa_barrier_count=1)
    direct = gin_requirements(Topology(16, 8, False), num_allocated_qps=17, sl_idx=3, lsa_barrier_count=1)
    assert hybrid["gin_connection_type"] == "full" and direct["gin_connection_type"] == "full"


def test_gin_requirements_default_qps_from_planner(monkeypatch) -> None:
    monkeypatch.setattr(planner, "detect_fast_rdma_atomics", lambda: True)
    topo = Topology(16, 8, True)
    reqs = gin_requirements(topo, num_allocated_qps=0, sl_idx=3, lsa_barrier_count=1)
    assert reqs["gin_contexts"] == planner.default_num_allocated_qps(topo, True) == 65
    with pytest.raises(EPConfigError, match="several nodes"):
        gin_requirements(Topology(8, 8, True), num_allocated_qps=0, sl_idx=3, lsa_barrier_count=1)


def test_signal_ids_none_in_the_kernels() -> None:
    """GIN_SIGNAL_COUNT = 0 holds while the gin scale-out only uses VA signals (no ncclGinSignal_t ids)."""
    from ep_core.kernels._source import get_include

    inc = pathlib.Path(get_include()) / "ep_core"
    text = "".join((inc / h).read_text() for h in ("scaleout.cuh", "hybrid.cuh", "direct_xnode.cuh"))
    assert "ncclGin_StrongVASignalAdd" in text
    for indexed in ("ncclGin_SignalAdd", "ncclGin_SignalInc", "ncclGin_StrongSignalAdd", "ncclGinSignal_t"):
        assert indexed not in text, indexed
    assert nccl_transport.GIN_SIGNAL_COUNT == 0


# --- setup through create_executor ---------------------------------------------------------------------------
def test_hybrid_creates_gin_dev_comm_and_uploads_it(fake) -> None:
    out = _setup(4, qps=33, sl=2)
    for r, res in enumerate(out):
        assert not isinstance(res, BaseException), res
        tr, st = res
        calls = fake.calls(r)
        assert calls == [
            "comm_init",
            "mem_alloc",
            "register_window",
            "create_dev_comm",
            "create_dev_comm_gin",
            "dev_comm_destroy",  # the LSA-only one, replaced
        ], calls
        gin = next(c[2] for c in fake.log if c[0] == r and c[1] == "create_dev_comm_gin")
        assert (
            gin
            == tr.gin_requirements
            == {
                "lsa_barrier_count": 132,
                "gin_contexts": 33,
                "gin_exclusive_contexts": True,
                "gin_queue_depth": 1024,
                "gin_signal_count": 0,
                "gin_connection_type": "rail",
                "gin_traffic_class": 2,
            }
        )
        assert st.nccl_devcomm and st.dev_comm.gin_available
    assert sorted(fake.executors) == sorted((r, out[r][1].nccl_devcomm) for r in range(4))
    assert len({st.nccl_devcomm for _, st in out}) == 4 and len(fake.uploads) == 4
    # teardown frees the device copy, then destroys the GIN device communicator
    for _, st in out:
        ptr = st.nccl_devcomm
        st.release_local()
        assert st.nccl_devcomm == 0 and ("free", ptr) in fake.uploads


def test_default_qps_reach_gin_contexts(fake) -> None:
    out = _setup(4, qps=0)
    gin = next(c[2] for c in fake.log if c[0] == 0 and c[1] == "create_dev_comm_gin")
    assert gin["gin_contexts"] == planner.HYBRID_NUM_ALLOCATED_QPS == 129
    for _, s in out:
        s.release_local()


def test_gin_missing_on_one_rank_fails_every_rank_before_the_collective(fake) -> None:
    fake.gin_missing = {2: ("no RDMA NIC with an active port under /sys/class/infiniband (test)",)}
    out = _setup(4)
    for r, e in enumerate(out):
        assert isinstance(e, EPConfigError), e
        assert "hybrid mode (2 nodes x 2 ranks) needs GIN" in str(e) and "rank(s) [2]" in str(e)
        assert "no RDMA NIC" in str(e)
        assert "create_dev_comm_gin" not in fake.calls(r)


def test_disable_gin_env_gives_clear_error(fake, monkeypatch, tmp_path) -> None:
    """EPKIT_DISABLE_GIN=1 through ep_nccl_gin's real gin_support (library and NIC checks faked away)."""
    eng = pytest.importorskip("ep_nccl_gin")
    from ep_nccl_gin import gin_availability

    nic = tmp_path / "mlx5_0" / "ports" / "1"
    nic.mkdir(parents=True)
    (nic / "state").write_text("4: ACTIVE\n")
    monkeypatch.setattr(
        gin_availability, "load", lambda: SimpleNamespace(runtime=_V(2, 30, 3), header=_V(2, 30, 3))
    )
    monkeypatch.setattr(
        gin_availability,
        "FEATURES",
        {k: SimpleNamespace(since=_V(2, 28, 7), description=k) for k in ("gin", "gin_connection_options")},
    )
    monkeypatch.setenv("EPKIT_RDMA_SYSFS_DIR", str(tmp_path))
    real = eng.gin_support
    fake.gin_support = lambda *, hybrid=False: real(hybrid=hybrid, sysfs_dir=tmp_path)
    assert fake.gin_support(hybrid=True).missing == ()  # nothing missing without the knob
    monkeypatch.setenv("EPKIT_DISABLE_GIN", "1")
    for e in _setup(4):
        assert isinstance(e, EPConfigError), e
        assert "EPKIT_DISABLE_GIN=1" in str(e) and "rank(s) [0, 1, 2, 3]" in str(e)


def test_traffic_class_needs_nccl_2_30_3(fake) -> None:
    fake.runtime = fake.header = _V(2, 29, 7)
    for e in _setup(4, sl=3):
        assert isinstance(e, EPConfigError), e
        assert "sl_idx=3" in str(e) and "2.30.3" in str(e)


def test_window_without_strict_ordering_is_refused(fake) -> None:
    fake.strict_ordering = False
    for e in _setup(4):
        assert isinstance(e, EPConfigError), e
        assert "NCCL_WIN_STRICT_ORDERING" in str(e)


def test_dev_comm_without_gin_contexts_fails_every_rank(fake) -> None:
    fake.gin_contexts_created = False
    out = _setup(4)
    for r, e in enumerate(out):
        assert isinstance(e, EPConfigError), e
        assert "without GIN contexts" in str(e)
        assert fake.calls(r).count("dev_comm_destroy") >= 1  # the GIN one released
    assert fake.executors == []


def test_direct_mode_across_nodes_creates_full_gin_dev_comm(fake, monkeypatch) -> None:
    """allow_hybrid_mode=False with 2 nodes: the direct kernels across nodes (direct_xnode.cuh) put to every rank
    of another node, so the GIN device communicator has a FULL connection; GIN is checked as direct mode."""
    asked = []
    real = fake.gin_support

    def gin_support(*, hybrid=False):
        asked.append(hybrid)
        return real(hybrid=hybrid)

    fake.gin_support = gin_support
    out = _setup(4, hybrid=False)
    for r, res in enumerate(out):
        assert not isinstance(res, BaseException), res
        tr, st = res
        assert "create_dev_comm_gin" in fake.calls(r)
        assert tr.gin_requirements["gin_connection_type"] == "full"
        assert st.nccl_devcomm
    assert asked == [False] * 4
    assert sorted(fake.executors) == sorted((r, out[r][1].nccl_devcomm) for r in range(4))
    for _, st in out:
        st.release_local()


def test_direct_mode_across_nodes_gin_missing_names_the_mode(fake) -> None:
    fake.gin_missing = {1: ("no RDMA NIC with an active port under /sys/class/infiniband (test)",)}
    for r, e in enumerate(_setup(4, hybrid=False)):
        assert isinstance(e, EPConfigError), e
        assert "direct mode across nodes (2 nodes x 2 ranks) needs GIN" in str(e) and "rank(s) [1]" in str(e)
        assert "create_dev_comm_gin" not in fake.calls(r)


def test_num_nvlink_ranks_must_be_the_lsa_team(fake) -> None:
    for e in _setup(4, nvl=1):
        assert isinstance(e, EPConfigError), e
        assert "num_nvlink_ranks" in str(e) and "LSA team size 2" in str(e)


def test_one_node_needs_no_gin(fake) -> None:
    fake.lsa_size = None
    out = _setup(2, nvl=2)
    for r, (_, st) in enumerate(out):
        assert "create_dev_comm_gin" not in fake.calls(r) and st.nccl_devcomm == 0
        st.release_local()


# --- kernels -------------------------------------------------------------------------------------------------
def test_devcomm_pointer_reaches_packed_op_args() -> None:
    res = RankResources(1, 4, 0x7000_0000_0000, 1 << 20, 0, None, nccl_window=0xAB000, nccl_devcomm=0xDC000)
    me = SimpleNamespace(
        res=res, rank=1, num_max_tokens=8, timeout_cycles=5, _status=SimpleNamespace(device_ptr=0x99)
    )
    plan = SimpleNamespace(workspace_offset=0, recv_offset=4096)
    args = RankDriver._common(me, plan, 0x5000, 16)
    raw = pack_op_args(**args)
    i = OP_ARGS_FIELDS.index("nccl_devcomm")
    assert int.from_bytes(raw[8 * i : 8 * i + 8], "little") == 0xDC000
    assert int.from_bytes(raw[40:48], "little") == 0xAB000


def test_jit_picks_gin_scaleout_for_nccl_hybrid() -> None:
    res = SimpleNamespace(nccl_window=0xAB000)
    me = SimpleNamespace(
        res=res, _num_warps=None, _configs={}, num_ranks=4, num_scaleup_ranks=2, num_nvlink_ranks=2
    )
    cfg = RankDriver._config(me, 2048, 2, 0, 4)
    assert cfg.transport == "nccl" and cfg.scaleout == "gin" and cfg.num_scaleup_ranks == 2
    me.res = SimpleNamespace(nccl_window=0)
    me._configs = {}
    assert RankDriver._config(me, 2048, 2, 0, 4).scaleout == "emulated"


def test_jit_picks_gin_for_nccl_direct_across_nodes() -> None:
    res = SimpleNamespace(nccl_window=0xAB000)
    me = SimpleNamespace(
        res=res, _num_warps=None, _configs={}, num_ranks=4, num_scaleup_ranks=4, num_nvlink_ranks=2
    )
    cfg = RankDriver._config(me, 2048, 2, 0, 4)
    assert cfg.is_direct_xnode and not cfg.is_hybrid and cfg.scaleout == "gin"
    assert cfg.defines()["EP_CORE_TRANSPORT"] == "ep_core::NodeLsaTransport<2>"
    me.res = SimpleNamespace(nccl_window=0)
    me._configs = {}
    assert RankDriver._config(me, 2048, 2, 0, 4).scaleout == "emulated"


def test_hybrid_over_nccl_without_devcomm_is_refused() -> None:
    res = RankResources(0, 4, 0x7000_0000_0000, 1 << 20, 0, None, nccl_window=0xAB000)
    with pytest.raises(EPConfigError, match="nccl_devcomm: hybrid mode"):
        RankDriver(res, num_max_tokens_per_rank=8, num_scaleup_ranks=2)
    with pytest.raises(
        EPConfigError, match=r"nccl_devcomm: direct mode across nodes over transport 'nccl' \(2 nodes"
    ):
        RankDriver(res, num_max_tokens_per_rank=8, num_nvlink_ranks=2)


def test_storage_close_frees_the_devcomm_copy(fake) -> None:
    out = _setup(4)
    closed = _run_ranks(4, lambda b: out[b.rank][1].close())
    assert closed == [None] * 4
    assert sum(1 for what, _ in fake.uploads if what == "free") == 4
    for r in range(4):
        # the GIN device communicator (the LSA-only one went at setup), window, memory, the owned communicator
        assert fake.calls(r)[-4:] == ["dev_comm_destroy", "window_deregister", "mem_free", "comm_destroy"]
        assert fake.calls(r).count("dev_comm_destroy") == 2
        assert isinstance(out[r][1], NcclStorage) and out[r][1].nccl_devcomm == 0


# --- the requirements through ep_nccl_gin's real create_dev_comm (its extension faked) ----------------------
def test_requirements_accepted_by_real_create_dev_comm(monkeypatch) -> None:
    """The keyword names and values of `gin_requirements` are what `Communicator.create_dev_comm` takes, and they
    land in the ncclDevCommRequirements fields (NCCL 2.30.3: RAIL/FULL, exclusive contexts, depth, class)."""
    pytest.importorskip("ep_nccl_gin")
    from ep_nccl_gin import communicator as comm_mod
    from ep_nccl_gin.errors import NcclVersionError
    from ep_nccl_gin.version import NcclVersion

    sent = []

    class _Req:
        pass

    class _Ext:
        DevCommRequest = _Req

        def dev_comm_create(self, ptr, req):
            sent.append(vars(req).copy())
            return b"\0" * 64

        def dev_comm_info(self, raw):
            return {"gin_context_count": 65, "lsa_size": 8, "lsa_rank": 3}

        def team_lsa(self, ptr):
            return (8, 3, 1)

    monkeypatch.setattr(comm_mod, "extension", lambda: _Ext())
    monkeypatch.delenv("EPKIT_DISABLE_GIN", raising=False)
    v = NcclVersion.parse("2.30.3")
    comm = comm_mod.Communicator.__new__(comm_mod.Communicator)
    comm._nccl, comm._ptr, comm._owned, comm._finalizer = (
        SimpleNamespace(runtime=v, header=v),
        0x1000,
        False,
        None,
    )
    reqs = gin_requirements(Topology(16, 8, False), num_allocated_qps=65, sl_idx=3, lsa_barrier_count=132)
    dev = comm.create_dev_comm(**reqs)
    assert dev.gin_available and dev.gin_contexts == 65
    (req,) = sent
    assert req["lsa_barrier_count"] == 132 and req["gin_context_count"] == 65
    assert req["gin_exclusive_contexts"] is True and req["gin_queue_depth"] == 1024
    assert req["gin_traffic_class"] == 3 and req["gin_signal_count"] == 0
    assert req["gin_connection_type"] == 1  # NCCL_GIN_CONNECTION_FULL (direct mode across nodes)
    comm.create_dev_comm(
        **gin_requirements(Topology(16, 8, True), num_allocated_qps=65, sl_idx=3, lsa_barrier_count=1)
    )
    assert sent[-1]["gin_connection_type"] == 2  # NCCL_GIN_CONNECTION_RAIL (hybrid mode)
    # an NCCL without the traffic class refuses it (a version gate, never silently dropped)
    old = NcclVersion.parse("2.29.7")
    comm._nccl = SimpleNamespace(runtime=old, header=old)
    with pytest.raises(NcclVersionError, match=r"2\.30\.3"):
        comm.create_dev_comm(**reqs)


def test_upload_failure_on_one_rank_fails_every_rank(fake, monkeypatch) -> None:
    def upload(raw):
        if _fakes._rank_of_thread() == 1:
            raise RuntimeError("cuMemAlloc: out of memory (test)")
        return _Copy(raw, fake.uploads)

    monkeypatch.setattr(nccl_transport, "_upload", upload)
    out = _setup(4)
    for r, e in enumerate(out):
        assert isinstance(e, EPConfigError), e
        assert "rank(s) [1]" in str(e) and "out of memory" in str(e)
        assert fake.calls(r).count("dev_comm_destroy") >= 1
    assert sum(1 for what, _ in fake.uploads if what == "free") == 3  # the copies that were made are freed
