"""How one peer's allocation is mapped into this process: by retaining a same-process allocation's handles, by
duplicating its POSIX fds (same host, same pid namespace), or through its fabric handle (other hosts)."""

from __future__ import annotations

from ._descriptor import HANDLE_TYPE_POSIX_FD, Descriptor
from ._errors import UnsupportedError

__all__ = ["import_methods"]


def import_methods(
    mine: Descriptor,
    peer: Descriptor,
    *,
    peer_rank: int,
    handle_type: str,
    same_process: str,
    peer_registered: bool,
) -> tuple[str, str]:
    """(method for the GPU part, method for the host part), each 'retain', 'posix_fd' or 'fabric'.

    handle_type: this rank's choice at create() ('auto', 'posix_fd', 'fabric'); same_process: the
    EPKIT_SYMMEM_SAME_PROCESS_IMPORT knob; peer_registered: a live allocation of this process has peer.token.
    """
    same_host = peer.boot_id == mine.boot_id
    same_pid_space = same_host and peer.pid_namespace == mine.pid_namespace
    if same_pid_space and peer.pid == mine.pid and same_process == "retain" and peer_registered:
        return "retain", "retain"
    if peer.num_host_bytes and not same_pid_space:
        raise UnsupportedError(
            f"rank {peer_rank} has a host part ({peer.num_host_bytes} bytes) but lives on another host or pid "
            "namespace: host NUMA parts are shared through POSIX fds only, so every rank of an elastic buffer must "
            "run on one host in one pid namespace (use num_host_bytes=0 across hosts)"
        )
    has_fd = peer.gpu_fd >= 0 and bool(peer.gpu_handle_types & HANDLE_TYPE_POSIX_FD)
    if handle_type == "fabric":
        if not peer.gpu_fabric_handle:
            raise UnsupportedError(
                f"handle_type='fabric' but rank {peer_rank} exported no fabric handle (its driver refused "
                "FABRIC handles or it was created with handle_type='posix_fd'); use handle_type='auto'"
            )
        return "fabric", "posix_fd"
    if same_pid_space and has_fd:
        return "posix_fd", "posix_fd"
    if handle_type == "auto" and peer.gpu_fabric_handle:
        return "fabric", "posix_fd"
    where = "another host" if not same_host else "another pid namespace"
    raise UnsupportedError(
        f"rank {peer_rank} (pid {peer.pid}) lives on {where} and exported "
        + ("no fabric handle" if handle_type == "auto" else "only what handle_type='posix_fd' allows")
        + ": POSIX fds can only be duplicated within one host and pid namespace; across hosts create the "
        "allocations with handle_type='auto' or 'fabric' on an NVLink fabric with IMEX channels"
    )
