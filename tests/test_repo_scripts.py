"""The GPU machine's scripts and the noxfile agree: scripts/gpu-suite.sh runs the same benchmarks as `nox -s bench`,
every benchmark named exists, and the shell scripts parse."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _nox_benchmarks() -> list[tuple[str, ...]]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BENCHMARKS" for t in node.targets):
            return [tuple(ast.literal_eval(e)) for e in node.value.elts]
    raise AssertionError("noxfile.py has no BENCHMARKS list")


def _suite_benchmarks() -> list[tuple[str, ...]]:
    text = (ROOT / "scripts" / "gpu-suite.sh").read_text()
    entries = " ".join(re.findall(r'default_benches\+?="([^"]*)"', text)).split()
    return [tuple(e.split(",")) for e in entries]


def test_gpu_suite_runs_the_nox_benchmarks():
    assert _suite_benchmarks() == _nox_benchmarks()


def test_every_benchmark_exists():
    for script, *_ in _nox_benchmarks():
        assert (ROOT / script).is_file(), script


def test_shell_scripts_parse():
    for script in [*sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run"]:
        subprocess.run(["bash", "-n", str(script)], check=True)
