"""ep_torch.launch.spawn: ranks start again on a new port when the picked one is taken before rank 0 listens.

The two spawning cases run as this file's script with the ranks forked from it (`run_script`, then
``start_method="fork"``): the retry does not depend on how the ranks start, and fresh interpreters (the default) cost
about 2.5 CPU-s a rank. The default start method runs in test_torch_demo.py and the README example's test.
"""

from __future__ import annotations

import operator
import socket
import sys

import torch.multiprocessing as mp
from ep_torch import launch


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _run(case: str) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [case], 120, what=f"{case}: ")
    assert code == 0, out[-3000:]


def test_spawn_retries_when_the_free_port_was_taken():
    _run("_retries_when_the_free_port_was_taken")


def test_spawn_does_not_retry_an_explicit_port():
    _run("_does_not_retry_an_explicit_port")


def test_lost_port_detection():
    assert launch._lost_the_port("... in init_process_group ... EADDRINUSE, message: address already in use")
    assert not launch._lost_the_port("ValueError: x: expected ...")


def _retries_when_the_free_port_was_taken() -> None:
    with _listening_socket() as busy:
        ports = iter([busy.getsockname()[1], launch.free_port()])
        launch.free_port = lambda: next(ports)
        launch.spawn(operator.add, 2, start_method="fork")  # fn(rank, world)
        assert next(ports, None) is None  # the second port was used


def _does_not_retry_an_explicit_port() -> None:
    with _listening_socket() as busy:
        try:
            launch.spawn(operator.add, 2, port=busy.getsockname()[1], start_method="fork")
        except mp.ProcessRaisedException as exc:
            assert "EADDRINUSE" in str(exc), exc
        else:
            raise AssertionError("spawn on a taken explicit port did not raise")


if __name__ == "__main__":  # ranks forked from this script: CPU only, one thread here
    globals()[sys.argv[1]]()
