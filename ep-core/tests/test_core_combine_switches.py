"""CPU: the kernels' JIT switches of issue 17, all on by default. EP_CORE_COMBINE_REDUCE_PARTS: unset is 4 where
the combine row splits into 4 whole 16-byte vectors, else 1; EP_CORE_COMBINE_LOCAL_REF and EP_CORE_WARP_MAJOR:
unset or 1 on, 0 off. The default build carries no name suffix (same names as before the switches); a switch
that differs from its default builds a separate instance `_rp<P>` / `_lr0` / `_wm0`. The defines are always all
three, explicit. The builds compile for sm_90a (direct default, each switch off, hybrid and direct mode across
nodes); invalid values are refused naming the variable."""

from __future__ import annotations

import shutil

import pytest
from ep_core.errors import EPConfigError
from ep_core.kernels import _source
from ep_core.kernels.plan import KernelConfig

ENV = _source.COMBINE_REDUCE_PARTS_ENV
LR = _source.COMBINE_LOCAL_REF_ENV
WM = _source.WARP_MAJOR_ENV
SWITCHES = (ENV, LR, WM)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for k in SWITCHES:
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("value", [None, "", "  "])
def test_default_parts_is_4(monkeypatch, value):
    if value is not None:
        monkeypatch.setenv(ENV, value)
    assert _source.combine_reduce_parts(KernelConfig(8, 8, 7168)) == 4


@pytest.mark.parametrize(("hidden", "parts"), [(7168, 4), (256, 4), (32, 4), (528, 1), (16, 1)])
def test_default_parts_falls_back_to_whole_rows(hidden, parts):
    # 4 parts need a row of a multiple of 64 bytes (hidden % 32 == 0): else the default is whole rows, never a refusal
    assert _source.default_combine_reduce_parts(KernelConfig(1, 8, hidden)) == parts
    assert _source.combine_reduce_parts(KernelConfig(1, 8, hidden)) == parts


@pytest.mark.parametrize("value", ["1", " 1 ", "2", "4", "8"])
def test_parts_accepted(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    assert _source.combine_reduce_parts(KernelConfig(8, 8, 7168)) == int(value)


@pytest.mark.parametrize("value", ["0", "-2", "x", "33", "3"])
def test_parts_refused(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(EPConfigError, match=ENV):
        _source.combine_reduce_parts(
            KernelConfig(8, 8, 7168)
        )  # 3 does not divide 14336 bytes into 16-byte vectors


def test_explicit_parts_refused_where_the_default_falls_back(monkeypatch):
    monkeypatch.setenv(ENV, "4")  # 1056-byte row: 4 parts of 16.5 vectors
    with pytest.raises(EPConfigError, match=f"{ENV}.*1056 bytes"):
        _source.combine_reduce_parts(KernelConfig(1, 8, 528))


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("", True), ("1", True), (" 1", True), ("0", False), (" 0 ", False)]
)
@pytest.mark.parametrize("env", [LR, WM])
def test_on_off_values(monkeypatch, env, value, on):
    if value is not None:
        monkeypatch.setenv(env, value)
    read = _source.combine_local_ref if env == LR else _source.warp_major
    assert read() is on


@pytest.mark.parametrize("value", ["2", "yes", "-1", "on"])
@pytest.mark.parametrize("env", [LR, WM])
def test_on_off_refused(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    read = _source.combine_local_ref if env == LR else _source.warp_major
    with pytest.raises(EPConfigError, match=env):
        read()


@pytest.mark.parametrize(
    ("env", "hidden", "want_defines", "suffix"),
    [
        ({}, 7168, (4, 1, 1), ""),
        ({}, 528, (1, 1, 1), ""),  # the default P of this row is 1: no `_rp1`
        ({ENV: "4"}, 7168, (4, 1, 1), ""),  # explicitly the default: the same instance
        ({ENV: "1"}, 7168, (1, 1, 1), "_rp1"),
        ({ENV: "2"}, 7168, (2, 1, 1), "_rp2"),
        ({ENV: "2"}, 528, (2, 1, 1), "_rp2"),
        ({LR: "0"}, 7168, (4, 0, 1), "_lr0"),
        ({WM: "0"}, 7168, (4, 1, 0), "_wm0"),
        ({ENV: "1", LR: "0", WM: "0"}, 7168, (1, 0, 0), "_rp1_lr0_wm0"),
        ({LR: "1", WM: "1"}, 7168, (4, 1, 1), ""),
    ],
)
def test_switch_defines_and_suffix(monkeypatch, env, hidden, want_defines, suffix):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    defines, got = _source.jit_switches(KernelConfig(8, 8, hidden))
    assert defines == dict(
        zip(("EP_CORE_COMBINE_REDUCE_PARTS", "EP_CORE_COMBINE_LOCAL_REF", "EP_CORE_WARP_MAJOR"), want_defines)
    )
    assert got == suffix


def _have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")


@pytest.fixture
def jit_cache(shared_jit_cache):
    """The compile tests here check the artifacts only: one cache for the test process (conftest.py)."""
    return shared_jit_cache


def _check(art, name: str) -> None:
    assert art.name == name
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(_source.KERNEL_NAMES) <= set(art.kernel_names)


@needs_nvcc
def test_default_instance_compiles(jit_cache):
    cfg = KernelConfig(8, 8, 7168)
    art = _source.compile_kernels(cfg, arch="sm_90a")
    _check(art, f"ep_core_direct_n8_k8_h7168_e2_p0_w{cfg.num_warps}_ipc")  # the name of before the switches


@needs_nvcc
@pytest.mark.parametrize(
    ("env", "cfg", "suffix"),
    [
        ({ENV: "1"}, KernelConfig(8, 8, 7168), "_rp1"),
        ({LR: "0"}, KernelConfig(1, 8, 7168), "_lr0"),
        ({WM: "0"}, KernelConfig(8, 8, 7168), "_wm0"),
    ],
    ids=["reduce-parts-1", "local-ref-0", "warp-major-0"],
)
def test_switch_off_instance_compiles(jit_cache, monkeypatch, env, cfg, suffix):
    default = _source.compile_kernels(cfg, arch="sm_90a")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    off = _source.compile_kernels(cfg, arch="sm_90a")
    _check(off, default.name + suffix)
    assert off.key != default.key
    assert off.cubin_path.read_bytes() != default.cubin_path.read_bytes()


@needs_nvcc
@pytest.mark.parametrize(
    "cfg",
    [KernelConfig(4, 8, 1024, num_scaleup_ranks=2), KernelConfig(4, 8, 1024, num_nvlink_ranks=2)],
    ids=["hybrid-2x2", "direct-xnode-2x2"],
)
def test_multi_node_default_instance_compiles(jit_cache, cfg):
    # their copy epilogue is direct mode's (token.cuh work order): the default defines must build there too
    art = _source.compile_kernels(cfg, arch="sm_90a")
    assert not any(s in art.name for s in ("_rp", "_lr0", "_wm0"))
    _check(art, art.name)
