"""CPU: the failure rule of the direct-mode runtime (sticky errors published through host-mapped words, collective
reset), ranks per GPU (default SM counts, cooperative launches, occupancy) and the ipc transport's peer checks.

The CUDA driver is replaced by small fakes (mapped words, streams, kernels); what the kernels do on the device is
checked by the GPU tests (ep-core/tests/gpu/test_gpu_failure.py) and their source contract here."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import ep_core as ec
import ep_layout
import numpy as np
import pytest
from ep_core import planner
from ep_core.errors import EPConfigError, EPDeviceError, EPStateError, EPTimeoutError
from ep_core.kernels import _cuda
from ep_core.kernels import gpu_executor as gpu_executor_mod
from ep_core.kernels import rank_driver as rank_driver_mod
from ep_core.kernels._args import OP_ARGS_FIELDS
from ep_core.kernels._envelope import OP_COMBINE, OP_DISPATCH, describe_envelope, pack_envelope
from ep_core.kernels.plan import SCRATCH_INPUT_ERROR_OFFSET, LaunchGeometry, check_occupancy, default_num_sms
from ep_core.kernels.rank_driver import RankDriver, RankResources, count_ranks_on_device
from ep_core.topology import Topology
from ep_core.transports import ipc

INCLUDE = Path(__file__).resolve().parents[1] / "include" / "ep_core"
_EK = ep_layout.ErrorKind
_FIELD = {f.name: f for f in ep_layout.ERROR_RECORD_FIELDS}


# --------------------------------------------------------------------------------------------------- fakes
class FakeWords:
    def __init__(self, count: int) -> None:
        self.array = np.zeros(count, np.int32)
        self.device_ptr = 0x7F00_0000_0000

    def read(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.array)

    def clear(self) -> None:
        self.array[:] = 0


class FakeStream:
    def __init__(self, log: list, name: str = "s") -> None:
        self.log = log
        self.name = name
        self.handle = 0x5000

    def synchronize(self, timeout: float | None = None) -> bool:
        self.log.append(f"sync:{self.name}")
        return True


class FakeKernel:
    def __init__(self, name: str, log: list, blocks_per_sm: int = 1) -> None:
        self.name = name
        self.log = log
        self.blocks_per_sm = blocks_per_sm

    def max_active_blocks_per_sm(self, block: int, shared_mem: int = 0) -> int:
        return self.blocks_per_sm

    def launch(self, grid, block, args, shared_mem=0, stream=0, cooperative=False):
        self.log.append((self.name, grid, cooperative))


@pytest.fixture
def fake_driver(monkeypatch):
    """RankDriver without a GPU: 132 SMs, 1.98 GHz, fake pinned/mapped memory, memsets logged."""
    log: list = []
    monkeypatch.setattr(_cuda, "num_device_sms", lambda: 132)
    monkeypatch.setattr(_cuda, "device_attribute", lambda name: 1_980_000)
    monkeypatch.setattr(_cuda, "MappedWords", FakeWords)
    monkeypatch.setattr(
        rank_driver_mod, "PinnedBuffer", lambda n: SimpleNamespace(array=np.zeros(n, np.uint8))
    )
    monkeypatch.setattr(_cuda, "memset", lambda ptr, n, stream=0: log.append(("memset", ptr, n)))
    monkeypatch.setattr(_cuda, "synchronize_context", lambda: log.append("context drained"))
    return log


def make_rank(log: list, *, num_ranks: int = 2, rank: int = 0, on_device: int = 0, **kw) -> RankDriver:
    res = RankResources(
        rank,
        num_ranks,
        0x1000_0000,
        1 << 30,
        0x2000,
        FakeStream(log, f"r{rank}"),
        num_ranks_on_device=on_device,
    )
    return RankDriver(res, num_max_tokens_per_rank=64, **kw)


def record(kind: int, *, rank: int = 1, tag: int = 3, counter: int = 99, value: int = 0) -> np.ndarray:
    rec = np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8)
    for name, v in (
        ("abort_flag", kind),
        ("rank", rank),
        ("tag", tag),
        ("counter", counter),
        ("value", value),
    ):
        f = _FIELD[name]
        dt = np.int32 if f.dtype == "int32" else np.int64
        rec[f.offset : f.offset + np.dtype(dt).itemsize] = np.array([v], dt).view(np.uint8)
    return rec


def set_device_error(rank: RankDriver, rec: np.ndarray, inp: np.ndarray | None = None) -> None:
    state = {"rec": rec, "inp": np.zeros(4, np.int64) if inp is None else inp}
    rank.read_error = lambda: (state["rec"].copy(), state["inp"].copy())
    rank._fake_state = state


# ------------------------------------------------------------------------------------- kernel-side contract
def test_op_args_mirror_follows_args_cuh() -> None:
    text = (INCLUDE / "args.cuh").read_text()
    body = text[text.index("struct OpArgs {") : text.index("};", text.index("struct OpArgs {"))]
    names = re.findall(r"^\s+[\w:<>\s\*]+?[\s\*](\w+);", body, re.M)
    assert tuple(names) == OP_ARGS_FIELDS
    m = re.search(r"static_assert\(sizeof\(OpArgs\) == (\d+) \* 8", text)
    assert m is not None and int(m.group(1)) == len(OP_ARGS_FIELDS)
    assert OP_ARGS_FIELDS[-3:] == ("host_error", "envelope", "topk_idx_copy")


@pytest.mark.parametrize(
    ("header", "impl"),
    [
        ("dispatch.cuh", "dispatch_impl"),
        ("dispatch_epilogue.cuh", "dispatch_epilogue_impl"),
        ("combine.cuh", "combine_impl"),
    ],
)
def test_every_kernel_guards_its_entry(header: str, impl: str) -> None:
    """Each kernel reads the abort flag (entry_aborted) and leaves before its first output, peer write or wait."""
    text = (INCLUDE / header).read_text()
    body = text[text.index(f"void {impl}(") :]
    guard = body.index("entry_aborted(args")
    leave = body.index("if (s_abort != 0)\n        return;", guard)
    for first_work in ("args.psum_rank[", "cross_rank_barrier(", "sym_ptr(", "bulk_store(", "atomicAdd("):
        at = body.find(first_work)
        assert at == -1 or at > leave, f"{impl}: {first_work} before the entry guard"


def test_failed_waits_publish_to_the_host() -> None:
    text = (INCLUDE / "timeout.cuh").read_text()
    wait = text[text.index("EP_CORE_DEVICE bool wait_until(") :]
    returns = [m.start() for m in re.finditer(r"return false;", wait)]
    assert len(returns) == 2
    for at in returns:
        assert "publish_failure(args, ws);" in wait[max(0, at - 120) : at]
    dispatch = (INCLUDE / "dispatch.cuh").read_text()
    report = dispatch[dispatch.index("void report_input_error(") : dispatch.index("template <int kNumTopk>")]
    assert "args.host_error + 1" in report


# ---------------------------------------------------------------------------------------- sticky host state
def test_timeout_is_sticky_until_reset(fake_driver) -> None:
    log = fake_driver
    r = make_rank(log)
    r.guard()  # nothing published
    set_device_error(r, record(int(_EK.TIMEOUT), rank=1, tag=3, counter=7, value=0))
    r._status.array[0] = int(_EK.TIMEOUT)
    for _ in range(3):  # every call raises, nothing launches
        with pytest.raises(EPTimeoutError, match="until the domain is reset") as info:
            r.launch_dispatch(None)
        assert info.value.tag == "dispatch.counts"
        with pytest.raises(EPTimeoutError):
            r.combine(None, None)
    assert not any(isinstance(e, tuple) and e[0] in ("ep_dispatch_impl", "ep_combine_impl") for e in log)
    barriers: list = []
    r.reset_state(lambda: (log.append("barrier"), barriers.append(1)))
    r._fake_state["rec"] = np.zeros_like(r._fake_state["rec"])
    assert r.status() == (0, 0)
    r.guard()


def test_peer_abort_is_published_and_raised(fake_driver) -> None:
    r = make_rank(fake_driver)
    set_device_error(r, record(int(_EK.PEER_ABORT)))
    r._status.array[0] = int(_EK.PEER_ABORT)
    with pytest.raises(EPTimeoutError, match="peer rank failed"):
        r.guard()


def test_published_abort_without_record_still_refuses(fake_driver) -> None:
    r = make_rank(fake_driver)
    set_device_error(r, np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8))
    r._status.array[0] = 5  # a kind the host does not decode
    with pytest.raises(EPDeviceError, match="kind 5"):
        r.guard()


def test_invalid_input_word_raises_once_after_the_launch(fake_driver) -> None:
    r = make_rank(fake_driver)
    inp = np.array([int(_EK.INVALID_EXPERT), 12, 3, 999], np.int64)
    set_device_error(r, np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8), inp)
    r._report_input_error()  # a call that started before the report: not this call's to raise
    r._status.array[1] = int(_EK.INVALID_EXPERT)
    r._report_input_error()  # published while the call ran (after its guard): the next call raises it
    r.guard()  # an input report never stops a launch: the peers would wait for this rank's kernel
    with pytest.raises(EPDeviceError, match=r"token 12, lane 3, value 999") as info:
        r._report_input_error()
    assert info.value.code == int(_EK.INVALID_EXPERT)
    assert r.status() == (0, 0)
    assert any(isinstance(e, tuple) and e[0] == "memset" for e in fake_driver)  # device report cleared
    r._fake_state["inp"] = np.zeros(4, np.int64)
    r.guard()
    r._report_input_error()
    # a report left in an earlier configuration's scratch (not the current one): still raised, generically
    r._status.array[1] = int(_EK.DUPLICATE_EXPERT)
    r.guard()
    with pytest.raises(EPDeviceError, match="duplicate expert"):
        r._report_input_error()
    r.guard()
    r._report_input_error()


def test_clear_input_error_clears_every_scratch_used(fake_driver) -> None:
    r = make_rank(fake_driver)
    r._scratches.update({0x5000_0000, 0x6000_0000})
    fake_driver.clear()
    r.clear_input_error()
    cleared = {
        e[1] - SCRATCH_INPUT_ERROR_OFFSET for e in fake_driver if isinstance(e, tuple) and e[0] == "memset"
    }
    assert {0x5000_0000, 0x6000_0000, r._any_scratch()} <= cleared


def test_reset_refuses_handles_in_flight_even_if_the_host_never_saw_the_error(fake_driver) -> None:
    r = make_rank(fake_driver)
    h = _Handle()
    r._unconfirmed.add(h)
    r.reset_state(lambda: None)
    with pytest.raises(EPStateError, match="no-sync dispatch that was running"):
        r._check_handle(h)


class _Handle:
    """Stands for an EPHandle (identity-hashed, weak-referenceable)."""


def test_handles_of_failed_nosync_dispatches_are_refused(fake_driver) -> None:
    r = make_rank(fake_driver)
    set_device_error(r, np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8))
    confirmed, pending = _Handle(), _Handle()
    r._unconfirmed.add(confirmed)
    r.check_errors(synchronize=True)  # drained and clean: confirmed
    r._unconfirmed.add(pending)
    r._fake_state["rec"] = record(int(_EK.TIMEOUT))
    r._status.array[0] = int(_EK.TIMEOUT)
    with pytest.raises(EPTimeoutError):
        r.guard()
    r.reset_state()
    r._fake_state["rec"] = np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8)
    r._check_handle(confirmed)
    r._check_handle(None)
    for call in (lambda: r._check_handle(pending), lambda: r.combine(None, pending)):
        with pytest.raises(EPStateError, match="dispatch again"):
            call()


def test_reset_state_is_ordered_by_barriers(fake_driver) -> None:
    log = fake_driver
    r = make_rank(log)
    r.res.scratch_buffers[4096] = SimpleNamespace(ptr=0x9000, nbytes=4096)
    r._status.array[:] = [1, 3]
    log.clear()
    r.reset_state(lambda: log.append("barrier"))
    ws = ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
    assert log == [
        "sync:r0",
        "barrier",
        ("memset", 0x1000_0000, ws),
        ("memset", 0x9000, 4096),
        "sync:r0",
        "barrier",
    ]
    assert r.status() == (0, 0)


def test_gpu_executor_reset_is_collective(fake_driver, monkeypatch) -> None:
    """Two executors in two threads: neither zeroes before both drained, neither returns before both zeroed."""
    log = fake_driver
    lock = threading.Lock()
    monkeypatch.setattr(_cuda, "device_identity", lambda: "host/gpu-uuid-" + threading.current_thread().name)
    monkeypatch.setattr(gpu_executor_mod, "Stream", lambda high_priority=False: FakeStream(log))
    executors: list = [None, None]

    def body(r: int, boot) -> None:
        config = SimpleNamespace(
            rank=r,
            num_ranks=2,
            num_workspace_bytes=ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES,
            num_cpu_bytes=0,
            num_max_tokens_per_rank=64,
            num_gpu_timeout_secs=1.0,
            num_cpu_timeout_secs=1.0,
            prefer_overlap_with_compute=True,
        )
        storage = SimpleNamespace(ptr=0x1000_0000 * (r + 1), num_bytes=1 << 30, peer_table=0x2000, device=r)
        ex = gpu_executor_mod.GpuExecutor(config, storage, boot)
        ex.rank._status.array[0] = 1
        executors[r] = ex
        orig = boot.barrier

        def barrier() -> None:
            with lock:
                log.append(("enter", r))
            orig()
            with lock:
                log.append(("exit", r))

        ex.bootstrap = SimpleNamespace(barrier=barrier)
        ex.reset()

    ec.ThreadGroup(2, timeout_secs=30).run(body)
    events = [e[0] for e in log if isinstance(e, tuple) and e[0] in ("enter", "exit", "memset")]
    assert events.count("enter") == 4 and events.count("exit") == 4 and events.count("memset") == 2
    enters = [i for i, e in enumerate(events) if e == "enter"]
    exits = [i for i, e in enumerate(events) if e == "exit"]
    memsets = [i for i, e in enumerate(events) if e == "memset"]
    # no rank zeroes before both ranks have drained and reached the first barrier; no rank leaves the second
    # barrier before both ranks have zeroed
    assert enters[1] < min(memsets)
    assert max(memsets) < exits[2]
    for ex in executors:
        assert ex.num_ranks_on_device == 1 and ex.num_device_sms == 132 and ex.rank.cooperative
        assert ex.rank.status() == (0, 0)


class _FakeLoopRank:
    def __init__(self, r: int, log: list, fail: bool) -> None:
        self.r, self.log, self.fail = r, log, fail

    def guard(self) -> None:
        if self.fail:
            raise EPTimeoutError(self.r, "peer_abort", "abort_flag", 2)

    def _check_handle(self, handle) -> None:
        return None

    def launch_dispatch(self, *a, **k):
        self.log.append(("launch", self.r))

    def combine(self, *a, **k):
        self.log.append(("combine", self.r))


def test_loopback_checks_every_rank_before_launching_any() -> None:
    from ep_core.loopback import LoopbackDomain

    log: list = []
    dom = LoopbackDomain.__new__(LoopbackDomain)
    dom.num_ranks = 3
    dom._closed = False
    dom.ranks = [_FakeLoopRank(0, log, False), _FakeLoopRank(1, log, False), _FakeLoopRank(2, log, True)]
    dom.streams = [None] * 3
    with pytest.raises(EPTimeoutError):
        dom.dispatch([None] * 3, [None] * 3, num_experts=6)
    with pytest.raises(EPTimeoutError):
        dom.combine([None] * 3, [None] * 3)
    assert log == []


def test_loopback_reset_drains_all_before_zeroing_any(fake_driver) -> None:
    from ep_core.loopback import LoopbackDomain

    log = fake_driver
    dom = LoopbackDomain.__new__(LoopbackDomain)
    dom.ranks = [make_rank(log, num_ranks=2, rank=r, on_device=2) for r in range(2)]
    dom.streams = [rk.stream for rk in dom.ranks]
    for rk in dom.ranks:
        rk._status.array[0] = 2
    log.clear()
    dom.reset()
    ws = ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
    assert log == [
        "sync:r0",
        "sync:r1",
        ("memset", 0x1000_0000, ws),
        ("memset", 0x1000_0000, ws),
        "sync:r0",
        "sync:r1",
    ]
    assert all(rk.status() == (0, 0) for rk in dom.ranks)


# ------------------------------------------------------------------------------------------ ranks per GPU
def test_default_num_sms() -> None:
    assert default_num_sms(132, 8) == 16  # eight ranks share one GPU: 8 x 16 <= 132
    assert default_num_sms(132, 12) == 11
    assert default_num_sms(132, 200) == 1
    assert default_num_sms(132, 1, planner_sms=24) == 24  # alone on its GPU: the planner's count
    assert default_num_sms(132, 1, planner_sms=500) == 132
    assert default_num_sms(132, 1) == 16  # planner could not run
    with pytest.raises(EPConfigError):
        default_num_sms(132, 0)


def test_count_ranks_on_device() -> None:
    ids = ["a/0", "a/0", "a/1", "b/0"]
    assert [count_ranks_on_device(ids, r) for r in range(4)] == [2, 2, 1, 1]


def test_rank_alone_on_its_gpu_uses_the_planner(fake_driver, monkeypatch) -> None:
    """64 ranks on 64 GPUs: the old default split one device between all ranks (132 // 64 = 2 SMs)."""
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "430.3")
    r = make_rank(fake_driver, num_ranks=64, on_device=1)
    want = planner.get_theoretical_num_sms(Topology(64), 256, 8, num_device_sms=132)
    assert want > 2
    assert r._num_sms(0, None, 256, 8) == want
    assert r.cooperative
    shared = make_rank(fake_driver, num_ranks=8, on_device=8)
    assert shared._num_sms(0, None, 256, 8) == 16 and not shared.cooperative
    with pytest.raises(EPConfigError, match="co-resident"):
        shared._num_sms(17, None, 256, 8)
    unknown = make_rank(fake_driver, num_ranks=4)  # not told: every rank assumed on this GPU
    assert unknown.num_ranks_on_device == 4 and unknown._num_sms(0, None, 64, 8) == 16


