"""CPU: the nccl transport's host side without a GPU.

- Errors when NCCL is absent (ep-nccl-gin not importable, or `EPKIT_NCCL_GIN_DISABLE=1`), too old, or an LSA team
  that is not a node of consecutive ranks; a rank that cannot load NCCL makes every rank raise (no hang).
- The setup and teardown sequence against a recording double of ep_nccl_gin (the real one needs a GPU for
  communicators): unique id from rank 0 to every rank through the bootstrap, `ncclCommInitRank` on the current
  device, `mem_alloc` of the ipc-sized storage, zeroing, `register_window`, `create_dev_comm(lsa_barrier_count)`;
  collective destroy in order (dev comm, window, memory, owned communicator), local release from a finalizer,
  borrowed communicators never destroyed.
- Kernel argument plumbing: `OpArgs::nccl_window` offset and size (compiled with the NCCL headers when present).
"""

from __future__ import annotations

import gc
import shutil
import threading
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import ep_layout
import pytest
from ep_core import EPBuffer, LocalBootstrap, ThreadGroup
from ep_core.buffer import resolve_transport
from ep_core.buffer_base import BufferBase
from ep_core.errors import EPConfigError
from ep_core.kernels._args import OP_ARGS_FIELDS, pack_op_args
from ep_core.transports import nccl as nccl_transport
from ep_core.transports.nccl import NcclStorage, NcclTransport

WS = ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
MIB2 = ep_layout.NUM_SYMMETRIC_ALIGN_BYTES


@dataclass(frozen=True, order=True)
class _V:
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


class _FakeNccl:
    """Records every call, per rank, the way ep_nccl_gin would make them."""

    class NcclGinError(RuntimeError):
        pass

    FEATURES: ClassVar[dict] = {
        "gin": SimpleNamespace(since=_V(2, 28, 7)),
        "gin_traffic_class": SimpleNamespace(since=_V(2, 30, 3)),
    }

    def __init__(self, runtime=_V(2, 28, 9), header=None, lsa_size=None, fail_rank=None) -> None:
        self.runtime, self.header = runtime, header or runtime
        self.lsa_size = lsa_size
        self.lsa_stride = 1
        self.gin_missing: dict[int, tuple[str, ...]] = {}  # rank -> what gin_support() reports missing
        self.strict_ordering = True
        self.gin_contexts_created = True
        self.fail_rank = fail_rank
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._next = 0x10000
        self.uids: list[bytes] = []
        fake = self

        class Communicator:
            def __init__(self, uid, nranks, rank, *, device=None):
                fake._rec(rank, "comm_init", bytes(uid), nranks, device)
                self.ptr, self.owned = fake._addr(), True
                self.rank, self.nranks, self.device = rank, nranks, device

            @classmethod
            def from_pointer(cls, ptr):
                self = cls.__new__(cls)
                self.ptr, self.owned = ptr, False
                self.rank, self.nranks, self.device = fake.borrowed
                fake._rec(self.rank, "comm_borrow", ptr)
                return self

            def lsa_team(self):
                n = fake.lsa_size or self.nranks
                return SimpleNamespace(nranks=n, rank=self.rank % n, stride=fake.lsa_stride if n > 1 else 1)

            def register_window(self, ptr, nbytes):
                fake._rec(self.rank, "register_window", ptr, nbytes)
                return _Window(fake, self.rank, fake._addr(), ptr, nbytes, fake.strict_ordering)

            def create_dev_comm(self, *, lsa_barrier_count, **gin):
                if gin:  # the GIN device communicator of several nodes
                    fake._rec(
                        self.rank, "create_dev_comm_gin", dict(gin, lsa_barrier_count=lsa_barrier_count)
                    )
                    return _DevComm(fake, self.rank, self.lsa_team(), gin=fake.gin_contexts_created)
                fake._rec(self.rank, "create_dev_comm", lsa_barrier_count)
                return _DevComm(fake, self.rank, self.lsa_team())

            def destroy(self):
                fake._rec(self.rank, "comm_destroy")

            def abort(self):
                fake._rec(self.rank, "comm_abort")

        self.Communicator = Communicator
        self.borrowed = (0, 1, 0)

    def _addr(self) -> int:
        with self._lock:
            self._next += 1 << 21
            return self._next

    def _rec(self, rank, *what) -> None:
        with self._lock:
            self.log.append((rank, *what))

    def calls(self, rank) -> list[str]:
        return [c[1] for c in self.log if c[0] == rank]

    def load(self):
        if self.fail_rank is not None and threading.current_thread().name == f"rank{self.fail_rank}":
            raise self.NcclGinError("libnccl.so.2 not found (test)")
        return SimpleNamespace(runtime=self.runtime, header=self.header)

    def include_dirs(self):
        return []

    def gin_support(self, *, hybrid=False):
        return SimpleNamespace(missing=self.gin_missing.get(_rank_of_thread(), ()))

    def get_unique_id(self) -> bytes:
        uid = bytes(range(128))
        self.uids.append(uid)
        return uid

    def mem_alloc(self, nbytes):
        ptr = self._addr()
        self._rec(_rank_of_thread(), "mem_alloc", nbytes, ptr)
        return ptr

    def mem_free(self, ptr):
        self._rec(_rank_of_thread(), "mem_free", ptr)


