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


def _run(monkeypatch, n, *, uuids=None, nccl=None, comms=None, requested=None, destroy=True, device="cuda"):
    """choose_transport on `n` thread ranks; returns each rank's TransportChoice or exception, and the number
    of all-gathers each rank took part in."""
    uuids = uuids or [f"GPU-{r}" for r in range(n)]
    nccl = nccl or [""] * n
    comms = comms or [(0x1000 + r, "") for r in range(n)]
    monkeypatch.setattr(tc, "_device_uuid", lambda device: uuids[_rank.r])
    monkeypatch.setattr(tc, "_nccl_problem", lambda: nccl[_rank.r])
    monkeypatch.setattr(tc, "_group_comm", lambda group: comms[_rank.r])
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
