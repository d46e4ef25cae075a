"""scripts/sass_diff.py, the machine-code comparison that proves a device-code refactor on a machine without a GPU:
its SPEC parsing, its listing normalization, and a real build (nvcc + nvdisasm) that calls a comment change
identical and a changed constant different, in that kernel only."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sass_diff.py"


def _load():
    spec = importlib.util.spec_from_file_location("sass_diff_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


sass_diff = _load()


def test_specs_name_every_kernel_family():
    direct = sass_diff.parse_spec("n8.k8.h7168")
    assert (direct.num_ranks, direct.num_topk, direct.hidden, direct.elem_size) == (8, 8, 7168, 2)
    fp8 = sass_diff.parse_spec("n8.k8.h7168.fp8")
    assert (fp8.elem_size, fp8.num_sf_packs) == (1, 56)
    assert sass_diff.parse_spec("n8.k8.h7168.fp8.p14").num_sf_packs == 14
    hybrid = sass_diff.parse_spec("n8.k8.h7168.su4")
    assert hybrid.is_hybrid and hybrid.scaleout == "emulated"
    xnode = sass_diff.parse_spec("n8.k8.h7168.nccl.xn4")
    assert xnode.is_direct_xnode and xnode.scaleout == "gin" and xnode.transport == "nccl"
    for spec in (*sass_diff.DEFAULT_SPECS, *sass_diff.QUICK_SPECS):
        sass_diff.parse_spec(spec)
    assert set(sass_diff.SIDE_INSTANCES) <= set(sass_diff.DEFAULT_SPECS)


def test_every_other_instance_builds_from_given_headers():
    pytest.importorskip("ep_core")
    import importlib
    import inspect

    for name, (module, function) in sass_diff.SIDE_INSTANCES.items():
        assert sass_diff.parse_spec(name) == name
        assert "headers" in inspect.signature(getattr(importlib.import_module(module), function)).parameters


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("n8.k8", "missing h"),
        ("n8.k8.h7168.bf16", "unknown field 'bf16'"),
        ("n8.k8.h7168.p14", "goes with fp8"),
        ("n8.k8.h7168.su4.xn4", "exclude each other"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        sass_diff.parse_spec(spec)


LISTING = """\
\t.target\tsm_90a
//--------------------- .text.kernel_a          --------------------------
\t.section\t.text.kernel_a,"ax",@progbits
kernel_a:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0010*/               @P0 BRA `(.L_x_9) ;
.L_x_9:
        /*0020*/                   EXIT ;
//--------------------- .text.kernel_b          --------------------------
        /*0000*/                   BRA `(.L_x_12) ;
.L_x_12:
        /*0010*/                   CALL.REL.NOINC `($__internal_4_$__cuda_sm20_rem_s64) ;
        /*0020*/                   EXIT ;
//--------------------- .text.$__internal_4_$__cuda_sm20_rem_s64 --------------------------
        /*0000*/                   RET.REL.NODEC R4 `(kernel_b) ;
"""


def test_listing_keeps_instructions_renumbers_labels_per_kernel_and_drops_helper_numbers():
    got = sass_diff.kernels_of(LISTING)
    assert got == {
        "kernel_a": ["MOV R1, c[0x0][0x28] ;", ".L0:", "@P0 BRA `(.L1) ;", ".L1:", "EXIT ;"],
        "kernel_b": [
            "BRA `(.L0) ;",
            ".L0:",
            "CALL.REL.NOINC `($__internal_$__cuda_sm20_rem_s64) ;",
            "EXIT ;",
        ],
        "$__internal_$__cuda_sm20_rem_s64": ["RET.REL.NODEC R4 `(kernel_b) ;"],
    }


def test_a_changed_instruction_is_counted():
    base = {"k": ["A ;", "B ;", "C ;"]}
    rows = sass_diff.compare("n2.k8.h2048", base, {"k": ["A ;", "X ;", "C ;"]})
    assert [(r.kernel, r.identical, r.changed) for r in rows] == [("k", False, 2)]
    assert sass_diff.compare("n2.k8.h2048", base, base)[0].identical
    missing = sass_diff.compare("n2.k8.h2048", base, {})[0]
    assert not missing.identical and not missing.new and missing.work_lines == 0
    added = sass_diff.compare("n2.k8.h2048", {}, base)[0]
    assert added.new and added.identical  # a kernel the base lacks changes none of the others


def _have_tools() -> bool:
    import os

    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if shutil.which("nvcc") is None and not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return False
    try:
        sass_diff.nvdisasm()
    except Exception:
        return False
    return True


@pytest.mark.skipif(
    not _have_tools(), reason="nvcc or nvdisasm not found (the tests session installs nvdisasm)"
)
def test_a_comment_is_identical_and_a_constant_is_not(tmp_path, monkeypatch):
    pytest.importorskip("ep_core")
    import ep_jit

    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    base = sass_diff.working_headers()

    def variant(name: str, old: str, new: str) -> tuple[str, str]:
        tree = tmp_path / name
        for d in sass_diff.HEADER_DIRS:
            shutil.copytree(ROOT / d, tree / d)
        header = tree / "ep-core/include/ep_core/dispatch.cuh"
        text = header.read_text()
        assert old in text
        header.write_text(text.replace(old, new, 1))
        return tuple(str(tree / d) for d in sass_diff.HEADER_DIRS)

    spec = ["n2.k8.h2048"]
    comment = variant("comment", "    // 4. send\n", "    // 4. send (a comment only)\n")
    rows = sass_diff.run(spec, base, comment, "sm_90a", 2, log=lambda _: None)
    kernels = [r.kernel for r in rows]
    assert {"ep_combine_impl", "ep_dispatch_copy_epilogue_impl", "ep_dispatch_impl"} <= set(kernels)
    assert all(r.identical and r.work_lines > 100 for r in rows)

    code = variant(
        "code", "kDirectOwnRowsTailOnly && kNumRanks == 1)", "kDirectOwnRowsTailOnly && kNumRanks == 2)"
    )
    rows = {r.kernel: r for r in sass_diff.run(spec, base, code, "sm_90a", 2, log=lambda _: None)}
    assert not rows["ep_dispatch_impl"].identical and rows["ep_dispatch_impl"].changed > 0
    assert rows["ep_combine_impl"].identical and rows["ep_dispatch_copy_epilogue_impl"].identical