def _rank_of_thread() -> int:
    name = threading.current_thread().name
    return int(name[4:]) if name.startswith("rank") else 0


class _Window:
    def __init__(self, fake, rank, handle, ptr, nbytes, strict_ordering=True):
        self._fake, self._rank = fake, rank
        self.handle, self.ptr, self.nbytes = handle, ptr, nbytes
        self.strict_ordering = strict_ordering

    def deregister(self):
        self._fake._rec(self._rank, "window_deregister")


class _DevComm:
    def __init__(self, fake, rank, team, gin=False):
        self._fake, self._rank = fake, rank
        self.lsa_size, self.lsa_rank = team.nranks, team.rank
        self.gin_available = gin

    def as_bytes(self):
        return b"\1" * 20

    def context_bytes(self, window):
        return self.as_bytes() + b"\0" * 4 + window.handle.to_bytes(8, "little") + b"\0" * 16

    def destroy(self):
        self._fake._rec(self._rank, "dev_comm_destroy")


@pytest.fixture
def fake(monkeypatch):
    f = _FakeNccl()
    monkeypatch.setattr(nccl_transport, "_import_nccl_gin", lambda: f)
    monkeypatch.setattr(nccl_transport, "_current_device", lambda: _rank_of_thread())
    monkeypatch.setattr(nccl_transport, "_device_sms", lambda: 132)
    monkeypatch.setattr(nccl_transport, "_zero", lambda ptr, n: f._rec(_rank_of_thread(), "zero", ptr, n))
    return f


def _run_ranks(n: int, fn) -> list:
    """fn(bootstrap) in n threads named rank<r>; returns results or exceptions, by rank."""
    boots = ThreadGroup(n, timeout_secs=20).bootstraps()
    out: list = [None] * n

    def body(r: int) -> None:
        try:
            out[r] = fn(boots[r])
        except BaseException as exc:  # handed back to the test
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


# --- resolution and availability -----------------------------------------------------------------------------
def test_name_resolves_to_nccl_transport() -> None:
    tr = resolve_transport("nccl")
    assert isinstance(tr, NcclTransport) and tr.comm_ptr is None and tr.communicator is None


@pytest.mark.parametrize("bad", [0, -3, True, "0x10", 1.0])
def test_comm_ptr_validated(bad) -> None:
    with pytest.raises(EPConfigError, match="comm_ptr"):
        NcclTransport(comm_ptr=bad)
    with pytest.raises(EPConfigError, match="lsa_barrier_count"):
        NcclTransport(lsa_barrier_count=-1)


