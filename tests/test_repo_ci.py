"""`nox -t ci` runs lint first and each test once: the noxfile is loaded with a stand-in `nox` (the `tests` venv has
no nox) and its session order and the `tests` session's selection of package tests are checked."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    registered: list[tuple[str, tuple[str, ...]]] = []

    def session(fn=None, /, *, name=None, tags=(), **_kw):
        def register(f):
            registered.append((name or f.__name__, tuple(tags)))
            return f

        return register(fn) if fn is not None else register

    fake = types.SimpleNamespace(session=session, options=types.SimpleNamespace(), Session=object)
    fake.project = types.SimpleNamespace(load_toml=None, dependency_groups=None)
    saved = sys.modules.get("nox")
    sys.modules["nox"] = fake  # type: ignore[assignment]
    try:
        spec = importlib.util.spec_from_file_location("ep_noxfile", ROOT / "noxfile.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["ep_noxfile"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop("ep_noxfile", None)
        if saved is None:
            sys.modules.pop("nox", None)
        else:
            sys.modules["nox"] = saved
    mod.registered = registered
    return mod


def test_lint_runs_first_then_each_package_then_tests(noxfile):
    ci = [name for name, tags in noxfile.registered if "ci" in tags]
    # then the wheels (manylinux tags checked) and the demo from those wheels in a fresh venv
    assert ci == ["lint", *(f"tests-{n}" for n in noxfile.PACKAGES), "tests", "build", "wheel-demo", "docs"]


def test_tests_session_takes_exactly_the_tests_that_skip_alone(noxfile):
    picked = {n: noxfile._needs_more(n) for n in noxfile.PACKAGES}
    flat = [i for ids in picked.values() for i in ids]
    # Known members: each skips in its own package's session for a module that session does not install.
    for needed in [
        "ep-core/tests/test_core_nccl_transport.py::test_real_gate_table_is_2_28_7",  # ep_nccl_gin
        "ep-core/tests/test_core_kernels_compile.py::test_nccl_transport_compiles",  # ep_nccl_gin
        "ep-core/tests/test_core_host_overhead.py::test_describe_torch_fast_path_equals_slow_path",  # torch
        "packages/ep-nccl-gin/tests/test_nccl_gin_device_header.py::test_device_header_compiles_through_ep_jit",
    ]:
        assert needed in flat
    # Tests that run alone are not picked again, and ep-torch (torch installed, nothing optional) adds none.
    assert not any(
        "test_core_planner.py" in i or "test_core_nccl_transport.py::test_version_gate" in i for i in flat
    )
    assert picked["ep-torch"] == [] and picked["ep-layout"] == []
    for test_id in flat:  # every id names a file, and a test function defined in it
        path, _, name = test_id.partition("::")
        assert (ROOT / path).is_file(), test_id
        assert not name or f"def {name.split('::')[-1]}(" in (ROOT / path).read_text(), test_id
    assert len(flat) == len(set(flat))


def test_lacks_follows_the_package_graph(noxfile):
    assert noxfile._lacks("ep-core", "torch") and noxfile._lacks("ep-core", "ep_nccl_gin")
    assert not noxfile._lacks("ep-core", "ep_jit") and not noxfile._lacks("ep-torch", "torch")
    assert noxfile._lacks("ep-nccl-gin", "ep_jit") and not noxfile._lacks("ep-core", "numpy")
