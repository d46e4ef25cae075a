"""GPU: the direct combine's staged path (combine.cuh: bulk-copy send of rows sent as they are, `warp_staged_sum` in
the reduction) is what the loopback tests run: RankDriver launches the direct combine with
`KernelConfig.combine_dynamic_smem_bytes` of dynamic shared memory (executor `_combine_smem`), and the kernel takes the
staged path when its launch has that much. test_gpu_loopback.py checks it bitwise in every combine mode; this file
only checks that the launch does carry the memory (so those tests do exercise the staged path)."""

from __future__ import annotations

import pytest
from ep_core_gpu_testing import num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)


def test_direct_combine_launch_carries_the_staging_memory() -> None:
    from ep_core.kernels import rank_driver
    from ep_core.kernels.plan import KernelConfig

    cfg = KernelConfig(8, 8, 7168)
    assert cfg.combine_dynamic_smem_bytes == cfg.num_warps * 2 * 7168
    assert rank_driver._combine_smem(cfg) == cfg.combine_dynamic_smem_bytes
    assert rank_driver._combine_smem(KernelConfig(4, 8, 1024, num_scaleup_ranks=2)) == 0