def test_disabled_nccl_raises_config_error(monkeypatch) -> None:
    pytest.importorskip("ep_nccl_gin")
    monkeypatch.setenv("EPKIT_NCCL_GIN_DISABLE", "1")
    with pytest.raises(EPConfigError, match="EPKIT_NCCL_GIN_DISABLE") as info:
        EPBuffer(LocalBootstrap(), transport="nccl", num_max_tokens_per_rank=16, hidden=256)
    assert "transport='ipc'" in str(info.value)


def test_missing_package_raises_config_error(monkeypatch) -> None:
    def missing():
        raise ImportError("No module named 'ep_nccl_gin'")

    monkeypatch.setattr(nccl_transport, "_import_nccl_gin", missing)
    with pytest.raises(EPConfigError, match=r"ep-core\[nccl\]"):
        EPBuffer(LocalBootstrap(), transport="nccl", num_max_tokens_per_rank=16, hidden=256)


@pytest.mark.parametrize(("runtime", "header"), [(_V(2, 28, 3), None), (_V(2, 28, 9), _V(2, 27, 7))])
def test_version_gate(fake, runtime, header) -> None:
    fake.runtime, fake.header = runtime, header or runtime
    with pytest.raises(EPConfigError, match=r"NCCL >= 2\.28\.7") as info:
        NcclTransport().allocate(LocalBootstrap(), WS + MIB2)
    assert str(header or runtime) in str(info.value)
    assert not any(c[1] == "comm_init" for c in fake.log)


def test_real_gate_table_is_2_28_7() -> None:
    eng = pytest.importorskip("ep_nccl_gin")
    assert eng.FEATURES["gin"].since.as_tuple() == nccl_transport.MIN_NCCL_VERSION


def test_one_rank_without_nccl_fails_every_rank(fake) -> None:
    fake.fail_rank = 1
    out = _run_ranks(2, lambda b: NcclTransport().allocate(b, WS + MIB2))
    assert all(isinstance(e, EPConfigError) for e in out), out
    assert "rank(s) [1]" in str(out[0]) and "not found" in str(out[0])
    assert "not found" in str(out[1])
    assert not any(c[1] == "comm_init" for c in fake.log)


# --- setup and teardown ------------------------------------------------------------------------------------
def test_setup_sequence_and_collective_destroy(fake) -> None:
    data = 3 * MIB2 + 5

    def body(b):
        tr = NcclTransport()
        assert tr.num_nvlink_ranks(b) == 2
        st = tr.allocate(b, WS + data)
        return tr, st

    out = _run_ranks(2, body)
    assert not any(isinstance(o, BaseException) for o in out), out
    total = WS + ep_layout.align(data, MIB2)
    assert len(fake.uids) == 1  # rank 0 made the id, everyone used it
    for r, (tr, st) in enumerate(out):
        calls = fake.calls(r)
        assert calls == ["comm_init", "mem_alloc", "zero", "register_window", "create_dev_comm"], calls
        init = next(c for c in fake.log if c[0] == r and c[1] == "comm_init")
        assert init[2:] == (fake.uids[0], 2, r)
        alloc = next(c for c in fake.log if c[0] == r and c[1] == "mem_alloc")
        assert alloc[2] == total and st.ptr == alloc[3] and st.num_bytes == total
        assert next(c for c in fake.log if c[0] == r and c[1] == "zero")[2:] == (st.ptr, total)
        assert next(c for c in fake.log if c[0] == r and c[1] == "register_window")[2:] == (st.ptr, total)
        assert next(c for c in fake.log if c[0] == r and c[1] == "create_dev_comm")[2] == 132
        assert isinstance(st, NcclStorage) and st.nccl_window == st.window.handle != 0
        assert st.peer_table == 0 and st.device == r and (st.lsa_size, st.lsa_rank) == (2, r)
        assert st.context_bytes()[24:32] == st.nccl_window.to_bytes(8, "little")
        assert tr.communicator.owned

    fake.log.clear()
    _run_ranks(2, lambda b: out[b.rank][1].close())
    for r, (tr, st) in enumerate(out):
        assert fake.calls(r) == ["dev_comm_destroy", "window_deregister", "mem_free", "comm_destroy"]
        assert st.closed and tr.communicator is None
        with pytest.raises(EPConfigError, match="after close"):
            st.context_bytes()
        st.close()  # idempotent
    assert len(fake.log) == 8


