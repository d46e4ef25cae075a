"""Which import method a peer gets: retain (same process), POSIX fd (same host and pid namespace), fabric."""

from __future__ import annotations

import dataclasses

import ep_symmem as sm
import pytest
from ep_symmem._peer_import import import_methods

ALIGN = 2 << 20
BOOT_A, BOOT_B = b"A" * 16, b"B" * 16


def _desc(pid: int = 100, boot: bytes = BOOT_A, ns: int = 7, host: int = 0, fabric: bytes = b"", fd: int = 5):
    return sm.Descriptor(
        pid=pid,
        device=0,
        pid_namespace=ns,
        token=bytes([pid % 256]) * 16,
        boot_id=boot,
        device_uuid=b"u" * 16,
        num_gpu_bytes=ALIGN,
        num_host_bytes=host,
        alignment=ALIGN,
        gpu_fd=fd,
        host_fd=6 if host else -1,
        gpu_handle_types=(1 if fd >= 0 else 0) | (8 if fabric else 0),
        host_handle_types=1 if host else 0,
        gpu_fabric_handle=fabric,
    )


def _methods(mine, peer, handle_type="auto", same_process="retain", registered=False):
    return import_methods(
        mine,
        peer,
        peer_rank=1,
        handle_type=handle_type,
        same_process=same_process,
        peer_registered=registered,
    )


def test_same_process_retains_when_registered() -> None:
    mine, peer = _desc(pid=100), dataclasses.replace(_desc(pid=100), token=b"z" * 16)
    assert _methods(mine, peer, registered=True) == ("retain", "retain")
    # Knob 'posix_fd', or the peer's allocation is not live here: pidfd_getfd on self.
    assert _methods(mine, peer, same_process="posix_fd", registered=True) == ("posix_fd", "posix_fd")
    assert _methods(mine, peer, registered=False) == ("posix_fd", "posix_fd")


def test_same_host_uses_posix_fd_even_with_fabric() -> None:
    assert _methods(_desc(pid=100), _desc(pid=200, fabric=b"f" * 64)) == ("posix_fd", "posix_fd")
    assert _methods(_desc(pid=100, host=ALIGN), _desc(pid=200, host=ALIGN)) == ("posix_fd", "posix_fd")


def test_fabric_mode_uses_fabric_for_the_gpu_part() -> None:
    peer = _desc(pid=200, fabric=b"f" * 64, host=ALIGN)
    assert _methods(_desc(pid=100, host=ALIGN), peer, handle_type="fabric") == ("fabric", "posix_fd")
    with pytest.raises(sm.UnsupportedError, match="exported no fabric handle"):
        _methods(_desc(pid=100), _desc(pid=200), handle_type="fabric")


def test_other_host_needs_fabric() -> None:
    remote = _desc(pid=200, boot=BOOT_B, fabric=b"f" * 64)
    assert _methods(_desc(pid=100), remote) == ("fabric", "posix_fd")
    with pytest.raises(sm.UnsupportedError, match="another host"):
        _methods(_desc(pid=100), _desc(pid=200, boot=BOOT_B))
    with pytest.raises(sm.UnsupportedError, match="another host"):
        _methods(_desc(pid=100), remote, handle_type="posix_fd")


def test_other_pid_namespace_cannot_use_fds() -> None:
    with pytest.raises(sm.UnsupportedError, match="another pid namespace"):
        _methods(_desc(pid=100, ns=1), _desc(pid=100, ns=2))


def test_host_part_across_hosts_is_refused() -> None:
    remote = _desc(pid=200, boot=BOOT_B, fabric=b"f" * 64, host=ALIGN)
    with pytest.raises(sm.UnsupportedError, match="host part"):
        _methods(_desc(pid=100, host=ALIGN), remote)


def test_peer_without_fd_falls_back_to_fabric_on_same_host() -> None:
    assert _methods(_desc(pid=100), _desc(pid=200, fd=-1, fabric=b"f" * 64)) == ("fabric", "posix_fd")
