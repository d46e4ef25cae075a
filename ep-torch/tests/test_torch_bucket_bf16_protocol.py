"""The GPU half of ``BucketBuffer.reduce_scatter(comm_precision="bf16")``
(``CopyEngineBackend.bucket_reduce_scatter_bf16``: the stream barriers, the owner's read of each peer's float32
shard, its own rounding, the sum in the CPU's order) on the host model of streams of
``test_torch_elastic_protocol.py`` (N ranks in one process): the results equal the CPU reference path's arithmetic
(``bf16_stochastic_round`` of every sender, summed peers ``rank-1, rank-2, ...``) bit for bit, the other shards stay
as they were, and the streams drain (issue 42)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ep_torch.bucket_buffer import bf16_stochastic_round, bf16_stochastic_rounded


def _model():
    """The host model (``_ranks``) of the elastic protocol tests, loaded by path (the test folder is no package)."""
    name = "ep_torch_tests_elastic_protocol"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("test_torch_elastic_protocol.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _cpu_formula(inputs: list[torch.Tensor], rank: int, scale: float) -> torch.Tensor:
    """What ``BucketBuffer._reduce_scatter_bf16`` computes on the CPU reference backend for `rank`."""
    n = len(inputs)
    m = inputs[0].numel() // n
    acc = inputs[rank][rank * m : (rank + 1) * m].clone()
    for p in range(1, n):
        q = (rank - p) % n
        acc += bf16_stochastic_round(inputs[q], q, n)[rank * m : (rank + 1) * m].float()
    if scale != 1.0:
        acc.mul_(torch.tensor(scale, dtype=torch.float32))
    return acc


def _inputs(n: int, count: int, salt: int) -> list[torch.Tensor]:
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(100 * salt + r)
        x = torch.randn(count, generator=g) * 10
        x[:4] = torch.tensor([3.3961514e38, -1e-40, float("inf"), 1.0 + 2**-9])  # carries, subnormals, inf
        out.append(x)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bf16_reduce_scatter_equals_the_cpu_arithmetic(n: int) -> None:
    streams, bs, (regions, _sigs) = _model()._ranks(n)
    count = n * 64
    views = [torch.from_numpy(regions[r][4096 : 4096 + 4 * count].view(np.float32)) for r in range(n)]
    for op, (salt, scale) in enumerate(((1, 0.25), (2, 1.0)), start=1):  # two in a row: the signal values
        inputs = _inputs(n, count, salt)
        for r in range(n):
            views[r].copy_(inputs[r])
        outs = [
            bs[r].bucket_reduce_scatter_bf16([(views[r], 4096)], op, scale, bf16_stochastic_rounded)
            for r in range(n)
        ]
        streams.run()
        assert streams.idle()
        m = count // n
        for r in range(n):
            want = _cpu_formula(inputs, r, scale)
            assert _same_bits(outs[r][0], want), (op, r)
            assert outs[r][0].data_ptr() == views[r][r * m].data_ptr()
            others = torch.ones(count, dtype=torch.bool)
            others[r * m : (r + 1) * m] = False
            assert _same_bits(views[r][others], inputs[r][others]), (op, r)  # left as they were
