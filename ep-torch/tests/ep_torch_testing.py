"""Helpers shared by the ep-torch test modules: the runner of a test file as a script in its own process group.

conftest.py of this folder loads this file as the module `ep_torch_testing` before pytest imports any test module
here (the root config's --import-mode=importlib puts no test folder on sys.path, so the test modules could not
import it by a sibling's name otherwise). The test modules import it inside their runner, never at module level:
they also run as the ranks' scripts, where no conftest loaded it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

__all__ = ["run_script"]


def run_script(
    script: str, args: list[str], limit: float, *, what: str = "", env: dict | None = None
) -> tuple[int, str]:
    """Run `python script *args` in a new process group; returns its exit status and output (stdout and stderr).

    Past `limit` seconds the whole group is killed (the ranks too) and the test fails as a hang, with the output's
    tail; `what` prefixes that message. `env` None: this process's environment."""
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what}still running after {limit} s (a hang):\n{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, out.decode(errors="replace")
