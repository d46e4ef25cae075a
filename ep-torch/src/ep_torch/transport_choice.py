"""Which ep-core transport a buffer runs on, decided the same way on every rank of the group.

Rules (``transport=`` or ``EPKIT_TORCH_TRANSPORT`` override them): a CPU group (gloo): ``"reference"``; a CUDA group:
``"nccl"`` (LSA through ep-nccl-gin) when every rank has its own GPU and can load NCCL >= 2.28.7 with its device
headers, ``"ipc"`` (ep-symmem) otherwise. The reason is kept in :attr:`TransportChoice.reason` (the buffer's
``repr``).

With ``"nccl"`` the buffer borrows the group's NCCL communicator (``ProcessGroupNCCL._comm_ptr()``) when, on every
rank, torch and ep-nccl-gin load one and the same ``libnccl.so``, the group's communicator exists, and the buffer
is released collectively (``explicitly_destroy=True``: a borrowed communicator's window can only be deregistered
collectively). ``EPKIT_TORCH_NCCL_COMM``: ``auto`` (that rule), ``group`` (borrow or fail with the reason), ``own``.

Nodes: ``EPKIT_SCALEUP_RANKS=S_u`` (a divisor of the group size) makes ranks ``r // S_u`` one node (hybrid mode,
ep-core's ``num_nvlink_ranks``). On one host they are emulated (the reference backend, or ``ipc``; ``nccl`` is
refused below the group size: its nodes are NCCL's LSA teams); across hosts the nccl transport requires ``S_u`` to
equal the LSA team size. ``TransportChoice.scaleup_ranks`` keeps it (None: not set).

Every local fact is exchanged (two small all-gathers) before anything is decided, so all ranks agree: a rank that
picked differently would hang its peers in NCCL's communicator setup.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPConfigError, EPValueError
from ep_core.executor import ReferenceTransport

from . import _env

__all__ = [
    "TRANSPORTS",
    "TransportChoice",
    "choose_transport",
    "make_core_transport",
    "ranks_per_host",
    "scaleup_ranks",
]

TRANSPORTS = ("reference", "ipc", "nccl")


@dataclass(frozen=True)
class TransportChoice:
    """The outcome: ``name`` (one of :data:`TRANSPORTS`), the ``device`` that holds the data, why it was chosen,
    for ``"nccl"`` the group communicator to borrow (``comm_ptr``; None = create one), and the ranks per emulated
    node from ``EPKIT_SCALEUP_RANKS`` (``scaleup_ranks``; None = not set)."""

    name: str
    device: torch.device
    reason: str
    comm_ptr: int | None = None
    scaleup_ranks: int | None = None

    @property
    def communicator(self) -> str | None:
        """``"group"`` (borrowed), ``"own"``, or None for the other transports."""
        if self.name != "nccl":
            return None
        return "group" if self.comm_ptr is not None else "own"


# --- local facts (seams: the CPU tests replace them to simulate GPUs, NCCL builds and communicators) ----------------
def _host_name() -> str:
    return socket.gethostname()


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _nccl_problem() -> str:
    """Why this rank cannot run the nccl transport ("" when it can)."""
    try:
        from ep_core.transports.nccl import load_nccl_gin

        load_nccl_gin()
    except (ImportError, EPConfigError) as exc:
        return str(exc)
    return ""


def _mapped_nccl_libraries() -> set[str] | None:
    """The distinct ``libnccl.so*`` files mapped into this process (None where /proc/self/maps does not exist)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    found = set()
    for line in maps.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[-1]).name.startswith("libnccl.so"):
            found.add(str(Path(fields[-1]).resolve()))
    return found


