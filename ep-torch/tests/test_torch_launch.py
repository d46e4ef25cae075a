"""ep_torch.launch.spawn: ranks start again on a new port when the picked one is taken before rank 0 listens."""

from __future__ import annotations

import operator
import socket

import pytest
import torch.multiprocessing as mp
from ep_torch import launch


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_spawn_retries_when_the_free_port_was_taken(monkeypatch):
    with _listening_socket() as busy:
        ports = iter([busy.getsockname()[1], launch.free_port()])
        monkeypatch.setattr(launch, "free_port", lambda: next(ports))
        launch.spawn(operator.add, 2)  # fn(rank, world): anything picklable
        assert next(ports, None) is None  # the second port was used


def test_spawn_does_not_retry_an_explicit_port():
    with _listening_socket() as busy, pytest.raises(mp.ProcessRaisedException, match="EADDRINUSE"):
        launch.spawn(operator.add, 2, port=busy.getsockname()[1])


def test_lost_port_detection():
    assert launch._lost_the_port("... in init_process_group ... EADDRINUSE, message: address already in use")
    assert not launch._lost_the_port("ValueError: x: expected ...")
