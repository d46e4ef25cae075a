"""GPU tests (marker gpu): the torch API on CUDA tensors against ep_core.reference, CUDA-graph capture, events and
streams, the demo on a GPU. Skipped without a GPU.

On the one-H200 machine: one rank over nccl (`cuda`), and several processes sharing the GPU over a gloo bootstrap
with the ipc transport (`cuda-shared`; NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _assert_all_pass(per_rank):
    failures = [f"rank {r}: {n}\n{d}" for r, res in enumerate(per_rank) for n, ok, d in res if not ok]
    assert per_rank and per_rank[0], "no checks ran"
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:10])


def test_event_handle_on_cuda():
    from ep_torch import EventHandle, EventOverlap

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.ones(1 << 20, device="cuda") * 2
        ev = EventOverlap(EventHandle())
    assert ev.event is not None and not ev.event.is_cpu
    ev.current_stream_wait()
    assert float(a.sum()) == 2 * (1 << 20)


def test_comm_stream_is_one_high_priority_stream():
    from ep_torch._streams import comm_stream

    a, b = comm_stream(torch.device("cuda", 0)), comm_stream(0)
    assert a is b and a.priority <= torch.cuda.Stream().priority


def test_host_extension_on_cuda():
    """The host extension (built here against this torch) allocates on the given CUDA device from the current
    stream's caching allocator, as torch.empty does, and reads a CUDA tensor's facts."""
    from ep_torch import host_extension

    mod = host_extension.module()
    assert mod is not None, host_extension.status()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = mod.empty((64, 7168), torch.bfloat16, 0)
        assert t.device == torch.device("cuda", 0) and t.dtype == torch.bfloat16 and t.shape == (64, 7168)
        t.fill_(1.5)
        del t
        again = mod.empty((64, 7168), torch.bfloat16, 0)
    s.synchronize()
    v = again[3:, 128:]
    assert mod.facts(v) == (v.dtype, tuple(v.shape), v.stride(), v.data_ptr(), 0)
    # the express lane's two calls: a batch of allocations, and a signature that reads CUDA pointers as describe
    # does (an empty CUDA tensor's is 0) and tells the device apart
    tensors, ptrs = mod.empty_many((((128, 7168), torch.bfloat16), ((0, 8), torch.int64)), 0)
    assert [t.device for t in tensors] == [torch.device("cuda", 0)] * 2 and ptrs[0] == tensors[0].data_ptr()
    sig = mod.signature(tensors[0], tensors[1], None)
    assert sig.match(*tensors, None) == (tensors[0].data_ptr(), 0, 0)
    assert sig.match(tensors[0].cpu(), tensors[1], None) is None


# (backend, ranks, extra cfg). One rank over nccl picks the nccl transport by itself (its own GPU, NCCL 2.28.9) and
# a collectively destroyed buffer borrows torch's communicator (torch and ep-nccl-gin share one libnccl there).
CONFORMANCE = [
    ("cuda", 1, {"expect_transport": "nccl", "expect_comm": "group"}),
    ("cuda", 1, {"transport": "ipc"}),
    ("cuda-shared", 2, {}),
    ("cuda-shared", 4, {}),
    ("cuda", 1, {"transport": "ipc", "prefer_overlap_with_compute": False}),
    ("cuda-shared", 2, {"prefer_overlap_with_compute": False}),
]


@pytest.mark.parametrize(
    "backend,ranks,extra",
    CONFORMANCE,
    ids=[
        "cuda-1-auto",
        "cuda-1-ipc",
        "cuda-shared-2",
        "cuda-shared-4",
        "cuda-1-no-overlap",
        "cuda-shared-2-no-overlap",
    ],
)
def test_conformance_on_gpu(backend, ranks, extra):
    from ep_torch_conformance.conformance import run_spawned

    if backend == "cuda" and torch.cuda.device_count() < ranks:
        pytest.skip("one GPU per rank needed")
    _assert_all_pass(run_spawned(ranks, {"backend": backend, **extra}))


@pytest.mark.parametrize("backend,ranks", [("cuda", 1), ("cuda-shared", 2)])
def test_demo_on_gpu(backend, ranks):
    from ep_torch import demo

    assert demo.main(["--backend", backend, "--ranks", str(ranks), "--steps", "3", "--no-progress"]) == 0
