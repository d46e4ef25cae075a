"""DeepEP 2.5's ``BucketBuffer`` rows of issue 42 on the CPU reference backend (gloo ranks): several groups and
``buffer.contexts``; ``handle.num_sms`` and ``current_stream_wait(release_handle=...)`` returning the results;
``reduce_scatter(comm_precision="bf16")`` against a pure-Python model of DeepEP's RDMA bf16 kernel."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
_MASK = 0xFFFFFFFF


_groups: dict[int, tuple[Path, int, str]] = {}  # n -> (output folder, exit status, output) of the shared run


def _run(mode: str, n: int, tmp_path: Path, limit: float = 120.0) -> list[dict]:
    """`mode`'s records of every rank. The cases of one group size share one process group (run in `_CASES`'
    order by the first test that needs them, each case's buffers destroyed before the next): starting the ranks is
    most of a case's time."""
    from ep_torch_testing import run_script  # loaded by conftest.py

    if n not in _groups:
        modes = ",".join(_CASES)
        code, out = run_script(
            __file__, [modes, str(n), str(tmp_path)], limit + 20 * len(_CASES), what=f"{modes}: "
        )
        _groups[n] = (tmp_path, code, out)
    folder, code, out = _groups[n]
    assert code == 0, out[-3000:]
    return [json.loads((folder / f"{mode}.{r}.json").read_text()) for r in range(n)]


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---------------------------------------------------------------------------------------------------------------
# a pure-Python model of the bf16 send conversion and the owner's float32 sum (written from DeepEP's kernel
# description, element by element, with Python ints: independent of the numpy code under test)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & _MASK))[0]


