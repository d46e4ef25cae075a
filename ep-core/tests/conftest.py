"""pytest setup of the ep-core tests: one ep-jit cache per test run for the tests that only check what a kernel
compiles to (`shared_jit_cache`); the extern "C" kernels of a header, to hold a host module's parameter table
against (`header_signatures`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def _shared_jit_dir(tmp_path_factory) -> object:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist: one cache for the run's workers (their base temp dirs share this run's parent), so an
        # instance two workers' files compile is built once; ep-jit locks each key's build across processes
        return tmp_path_factory.getbasetemp().parent / "jit-shared"
    return tmp_path_factory.mktemp("jit")


@pytest.fixture
def shared_jit_cache(_shared_jit_dir, monkeypatch):
    """EPKIT_JIT_CACHE_DIR for this test: one cache for every test that takes it in this run (pytest, or every
    pytest-xdist worker of it). Only for tests that assert on the artifacts alone: an instance (config, switches,
    arch) compiles once and the later tests load the same cubin (the default 8-rank instance was compiled five times).
    ep-jit's cache keys keep instances apart; tests of caching itself keep a fresh cache of their own."""
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(_shared_jit_dir))
    ep_jit.clear_memo()
    return ep_jit


@pytest.fixture
def header_signatures():
    """``read(file)`` -> ``(text, {kernel: parameters})``: an ``ep_core/`` header's text and its extern "C" kernels'
    parameters spelled as the host modules' ``SIGNATURES`` spell them (``p`` a pointer, ``i`` an int32)."""

    def read(name: str) -> tuple[str, dict[str, str]]:
        from ep_core.kernels._source import get_include

        text = (Path(get_include()) / "ep_core" / name).read_text()
        pattern = r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(([^)]*)\)'
        found = {
            m.group(1): "".join("p" if "*" in p else "i" for p in m.group(2).split(","))
            for m in re.finditer(pattern, text)
        }
        return text, found

    return read