def test_planner_failure_falls_back(fake_driver, monkeypatch) -> None:
    def boom(*a, **k):
        raise EPConfigError("nvlink_gbs: could not detect")

    monkeypatch.setattr(planner, "get_theoretical_num_sms", boom)
    r = make_rank(fake_driver, num_ranks=8, on_device=1)
    assert r._num_sms(0, None, 256, 8) == 16


def test_cooperative_only_alone_on_a_gpu(fake_driver) -> None:
    with pytest.raises(EPConfigError, match="share this GPU"):
        make_rank(fake_driver, num_ranks=4, on_device=2, cooperative=True)
    assert not make_rank(fake_driver, num_ranks=4, on_device=1, cooperative=False).cooperative
    with pytest.raises(EPConfigError, match="num_ranks_on_device"):
        make_rank(fake_driver, num_ranks=2, on_device=3)


@pytest.mark.parametrize(("on_device", "cooperative"), [(1, True), (2, False)])
def test_launch_mode_and_occupancy(fake_driver, on_device: int, cooperative: bool) -> None:
    log = fake_driver
    r = make_rank(log, num_ranks=2, on_device=on_device)
    geo = LaunchGeometry(16, 512, 100_000)
    r._launch(
        FakeKernel("ep_dispatch_impl", log),
        "ep_dispatch_impl",
        geo,
        {"rank": 0},
        geo.shared_mem,
        r.cooperative,
    )
    r._launch(
        FakeKernel("ep_dispatch_copy_epilogue_impl", log),
        "ep_dispatch_copy_epilogue_impl",
        geo,
        {},
        geo.shared_mem,
        False,
    )
    assert [e for e in log if isinstance(e, tuple) and e[0].startswith("ep_")] == [
        ("ep_dispatch_impl", 16, cooperative),
        ("ep_dispatch_copy_epilogue_impl", 16, False),
    ]
    with pytest.raises(EPConfigError, match="does not fit on one SM"):
        r._launch(
            FakeKernel("ep_combine_impl", log, blocks_per_sm=0), "ep_combine_impl", geo, {}, 0, r.cooperative
        )
    assert ("ep_combine_impl", 16, cooperative) not in log


