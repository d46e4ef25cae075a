"""GPU: the loopback domain launches its ranks one after another with the synchronizing frees (cuMemFree,
cuMemFreeHost) and the cycle collector held (`_cuda.frees_deferred`), so nothing between two ranks' launches can wait
for the device, whose running kernels wait for the ranks not launched yet."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _cuda  # noqa: E402
from ep_core.kernels._cuda import DeviceBuffer  # noqa: E402
from ep_core.kernels.rank_driver import RankDriver  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M, HIDDEN, K, E = 64, 512, 8, 64


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_free_between_the_ranks_launches_waits_for_the_last_launch(op: str, monkeypatch) -> None:
    dom = LoopbackDomain(2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=5.0)
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=17, masked_ratio=0.1)
    kw = {"num_experts": E, "deterministic": True}
    first = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, **kw)  # loads the kernels
    dom.synchronize()
    doomed = DeviceBuffer(1 << 20)
    seen: list = []
    name = "launch_dispatch" if op == "dispatch" else "combine"
    orig = getattr(RankDriver, name)

    def launch_then_free(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if self.rank == 0:  # rank 0's kernel now waits for rank 1
            doomed.close()
            seen.append((gc.isenabled(), len(_cuda._deferred_frees or ())))
        return out

    monkeypatch.setattr(RankDriver, name, launch_then_free)
    if op == "dispatch":
        outs = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, **kw)
        ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_max_tokens_per_rank=M, **kw)
        got = [(o.recv_x.numpy(), r.recv_x) for o, r in zip(outs, ref)]
    else:
        comb = dom.combine([o.recv_x for o in first], [o.handle for o in first])
        ref = reference.combine([o.recv_x.numpy() for o in first], [o.to_reference().handle for o in first])
        got = [(c.combined_x.numpy(), r.combined_x) for c, r in zip(comb, ref)]
    dom.synchronize()
    assert seen == [(False, 1)], "the free between the launches ran at once (or the collector was on)"
    assert _cuda._deferred_frees is None and gc.isenabled()  # released after the last launch
    for a, b in got:
        assert np.array_equal(a, b)
    dom.close()
