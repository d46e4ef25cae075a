"""``BucketBuffer.send_recv`` (DeepEP 2.6's name, ep's semantics, issue 42) on 2 and 4 gloo ranks (CPU reference
backend): rings both ways, swaps, a send to itself, one transfer with idle ranks, a second group of the buffer, the
bytes compared with the sender's tensors; the refusals (announced to every rank) and calls that do not pair (every
rank raises, refused until ``reset()``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def _run(n: int, tmp_path: Path, limit: float = 180.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["sr", str(n), str(tmp_path)], limit, what="send_recv: ")
    assert code == 0, out[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _val(seed: int, shape, dtype=None):
    import torch

    g = torch.Generator().manual_seed(seed * 31 + 7)
    return (torch.randn(shape, generator=g) * 10).to(dtype or torch.float32)


def _case(rank: int, n: int, out: dict) -> None:
    import torch
    import torch.distributed as dist
    from ep_core import BufferAllocator
    from ep_torch import BucketBuffer

    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)]
    pair = pairs[rank // 2]
    plan = BufferAllocator()
    plan.tensor("d1", (5, 3), "float32")
    plan.tensor("d2", (8,), "bfloat16")
    plan.tensor("s2", (8,), "bfloat16")
    plan.tensor("spare", (1024,), "float32")
    buf = BucketBuffer(
        [dist.group.WORLD, pair],
        plan,
        explicitly_destroy=True,
        transport="reference",
        num_cpu_timeout_secs=30,
    )
    world = dist.group.WORLD
    d1, d2, s2 = buf.tensors["d1"], buf.tensors["d2"], buf.tensors["s2"]
    ok = {}

    def srcs(r: int, salt: int):
        return _val(100 * salt + r, (5, 3)), _val(100 * salt + r + 50, (8,), torch.bfloat16)

    def clear():
        d1.fill_(-7.0)
        d2.fill_(-7.0)

    # rings both ways: one src outside the storage, one inside it
    for salt, step in ((1, 1), (2, -1)):
        clear()
        a, b = srcs(rank, salt)
        s2.copy_(b)
        h = buf.send_recv([a, s2], [d1, d2], (rank + step) % n, (rank - step) % n, group=world)
        got = h.wait()
        wa, wb = srcs((rank - step) % n, salt)
        ok[f"ring{step}"] = (
            isinstance(got, list)
            and got[0] is d1
            and got[1] is d2
            and torch.equal(d1, wa)
            and torch.equal(d2, wb)
            and h.num_sms == 0
        )
    # a swap of tensors (a tensor argument: the handle returns the tensor)
    clear()
    a, _ = srcs(rank, 3)
    got = buf.send_recv(a, d1, rank ^ 1, rank ^ 1, group=world).current_stream_wait(release_handle=True)
    ok["swap"] = got is d1 and torch.equal(d1, srcs(rank ^ 1, 3)[0])
    # to itself
    clear()
    a, _ = srcs(rank, 4)
    ok["self"] = torch.equal(buf.send_recv(a, d1, rank, rank, group=world).wait(), a)
    # one transfer, the other ranks idle
    clear()
    a, _ = srcs(rank, 5)
    if rank == 0:
        h = buf.send_recv(a, None, n - 1, None, group=world)
        ok["one"] = h.wait() is None
    elif rank == n - 1:
        ok["one"] = torch.equal(buf.send_recv(None, d1, None, 0, group=world).wait(), srcs(0, 5)[0])
    else:
        ok["one"] = buf.send_recv(group=world).wait() is None and torch.equal(d1, torch.full((5, 3), -7.0))
    # the buffer's second group: a swap inside each pair (ranks of that group)
    clear()
    a, _ = srcs(rank, 6)
    mate = rank % 2 ^ 1
    ok["pair"] = torch.equal(buf.send_recv(a, d1, mate, mate, group=pair).wait(), srcs(rank ^ 1, 6)[0])

    # refusals on one rank: announced, the others raise EPPeerError naming it, then the next call pairs
    outside = torch.zeros(5, 3)
    a, _ = srcs(rank, 7)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank == n - 1:
        out["outside"] = _raises(lambda: buf.send_recv(a, outside, nxt, prv, group=world))
    else:
        out["outside_peer"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world))
    if rank == 0:
        out["bad_rank"] = _raises(lambda: buf.send_recv(a, d1, n, prv, group=world))
        out["num_sms"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world, num_sms=4))
        out["srcs_without_dst"] = _raises(lambda: buf.send_recv(a, d1, None, prv, group=world))
    else:
        out["bad_rank_peer"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world))
        out["num_sms_peer"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world))
        out["srcs_without_dst_peer"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world))
    clear()
    ok["after_refusals"] = torch.equal(buf.send_recv(a, d1, nxt, prv, group=world).wait(), srcs(prv, 7)[0])
    # calls that do not pair: every rank raises the same error, then every call is refused until reset()
    out["unpaired"] = _raises(lambda: buf.send_recv(a, d1, nxt, rank, group=world))
    out["refused"] = _raises(lambda: buf.send_recv(a, d1, nxt, prv, group=world))
    buf.reset(group=world)
    clear()
    ok["after_reset"] = torch.equal(buf.send_recv(a, d1, nxt, prv, group=world).wait(), srcs(prv, 7)[0])
    out["dtype"] = _raises(lambda: buf.send_recv(a.double(), d1, nxt, prv, group=world))
    buf.reset(group=world)
    ok["all_reduce_after"] = torch.equal(
        buf.all_reduce(buf.tensors["spare"][:4].fill_(1.0), group=world).wait(), torch.full((4,), float(n))
    )
    out["ok"] = ok
    buf.destroy()


def _worker(rank: int, n: int, mode: str, out_dir: str) -> None:
    out: dict = {}
    _case(rank, n, out)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize("n", [2, 4])
def test_send_recv(n: int, tmp_path: Path) -> None:
    outs = _run(n, tmp_path)
    for r, out in enumerate(outs):
        assert all(out["ok"].values()), (r, out)
        assert out["unpaired"].startswith("EPMismatchError") and "do not pair" in out["unpaired"], out
        assert out["refused"].startswith("EPStateError") and "reset()" in out["refused"], out
        assert out["dtype"].startswith("EPMismatchError") and "do not fit" in out["dtype"], out
        if r == n - 1:
            assert "dsts[0]" in out["outside"] and "storage" in out["outside"], out
        else:
            assert out["outside_peer"].startswith("EPPeerError") and f"rank {n - 1}" in out["outside_peer"], (
                out
            )
        if r == 0:
            assert "dst_rank_idx" in out["bad_rank"], out
            assert "num_sms" in out["num_sms"], out
            assert "srcs" in out["srcs_without_dst"], out
        else:
            for k in ("bad_rank_peer", "num_sms_peer", "srcs_without_dst_peer"):
                assert out[k].startswith("EPPeerError") and "rank 0" in out[k], (k, out)


def test_signature() -> None:
    import inspect

    from ep_torch import BucketBuffer

    p = inspect.signature(BucketBuffer.send_recv).parameters
    assert list(p)[1:] == ["srcs", "dsts", "dst_rank_idx", "src_rank_idx", "group", "num_sms"]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(_worker, int(sys.argv[2]), sys.argv[1], sys.argv[3])
