"""ep_core's knobs are read in `ep_core._env` only, under `EPKIT_` names; the old `EP_CORE_` names of the JIT
switches still work for one release, with a DeprecationWarning, and the `EPKIT_` name wins when both are set
(issue 45)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ep_core import _env
from ep_core.errors import EPConfigError
from ep_core.kernels import _source
from ep_core.kernels.plan import KernelConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "ep_core"


def test_every_knob_has_the_epkit_prefix_and_its_old_name_the_ep_core_one():
    for name, knob in _env.KNOBS.items():
        assert name.startswith("EPKIT_") and knob.name == name
        assert knob.old == "" or knob.old == "EP_CORE_" + name[len("EPKIT_") :]


def test_no_module_but_env_reads_the_environment():
    readers = {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if re.search(r"os\.environ\.get|os\.getenv", p.read_text())
    }
    # CUDA's own variable, which ep_core reads and sets for the driver (not a knob of ep_core's)
    assert readers <= {"_env.py", "kernels/_cuda.py"}
    assert "EPKIT_" not in "".join(
        line for line in (SRC / "kernels" / "_cuda.py").read_text().splitlines() if "os.environ" in line
    )


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (_source.WARP_MAJOR_ENV, "EP_CORE_WARP_MAJOR"),
        (_source.COMBINE_LOCAL_REF_ENV, "EP_CORE_COMBINE_LOCAL_REF"),
    ],
)
def test_the_old_name_works_with_a_warning_and_the_new_one_wins(monkeypatch, new, old):
    read = _source.warp_major if new == _source.WARP_MAJOR_ENV else _source.combine_local_ref
    monkeypatch.delenv(new, raising=False)
    monkeypatch.setenv(old, "0")
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*set {new} instead"):
        assert read() is False
    monkeypatch.setenv(new, "1")
    assert read() is True  # no warning: the new name is read
    monkeypatch.delenv(new)
    monkeypatch.setenv(old, "2")
    with pytest.warns(DeprecationWarning), pytest.raises(EPConfigError, match=f"^{old}: expected 0 or 1"):
        read()


def test_reduce_parts_and_phase_timing_by_either_name(monkeypatch):
    cfg = KernelConfig(1, 8, 7168)
    monkeypatch.delenv(_source.COMBINE_REDUCE_PARTS_ENV, raising=False)
    monkeypatch.setenv("EP_CORE_COMBINE_REDUCE_PARTS", "2")
    with pytest.warns(DeprecationWarning):
        assert _source.combine_reduce_parts(cfg) == 2
    monkeypatch.setenv(_source.COMBINE_REDUCE_PARTS_ENV, "1")
    assert _source.combine_reduce_parts(cfg) == 1
    monkeypatch.delenv(_source.PHASE_TIMING_ENV, raising=False)
    monkeypatch.setenv("EP_CORE_PHASE_TIMING", "1")
    with pytest.warns(DeprecationWarning):
        assert _source.phase_timing_enabled()


def test_ep_cores_tree_imports_no_ep_torch():
    """The arrows point down: ep-core's sources and benchmarks never import ep_torch (ep_torch's road is timed by
    the top-level benchmarks/bench_host_torch.py)."""
    root = SRC.parents[1]
    for p in [*root.joinpath("src").rglob("*.py"), *root.joinpath("benchmarks").rglob("*.py")]:
        assert not re.search(r"^\s*(from|import)\s+ep_torch\b", p.read_text(), re.M), p
