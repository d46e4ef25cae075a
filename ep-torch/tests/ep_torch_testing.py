"""Helpers shared by the ep-torch test modules: the runner of a test file as a script in its own process group,
and the CPU ranks' start in that script (`spawn_cpu`).

conftest.py of this folder loads this file as the module `ep_torch_testing` before pytest imports any test module
here (the root config's --import-mode=importlib puts no test folder on sys.path, so the test modules could not
import it by a sibling's name otherwise). The test modules import it inside their runner, never at module level:
they also run as the ranks' scripts, where no conftest loaded it (there the script's folder is sys.path[0], so
their `__main__` block imports it by name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["BENCH_V1_ROWS", "bench_v1_dry_run", "run_script", "spawn_cpu"]

BENCH_V1_ROWS = (
    "v2 dispatch bf16",
    "v2 combine",
    "v1 ll_dispatch bf16",
    "v1 ll_dispatch fp8",
    "v1 ll_combine",
)
"""Rows every domain of benchmarks/bench_v1.py reports (its table's op column starts with one of these)."""


def bench_v1_dry_run(*args: str) -> list[str]:
    """benchmarks/bench_v1.py on the CPU reference backend (`--dry-run-cpu`, tiny sizes) with `args`: checks that it
    exits 0 with no failed bitwise check and returns its output's lines."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_v1.py"
    code, out = run_script(str(bench), ["--dry-run-cpu", *args], 300, what="bench_v1.py --dry-run-cpu: ")
    assert code == 0, out[-3000:]
    assert "CHECK FAILED" not in out, out[-3000:]
    return out.splitlines()


def run_script(
    script: str, args: list[str], limit: float, *, what: str = "", env: dict | None = None
) -> tuple[int, str]:
    """Run `python script *args` in a new process group; returns its exit status and output (stdout and stderr).

    Past `limit` seconds the whole group is killed (the ranks too) and the test fails as a hang, with the output's
    tail; `what` prefixes that message. `env` None: this process's environment.

    On a machine without a CUDA device the script runs in a process forked from a server that has imported torch
    and numpy once (`_Zygote`), not in a fresh interpreter: the import is about 2 CPU-s of every script's time."""
    if _use_zygote():
        return _Zygote.get().run(script, args, limit, what, dict(os.environ if env is None else env))
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


_zygote_wanted: list[bool] = []


def survey_chain(
    cases: list[str], tmp_path: Path, limit: float, env: dict | None = None, what: str = "chain: "
) -> list[str]:
    """Run ``collective_safety_survey.py chain`` over ``cases`` (two ranks, its own process group) and return one
    line per case whose verdict is not "clear" (empty: every case clear)."""
    import importlib.util
    import json

    survey_path = str(Path(__file__).with_name("collective_safety_survey.py"))
    spec = importlib.util.spec_from_file_location("collective_safety_survey", survey_path)
    survey = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(survey)
    code, out = run_script(survey_path, ["chain", str(tmp_path), *cases], limit, what=what, env=env)
    assert code == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    bad = []
    for case in cases:
        v, why = survey.verdict(case, [r0.get(case, {}), r1.get(case, {})])
        if v != "clear":
            bad.append(f"{case}: {v}: {why}")
    return bad


def _use_zygote() -> bool:
    """No CUDA device here (asked once). Where there is one, every script starts afresh as before: a process forked
    from another cannot use a CUDA context that one made, and the GPU scripts are not worth the risk."""
    if not _zygote_wanted:
        import torch

        _zygote_wanted.append(not torch.cuda.is_available())
    return _zygote_wanted[0]


class _Zygote:
    """A server process (this file run as `python ep_torch_testing.py zygote`) that imports torch and numpy once,
    then forks one child per script: the child starts a new session (its process group is the script's: killed
    whole on a hang), takes the request's environment, argv and output file, and runs the script as `__main__`.
    Only ever one script at a time per test process (pytest and each pytest-xdist worker have their own server);
    the server exits when this process closes its stdin (`close`, at exit)."""

    _one: _Zygote | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        import atexit

        atexit.register(self.close)

    def close(self) -> None:
        """End the server and wait for it (its CPU time then counts as this process's children's)."""
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    @classmethod
    def get(cls) -> _Zygote:
        if cls._one is None:
            cls._one = cls()
        elif cls._one.proc.poll() is not None:
            raise RuntimeError(f"the script server ({__file__} zygote) exited ({cls._one.proc.returncode})")
        return cls._one

    def _line(self, deadline: float | None) -> str | None:
        """One reply line, or None past `deadline` (read a byte at a time: nothing of the next line is consumed)."""
        import select
        import time

        fd = self.proc.stdout.fileno()
        got = b""
        while not got.endswith(b"\n"):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                return None
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError(f"the script server ({__file__} zygote) exited ({self.proc.wait()})")
            got += byte
        return got.decode()

    def run(self, script: str, args: list[str], limit: float, what: str, env: dict) -> tuple[int, str]:
        import json
        import tempfile
        import time

        with tempfile.NamedTemporaryFile(prefix="ep-script-", suffix=".out") as out:
            req = {
                "script": os.path.abspath(script),
                "args": [str(a) for a in args],
                "env": env,
                "out": out.name,
            }
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            pid = int(self._line(None))
            status = self._line(time.monotonic() + limit)
            if status is None:
                os.killpg(pid, signal.SIGKILL)
                self._line(None)
                text = Path(out.name).read_text(errors="replace")
                pytest.fail(f"{what}still running after {limit} s (a hang):\n{text[-3000:]}")
            return int(status), Path(out.name).read_text(errors="replace")


def _serve() -> None:
    """The server side of `_Zygote`: one JSON request a line on stdin; replies the child's pid, then its exit status
    (negative: killed by that signal, as Popen.returncode)."""
    import json

    import numpy  # noqa: F401  what the scripts import, once for all of them
    import torch  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        os.write(1, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _child(req: dict) -> None:
    """Run the requested script as `python script *args` would, then leave (never returns)."""
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(req["script"])
        try:
            runpy.run_path(req["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:  # what the interpreter does with it
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn_cpu(fn, nprocs: int, *args) -> None:
    """``ep_torch.launch.spawn(fn, nprocs, *args)`` (gloo, one thread a rank, same rank entry and port retry) with
    the ranks forked from this process instead of started afresh: each rank inherits the torch, ep_torch and test
    module this script has imported (a fresh interpreter spends about 2 CPU-s importing them; a test's ranks often
    do less work than that). `fn` needs not be picklable.

    Only for ranks that never touch CUDA (a forked child cannot use a CUDA context, and importing ep_core may
    initialize the driver in this process), called from a test script's ``__main__`` (one thread: nothing else
    runs here when it forks). GPU ranks keep ``launch.spawn``."""
    from ep_torch import launch

    launch.spawn(fn, nprocs, *args, start_method="fork")


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    _serve()
