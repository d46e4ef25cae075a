"""GPU: 2 and 4 processes sharing the GPU, one rank each, buffers exchanged through ep_symmem or CUDA IPC handles
(file bootstrap of ep_symmem in both cases):
dispatch (sync, deterministic and not) and combine against ep_core.reference."""

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
    import json, sys
    import numpy as np
    from ep_core import reference, routing
    from ep_core.kernels._cuda import DeviceArray
    from ep_core.loopback import ProcessRank

    rank, size, directory, memory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    M, H, K, E = 64, 512, 8, 32
    import ep_symmem
    boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
    pr = ProcessRank(boot, num_max_tokens_per_rank=M, hidden=H, num_topk=K, gpu_timeout_secs=30.0, memory=memory)
    checks = 0
    for it, (det, expand) in enumerate([(True, False), (False, False), (True, True)]):
        inp = routing.make_inputs(size, [M, M // 2, 0, 17][:size], H, E, K, seed=7 + it, masked_ratio=0.2)
        ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M,
                                 do_expand=expand, expert_alignment=4 if expand else 1)
        up = lambda a: DeviceArray.from_numpy(a, pr.stream)
        out = pr.dispatch(up(inp.xs[rank]), up(inp.topk_idxs[rank]), up(inp.topk_weights[rank]), num_experts=E,
                          deterministic=det, do_expand=expand, expert_alignment=4 if expand else 1,
                          num_sms=4)
        k = out.to_reference()
        if not det:
            k = reference.canonical_order(k)
        r = ref[rank]
        nv = r.num_valid_rows
        if expand:
            v = r.valid_expanded_rows
            assert np.array_equal(k.recv_x[v], r.recv_x[v]), "recv_x"
        else:
            assert np.array_equal(k.recv_x[:nv], r.recv_x[:nv]), "recv_x"
            assert np.array_equal(k.recv_topk_idx[:nv], r.recv_topk_idx[:nv]), "recv_topk_idx"
        # combine: every rank's identity experts; gather the handles for the reference through the bootstrap
        comb = pr.combine(out.recv_x, out.handle, num_sms=4)
        import pickle
        mine = pickle.dumps((out.recv_x.numpy(), out.to_reference().handle))
        everyone = [pickle.loads(b) for b in boot.allgather(mine)]
        ref_c = reference.combine([e[0] for e in everyone], [e[1] for e in everyone])
        assert np.array_equal(comb.combined_x.numpy(), ref_c[rank].combined_x), "combined_x"
        checks += 1
    pr.check_errors()
    pr.close()
    print(json.dumps({"rank": rank, "checks": checks}))
    """
)


@pytest.mark.parametrize("memory", ["cuda_ipc", "symmem"])
@pytest.mark.parametrize("size", [2, 4])
def test_processes_share_gpu(size: int, memory: str, tmp_path) -> None:
    results = run_workers(WORKER, size, tmp_path, memory)
    assert sorted(r["rank"] for r in results) == list(range(size))
    assert all(r["checks"] == 3 for r in results)


EPBUFFER_WORKER = textwrap.dedent(
    """
    import json, pickle, sys
    import numpy as np
    import ep_symmem
    from ep_core import EPBuffer, reference, routing
    from ep_core.device_array import DeviceArray as CoreArray
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
        return _cuda.DeviceArray.numpy(a.owner) if hasattr(a, "owner") and isinstance(a.owner, _cuda.DeviceArray) \
            else np.asarray(a)

    inp = routing.make_inputs(size, [M, 40, 0, 17][:size], H, E, K, seed=21, masked_ratio=0.2)
    ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M)
    res = buf.dispatch(up(inp.xs[rank], "bfloat16"), up(inp.topk_idxs[rank], "int64"),
                       up(inp.topk_weights[rank], "float32"), num_experts=E, num_sms=4)
    _cuda.driver().cuCtxSynchronize()
    recv_x = down(res.recv_x)
    h = res.handle
    meta = down(h.recv_src_metadata)
    r = ref[rank]
    nv = r.num_valid_rows
    order = np.argsort(meta[:nv, 0], kind="stable")
    ref_order = np.argsort(np.asarray(r.handle.recv_src_metadata)[:nv, 0], kind="stable")
    assert np.array_equal(recv_x[:nv][order], r.recv_x[:nv][ref_order]), "recv_x"
    comb = buf.combine(res.recv_x, h, res.recv_topk_weights, num_sms=4)
    _cuda.driver().cuCtxSynchronize()
    w = down(comb.combined_topk_weights)
    want = np.where(inp.topk_idxs[rank] >= 0, inp.topk_weights[rank], 0).astype(np.float32)
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32)), "weights round trip"
    buf.destroy()
    print(json.dumps({"rank": rank, "ok": True}))
    """
)


def test_epbuffer_ipc_transport(tmp_path) -> None:
    size = 2
    for result in run_workers(EPBUFFER_WORKER, size, tmp_path):
        assert result["ok"]
