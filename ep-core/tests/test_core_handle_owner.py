"""CPU: a handle's owner on the GPU road (issue 41), driver mocked (`ep-core/benchmarks/bench_host_cpu.py`'s).

A dispatch stamps its handle with its buffer's identity and generation (`ep_core.rank_state.check_owner`, shared
with the reference executor); the rank runtime (`RankDriver._check_handle`, which every road to a combine, cached
dispatch or combine buffer passes: the full path, the repeats and the express lanes) refuses a handle of another
buffer (`EPValueError`) or one from before a `reset()` (`EPStateError`), naming it, before anything is launched.
A valid handle passes on every road."""

from __future__ import annotations

import sys
from pathlib import Path

import ep_core
import pytest
from ep_core.errors import EPStateError, EPValueError
from ep_core.kernels import prepared_launch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_host_cpu as b

T, H, K, E = 8, 64, 2, 8
FOREIGN = r"handle: comes from another buffer \(rank 0\)"
STALE = r"handle: stale \(rank 0\): this buffer was reset\(\)"


class _Alloc:
    """Device arrays at fresh mocked addresses; trusted (exact shapes and dtypes), as the express lanes need."""

    ep_core_trusted = True

    def __init__(self) -> None:
        self.next = 1 << 40

    def __call__(self, shape: tuple, dtype: str, strides: tuple | None = None) -> ep_core.DeviceArray:
        self.next += 1 << 24
        return ep_core.DeviceArray(self.next, tuple(shape), dtype, device="cuda")

    def batch(self, specs: tuple):
        """The express dispatch lane's allocation: one call that makes every `(shape, dtype name)`."""

        def made() -> tuple:
            arrays = tuple([self(shape, dtype) for shape, dtype in specs])
            return arrays, tuple([a.ptr for a in arrays])

        return made


@pytest.fixture
def mocked(monkeypatch):
    """`make()`: an EPBuffer over the mocked GPU executor; the allocator; every launch's kernel name."""
    launched: list = []
    native = pl._native_launch

    def recorded_native(launch):  # a prepared launch's words reach the (mocked) native launch, on every road
        call = native(launch)

        def recorded(stream, values, *pairs):
            launched.append(launch.name)
            return call(stream, values, *pairs)

        return recorded

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", lambda self, words, stream: launched.append(self.name))

    def make() -> ep_core.EPBuffer:
        return ep_core.EPBuffer(
            ep_core.LocalBootstrap(),
            transport=b._MockedTransport(),
            num_max_tokens_per_rank=T,
            hidden=H,
            num_topk=K,
        )

    with b._MockedGpu():
        yield make, _Alloc(), launched


def _dispatch(buf: ep_core.EPBuffer, alloc: _Alloc) -> tuple:
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    h = buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False, allocator=alloc).handle
    return x, h, alloc((h.num_recv_tokens, H), "bfloat16")


def _lanes(buf: ep_core.EPBuffer, alloc: _Alloc, x, h, y) -> tuple:
    """The combine's and the cached dispatch's express lanes, each after a full call and a repeat of `h`."""
    for _ in range(2):
        buf.combine(y, h, num_sms=4, allocator=alloc)
        buf.dispatch(x, handle=h, num_sms=4, allocator=alloc)
    combine = buf.keep_lane("c", "combine", lambda a, w: (a.ptr, 0), (4, 0), h)
    buf.dispatch(x, handle=h, num_sms=4, allocator=alloc)
    cached = buf.keep_lane("d", "dispatch", lambda a, w: (a.ptr, 0), (4,), h)
    assert type(combine).__name__ == "CombinePlan" and type(cached).__name__ == "DispatchPlan"
    return combine, cached


def _roads(buf: ep_core.EPBuffer, alloc: _Alloc, x, y, lanes: tuple) -> dict:
    """Every road that takes a handle, as `road(handle)`."""
    combine, cached = lanes
    return {
        "combine": lambda h: buf.combine(y, h, num_sms=4, allocator=alloc),
        "cached dispatch": lambda h: buf.dispatch(x, handle=h, num_sms=4, allocator=alloc),
        "combine_buffer": lambda h: buf.combine_buffer(h),
        "combine lane": lambda h: combine(y, h, None, 0),
        "cached dispatch lane": lambda h: cached(x, h, None, 0),
    }


def test_a_valid_handle_passes_every_road(mocked) -> None:
    make, alloc, launched = mocked
    buf = make()
    x, h, y = _dispatch(buf, alloc)
    roads = _roads(buf, alloc, x, y, _lanes(buf, alloc, x, h, y))
    for name, road in roads.items():
        for _ in range(2):  # a repeat too
            launched.clear()
            res = road(h)
            assert res is not None, name
            assert name == "combine_buffer" or launched, name


def test_a_handle_of_another_buffer_is_refused_on_every_road(mocked) -> None:
    make, alloc, launched = mocked
    buf, other = make(), make()
    x, h, y = _dispatch(buf, alloc)
    roads = _roads(buf, alloc, x, y, _lanes(buf, alloc, x, h, y))
    _, foreign, _ = _dispatch(other, alloc)  # the same configuration: only the owner tells them apart
    for name, road in roads.items():
        launched.clear()
        with pytest.raises(EPValueError, match=FOREIGN):
            road(foreign)
        assert launched == [], name
    for road in roads.values():  # and the buffer's own handle still works on each, and the other's on its own
        assert road(h) is not None
    other.combine(alloc((foreign.num_recv_tokens, H), "bfloat16"), foreign, num_sms=4, allocator=alloc)


def test_a_handle_from_before_a_reset_is_stale_on_every_road(mocked) -> None:
    make, alloc, launched = mocked
    buf = make()
    x, h, y = _dispatch(buf, alloc)
    roads = _roads(buf, alloc, x, y, _lanes(buf, alloc, x, h, y))
    buf.reset()
    for name, road in roads.items():
        launched.clear()
        with pytest.raises(EPStateError, match=STALE):
            road(h)
        assert launched == [], name
    x, fresh, y = _dispatch(buf, alloc)  # a new dispatch's handle works again, repeats and lanes included
    for road in _roads(buf, alloc, x, y, _lanes(buf, alloc, x, fresh, y)).values():
        assert road(fresh) is not None


def test_the_express_dispatchs_handles_carry_the_owner(mocked) -> None:
    """The express dispatch lane's new handle (its int32 arrays in one block) carries the owner too, with the
    block's shortcut intact (`validation._block_arrays`: the handle's dict as the dispatch left it); a reset makes
    its handles stale as any."""
    make, alloc, _ = mocked
    buf = make()
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    for _ in range(2):
        buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False, allocator=alloc)
    lane = buf.keep_lane("n", "dispatch", lambda a, i, v: (a.ptr, i.ptr, v.ptr), (E, 4))
    assert type(lane).__name__ == "DispatchPlan"
    h = lane(x, idx, w, 0).handle
    parts = h.__dict__.get("_block_parts")
    assert parts is not None and parts[2] == len(h.__dict__)
    assert h._ep_owner is buf.executor.rank.state.owner
    y = alloc((h.num_recv_tokens, H), "bfloat16")
    assert buf.combine(y, h, num_sms=4, allocator=alloc) is not None
    buf.reset()
    with pytest.raises(EPStateError, match=STALE):
        buf.combine(y, h, num_sms=4, allocator=alloc)