def test_check_occupancy() -> None:
    check_occupancy("k", 1, 132, 132, 1, threads=512, shared_mem=0)
    check_occupancy("k", 2, 33, 132, 8, threads=512, shared_mem=0)
    with pytest.raises(EPConfigError, match=r"use num_sms <= 16"):
        check_occupancy("ep_dispatch_impl", 1, 17, 132, 8, threads=512, shared_mem=200_000)
    with pytest.raises(EPConfigError, match="does not fit on one SM"):
        check_occupancy("ep_dispatch_impl", 0, 1, 132, 1, threads=1024, shared_mem=300_000)


# -------------------------------------------------------------------------------------- ipc peer checks
VISIBLE = {"u0": 0, "u1": 1, "u2": 2}


def p2p_table(table: dict):
    return lambda src, dst: table[(src, dst)]


def test_same_gpu_needs_nothing() -> None:
    def never(src, dst):
        raise AssertionError("no P2P query for ranks on one GPU")

    assert ipc.peer_access_problems(["h/u0"] * 4, 2, VISIBLE, never) == []


def test_pcie_peer_without_atomics_is_refused() -> None:
    ids = ["h/u0", "h/u0", "h/u1", "h/u2"]
    table = {(0, 1): (True, True), (0, 2): (True, False)}
    problems = ipc.peer_access_problems(ids, 0, VISIBLE, p2p_table(table))
    assert len(problems) == 1
    assert "GPU 0 (rank 0) -> GPU 2 (rank 3)" in problems[0] and "native peer atomics" in problems[0]
    table[(0, 2)] = (False, False)
    problems = ipc.peer_access_problems(ids, 0, VISIBLE, p2p_table(table))
    assert "GPU 0 (rank 0) cannot access GPU 2 (rank 3)" in problems[0]