def test_two_buffers_share_the_communicator(fake) -> None:
    tr = NcclTransport(lsa_barrier_count=7)
    b = LocalBootstrap()
    s1, s2 = tr.allocate(b, WS + MIB2), tr.allocate(b, WS + 2 * MIB2)
    assert fake.calls(0).count("comm_init") == 1
    assert [c[2] for c in fake.log if c[1] == "create_dev_comm"] == [7, 7]
    s1.close()
    assert "comm_destroy" not in fake.calls(0) and tr.communicator is not None
    s2.close()
    assert fake.calls(0)[-1] == "comm_destroy" and tr.communicator is None


def test_lsa_domain_smaller_than_world_is_a_node(fake) -> None:
    """Several nodes: allocate gives each rank its node's LSA team (GIN is set up by create_executor)."""
    fake.lsa_size = 2
    out = _run_ranks(4, lambda b: NcclTransport().allocate(b, WS + MIB2))
    for r, st in enumerate(out):
        assert isinstance(st, NcclStorage), st
        assert (st.lsa_size, st.lsa_rank, st.nccl_devcomm) == (2, r % 2, 0)
        st.release_local()


def test_lsa_team_not_consecutive_ranks_is_refused(fake) -> None:
    fake.lsa_size, fake.lsa_stride = 2, 2  # nodes {0, 2} and {1, 3}: not ranks r // S_u
    out = _run_ranks(4, lambda b: NcclTransport().allocate(b, WS + MIB2))
    for r, e in enumerate(out):
        assert isinstance(e, EPConfigError), e
        assert "LSA team" in str(e) and "stride 2" in str(e) and "consecutive" in str(e)
        assert fake.calls(r) == ["comm_init", "comm_abort"]  # local cleanup, nothing allocated


def test_borrowed_communicator(fake) -> None:
    fake.borrowed = (1, 2, 0)  # rank 1 of 2 on device 0
    with pytest.raises(EPConfigError, match="comm_ptr"):
        NcclTransport(comm_ptr=0xABC).allocate(LocalBootstrap(), WS + MIB2)
    fake.borrowed = (0, 1, 3)
    with pytest.raises(EPConfigError, match="device 3"):
        NcclTransport(comm_ptr=0xABC).allocate(LocalBootstrap(), WS + MIB2)
    fake.borrowed = (0, 1, 0)
    fake.log.clear()
    tr = NcclTransport(comm_ptr=0xABC)
    st = tr.allocate(LocalBootstrap(), WS + MIB2)
    assert not tr.communicator.owned and not fake.uids  # no unique id for a borrowed communicator
    st.close()
    assert fake.calls(0) == [
        "comm_borrow",
        "mem_alloc",
        "zero",
        "register_window",
        "create_dev_comm",
        "dev_comm_destroy",
        "window_deregister",
        "mem_free",
    ]


def _buffer_over(storage) -> BufferBase:
    """A buffer whose garbage collection releases the storage (BufferBase.__del__ -> release_local)."""
    return BufferBase(LocalBootstrap(), storage, num_workspace_bytes=WS)


def test_release_from_finalizer_is_local(fake) -> None:
    tr = NcclTransport()
    st = tr.allocate(LocalBootstrap(), WS + MIB2)
    fake.log.clear()
    h = _buffer_over(st)
    del h
    gc.collect()
    assert fake.calls(0) == ["comm_abort", "mem_free"] and st.closed and tr.communicator is None


def test_release_from_finalizer_with_borrowed_comm_leaks_with_warning(fake) -> None:
    tr = NcclTransport(comm_ptr=0x1234)
    st = tr.allocate(LocalBootstrap(), WS + MIB2)
    fake.log.clear()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        h = _buffer_over(st)
        del h
        gc.collect()
    assert fake.calls(0) == [] and st.closed
    assert any(issubclass(w.category, ResourceWarning) and "destroy()" in str(w.message) for w in got)


