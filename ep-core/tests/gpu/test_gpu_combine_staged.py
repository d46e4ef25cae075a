"""GPU: the staged direct combine (combine.cuh: bulk-copy send of rows sent as they are, `warp_staged_sum` in the
reduction), which the kernel takes when its launch carries `KernelConfig.combine_dynamic_smem_bytes` of dynamic
shared memory. Until the executor passes that memory itself, `staged_combine_launches` patches
`DirectRank._prepare` so that it does; the loopback cases of test_gpu_loopback.py (every combine mode: expand or
not, multiple reduction on/off, 0/1/2 biases, weights, sync / no sync / cached handles) then run against
ep_core.reference bitwise, on domains of their own."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
from ep_core_gpu_testing import num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)


@contextlib.contextmanager
def staged_combine_launches():
    """While active, every direct combine launch prepared by a DirectRank gets the staged path's shared memory."""
    from ep_core.kernels import _source, executor

    orig = executor.DirectRank._prepare

    def _prepare(self, kernel, name, geo, shared_mem, cooperative, args, dynamic):
        if name == "ep_combine_impl" and shared_mem == 0:
            cfg = next((c for c, ks in _source._loaded.items() if ks.combine is kernel), None)
            if cfg is not None and not cfg.is_hybrid:
                shared_mem = cfg.combine_dynamic_smem_bytes
        return orig(self, kernel, name, geo, shared_mem, cooperative, args, dynamic)

    executor.DirectRank._prepare = _prepare
    try:
        yield
    finally:
        executor.DirectRank._prepare = orig


def _loopback_module():
    path = Path(__file__).with_name("test_gpu_loopback.py")
    spec = importlib.util.spec_from_file_location("ep_core_gpu_loopback_for_staged_combine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(
        mod
    )  # its own `_domains`: fresh domains whose launches are prepared under the patch
    return mod


_loopback = _loopback_module()


@pytest.fixture(scope="module", autouse=True)
def _staged():
    with staged_combine_launches():
        yield
    for dom in _loopback._domains.values():
        dom.close()
    _loopback._domains.clear()


def test_staged_path_is_planned() -> None:
    from ep_core.kernels.plan import KernelConfig

    cfg = KernelConfig(8, _loopback.K, _loopback.HIDDEN)
    assert cfg.combine_dynamic_smem_bytes == cfg.num_warps * 2 * _loopback.HIDDEN


@pytest.mark.parametrize(
    "case", range(len(_loopback.CASES)), ids=lambda c: "-".join(map(str, _loopback.CASES[c]))
)
@pytest.mark.parametrize("n", (1, 2, 8))
def test_dispatch_combine_staged(n: int, case: int) -> None:
    _loopback.test_dispatch_combine(n, case)
