"""The GPU half of ``BucketBuffer.reduce_scatter(comm_precision="bf16")``
(``CopyEngineBackend.bucket_reduce_scatter_bf16``: the sender's pack, the stream barriers, the owner's reduce over
the peers' packed bf16) on the host model of streams of ``test_torch_elastic_protocol.py`` (N ranks in one process,
the two kernels modelled by ``ep_core.bucket_bf16``'s numpy steps in stream order): the results equal DeepEP's
arithmetic (every sender's stochastic rounding, summed peers ``rank-1, rank-2, ...``) bit for bit, the other shards
hold the packed bf16 sent, and the streams drain (issue 42). The kernels' own arithmetic: ep-core's
``test_core_bucket_bf16.py``."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ep_core import bucket_bf16
from ep_core.bf16 import bf16_to_float32, stochastic_bits


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


def _at(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _kernels(ops, n: int) -> None:
    """``DriverOps.bucket_bf16`` on the host model: each kernel a numpy step run in stream order."""

    def bucket_bf16_call(kind, entries, bases, rank, scale, num_sms, stream):
        def run() -> None:
            for off, m in entries:
                if kind == "pack":
                    bucket_bf16.pack(_at(bases[rank] + off, 4 * n * m).view(np.float32), rank, n)
                    continue
                own = _at(bases[rank] + off + 4 * rank * m, 4 * m).view(np.float32)
                peers = [_at(bases[(rank - p) % n] + off + 4 * rank * m, 4 * m) for p in range(1, n)]
                own[:] = bucket_bf16.reduce(own, [bucket_bf16.packed(b, m, n) for b in peers], scale)

        ops.q.append(("call", run))

    ops.bucket_bf16 = bucket_bf16_call


def _deepep(inputs: list[torch.Tensor], rank: int, scale: float) -> torch.Tensor:
    """DeepEP's result on `rank`, written out: its fp32 shard + each peer's rounded shard, then the scale."""
    n = len(inputs)
    m = inputs[0].numel() // n
    acc = inputs[rank][rank * m : (rank + 1) * m].clone()
    for p in range(1, n):
        q = (rank - p) % n
        sent = stochastic_bits(inputs[q].numpy())[rank * m : (rank + 1) * m]
        acc += torch.from_numpy(bf16_to_float32(sent))
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


@pytest.mark.parametrize(("n", "count"), [(1, 64), (2, 2 * 40008), (3, 3 * 64), (4, 4 * 64)])
def test_bf16_reduce_scatter_equals_the_cpu_arithmetic(n: int, count: int) -> None:
    streams, bs, (regions, _sigs) = _model()._ranks(n)
    for b in bs:
        _kernels(b.ops, n)
    views = [torch.from_numpy(regions[r][4096 : 4096 + 4 * count].view(np.float32)) for r in range(n)]
    for op, (salt, scale) in enumerate(((1, 0.25), (2, 1.0)), start=1):  # two in a row: the signal values
        inputs = _inputs(n, count, salt)
        for r in range(n):
            views[r].copy_(inputs[r])
        outs = [bs[r].bucket_reduce_scatter_bf16([(views[r], 4096)], op, scale, None) for r in range(n)]
        streams.run()
        assert streams.idle()
        m = count // n
        slots = (np.arange(m) // 32768) * 65536 + np.arange(m) % 32768  # the packed layout, 32768 a tile
        for r in range(n):
            want = _deepep(inputs, r, scale)
            assert _same_bits(outs[r][0], want), (op, r)
            assert outs[r][0].data_ptr() == views[r][r * m].data_ptr()
            u16 = views[r].numpy().view(np.uint16)
            for q in range(n):  # the others: the bf16 sent, packed; the rest of their bytes as they were
                if q != r:
                    shard = u16[2 * q * m : 2 * (q + 1) * m]
                    assert np.array_equal(
                        shard[slots], stochastic_bits(inputs[r].numpy())[q * m : (q + 1) * m]
                    )
                    rest = np.ones(2 * m, bool)
                    rest[slots] = False
                    assert np.array_equal(
                        shard[rest], inputs[r][q * m : (q + 1) * m].numpy().view(np.uint16)[rest]
                    )
