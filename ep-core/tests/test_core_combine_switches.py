"""CPU: the kernels' JIT switches of issue 17. EP_CORE_COMBINE_REDUCE_PARTS: unset or 1 is the default build (no
define, same instance name), P > 1 a separate instance `_rp<P>`; EP_CORE_COMBINE_LOCAL_REF and EP_CORE_WARP_MAJOR:
unset or 0 default, 1 an instance `_lr` / `_wm`. They compile for sm_90a, alone and together; invalid values are
refused naming the variable."""

from __future__ import annotations

import shutil

import pytest
from ep_core.errors import EPConfigError
from ep_core.kernels import _source
from ep_core.kernels.plan import KernelConfig

ENV = _source.COMBINE_REDUCE_PARTS_ENV
LR = _source.COMBINE_LOCAL_REF_ENV


@pytest.mark.parametrize("value", [None, "", "1", " 1 "])
def test_default_is_whole_rows(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert _source.combine_reduce_parts(KernelConfig(8, 8, 7168)) == 1


@pytest.mark.parametrize("value", ["2", "4", "8"])
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


def _have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


@pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
def test_parts_instance_compiles(monkeypatch, tmp_path):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    cfg = KernelConfig(8, 8, 7168)
    monkeypatch.delenv(ENV, raising=False)
    plain = _source.compile_kernels(cfg, arch="sm_90a")
    monkeypatch.setenv(ENV, "2")
    split = _source.compile_kernels(cfg, arch="sm_90a")
    assert "_rp2" in split.cubin_path.parent.name and "_rp" not in plain.cubin_path.parent.name
    assert split.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert split.cubin_path.read_bytes() != plain.cubin_path.read_bytes()
    assert set(_source.KERNEL_NAMES) <= set(split.kernel_names)


@pytest.mark.parametrize(
    ("value", "on"), [(None, False), ("", False), ("0", False), ("1", True), (" 1", True)]
)
def test_local_ref_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(LR, raising=False)
    else:
        monkeypatch.setenv(LR, value)
    assert _source.combine_local_ref() is on


@pytest.mark.parametrize("value", ["2", "yes", "-1"])
def test_local_ref_refused(monkeypatch, value):
    monkeypatch.setenv(LR, value)
    with pytest.raises(EPConfigError, match=LR):
        _source.combine_local_ref()


@pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
@pytest.mark.parametrize("parts", ["1", "2"])
def test_local_ref_instance_compiles(monkeypatch, tmp_path, parts):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    monkeypatch.setenv(ENV, parts)
    monkeypatch.setenv(LR, "1")
    art = _source.compile_kernels(KernelConfig(1, 8, 7168), arch="sm_90a")
    name = art.cubin_path.parent.name
    assert "_lr" in name and (("_rp2" in name) == (parts == "2"))
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(_source.KERNEL_NAMES) <= set(art.kernel_names)


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True)])
def test_warp_major_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(_source.WARP_MAJOR_ENV, raising=False)
    else:
        monkeypatch.setenv(_source.WARP_MAJOR_ENV, value)
    assert _source.warp_major() is on
    monkeypatch.setenv(_source.WARP_MAJOR_ENV, "on")
    with pytest.raises(EPConfigError, match=_source.WARP_MAJOR_ENV):
        _source.warp_major()


@pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
def test_warp_major_instance_compiles(monkeypatch, tmp_path):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    monkeypatch.setenv(_source.WARP_MAJOR_ENV, "1")
    art = _source.compile_kernels(KernelConfig(8, 8, 7168), arch="sm_90a")
    assert "_wm" in art.cubin_path.parent.name
    assert set(_source.KERNEL_NAMES) <= set(art.kernel_names)
