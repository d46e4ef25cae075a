"""GPU: a call that one rank rejects before launching gives up its device sequence number (`abandon_step`), so its
peers are never paired with that rank's next call: the kernels' envelopes differ and every rank raises at once,
long before the GPU timeout; after a collective `reset()` the buffers work again (2 processes sharing the GPU,
`ep_core.EPBuffer` over `IpcTransport`)."""

from __future__ import annotations

import textwrap

import pytest
from ep_core_gpu_testing import num_gpus, run_workers

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("ep_symmem")

WORKER = textwrap.dedent(
    """
    import json, pickle, sys, time
    import numpy as np
    import ep_symmem
    from ep_core import EPBuffer, reference, routing
    from ep_core.device_array import DeviceArray as CoreArray
    from ep_core.errors import EPDeviceError
    from ep_core.kernels import _cuda
    from ep_core.transports.ipc import IpcTransport

    rank, size, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    M, H, K, E = 64, 512, 8, 32
    boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
    buf = EPBuffer(boot, transport=IpcTransport("cuda_ipc"), num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                   num_experts=E, num_gpu_timeout_secs=30, num_cpu_timeout_secs=60)

    def up(a, dtype):
        mem = _cuda.DeviceArray.from_numpy(a, 0)
        return CoreArray(mem.ptr, a.shape, dtype, owner=mem)

    def down(a):
        return _cuda.DeviceArray.numpy(a.owner)

    inp = routing.make_inputs(size, [M, 40], H, E, K, seed=5, masked_ratio=0.1)
    args = (up(inp.xs[rank], "bfloat16"), up(inp.topk_idxs[rank], "int64"), up(inp.topk_weights[rank], "float32"))
    buf.dispatch(*args, num_experts=E, num_sms=4)
    _cuda.driver().cuCtxSynchronize()
    seen = {}
    if rank == 1:  # more tokens than num_max_tokens_per_rank: rejected before anything launches
        many = np.zeros((M + 1, H), np.uint16)
        try:
            buf.dispatch(up(many, "bfloat16"), up(np.zeros((M + 1, K), np.int64), "int64"), num_experts=E)
        except ValueError as exc:
            seen["rejected"] = "ValueError"  # EPValueError is a ValueError
    start = time.monotonic()
    try:  # rank 0's second launch meets rank 1's third: the envelopes differ
        buf.dispatch(*args, num_experts=E, num_sms=4)
        _cuda.driver().cuCtxSynchronize()
        buf.dispatch(*args, num_experts=E, num_sms=4)  # a failure left on the device is raised here at the latest
    except EPDeviceError as exc:
        seen["error"] = type(exc).__name__
        seen["message"] = str(exc)
    seen["seconds"] = time.monotonic() - start
    buf.reset()
    ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M)
    res = buf.dispatch(*args, num_experts=E, num_sms=4)
    _cuda.driver().cuCtxSynchronize()
    r = ref[rank]
    nv = r.num_valid_rows
    order = np.argsort(down(res.handle.recv_src_metadata)[:nv, 0], kind="stable")
    ref_order = np.argsort(np.asarray(r.handle.recv_src_metadata)[:nv, 0], kind="stable")
    seen["after_reset"] = bool(np.array_equal(down(res.recv_x)[:nv][order], r.recv_x[:nv][ref_order]))
    buf.destroy()
    print(json.dumps({"rank": rank, "seen": seen}))
    """
)


def test_rejected_call_gives_up_its_step_on_the_gpu(tmp_path) -> None:
    by_rank = {r["rank"]: r["seen"] for r in run_workers(WORKER, 2, tmp_path)}
    assert by_rank[1].get("rejected") == "ValueError", by_rank  # an EPValueError, a ValueError
    for rank, peer in ((0, 1), (1, 0)):
        seen = by_rank[rank]
        assert seen.get("error") == "EPDeviceError", (rank, seen)
        assert f"rank {peer} entered" in seen["message"], (rank, seen["message"])
        assert seen["seconds"] < 20.0, (rank, seen)  # the envelope, not the 30 s timeout, stopped it
        assert seen["after_reset"], (rank, seen)
