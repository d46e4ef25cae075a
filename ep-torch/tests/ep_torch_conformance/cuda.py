"""Conformance ``cuda`` (CUDA only): streams, events, CUDA-graph capture."""

from __future__ import annotations

from typing import Any

import torch
from ep_torch.buffer import ElasticBuffer

from ._common import _bits, _Checks, _inputs, _same, _torch_x

# --------------------------------------------------------------------------------------------------------------------
# CUDA only: streams, events, CUDA-graph capture


def check_cuda(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    from ep_torch.cuda_graph import CapturedStep

    rank, n, device = cfg["rank"], cfg["world"], cfg["device"]
    m, hidden, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    buf = buffers["EP-deterministic-single-reduction"]
    inputs = _inputs("masked", n, m, hidden, e, k, False, 99)
    x = _torch_x(inputs, rank, device)
    idx = torch.from_numpy(inputs.topk_idxs[rank]).to(device)
    w = torch.from_numpy(inputs.topk_weights[rank]).to(device)

    def streams() -> None:
        comm = buf.get_comm_stream()
        assert comm is not None and comm is buffers["Elastic"].get_comm_stream(), (
            "one comm stream per process"
        )
        assert comm.priority <= torch.cuda.Stream().priority, "the comm stream has high priority"

    checks.run("cuda/comm stream", streams)

    # async dispatch + combine: events, then the results equal the synchronous ones
    sync = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
    sync_out = buf.combine(sync[0], sync[3])[0]
    prev = buf.capture()
    a_x, _, _, a_h, a_ev = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_experts=e,
        async_with_compute_stream=True,
        allocate_on_comm_stream=True,
        previous_event=prev,
    )
    a_ev.current_stream_wait()
    a_out, _, c_ev = buf.combine(a_x, a_h, async_with_compute_stream=True)
    c_ev.current_stream_wait()
    torch.cuda.synchronize()

    def events() -> None:
        assert a_ev.event is not None and not a_ev.event.is_cpu, "async dispatch returns a CUDA event"
        _same("async recv_x", a_x, _bits(sync[0]))
        _same("async combined_x", a_out, _bits(sync_out))

    checks.run("cuda/async events", events)

    # CUDA graph: a no-sync dispatch + combine captured once, replayed on new inputs, equals eager mode
    def step(xx: torch.Tensor, ii: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rx, _, _, hh, _ = buf.dispatch(xx, topk_idx=ii, topk_weights=ww, num_experts=e, do_cpu_sync=False)
        out, _, _ = buf.combine(rx, hh)
        return hh.psum_num_recv_tokens_per_scaleup_rank, out

    fresh = _inputs("unbalanced", n, m, hidden, e, k, False, 100)
    x2 = _torch_x(fresh, rank, device)
    if x2.shape[0] != x.shape[0]:
        x2 = x2[: x.shape[0]] if x2.shape[0] > x.shape[0] else torch.cat([x2, x[x2.shape[0] :]])
    i2 = torch.from_numpy(fresh.topk_idxs[rank]).to(device)[: x.shape[0]]
    if i2.shape[0] < x.shape[0]:
        i2 = torch.cat([i2, idx[i2.shape[0] :]])
    w2 = torch.ones(i2.shape, dtype=torch.float32, device=device)
    error: Exception | None = None
    try:
        graph = CapturedStep(step, x, idx, w)
        _, g_out = graph(x2.contiguous(), i2.contiguous(), w2)
        g_out = g_out.clone()
    except Exception as exc:  # keep the ranks in step, report below
        error = exc
    _, e_out = step(x2.contiguous(), i2.contiguous(), w2)
    torch.cuda.synchronize()

    def graphs() -> None:
        if error is not None:
            raise error
        _same("graph-replayed combine", g_out, _bits(e_out))

    checks.run("cuda/graph capture and replay", graphs)

    def capture_refuses_cpu_sync() -> None:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                buf.dispatch(x, topk_idx=idx, num_experts=e)
        except ValueError as exc:
            assert "do_cpu_sync" in str(exc)
            return
        raise AssertionError("a CPU-synchronizing dispatch was accepted inside CUDA-graph capture")

    checks.run("cuda/capture refuses cpu sync", capture_refuses_cpu_sync)
