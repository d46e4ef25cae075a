"""The automatic transport choice (ep_torch.transport_choice) for simulated groups: ranks are threads, and the local
facts (GPU UUID, NCCL usability, the group's communicator) come from per-rank tables instead of real GPUs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ep_core.bootstrap import ThreadGroup
from ep_core.errors import EPConfigError, EPValueError
from ep_core.executor import ReferenceTransport
from ep_torch import transport_choice as tc

_rank = threading.local()


def _run(
    monkeypatch,
    n,
    *,
    uuids=None,
    nccl=None,
    comms=None,
    requested=None,
    destroy=True,
    device="cuda",
    hosts=None,
):
    """choose_transport on `n` thread ranks; returns each rank's TransportChoice or exception, and the number
    of all-gathers each rank took part in."""
    uuids = uuids or [f"GPU-{r}" for r in range(n)]
    nccl = nccl or [""] * n
    comms = comms or [(0x1000 + r, "") for r in range(n)]
    monkeypatch.setattr(tc, "_device_uuid", lambda device: uuids[_rank.r])
    monkeypatch.setattr(tc, "_nccl_problem", lambda: nccl[_rank.r])
    monkeypatch.setattr(tc, "_group_comm", lambda group: comms[_rank.r])
    monkeypatch.setattr(tc, "_host_name", lambda: hosts[_rank.r] if hosts else "host-0")
    group = ThreadGroup(n, timeout_secs=20)
    boots = group.bootstraps()
    calls = [0] * n

    def one(r):
        _rank.r = r
        boot = boots[r]
        boot.device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        inner = boot.allgather

        def counted(data):
            calls[r] += 1
            return inner(data)

        boot.allgather = counted
        try:
            return tc.choose_transport(requested, boot, None, explicitly_destroy=destroy)
        except Exception as exc:  # returned, so that every rank's outcome is compared
            return exc

    with ThreadPoolExecutor(n) as pool:
        out = list(pool.map(one, range(n)))
    return out, calls


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("EPKIT_TORCH_TRANSPORT", raising=False)
    monkeypatch.delenv("EPKIT_TORCH_NCCL_COMM", raising=False)
    monkeypatch.delenv("EPKIT_SCALEUP_RANKS", raising=False)
    monkeypatch.delenv("EPKIT_TORCH_REFERENCE_NVLINK_RANKS", raising=False)


def _names(out):
    return [(c.name, c.communicator) for c in out]


def test_cpu_group_is_the_reference_backend_without_a_collective(monkeypatch):
    out, calls = _run(monkeypatch, 3, device="cpu")
    assert _names(out) == [("reference", None)] * 3
    assert calls == [0, 0, 0]
    assert all(c.device.type == "cpu" for c in out)


def test_own_gpus_and_nccl_pick_nccl_and_borrow_the_group_communicator(monkeypatch):
    out, calls = _run(monkeypatch, 4)
    assert _names(out) == [("nccl", "group")] * 4
    assert [c.comm_ptr for c in out] == [0x1000, 0x1001, 0x1002, 0x1003]
    assert calls == [2] * 4
    assert "own GPU" in out[0].reason and "group's NCCL communicator" in out[0].reason


def test_nccl_without_collective_destroy_owns_its_communicator(monkeypatch):
    out, _ = _run(monkeypatch, 2, destroy=False)
    assert _names(out) == [("nccl", "own")] * 2
    assert all(c.comm_ptr is None for c in out)
    assert "explicitly_destroy=False" in out[1].reason


def test_shared_gpu_picks_ipc_on_every_rank(monkeypatch):
    out, calls = _run(monkeypatch, 4, uuids=["A", "B", "A", "C"])
    assert _names(out) == [("ipc", None)] * 4
    assert "ranks 0 and 2 share a GPU" in out[3].reason
    assert calls == [1] * 4


def test_one_rank_without_nccl_moves_everyone_to_ipc(monkeypatch):
    out, _ = _run(monkeypatch, 3, nccl=["", "", "NCCL 2.27.3 is too old"])
    assert _names(out) == [("ipc", None)] * 3
    assert all("rank 2" in c.reason and "2.27.3" in c.reason for c in out)


def test_one_rank_that_cannot_borrow_makes_every_rank_own(monkeypatch):
    comms = [(0x10, ""), (0, "torch uses NCCL (2, 27, 3)"), (0x30, "")]
    out, _ = _run(monkeypatch, 3, comms=comms)
    assert _names(out) == [("nccl", "own")] * 3
    assert all("rank 1" in c.reason for c in out)


def test_group_communicator_asked_for_but_refused_raises_on_every_rank(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_NCCL_COMM", "group")
    out, _ = _run(monkeypatch, 2, comms=[(0x10, ""), (0, "no _comm_ptr()")])
    assert all(
        isinstance(e, EPConfigError) and "rank 1" in str(e) and "no _comm_ptr()" in str(e) for e in out
    )


def test_group_communicator_asked_for_ignores_explicitly_destroy(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_NCCL_COMM", "group")
    out, _ = _run(monkeypatch, 2, destroy=False)
    assert _names(out) == [("nccl", "group")] * 2


def test_own_communicator_asked_for(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_NCCL_COMM", "own")
    out, calls = _run(monkeypatch, 2)
    assert _names(out) == [("nccl", "own")] * 2
    assert calls == [1, 1]


def test_bad_nccl_comm_knob(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_NCCL_COMM", "borrowed")
    out, _ = _run(monkeypatch, 1)
    assert isinstance(out[0], ValueError) and "EPKIT_TORCH_NCCL_COMM" in str(out[0])


def test_nccl_asked_for_on_a_shared_gpu_is_refused(monkeypatch):
    out, _ = _run(monkeypatch, 2, uuids=["A", "A"], requested="nccl")
    assert all(isinstance(e, EPConfigError) and "share one GPU" in str(e) for e in out)


def test_nccl_asked_for_without_nccl_leaves_the_error_to_the_transport(monkeypatch):
    out, calls = _run(monkeypatch, 2, nccl=["", "too old"], requested="nccl")
    assert _names(out) == [("nccl", "own")] * 2  # NcclTransport raises its own precise error on every rank
    assert calls == [1, 1]


def test_ipc_asked_for_needs_no_collective(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_TRANSPORT", "ipc")
    out, calls = _run(monkeypatch, 2)
    assert _names(out) == [("ipc", None)] * 2
    assert calls == [0, 0]


def test_unknown_transport_name():
    with pytest.raises(EPValueError, match="transport: expected 'reference', 'ipc', 'nccl'"):
        tc.data_device("carrier", torch.device("cpu"))


def test_reference_on_a_cuda_group_is_refused():
    with pytest.raises(EPValueError, match="'reference' runs on CPU tensors"):
        tc.data_device("reference", torch.device("cuda", 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_gpu_transport_on_a_machine_without_cuda():
    with pytest.raises(EPValueError, match="CUDA is not available"):
        tc.data_device("ipc", torch.device("cpu"))


def test_core_transports_for_each_choice():
    cpu = torch.device("cpu")
    assert isinstance(tc.make_core_transport(tc.TransportChoice("reference", cpu, "")), ReferenceTransport)
    from ep_core.transports.nccl import NcclTransport

    borrowed = tc.make_core_transport(tc.TransportChoice("nccl", cpu, "", 0x1234))
    assert isinstance(borrowed, NcclTransport) and borrowed.comm_ptr == 0x1234
    assert tc.make_core_transport(tc.TransportChoice("nccl", cpu, "")).comm_ptr is None
    assert type(tc.make_core_transport(tc.TransportChoice("ipc", cpu, ""))).__name__ == "IpcTransport"


def test_mapped_nccl_libraries_is_a_set_of_paths():
    found = tc._mapped_nccl_libraries()
    assert found is None or all(p.startswith("/") and "libnccl.so" in p for p in found)


def test_nccl_problem_is_a_string_here():
    # On this machine either ep-nccl-gin loads NCCL >= 2.28.7 ("") or the reason says what to install.
    why = tc._nccl_problem()
    assert isinstance(why, str)
    assert why == "" or "transport 'nccl'" in why


# --- emulated nodes: EPKIT_SCALEUP_RANKS ------------------------------------------------------------------------
def test_scaleup_ranks_unset_keeps_the_transport_domain(monkeypatch):
    out, calls = _run(monkeypatch, 4)
    assert [c.scaleup_ranks for c in out] == [None] * 4 and calls == [2] * 4
    out, _ = _run(monkeypatch, 2, device="cpu")
    assert [c.scaleup_ranks for c in out] == [None] * 2


def test_scaleup_ranks_on_the_reference_backend(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    out, calls = _run(monkeypatch, 4, device="cpu")
    assert [(c.name, c.scaleup_ranks) for c in out] == [("reference", 2)] * 4 and calls == [0] * 4
    assert tc.make_core_transport(out[0]).num_nvlink_ranks(None) == 2


def test_old_name_counts_on_the_reference_backend_only(monkeypatch):
    monkeypatch.setenv("EPKIT_TORCH_REFERENCE_NVLINK_RANKS", "2")
    out, _ = _run(monkeypatch, 4, device="cpu")
    assert [c.scaleup_ranks for c in out] == [2] * 4
    assert tc.scaleup_ranks("ipc", 4, 0) is None  # documented as a CPU-backend knob
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "4")
    with pytest.raises(EPConfigError, match=r"disagree.*rank 0"):
        tc.scaleup_ranks("reference", 4, 0)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    assert tc.scaleup_ranks("reference", 4, 0) == 2  # both set, equal


@pytest.mark.parametrize("value, rule", [("3", "divisor of the group size 4"), ("-1", ">= 0"), ("x", "int")])
def test_bad_scaleup_ranks_names_variable_value_and_rank(monkeypatch, value, rule):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", value)
    out, _ = _run(monkeypatch, 4, device="cpu")
    for r, exc in enumerate(out):
        assert isinstance(exc, EPConfigError), exc
        assert "EPKIT_SCALEUP_RANKS" in str(exc) and value in str(exc) and f"rank {r}" in str(exc), exc
        assert rule in str(exc), exc


def test_bad_scaleup_ranks_on_a_gpu_group_fails_every_rank_after_the_exchange(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "3")
    out, calls = _run(monkeypatch, 4)
    assert all(isinstance(e, EPConfigError) and "EPKIT_SCALEUP_RANKS=3 (rank 0)" in str(e) for e in out), out
    assert calls == [1] * 4


def test_scaleup_ranks_below_the_group_size_picks_ipc(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    out, calls = _run(monkeypatch, 4)  # own GPUs and NCCL: nccl would be picked without the knob
    assert [(c.name, c.scaleup_ranks) for c in out] == [("ipc", 2)] * 4 and calls == [1] * 4
    assert "EPKIT_SCALEUP_RANKS=2" in out[0].reason
    out, _ = _run(monkeypatch, 4, uuids=["GPU-0"] * 4)  # sharing one GPU
    assert [(c.name, c.scaleup_ranks) for c in out] == [("ipc", 2)] * 4


def test_scaleup_ranks_equal_to_the_group_size_is_one_node(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "4")
    out, _ = _run(monkeypatch, 4)
    assert [(c.name, c.communicator, c.scaleup_ranks) for c in out] == [("nccl", "group", 4)] * 4


def test_scaleup_ranks_with_nccl_asked_for_is_refused(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    out, _ = _run(monkeypatch, 4, requested="nccl")
    assert all(
        isinstance(e, EPConfigError) and "use transport='ipc' for emulated nodes" in str(e) for e in out
    ), out


def test_ipc_asked_for_keeps_scaleup_ranks(monkeypatch):
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    out, calls = _run(monkeypatch, 4, requested="ipc")
    assert [(c.name, c.scaleup_ranks) for c in out] == [("ipc", 2)] * 4 and calls == [0] * 4


def test_ranks_that_disagree_on_scaleup_ranks_fail_together(monkeypatch):
    values = [2, 2, 0, 2]
    monkeypatch.setattr(tc, "_local_scaleup", lambda name, boot: (values[_rank.r], ""))
    out, _ = _run(monkeypatch, 4)
    assert all(
        isinstance(e, EPConfigError) and "disagree" in str(e) and "rank 2: 0" in str(e) for e in out
    ), out


def test_scaleup_ranks_across_hosts_only_overrides_the_nodes(monkeypatch):
    # real nodes: the choice is made as without the knob, which reaches ep-core (its nccl transport checks it
    # against NCCL's LSA team)
    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    hosts = ["a", "a", "b", "b"]
    out, _ = _run(monkeypatch, 4, hosts=hosts)
    assert [(c.name, c.communicator, c.scaleup_ranks) for c in out] == [("nccl", "group", 2)] * 4
    out, _ = _run(monkeypatch, 4, hosts=hosts, requested="nccl")
    assert [(c.name, c.scaleup_ranks) for c in out] == [("nccl", 2)] * 4


@pytest.mark.parametrize(
    "hosts, want",
    [
        (["a"] * 4, 4),
        (["a", "a", "b", "b"], 2),
        (["a", "b", "a", "b"], 4),
        (["a", "a", "a", "b"], 4),
        (["a"], 1),
    ],
)
def test_ranks_per_host(monkeypatch, hosts, want):
    monkeypatch.setattr(tc, "_host_name", lambda: hosts[_rank.r])
    boots = ThreadGroup(len(hosts), timeout_secs=20).bootstraps()

    def one(r):
        _rank.r = r
        return tc.ranks_per_host(boots[r])

    with ThreadPoolExecutor(len(hosts)) as pool:
        assert list(pool.map(one, range(len(hosts)))) == [want] * len(hosts)
