"""CPU: `python -m ep_core compile` prebuilds the instances the runtime would ask for (real nvcc compile of a small
config), the runtime's own compile then hits the cache, hybrid configurations build the hybrid kernels (emulated
scale-out over ipc, GIN over nccl) and invalid configurations are refused."""

from __future__ import annotations

import os
import shutil

import pytest
from ep_core import prebuild
from ep_core.__main__ import main
from ep_core.errors import EPConfigError
from ep_core.kernels._source import compile_kernels
from ep_core.kernels.plan import KernelConfig

ep_jit = pytest.importorskip("ep_jit")


def _have_nvcc() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()


def _run(cmd: str) -> int:
    return main(cmd.split())


def test_instances_are_the_executor_keys() -> None:
    inst = prebuild.plan_instances(num_ranks=4, hidden=1024, num_topk=8, num_experts=32, fp8=True)
    assert [i.config for i in inst] == [
        KernelConfig(4, 8, 1024),  # bf16 dispatch and every combine
        KernelConfig(4, 8, 1024, 1, 8),  # FP32 scale per 128 elements
        KernelConfig(4, 8, 1024, 1, 2),  # UE8M0 x4 per int32 pack
    ]
    assert "combine" in inst[0].uses
    only = prebuild.plan_instances(
        num_ranks=4, hidden=1024, num_topk=8, num_experts=32, fp8=True, num_sf_packs=(3,)
    )
    assert [i.config.num_sf_packs for i in only] == [0, 3]
    assert prebuild.fp8_sf_pack_counts(7168) == (56, 14)
    assert prebuild.fp8_sf_pack_counts(128) == (1,)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_scaleup_ranks": 3}, "num_scaleup_ranks: expected a divisor"),
        ({"num_experts": 6}, "num_experts: expected a multiple"),
        ({"hidden": 100}, "hidden"),
        ({"transport": "shm"}, "transport"),
    ],
)
def test_refused_configurations(kw, match) -> None:
    args = {"num_ranks": 4, "hidden": 256, "num_topk": 2, "num_experts": 8, **kw}
    with pytest.raises(EPConfigError, match=match):
        prebuild.plan_instances(**args)


def test_hybrid_instances() -> None:
    inst = prebuild.plan_instances(num_ranks=4, num_scaleup_ranks=2, hidden=1024, num_topk=8, num_experts=32)
    assert [i.config for i in inst] == [KernelConfig(4, 8, 1024, num_scaleup_ranks=2)]
    assert inst[0].config.scaleout == "emulated" and inst[0].config.is_hybrid
    gin = prebuild.plan_instances(
        num_ranks=4, num_scaleup_ranks=2, hidden=1024, num_topk=8, num_experts=32, transport="nccl"
    )
    assert gin[0].config.scaleout == "gin"


@needs_nvcc
def test_cli_hybrid_builds(capsys) -> None:
    rc = _run("compile --num-ranks 4 --num-scaleup-ranks 2 --hidden 256 --num-topk 2 --num-experts 8")
    assert rc == 0
    out = capsys.readouterr().out
    assert "ep_core_hybrid_n4_k2_h256" in out and "_su2_emu" in out
    assert "1 instance(s) ready (1 built, 0 cached)" in out


@needs_nvcc
def test_cli_compiles_and_runtime_hits_cache(capsys, monkeypatch) -> None:
    argv = (
        "compile --num-ranks 2 --hidden 256 --num-topk 2 --num-experts 8 --fp8 --num-sf-packs 2 --num-sms 8"
    )
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "2 instance(s) ready (2 built, 0 cached)" in out
    assert "num_sms=8 (given; a launch parameter, not part of the JIT key)" in out
    assert out.count("kernel.cubin") == 2
    # A second run finds everything in the cache.
    ep_jit.clear_memo()
    assert main(argv.split()) == 0
    assert "(0 built, 2 cached)" in capsys.readouterr().out
    # The runtime compiles with arch=None (the GPU's): on an H200 that is sm_90a, and it must hit these entries.
    import ep_jit._driver as drv

    monkeypatch.setattr(drv, "current_arch", lambda: "sm_90a")
    ep_jit.clear_memo()
    for cfg in (KernelConfig(2, 2, 256), KernelConfig(2, 2, 256, 1, 2)):
        assert compile_kernels(cfg).from_cache


def test_cli_build_failure_exits_1(capsys, monkeypatch) -> None:
    def boom(config, arch=None):
        raise ep_jit.CompileError("nvcc failed: fake")

    monkeypatch.setattr(prebuild, "compile_kernels", boom)
    rc = _run("compile --num-ranks 2 --hidden 256 --num-topk 2 --num-experts 8")
    assert rc == 1
    assert "build failed" in capsys.readouterr().err


@needs_nvcc
def test_cli_nccl_transport(capsys) -> None:
    ep_nccl_gin = pytest.importorskip("ep_nccl_gin")
    try:
        ep_nccl_gin.include_dirs(check=False)
    except Exception as e:  # no NCCL headers on this machine
        pytest.skip(f"no NCCL device headers: {e}")
    assert _run("compile --num-ranks 2 --hidden 256 --num-topk 2 --num-experts 8 --transport nccl") == 0
    assert "_nccl." in capsys.readouterr().out
    # hybrid over nccl: the GIN scale-out put, built against NCCL's device headers
    hybrid = "compile --num-ranks 4 --num-scaleup-ranks 2 --hidden 256 --num-topk 2 --num-experts 8 --transport nccl"
    assert _run(hybrid) == 0
    assert "_nccl_su2_gin." in capsys.readouterr().out


@needs_nvcc
def test_cli_builds_the_switched_instance_the_runtime_loads(capsys, monkeypatch) -> None:
    # the issue-17 JIT switches come from the environment, read by the same compile_kernels as the runtime's
    monkeypatch.delenv("EP_CORE_COMBINE_REDUCE_PARTS", raising=False)
    monkeypatch.delenv("EP_CORE_WARP_MAJOR", raising=False)
    monkeypatch.setenv("EP_CORE_COMBINE_LOCAL_REF", "0")
    assert _run("compile --num-ranks 2 --hidden 256 --num-topk 2 --num-experts 8") == 0
    out = capsys.readouterr().out
    assert "EP_CORE_COMBINE_REDUCE_PARTS=4 EP_CORE_COMBINE_LOCAL_REF=0 EP_CORE_WARP_MAJOR=1" in out
    assert "_lr0." in out and "_wm0" not in out and "_rp" not in out
    ep_jit.clear_memo()
    assert compile_kernels(KernelConfig(2, 2, 256), arch="sm_90a").from_cache


def test_cli_refuses_an_invalid_switch(capsys, monkeypatch) -> None:
    monkeypatch.setenv("EP_CORE_WARP_MAJOR", "2")
    assert _run("compile --num-ranks 2 --hidden 256 --num-topk 2 --num-experts 8") == 2
    assert "EP_CORE_WARP_MAJOR: expected 0 or 1" in capsys.readouterr().err
