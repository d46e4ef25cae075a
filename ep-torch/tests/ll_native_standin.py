"""A CPU stand-in of V1 low-latency mode's native kernels (``ep_torch.legacy.ll_kernels.native_*``) for the host
logic's tests on gloo processes (issue 41): ``install(directory)`` makes ``Buffer(ll_native=True)`` take the native
road on CPU tensors, with the kernels replaced by an exchange through files in ``directory`` (every rank's region:
one file per call and sender, named by the call's epoch, like the kernels' flags).

What it keeps of the kernels: the signature words (issue 41): each message carries its call's word
(``ll_kernels.dispatch_sig`` / ``combine_sig``); a receiver that finds another word, or the abort word a refused call
posts instead of its message (``host_abort``, the kernels' ``ep_lln_abort``), records the first one in ``herr``'s
signature record (the kernels' ``envelope_record``) and takes no rows from it, every message of the call consumed;
waits bounded by ``timeout`` seconds, an expired wait recorded in ``herr``'s timeout words with that call's outputs
left undefined; epochs advance per call on every rank, refused calls included. The host reads both records as it does
the kernels' (``NativeRegion.check``): the receive runs inside the call here, so a record is raised at the call
itself (on the GPU, usually at the next call). What it does not model: rank masking, ``use_ue8m0``'s packed scales,
the local shortcut. Results are bitwise the kernels' (``legacy.reference``'s)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ep_core.ll_native import herr_words
from ep_torch.legacy.ll_kernels import NativeRegion

_CHECK = NativeRegion.check  # the real region's report (install() replaces the class)
_COUNTS: dict[tuple, Any] = {}
_DISPATCH_BITS, _COMBINE_BITS = 0xFFFF0000, 0xFFFFFFFF  # ep_lln::kDispatchSigBits / kCombineSigBits


def install(directory: str | os.PathLike, timeout: float = 3.0) -> None:
    """Route ``ll_native=True`` through the stand-in in this process (the mailbox ``directory`` is shared by every
    rank of the group)."""
    from ep_torch.legacy import ll_kernels
    from ep_torch.legacy.ll_mode import LowLatencyMode

    Path(directory).mkdir(parents=True, exist_ok=True)
    HostRegion.directory, HostRegion.timeout = str(directory), float(timeout)
    if not hasattr(LowLatencyMode, "_ll_native_on_cpu"):  # a tree from before issue 41's native envelope
        ensure = LowLatencyMode._ensure_ll

        def ensure_native(self, m, hidden, num_topk, num_experts=0, cuda=False):
            return ensure(self, m, hidden, num_topk, num_experts, cuda or bool(self.ll_native))

        LowLatencyMode._ensure_ll = ensure_native
        torch.cuda.is_current_stream_capturing = lambda: False
    LowLatencyMode._ll_native_on_cpu = True
    ll_kernels.preload = lambda: None
    ll_kernels.native_refusal = lambda inner: ""
    ll_kernels.NativeRegion = HostRegion
    ll_kernels.native_dispatch = host_dispatch
    ll_kernels.native_combine = host_combine
    ll_kernels.native_abort = host_abort


class HostRegion:
    """``NativeRegion``'s interface: the sizes, the halves, the sticky timeout record (``check``)."""

    directory = ""
    timeout = 3.0
    # EP_STANDIN_DEFERRED=1: a record is read only at the next call (the GPU's timing: its receive kernel rarely
    # finishes before its call returns), not right after the receive
    deferred = os.environ.get("EP_STANDIN_DEFERRED") == "1"

    def __init__(
        self, inner: Any, rank: int, n: int, num_experts: int, m: int, num_topk: int, hidden: int
    ) -> None:
        st = (
            inner.bootstrap.rank_state
        )  # the V1 buffer's steps: every rank builds its regions in the same order
        key = (st.ident, st.generation)
        count = next(_COUNTS.setdefault(key, itertools.count()))
        self.tag = f"{st.ident}.{st.generation}.{count}"
        self.inner = inner
        self.rank, self.num_ranks, self.num_experts = rank, n, num_experts
        self.epr, self.m, self.num_topk, self.hidden = num_experts // n, m, num_topk, hidden
        self.herr = torch.zeros(herr_words(n), dtype=torch.int32)
        self.words = self.herr.numpy()
        self.next_half = 0
        self.epochs = [0, 0]
        self.calls = self.dispatches = self.seen = self.token = 0

    def check(self, op: str, at_call: int = 0) -> None:
        if at_call and self.deferred:  # as on the GPU: the receive has not run yet when its call returns
            return
        _CHECK(self, op, at_call)

    def take_half(self, dispatch: bool = False) -> int:
        h = self.next_half
        self.next_half ^= 1
        self.calls += 1
        self.dispatches += int(dispatch)
        which = 0 if dispatch else 1
        # its record's token (`gather`): post() then takes the epoch
        self.token = 2 * (self.epochs[which] + 1) + which
        return h

    def post(self, kind: str, obj: Any) -> int:
        """Write this rank's message of the next ``kind`` call; returns its epoch."""
        which = 0 if kind == "d" else 1
        self.epochs[which] += 1
        e = self.epochs[which]
        path = Path(self.directory, f"{self.tag}.{kind}{e}.{self.rank}")
        tmp = path.with_name(path.name + ".tmp")
        torch.save(obj, tmp)
        os.replace(tmp, path)
        return e

    def gather(self, kind: str, epoch: int, tag: int, sig: int) -> list[Any] | None:
        """Every rank's message of that call, or None when the wait expired (recorded, like the kernels' err); a
        message whose word differs from ``sig`` (another signature, an abort) is recorded (the first of the call, as
        ``envelope_record``) and given as None (no rows from it)."""
        if int(self.herr[0]):
            return None
        out = self._wait(kind, epoch, tag)
        if out is None:
            return None
        bits = _DISPATCH_BITS if kind == "d" else _COMBINE_BITS
        base = 4 + self.num_ranks
        for r, msg in enumerate(out):
            theirs = msg["sig"] & 0xFFFFFFFF
            if (theirs ^ sig) & bits:
                token = 2 * epoch + (kind == "c")
                if int(self.herr[base]) != token:
                    signed = theirs - ((theirs >> 31) << 32)
                    self.herr[base + 1 : base + 5] = torch.tensor([r, tag, signed, sig], dtype=torch.int32)
                    self.herr[base] = token
                out[r] = None
        return out

    def _wait(self, kind: str, epoch: int, tag: int) -> list[Any] | None:
        out: list[Any] = [None] * self.num_ranks
        start = time.monotonic()
        while True:
            for r in range(self.num_ranks):
                path = Path(self.directory, f"{self.tag}.{kind}{epoch}.{r}")
                if out[r] is None and path.exists():
                    out[r] = torch.load(path)
            missing = [r for r, o in enumerate(out) if o is None]
            if not missing:
                return out
            if time.monotonic() - start > self.timeout:
                self.herr[1], self.herr[2], self.herr[3], self.herr[0] = self.rank, missing[0], tag, 1
                return None
            time.sleep(0.002)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def host_dispatch(
    reg, x, topk_idx, use_fp8, round_scale, use_ue8m0, stats, local_direct=False, mask=None, sig=0
):
    """``native_dispatch``'s contract on the host."""
    from ep_torch.legacy.reference import fp8_cast_reference

    assert mask is None, "the stand-in models no rank masking"
    if use_ue8m0:
        raise NotImplementedError("the stand-in models no use_ue8m0 scales")
    n, epr, m, h, k = reg.num_ranks, reg.epr, reg.m, reg.hidden, reg.num_topk
    t = int(x.shape[0])
    width = 2 * h  # one message's payload bytes: a bf16 row, or an FP8 row then its float32 scales
    payload = torch.zeros(t, width, dtype=torch.uint8)
    if use_fp8 and t:
        q, s = fp8_cast_reference(
            x.contiguous().view(torch.int16).numpy().view(np.uint16), round_scale, False
        )
        payload[:, :h] = torch.from_numpy(q)
        payload[:, h : h + 4 * (h // 128)] = torch.from_numpy(
            np.ascontiguousarray(s, np.float32).view(np.uint8)
        )
    elif t:
        payload[:] = _bits(x)
    reg.take_half(dispatch=True)
    epoch = reg.post("d", {"sig": sig, "x": payload, "idx": topk_idx.to(torch.int64).contiguous()})
    slots = n * m
    rows = torch.full((epr, slots, width), 0xAB, dtype=torch.uint8)  # undefined unless written
    src_info = torch.full((epr, slots), -1, dtype=torch.int32)
    lanes = torch.zeros(epr, slots, dtype=torch.int32)
    count = torch.zeros(epr, dtype=torch.int32)
    layout_range = torch.zeros(epr, n, dtype=torch.int64)
    if use_fp8:
        q = torch.empty(epr, slots, h, dtype=torch.float8_e4m3fn)
        scales = torch.empty(epr, slots, h // 128, dtype=torch.float32)
        recv: Any = (q, scales)
    else:
        recv = torch.empty(epr, slots, h, dtype=torch.bfloat16)

    def receive() -> None:
        every = reg.gather("d", epoch, 1, sig)
        if every is not None:
            for e in range(epr):
                g, pos = reg.rank * epr + e, 0
                for s, msg in enumerate(every):
                    start = pos
                    for tok in range(0 if msg is None else int(msg["idx"].shape[0])):
                        ids = msg["idx"][tok].tolist()
                        if g in ids:
                            rows[e, pos], src_info[e, pos], lanes[e, pos] = msg["x"][tok], tok, ids.index(g)
                            pos += 1
                    layout_range[e, s] = (start << 32) | (pos - start)
                count[e] = pos
        if use_fp8:
            recv[0].view(torch.uint8).copy_(rows[..., :h])
            recv[1].copy_(rows[..., h : h + 4 * (h // 128)].contiguous().view(torch.float32))
        else:
            recv.view(torch.uint8).copy_(rows)
        if stats is not None:
            stats.add_(count.to(stats.dtype))

    lane_pos = torch.zeros(max(t, 1), k, dtype=torch.int32)
    return recv, count, src_info, layout_range, lanes, lane_pos, receive


def host_combine(
    reg, x, src_info, lanes, layout_range, topk_idx, topk_weights, out, lane_pos=None, local_direct=False,
    use_logfmt=False, mask=None, sig=0,
):  # fmt: skip
    """``native_combine``'s contract on the host: every expert output row goes to its token's rank (LogFMT: as its
    decoded float32 values, a different wire format than a plain row's bf16 bits)."""
    from ep_torch.legacy.logfmt import roundtrip_torch

    assert mask is None, "the stand-in models no rank masking"
    n, epr, h = reg.num_ranks, reg.epr, reg.hidden
    wire = torch.zeros(0, 4 * h, dtype=torch.uint8)
    meta = []
    for e in range(epr):
        for s in range(n):
            v = int(layout_range[e, s])
            off, cnt = v >> 32, v & 0xFFFFFFFF
            for i in range(off, off + cnt):
                meta.append((reg.rank * epr + e, s, int(src_info[e, i]), e, i))
    if meta:
        ys = torch.stack([x[e, i] for *_, e, i in meta])
        wire = torch.zeros(len(meta), 4 * h, dtype=torch.uint8)
        if use_logfmt:
            wire[:] = _bits(roundtrip_torch(ys))
        else:
            wire[:, : 2 * h] = _bits(ys)
    head = torch.tensor([m[:3] for m in meta], dtype=torch.int64).reshape(-1, 3)
    reg.take_half()
    epoch = reg.post("c", {"sig": sig, "head": head, "rows": wire})
    t = int(topk_idx.shape[0])
    dest = torch.full((t, h), float("nan"), dtype=torch.bfloat16)  # undefined unless written

    def receive() -> None:
        every = reg.gather("c", epoch, 2, sig)
        if every is not None:
            got: dict[tuple[int, int], torch.Tensor] = {}
            for msg in every:
                if msg is None:
                    continue
                for (g, dst, tok), row in zip(msg["head"].tolist(), msg["rows"]):
                    if dst == reg.rank:
                        got[(g, tok)] = row
            w = topk_weights.to(torch.float32)
            for tok in range(t):
                acc = torch.zeros(h, dtype=torch.float32)
                for k, g in enumerate(topk_idx[tok].tolist()):
                    if g < 0:
                        continue
                    row = got.get((g, tok), torch.zeros(4 * h, dtype=torch.uint8))
                    if use_logfmt:
                        y = row.view(torch.float32)
                    else:
                        y = row[: 2 * h].view(torch.bfloat16).to(torch.float32)
                    acc = acc + y * w[tok, k]
                dest[tok] = acc.to(torch.bfloat16)
        if out is not None:
            out.copy_(dest)

    return (out if out is not None else dest), receive


def host_abort(reg, op, exc):
    """``native_abort``'s contract on the host: this call's message is the abort word, and the epoch advances."""
    from ep_torch.legacy.ll_kernels import abort_word

    which = "d" if op == "low_latency_dispatch" else "c"
    reg.take_half(dispatch=which == "d")
    reg.post(which, {"sig": abort_word(exc)})
