"""``Buffer(ll_native=True)`` where the native low-latency kernels cannot run raises on every rank, naming the
reason (no silent fallback to the adapter); ``ll_native=None`` takes the adapter there (issue 44). On the CPU: fake
storages for ``ll_kernels.native_refusal``, and ``LowLatencyMode._build_native`` on a stand-in buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ep_core.errors import EPValueError
from ep_torch.legacy import ll_kernels
from ep_torch.legacy.ll_mode import LowLatencyMode


def _inner(storage, num_ranks: int = 4):
    rt = SimpleNamespace(storage=storage, num_ranks=num_ranks)
    return SimpleNamespace(_rt=lambda: rt, destroy=lambda: None)


class _Mapped:  # ipc / loopback: a peer table of GPU pointers
    array_device = "cuda"

    def peer_bases(self, n):
        return [0] * n


class _Nccl(_Mapped):
    def __init__(self, lsa_size):
        self.lsa_size = lsa_size


def test_native_refusal_names_the_reason():
    assert ll_kernels.native_refusal(_inner(_Mapped())) == ""
    assert ll_kernels.native_refusal(_inner(_Nccl(4))) == ""  # nccl within one LSA team: the native kernels
    assert "reaches 2 of the 4 ranks" in ll_kernels.native_refusal(_inner(_Nccl(2)))
    cpu = SimpleNamespace(array_device="cpu", peer_bases=lambda n: [])
    assert "does not map the peers' GPU memory" in ll_kernels.native_refusal(_inner(cpu))
    assert "does not map" in ll_kernels.native_refusal(_inner(SimpleNamespace()))

    def gone():
        raise RuntimeError("destroyed")

    assert "destroyed" in ll_kernels.native_refusal(SimpleNamespace(_rt=gone))


def _stand_in(ll_native, storage):
    destroyed = []
    inner = _inner(storage)
    inner.destroy = lambda: destroyed.append(True)
    buf = SimpleNamespace(
        rank=3, group_size=4, _ll_inner=None, _builds=0, _shrink=None, ll_native=ll_native,
        _new_inner=lambda **kw: inner,
    )  # fmt: skip
    return buf, destroyed


@pytest.mark.parametrize("storage", [_Nccl(2), SimpleNamespace(array_device="cpu")])
def test_explicit_ll_native_raises_where_the_kernels_cannot_run(monkeypatch, storage):
    monkeypatch.setattr(ll_kernels, "preload", lambda: None)
    buf, destroyed = _stand_in(True, storage)
    with pytest.raises(
        EPValueError, match=r"Buffer\(ll_native=True\) \(rank 3\): the native low-latency kernels"
    ):
        LowLatencyMode._build_native(buf, 8, 128, 2, 8, ("key",))
    assert destroyed and buf._ll_inner is None and buf._ll_region is None


def test_auto_takes_the_adapter_where_the_kernels_cannot_run(monkeypatch):
    monkeypatch.setattr(ll_kernels, "preload", lambda: None)
    buf, destroyed = _stand_in("auto", _Nccl(2))  # an LSA team short of the group: across nodes
    LowLatencyMode._build_native(buf, 8, 128, 2, 8, ("key",))
    assert destroyed and buf.ll_native is False and buf._ll_region is None