def _model_bf16_bits(values: list[float]) -> list[int]:
    """The bf16 bit pattern (upper 16 bits of a float32) sent for each element."""
    out = []
    for q in range(len(values) // 4):
        b = [_f32_bits(v) for v in values[4 * q : 4 * q + 4]]
        h = (b[0] * 0x5671D42B + b[1] * 0x9995E499 + b[2] * 0xACE1B8A5 + b[3] * 0xE153538D + q) & _MASK
        h ^= h >> 23
        h = (h * 0x7FEB352D) & _MASK
        h ^= h >> 16
        h1 = (h * 0x846CA68B) & _MASK
        h1 ^= h1 >> 11
        h2 = (h * 0xD35A2D97) & _MASK
        h2 ^= h2 >> 11
        rnd = [h1 & 0xFFFF, h1 >> 16, h2 & 0xFFFF, h2 >> 16]
        for k in range(4):
            v = values[4 * q + k]
            out.append(0x7FFF if v != v else ((b[k] + rnd[k]) >> 16) & 0xFFFF)
    return out


def _model_reduce_scatter_bf16(inputs: list[list[float]], rank: int, scale: float) -> list[float]:
    """What rank `rank` holds after the bf16 reduce-scatter of every rank's `inputs` (float32 arithmetic)."""
    import numpy as np

    n = len(inputs)
    m = len(inputs[0]) // n
    sent = [_model_bf16_bits(x) for x in inputs]
    acc = np.array(inputs[rank][rank * m : (rank + 1) * m], dtype=np.float32)
    for p in range(1, n):
        q = (rank - p) % n
        peer = np.array([_bits_f32(b << 16) for b in sent[q][rank * m : (rank + 1) * m]], dtype=np.float32)
        acc = (acc + peer).astype(np.float32)
    if scale != 1.0:
        acc = (acc * np.float32(scale)).astype(np.float32)
    return [float(v) for v in acc]


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _val(seed: int, shape, dtype=None):
    import torch

    g = torch.Generator().manual_seed(seed * 31 + 7)
    return (torch.randn(shape, generator=g) * 10).to(dtype or torch.float32)


def _handles_case(rank: int, n: int, out: dict) -> None:
    """`num_sms`, `current_stream_wait(release_handle=...)` returning results, `with handle:`, the contexts."""
    import os

    os.environ["EPKIT_NVLINK_GBS"] = "900"  # DeepEP's SM model needs a bandwidth (the CPU has no NVLink)
    import torch
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    plan = BufferAllocator()
    plan.tensor("ag", (n * 8,), "float32")
    plan.tensor("rs", (n * 16,), "float32")
    plan.tensor("spare", (4096,), "float32")
    buf = BucketBuffer(None, plan, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=30)
    ok = {}
    shard = buf.tensors["ag"].view(n, 8)[rank]
    shard.copy_(_val(rank, (8,)))
    h = buf.all_gather(shard)
    got = h.current_stream_wait()
    ok["ag_csw"] = bool(torch.equal(got, torch.cat([_val(r, (8,)) for r in range(n)])))
    ok["ag_num_sms"] = h.num_sms == 0
    ok["ag_wait_again"] = h.wait() is got
    rs = buf.tensors["rs"]
    rs.copy_(_val(rank + 10, (n * 16,)))
    h = buf.reduce_scatter(rs)
    ok["rs_num_sms"] = h.num_sms == buf.get_theoretical_num_sms("reduce_scatter") > 0
    got = h.current_stream_wait(release_handle=True)
    want = sum(_val(r + 10, (n * 16,)) for r in range(n))[rank * 16 : (rank + 1) * 16]
    ok["rs_release"] = bool(torch.equal(got, want)) and h.event is None
    out["after_release"] = _raises(h.current_stream_wait)
    h = buf.all_reduce(rs, num_sms=10)
    ok["ar_num_sms"] = h.num_sms == 10
    with h:
        pass
    ok["with"] = h.event is not None
    with buf.session():
        ext = torch.empty(n * 3)
        h = buf.all_gather(_val(rank, (3,)), ext)
        got = h.current_stream_wait()
        ok["session_csw"] = got is ext and bool(
            torch.equal(ext, torch.cat([_val(r, (3,)) for r in range(n)]))
        )
        ok["session_num_sms"] = h.num_sms == 0
        h = buf.reduce_scatter(_val(rank, (n * 4,)), num_sms=6)
        ok["session_rs_num_sms"] = h.num_sms == 6
        got = h.current_stream_wait(release_handle=True)
        ok["session_rs"] = bool(
            torch.equal(got, sum(_val(r, (n * 4,)) for r in range(n))[rank * 4 : rank * 4 + 4])
        )
    c = buf.contexts
    ok["contexts"] = (
        len(c) == 1
        and c[0].get_physical_domain_size() == (1, n)
        and c[0].get_logical_domain_size() == (1, n)
        and (c[0].rank_idx, c[0].num_ranks) == (rank, n)
        and buf.get_context_idx(None) == 0
        and buf.get_context_idx(buf.group) == 0
    )
    out["ok"] = ok
    buf.destroy()
    out["contexts_after_destroy"] = buf.contexts is None


def _groups_case(rank: int, n: int, out: dict) -> None:
    """`BucketBuffer([world, pair])`: one storage, collectives over either group."""
    import torch
    import torch.distributed as dist
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)]  # every rank makes every group
    pair = pairs[rank // 2]
    world = dist.group.WORLD
    plan = BufferAllocator()
    plan.tensor("w", (n * 8,), "float32")
    plan.tensor("p", (2 * 8,), "float32")
    plan.tensor("spare", (4096,), "float32")
    buf = BucketBuffer(
        [world, pair], plan, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=30
    )
    ok = {}
    c = buf.contexts
    ok["contexts"] = (
        len(c) == 2
        and (c[0].rank_idx, c[0].num_ranks) == (rank, n)
        and (c[1].rank_idx, c[1].num_ranks) == (rank % 2, 2)
        and c[1].get_physical_domain_size() == (1, 2)
        and buf.groups[1] is pair
        and buf.get_context_idx(pair) == 1
        and buf.get_context_idx(world) == 0
    )
    out["no_group"] = _raises(lambda: buf.all_reduce(buf.tensors["w"]))
    w, p = buf.tensors["w"], buf.tensors["p"]
    w.copy_(_val(rank, (n * 8,)))
    p.copy_(_val(rank + 50, (16,)))
    got_w = buf.all_reduce(w, group=world).wait()
    got_p = buf.all_reduce(p, group=pair).wait()
    mates = [2 * (rank // 2), 2 * (rank // 2) + 1]
    ok["world_all_reduce"] = bool(torch.equal(got_w, sum(_val(r, (n * 8,)) for r in range(n))))
    ok["pair_all_reduce"] = bool(torch.equal(got_p, sum(_val(r + 50, (16,)) for r in mates)))
    ok["pair_in_storage"] = got_p.data_ptr() == p.data_ptr()
    p.copy_(_val(rank + 60, (16,)))
    h = buf.reduce_scatter(p, group=pair)
    lo = (rank % 2) * 8
    ok["pair_reduce_scatter"] = (
        bool(torch.equal(h.wait(), sum(_val(r + 60, (16,)) for r in mates)[lo : lo + 8])) and h.num_sms == 0
    )
    shard = p.view(2, 8)[rank % 2]
    shard.copy_(_val(rank + 70, (8,)))
    got = buf.all_gather(shard, group=pair).wait()
    ok["pair_all_gather"] = bool(torch.equal(got, torch.cat([_val(r + 70, (8,)) for r in mates])))
    buf.barrier(group=pair)
    with buf.session() as s:
        got = buf.all_reduce(_val(rank + 80, (5,)), group=pair).wait()
        ok["pair_session"] = bool(torch.equal(got, sum(_val(r + 80, (5,)) for r in mates)))
        out["session_other_group"] = _raises(lambda: s.allocate((4,), torch.float32, group=world))
    out["ok"] = ok
    buf.destroy()


def _bf16_case(rank: int, n: int, out: dict) -> None:
    """`reduce_scatter(comm_precision="bf16")` against the model; its refusals."""
    import torch
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    m = 64
    plan = BufferAllocator()
    plan.tensor("rs", (n * m,), "float32")
    plan.tensor("rs2", (n * 8, 2), "float32")
    plan.tensor("half", (n * 8,), "bfloat16")
    plan.tensor("spare", (4096,), "float32")
    buf = BucketBuffer(None, plan, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=30)
    ok = {}
    inputs = [_val(r + 100, (n * m,)) for r in range(n)]
    rs = buf.tensors["rs"]
    rs.copy_(inputs[rank])
    h = buf.reduce_scatter(rs, comm_precision="bf16", scale=0.25)
    got = h.wait()
    want = _model_reduce_scatter_bf16([x.tolist() for x in inputs], rank, 0.25)
    ok["model"] = got.tolist() == want
    ok["in_place"] = (
        bool(torch.equal(rs[rank * m : (rank + 1) * m], got)) and got.data_ptr() == rs[rank * m :].data_ptr()
    )
    ok["num_sms"] = h.num_sms == 0  # no bandwidth known (no EPKIT_NVLINK_GBS): no SM model
    # differs from the fp32 precision (the peers' shards went through bf16), stays within bf16's error
    exact = sum(x.double() for x in inputs)[rank * m : (rank + 1) * m] * 0.25
    err = (got.double() - exact).abs().max().item()
    ok["bf16_error"] = 0 < err < 0.25 * sum(x.abs().max().item() for x in inputs) * 2**-7
    # a list of srcs, 2-D, scale 1 (no multiply)
    rs2 = buf.tensors["rs2"]
    inputs2 = [_val(r + 200, (n * 8, 2)) for r in range(n)]
    rs.copy_(inputs[rank])
    rs2.copy_(inputs2[rank])
    got = buf.reduce_scatter([rs, rs2], comm_precision="bf16").wait()
    ok["list"] = got[0].tolist() == _model_reduce_scatter_bf16(
        [x.tolist() for x in inputs], rank, 1.0
    ) and got[1].tolist() == _model_reduce_scatter_bf16([x.reshape(-1).tolist() for x in inputs2], rank, 1.0)
    # a session: an external float32 tensor
    with buf.session():
        got = buf.reduce_scatter(inputs[rank].clone(), comm_precision="bf16", scale=2.0).wait()
        ok["session"] = got.tolist() == _model_reduce_scatter_bf16([x.tolist() for x in inputs], rank, 2.0)
    out["ok"] = ok
    out["fp16"] = _raises(lambda: buf.reduce_scatter(rs, comm_precision="fp16"))
    out["bf16_src"] = _raises(lambda: buf.reduce_scatter(buf.tensors["half"], comm_precision="bf16"))
    out["odd"] = _raises(lambda: buf.reduce_scatter(rs[: n * 4], comm_precision="bf16"))
    # ranks that disagree on the precision all raise instead of pairing different exchanges
    out["mixed"] = _raises(lambda: buf.reduce_scatter(rs, comm_precision="bf16" if rank else "fp32"))
    buf.destroy()


# run in this order in one process group: "handles" last, since it sets EPKIT_NVLINK_GBS for the rest of the process
# (the others want no bandwidth known: num_sms 0)
_CASES = {"groups": _groups_case, "bf16": _bf16_case, "handles": _handles_case}


def _worker(rank: int, n: int, modes: str, out_dir: str) -> None:
    import torch.distributed as dist

    for mode in modes.split(","):
        out: dict = {}
        _CASES[mode](rank, n, out)
        Path(out_dir, f"{mode}.{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # the next case starts together on every rank


# ---------------------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("n", [2, 4])
def test_handles_return_results_and_num_sms(n: int, tmp_path: Path) -> None:
    for out in _run("handles", n, tmp_path):
        assert all(out["ok"].values()), out
        assert "release_handle" in out["after_release"], out
        assert out["contexts_after_destroy"]


@pytest.mark.parametrize("n", [2, 4])
def test_several_groups_share_the_storage(n: int, tmp_path: Path) -> None:
    for out in _run("groups", n, tmp_path):
        assert all(out["ok"].values()), out
        assert "required when the BucketBuffer has several groups" in out["no_group"], out
        assert "same group" in out["session_other_group"], out


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_scatter_bf16_matches_the_model(n: int, tmp_path: Path) -> None:
    for out in _run("bf16", n, tmp_path):
        assert all(out["ok"].values()), out
        assert "expected 'fp32' or 'bf16'" in out["fp16"], out
        assert out["bf16_src"].startswith("EPTypeError"), out
        assert "multiple of 8" in out["odd"], out
        assert out["mixed"].startswith("EPMismatchError"), out


def test_stochastic_rounding_properties() -> None:
    """Each element rounds to one of its two bf16 neighbours, up about as often as its distance says; exact bf16
    values, infinities and NaN as the model says; the numpy code equals the pure-Python model bit for bit."""
    import numpy as np
    import torch
    from ep_core.bf16 import stochastic_bits

    x = torch.full((4096,), 1.0 + 2**-9, dtype=torch.float32)  # a quarter of the way from 1 to the next bf16
    x[:4] = torch.tensor([1.5, -2.0, float("inf"), float("nan")])
    x[4:8] = torch.tensor([3.4028234e38, -3.4028234e38, 1e-40, -1e-40])
    bits = stochastic_bits(x.numpy())[:2048]  # what rank 1 of 2 sends for shard 0
    got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    assert list(bits[8:2048]) == [b for b in _model_bf16_bits(x[:2048].tolist())][8:2048]
    assert list(bits[:8]) == _model_bf16_bits(x[:8].tolist())
    assert got[0].item() == 1.5 and got[1].item() == -2.0 and got[2].item() == float("inf")
    assert bits[3] == 0x7FFF
    assert bits[4] in (0x7F7F, 0x7F80) and bits[5] in (
        0xFF7F,
        0xFF80,
    )  # the largest finite, or carried to inf
    assert bits[6] in (0x0001, 0x0002) and bits[7] in (0x8001, 0x8002)  # subnormals (1e-40: 0x000116C2) too
    body = got[8:2048].float()
    assert set(body.unique().tolist()) == {1.0, 1.0078125}
    up = (body == 1.0078125).float().mean().item()
    assert 0.2 < up < 0.3, up


def _special_values(n: int, seed: int):
    """`n * 512` float32 values: random ones, and in every shard the edge cases (zeros, infinities, the largest
    finite, subnormals, NaNs of both signs, values that carry past the largest finite) and random bit patterns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * 512, generator=g) * 10
    spec = torch.tensor(
        [
            *(0.0, -0.0, float("inf"), -float("inf"), 3.3961514e38, -3.3961514e38, 1e-45, -1e-45, 1e-40),
            *(float("nan"), -float("nan"), 1.0, 2**-130, 65504.0, -7.0, 0.1),
        ]
    )
    for r in range(n):
        x[r * 512 : r * 512 + 16] = spec
        x[r * 512 + 16 : r * 512 + 48] = (
            torch.randint(-(2**31), 2**31, (32,), generator=g, dtype=torch.int64)
            .to(torch.int32)
            .view(torch.float32)
        )
    return x


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stochastic_rounding_equals_the_model_bit_for_bit(n: int) -> None:
    """``ep_core.bf16.stochastic_bits`` (numpy, the kernels' oracle) equals the pure-Python model on the whole
    tensor, and on each shard alone numbered from its place (``first_quad``): what the sender packs for its owner."""
    from ep_core.bf16 import stochastic_bits

    x = _special_values(n, n)
    model = _model_bf16_bits(x.tolist())
    assert stochastic_bits(x.numpy()).tolist() == model
    m = 512
    for q in range(n):
        part = slice(q * m, (q + 1) * m)
        assert stochastic_bits(x[part].numpy(), q * m // 4).tolist() == model[part], q


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(_worker, int(sys.argv[2]), sys.argv[1], sys.argv[3])
