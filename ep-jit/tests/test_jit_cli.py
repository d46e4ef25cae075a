"""CPU tests of `python -m ep_jit info|list|clear` against a real cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ep_jit
import pytest
from ep_jit._compiler import NvccBackend

KERNEL = r"""
extern "C" __global__ void cli_kernel(int* x) { x[threadIdx.x] = threadIdx.x; }
"""


def _cli(cache_dir, *args: str) -> str:
    env = dict(os.environ, EPKIT_JIT_CACHE_DIR=str(cache_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "ep_jit", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_info_list_clear(tmp_path, monkeypatch):
    try:
        NvccBackend.locate()
    except ep_jit.JitError as e:
        pytest.skip(f"nvcc not available: {e}")
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(cache_dir))
    ep_jit.clear_memo()

    info = json.loads(_cli(cache_dir, "--json", "info"))
    assert (
        info["cache_dir"] == str(cache_dir) and info["entries"] == 0 and info["ep_jit"] == ep_jit.__version__
    )
    assert "(no entries" in _cli(cache_dir, "list")

    art = ep_jit.compile(KERNEL, name="cli_kernel", arch="sm_90a")
    art2 = ep_jit.compile(KERNEL, name="cli_kernel_80", arch="sm_80")
    rows = json.loads(_cli(cache_dir, "--json", "list"))
    assert {r["key"] for r in rows} == {art.key, art2.key}
    row = next(r for r in rows if r["key"] == art.key)
    assert row["name"] == "cli_kernel" and row["arch"] == "sm_90a" and row["kernels"] == ["cli_kernel"]
    assert row["bytes"] > art.cubin_path.stat().st_size
    text = _cli(cache_dir, "list")
    assert "cli_kernel" in text and art.key[:12] in text and "2 entries" in text
    info_text = _cli(cache_dir, "info")
    assert (
        str(cache_dir) in info_text
        and "entries   : 2" in info_text
        and "EPKIT_JIT_CACHE_MAX_BYTES" in info_text
    )
    # --cache-dir overrides the environment
    other = tmp_path / "other"
    assert json.loads(_cli(cache_dir, "--cache-dir", str(other), "--json", "info"))["entries"] == 0

    cleared = json.loads(_cli(cache_dir, "--json", "clear"))
    assert cleared["removed_entries"] == 2 and cleared["removed_bytes"] > 0
    assert json.loads(_cli(cache_dir, "--json", "info"))["entries"] == 0
    assert not art.cubin_path.exists()
    # after clear, a compile in a fresh memo rebuilds
    ep_jit.clear_memo()
    assert not ep_jit.compile(KERNEL, name="cli_kernel", arch="sm_90a").from_cache
    ep_jit.clear_memo()