def test_failed_setup_releases_locally(fake, monkeypatch) -> None:
    def boom(ptr, n):
        raise RuntimeError("memset failed (test)")

    monkeypatch.setattr(nccl_transport, "_zero", boom)
    with pytest.raises(RuntimeError, match="memset"):
        NcclTransport().allocate(LocalBootstrap(), WS + MIB2)
    assert fake.calls(0) == ["comm_init", "mem_alloc", "mem_free"]


# --- kernel argument plumbing --------------------------------------------------------------------------------
def test_op_args_nccl_window_slot() -> None:
    assert OP_ARGS_FIELDS.index("nccl_window") == 5 and len(OP_ARGS_FIELDS) == 44
    raw = pack_op_args(nccl_window=0xDEADBEEF000, own_base=0x7000_0000_0000, peer_bases=0)
    assert len(raw) == 44 * 8
    assert int.from_bytes(raw[40:48], "little") == 0xDEADBEEF000
    assert int.from_bytes(raw[32:40], "little") == 0x7000_0000_0000
    assert raw[24:32] == b"\0" * 8


PLUMBING = r"""
#include <cstddef>
#include <ep_core/kernels.cuh>
static_assert(sizeof(ep_core::OpArgs) == 44 * 8, "OpArgs size");
static_assert(offsetof(ep_core::OpArgs, own_base) == 32, "own_base offset");
static_assert(offsetof(ep_core::OpArgs, nccl_window) == 40, "nccl_window offset");
static_assert(sizeof(ncclWindow_t) == 8, "ncclWindow_t is one pointer");
extern "C" __global__ void probe(const __grid_constant__ ep_core::OpArgs args, unsigned long long* out) {
    ep_core::NcclTransport t(args);
    out[0] = reinterpret_cast<unsigned long long>(t.sym_ptr(static_cast<unsigned char*>(args.workspace), 0));
}
"""


def test_nccl_transport_struct_compiles(tmp_path, monkeypatch) -> None:
    ep_jit = pytest.importorskip("ep_jit")
    eng = pytest.importorskip("ep_nccl_gin")
    if shutil.which("nvcc") is None and not shutil.os.path.exists("/usr/local/cuda/bin/nvcc"):
        pytest.skip("nvcc not found")
    try:
        dirs = eng.include_dirs(check=False)
    except Exception as exc:
        pytest.skip(f"no NCCL device headers: {exc}")
    from ep_core.kernels._source import get_include

    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = ep_jit.compile(
        "#define EP_CORE_WITH_NCCL 1\n" + PLUMBING,
        name="ep_core_nccl_plumbing",
        include_dirs=[get_include(), ep_layout.get_include(), *dirs],
        arch="sm_90a",
        flags=("-std=c++17",),
    )
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"


def test_lsa_peer_bases_kernel_compiles(tmp_path, monkeypatch) -> None:
    """The one-block kernel behind `NcclStorage.peer_bases` (V1 low-latency mode's own kernels over nccl) compiles
    with NCCL's device headers."""
    ep_jit = pytest.importorskip("ep_jit")
    eng = pytest.importorskip("ep_nccl_gin")
    if shutil.which("nvcc") is None and not shutil.os.path.exists("/usr/local/cuda/bin/nvcc"):
        pytest.skip("nvcc not found")
    try:
        eng.include_dirs(check=False)
    except Exception as exc:
        pytest.skip(f"no NCCL device headers: {exc}")
    from ep_core.transports.nccl_peer_bases import compile_lsa_bases

    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    assert compile_lsa_bases("sm_90a").cubin_path.read_bytes()[:4] == b"\x7fELF"


def test_peer_bases_only_where_the_lsa_team_is_the_group() -> None:
    st = NcclStorage.__new__(NcclStorage)
    st.lsa_size, st._peer_bases, st.closed = 4, None, False
    with pytest.raises(EPConfigError, match="LSA team has 4 of the 8 ranks"):
        st.peer_bases(8)
    st._peer_bases = [1, 2, 3, 4]  # read once, then kept
    assert st.peer_bases(4) == [1, 2, 3, 4]