def test_other_host_and_invisible_gpu_are_refused() -> None:
    problems = ipc.peer_access_problems(["h/u0", "g/u1", "h/u9"], 0, VISIBLE, p2p_table({}))
    assert "runs on host 'g'" in problems[0]
    assert "uuid u9" in problems[1] and "not visible" in problems[1]


def test_check_peer_access_raises_on_every_rank() -> None:
    """Only rank 1's row fails; both ranks raise the same error (nobody goes on to wait for the other)."""
    ids = ["h/u0", "h/u1"]
    table = {(0, 1): (True, True), (1, 0): (True, False)}

    def body(r, boot):
        ipc.check_peer_access(boot, ids, visible={"u0": 0, "u1": 1}, p2p=p2p_table(table))
        return "ok"

    out = ec.ThreadGroup(2, timeout_secs=30).run(body, raise_first=False)
    assert all(isinstance(x, EPConfigError) for x in out), out
    results = [str(x) for x in out]
    assert results[0] == results[1]
    assert "GPU 1 (rank 1) -> GPU 0 (rank 0)" in results[0]
    ok = ec.ThreadGroup(1).bootstraps()[0]
    ipc.check_peer_access(ok, ["h/u0"], visible={}, p2p=p2p_table({}))


# ------------------------------------------------------------------------------------------ compile check
def test_large_domain_compiles(tmp_path, monkeypatch) -> None:
    """More ranks than the per-block peer table holds (transport.cuh kMaxCachedPeers): the sym_ptr-per-use branch."""
    import os
    import shutil

    ep_jit = pytest.importorskip("ep_jit")
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if shutil.which("nvcc") is None and not os.path.exists(os.path.join(home, "bin", "nvcc")):
        pytest.skip("nvcc not found")
    from ep_core.kernels import KernelConfig
    from ep_core.kernels._source import compile_kernels

    text = (INCLUDE / "transport.cuh").read_text()
    cached = int(re.search(r"kMaxCachedPeers = (\d+);", text).group(1))
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = compile_kernels(KernelConfig(2 * cached, 8, 1024), arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("memory", ["cuda_ipc", "symmem"])
def test_exchange_refuses_before_allocating(monkeypatch, memory: str) -> None:
    """IpcBuffer.create_exchanged checks the device pairs first: a PCIe pair fails before any allocation."""
    monkeypatch.setattr(_cuda, "device_identity", lambda: "h/u0")
    monkeypatch.setattr(_cuda, "visible_devices", lambda: {"u0": 0, "u1": 1})
    monkeypatch.setattr(_cuda, "p2p_support", lambda src, dst: (True, False))

    def no_alloc(*a, **k):
        raise AssertionError("allocated before the peer check")

    monkeypatch.setattr(_cuda, "DeviceBuffer", no_alloc)
    monkeypatch.setattr(_cuda, "driver", no_alloc)

    class Boot:
        rank, size = 0, 2

        def allgather(self, data: bytes) -> list[bytes]:
            return [data, b"h/u1" if data == b"h/u0" else data]

        def barrier(self) -> None:
            return None

    with pytest.raises(
        EPConfigError, match=r"GPU 0 \(rank 0\) -> GPU 1 \(rank 1\) has no native peer atomics"
    ):
        ipc.IpcBuffer.create_exchanged(Boot(), 1 << 21, memory)


# ------------------------------------------------------------------ operation envelope (kernels/_envelope.py)
def test_envelope_word_layout() -> None:
    w = pack_envelope(OP_DISPATCH, 7, (7168, 0, 8, 256, 4096, 1, 0, -1))
    assert w >> 56 == OP_DISPATCH and (w >> 32) & 0xFFFFFF == 7 and w != 0
    assert (
        pack_envelope(OP_DISPATCH, 7, (7168, 0, 8, 256, 4096, 1, 0, -1)) == w
    )  # deterministic across processes
    assert pack_envelope(OP_DISPATCH, 7, (7168, 0, 8, 128, 4096, 1, 0, -1)) != w  # num_experts differs
    assert pack_envelope(OP_COMBINE, 7, (7168, 0, 8, 256, 4096, 1, 0, -1)) != w
    assert pack_envelope(OP_DISPATCH, 8, (7168, 0, 8, 256, 4096, 1, 0, -1)) != w
    assert (
        pack_envelope(OP_DISPATCH, (1 << 24) + 7, (7168, 0, 8, 256, 4096, 1, 0, -1)) == w
    )  # 24-bit sequence
    assert describe_envelope(w).startswith("dispatch #7 (config digest ")
    assert describe_envelope(pack_envelope(OP_COMBINE, 3, ())).startswith("combine #3")


def test_barrier_checks_envelopes_at_both_entries() -> None:
    barrier = (INCLUDE / "barrier.cuh").read_text()
    assert "ErrorKind::kEnvelopeMismatch" in barrier
    for header, tag in (("dispatch.cuh", "kTagDispatchEntry"), ("combine.cuh", "kTagCombineEntry")):
        assert f"cross_rank_barrier({tag}, true)" in (INCLUDE / header).read_text()
    # the workspace view keeps the envelopes inside the barrier-signal region (the assert in args.cuh says so too)
    assert re.search(r"kEnvelopesOffset = 4096;", (INCLUDE / "args.cuh").read_text())
    assert 4096 + 8 * ep_layout.NUM_MAX_RANKS <= ep_layout.WorkspaceLayout.BARRIER_SIGNALS_NUM_ELEMS * 4


def _record(**fields: int) -> np.ndarray:
    rec = np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8)
    for name, v in fields.items():
        f = _FIELD[name]
        dt = np.int32 if f.dtype == "int32" else np.int64
        rec[f.offset : f.offset + np.dtype(dt).itemsize] = np.array([v], dt).view(np.uint8)
    return rec


def test_mismatch_is_raised_naming_the_peer_and_both_operations(fake_driver) -> None:
    r = make_rank(fake_driver)
    mine = pack_envelope(OP_DISPATCH, 4, (1,))
    theirs = pack_envelope(OP_COMBINE, 4, (1,))
    kind = int(_EK.ENVELOPE_MISMATCH)
    rec = _record(abort_flag=kind, rank=0, peer_rank=1, tag=2, value=theirs, expected=mine)
    set_device_error(r, rec)
    r._status.array[0] = kind
    for _ in range(2):  # sticky until reset, like every abort
        with pytest.raises(
            EPDeviceError, match=r"rank 1 entered combine #4 .* this rank entered dispatch #4"
        ) as e:
            r.guard()
        assert e.value.rank == 0 and "dispatch.entry_barrier" in str(e.value)


def test_launch_count_restarts_at_reset(fake_driver) -> None:
    r = make_rank(fake_driver)
    r._num_collective_launches = 5
    r.reset_state(lambda: None)
    assert r._envelope(OP_DISPATCH, ()) == pack_envelope(OP_DISPATCH, 1, ())