def _group_comm(group: dist.ProcessGroup) -> tuple[int, str]:
    """(the group's ``ncclComm_t``, "") when ep-nccl-gin can borrow it, else (0, why not)."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError) as exc:  # which one depends on the torch release
        return 0, f"the group has no CUDA backend ({exc})"
    if not hasattr(backend, "_comm_ptr"):
        return 0, f"the group's CUDA backend {type(backend).__name__} has no _comm_ptr()"
    ptr = int(backend._comm_ptr())
    if ptr == 0:
        return 0, "the group's NCCL communicator does not exist on this device"
    from ep_core.transports.nccl import load_nccl_gin  # ep-nccl-gin comes through ep-core (its `nccl` extra)

    try:
        loaded = load_nccl_gin().load()
    except EPConfigError as exc:
        return 0, str(exc)
    torch_version = tuple(int(v) for v in torch.cuda.nccl.version())
    ours = (loaded.runtime.major, loaded.runtime.minor, loaded.runtime.patch)
    if torch_version != ours:
        return 0, f"torch uses NCCL {torch_version}, ep-nccl-gin loaded {ours}"
    mapped = _mapped_nccl_libraries()
    if mapped is None:
        return 0, "cannot tell which libnccl torch uses (no /proc/self/maps)"
    if len(mapped) != 1 or Path(loaded.path).resolve() != Path(next(iter(mapped))):
        return (
            0,
            f"torch and ep-nccl-gin do not share one libnccl (mapped: {sorted(mapped)}, ours: {loaded.path})",
        )
    return ptr, ""


def _allgather_json(bootstrap: Any, value: dict) -> list[dict]:
    return [json.loads(b.decode()) for b in bootstrap.allgather(json.dumps(value, sort_keys=True).encode())]


def scaleup_ranks(name: str, num_ranks: int, rank: int) -> int | None:
    """S_u of ``EPKIT_SCALEUP_RANKS`` for a buffer of ``num_ranks`` on transport ``name`` (the old name
    ``EPKIT_TORCH_REFERENCE_NVLINK_RANKS`` counts on ``reference``); None when not set. Local: no collective."""
    try:
        var, su = _env.scaleup_ranks(reference=name == "reference")
    except ValueError as exc:
        raise EPConfigError(f"{exc} (rank {rank})") from None
    if not su:
        return None
    if num_ranks % su:
        raise EPConfigError(
            f"{var}={su} (rank {rank}): expected a divisor of the group size {num_ranks} (ranks r // S_u form one "
            "node), or 0 / unset for one node"
        )
    return su


def ranks_per_host(bootstrap: Any) -> int:
    """Ranks per host when the group's hosts hold equal blocks of consecutive ranks, else the group size: the usual
    NVLink domain of a CUDA group (NCCL's LSA team), known without creating a communicator. A collective."""
    hosts = [b.decode() for b in bootstrap.allgather(_host_name().encode())]
    n, c = len(hosts), hosts.count(hosts[0])
    blocks = [hosts[i : i + c] for i in range(0, n, c)]
    if n % c or len({b[0] for b in blocks}) != len(blocks) or any(len(set(b)) != 1 for b in blocks):
        return n
    return c


def _local_scaleup(name: str, bootstrap: Any) -> tuple[int, str]:
    """(S_u or 0, "") or (0, why it is invalid): a fact to exchange, so that a bad value fails every rank."""
    try:
        return scaleup_ranks(name, int(bootstrap.size), int(bootstrap.rank)) or 0, ""
    except EPConfigError as exc:
        return 0, str(exc)


# --- the decision ----------------------------------------------------------------------------------------------------
def _requested(requested: str | None) -> str:
    choice = (requested or _env.transport() or "").lower()
    if choice not in ("", *TRANSPORTS):
        raise EPValueError(f"transport: expected 'reference', 'ipc', 'nccl' or None, got {requested!r}")
    return choice


def data_device(requested: str | None, bootstrap_device: torch.device) -> tuple[str, torch.device]:
    """(the transport asked for, "" = automatic; the device of the data), checked against the group's device.
    Local: no collective."""
    choice = _requested(requested)
    if choice == "reference" or (not choice and bootstrap_device.type == "cpu"):
        if bootstrap_device.type != "cpu":
            raise EPValueError(
                "transport: 'reference' runs on CPU tensors over a gloo group; this group is nccl (CUDA tensors)"
            )
        return "reference", bootstrap_device
    if bootstrap_device.type == "cuda":
        return choice, bootstrap_device
    if not torch.cuda.is_available():
        raise EPValueError(
            f"transport: {choice!r} runs the GPU kernels, but CUDA is not available here; use transport='reference' "
            "(the default for CPU groups)"
        )
    # a gloo group driving the GPU kernels (e.g. several processes sharing one GPU, which NCCL refuses)
    return choice, torch.device("cuda", torch.cuda.current_device())


def choose_transport(
    requested: str | None, bootstrap: Any, group: dist.ProcessGroup, *, explicitly_destroy: bool
) -> TransportChoice:
    """The transport of a new buffer (module doc). A collective over ``bootstrap`` unless the answer is fixed
    (``reference``, or ``ipc`` asked for)."""
    choice, device = data_device(requested, bootstrap.device)
    if choice in ("reference", "ipc"):  # fixed: no collective (ep-core's construction envelope compares S_u)
        su = scaleup_ranks(choice, int(bootstrap.size), int(bootstrap.rank))
        if choice == "reference":
            return TransportChoice(
                "reference", device, "CPU tensors (gloo group): the reference backend", None, su
            )
        return TransportChoice(
            "ipc", device, "asked for (transport='ipc' or EPKIT_TORCH_TRANSPORT)", None, su
        )

    su, su_problem = _local_scaleup(choice or "auto", bootstrap)
    facts = _allgather_json(
        bootstrap,
        {
            "uuid": _device_uuid(device),
            "nccl": _nccl_problem(),
            "scaleup": su,
            "scaleup_problem": su_problem,
            "host": _host_name(),
        },
    )
    for f in facts:
        if f["scaleup_problem"]:
            raise EPConfigError(f["scaleup_problem"])
    values = [f["scaleup"] for f in facts]
    if len(set(values)) > 1:
        raise EPConfigError(
            "EPKIT_SCALEUP_RANKS: the ranks disagree ("
            + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            + "; 0 = not set); set the same value on every rank"
        )
    if su and su < int(bootstrap.size) and len({f["host"] for f in facts}) == 1:
        nodes = f"EPKIT_SCALEUP_RANKS={su} emulates nodes of {su} ranks on one host"
        if choice == "nccl":
            raise EPConfigError(
                f"transport 'nccl': {nodes}, but the nccl transport's nodes are NCCL's LSA teams and its scale-out "
                "put is GIN; use transport='ipc' for emulated nodes (the hybrid kernels with the emulated scale-out "
                "put), or unset EPKIT_SCALEUP_RANKS"
            )
        return TransportChoice(
            "ipc", device, f"{nodes}: hybrid kernels over ipc (emulated scale-out put)", None, su
        )
    su_or_none = su or None
    seen: dict[str, int] = {}
    shared = None
    for r, f in enumerate(facts):
        if f["uuid"] in seen:
            shared = (seen[f["uuid"]], r)
            break
        seen[f["uuid"]] = r
    unable = [(r, f["nccl"]) for r, f in enumerate(facts) if f["nccl"]]
    if not choice:
        if shared is not None:
            return TransportChoice(
                "ipc",
                device,
                f"ranks {shared[0]} and {shared[1]} share a GPU (NCCL refuses that)",
                None,
                su_or_none,
            )
        if unable:
            r, why = unable[0]
            return TransportChoice(
                "ipc", device, f"rank {r} cannot use the nccl transport: {why}", None, su_or_none
            )
    elif shared is not None:  # nccl asked for
        raise EPConfigError(
            f"transport 'nccl': ranks {shared[0]} and {shared[1]} share one GPU, which NCCL refuses; use "
            "transport='ipc' (ep-symmem) for processes that share a GPU"
        )
    reason = "every rank has its own GPU and NCCL >= 2.28.7" if not choice else "asked for"
    if unable:  # nccl asked for: NcclTransport raises the precise error on every rank
        return TransportChoice("nccl", device, reason, None, su_or_none)
    return _with_communicator(
        TransportChoice("nccl", device, reason, None, su_or_none), bootstrap, group, explicitly_destroy
    )


def _with_communicator(
    choice: TransportChoice, bootstrap: Any, group: dist.ProcessGroup, explicitly_destroy: bool
) -> TransportChoice:
    mode = _env.nccl_comm()
    if mode == "own":
        return dataclasses.replace(choice, reason=f"{choice.reason}; own communicator (asked for)")
    if mode == "auto" and not explicitly_destroy:
        ptr, why = 0, "the buffer is not destroyed collectively (explicitly_destroy=False)"
    else:  # after the first exchange, which created a lazily initialized communicator
        ptr, why = _group_comm(group)
    facts = _allgather_json(bootstrap, {"ok": ptr != 0, "why": why})
    refused = [(r, f["why"]) for r, f in enumerate(facts) if not f["ok"]]
    if not refused:
        return dataclasses.replace(
            choice, reason=f"{choice.reason}; the group's NCCL communicator", comm_ptr=ptr
        )
    r, why = refused[0]
    if mode == "group":
        raise EPConfigError(
            f"EPKIT_TORCH_NCCL_COMM=group: rank {r} cannot borrow the group's NCCL communicator: {why}; unset it "
            "(or set it to 'own') to let the buffer create its own communicator"
        )
    return dataclasses.replace(choice, reason=f"{choice.reason}; own communicator (rank {r}: {why})")


def reference_transport(num_nvlink_ranks: int | None = None) -> ReferenceTransport:
    """ep-core's reference transport with the planner inputs of ``_env`` (an H200 by default) and NVLink domains
    of ``num_nvlink_ranks`` (emulated nodes: hybrid mode on CPU; None = one domain)."""
    return ReferenceTransport(
        num_device_sms=_env.reference_num_sms(),
        nvlink_gbs=_env.reference_nvlink_gbs(),
        num_nvlink_ranks=num_nvlink_ranks,
    )


def make_core_transport(choice: TransportChoice) -> Any:
    """The ep-core transport object for ``choice`` (the buffer passes ``choice.scaleup_ranks`` to ep-core as its
    ``num_nvlink_ranks``)."""
    if choice.name == "reference":
        return reference_transport(choice.scaleup_ranks)
    if choice.name == "nccl":
        from ep_core.transports.nccl import NcclTransport

        return NcclTransport(choice.comm_ptr)
    from ep_core.buffer import resolve_transport  # the name's module, or EPConfigError saying what is missing

    return resolve_transport(choice.name)
