"""CPU check of benchmarks/profile_ops.py --register-combine: inside its context the executor launches the direct
combine without dynamic shared memory (the register path), and the staged default comes back afterwards."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_ops.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("profile_ops_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_register_combine_context():
    from ep_core.kernels import direct_rank
    from ep_core.kernels.plan import KernelConfig

    prof = _load()
    cfg = KernelConfig(1, 8, 7168)
    staged = direct_rank._combine_smem(cfg)
    assert staged == cfg.combine_dynamic_smem_bytes > 0
    with prof.register_combine_launches(True):
        assert direct_rank._combine_smem(cfg) == 0
    assert direct_rank._combine_smem(cfg) == staged
    with prof.register_combine_launches(False):
        assert direct_rank._combine_smem(cfg) == staged
