"""pytest setup of the ep-core tests: one ep-jit cache per test process for the tests that only check what a kernel
compiles to (`shared_jit_cache`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def _shared_jit_dir(tmp_path_factory) -> object:
    return tmp_path_factory.mktemp("jit")


@pytest.fixture
def shared_jit_cache(_shared_jit_dir, monkeypatch):
    """EPKIT_JIT_CACHE_DIR for this test: one cache for every test that takes it in this process (pytest, or one
    pytest-xdist worker). Only for tests that assert on the artifacts alone: an instance (config, switches, arch)
    compiles once and the later tests load the same cubin (the default 8-rank instance was compiled five times).
    ep-jit's cache keys keep instances apart; tests of caching itself keep a fresh cache of their own."""
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(_shared_jit_dir))
    ep_jit.clear_memo()
    return ep_jit
