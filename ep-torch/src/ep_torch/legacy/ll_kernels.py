"""Launches of V1 low-latency mode's CUDA kernels (``ep_core.ll_pack``, ``include/ep_core/ll_pack.cuh``; ep-core
compiles them through ep_jit like its other kernels) on torch's current stream with the tensors' addresses
(capturable: fixed shapes, counts read on the GPU).

``pack`` is the dispatch epilogue (layout + row copy or FP8 cast: two launches, three when rows are ordered by key),
``gather_lanes`` builds the wide combine rows, ``weighted_sum`` the fused fp32 lane sum. Each is bit for bit the
torch composition in ``legacy.low_latency`` (kept as the CPU path and as the reference of the GPU tests).
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core import ll_pack
from ep_core.errors import EPValueError
from ep_core.ll_pack import KERNEL_NAMES, MAX_TOPK, compile_ll_kernels

from .. import _env

__all__ = [
    "KERNEL_NAMES",
    "MAX_TOPK",
    "compile_ll_kernels",
    "gather_lanes",
    "get_include",
    "pack",
    "preload",
    "weighted_sum",
]


def get_include() -> str:
    """Directory holding ``ep_core/ll_pack.cuh`` (ep-core's kernel headers)."""
    from ep_core.kernels._source import get_include as core_include

    return core_include()


def preload() -> None:
    """Compile and load the kernels on the current device now (``ep_core.ll_pack.load``, ``ep_core.ll_native.load``)."""
    from ep_core import ll_native

    ll_pack.load(torch.cuda.current_device())
    ll_native.load(torch.cuda.current_device())


class _Launch:
    """``ll_pack.launch`` on torch's current stream and device; tensors are passed as their addresses (kept alive
    by the caller until the launch returns: the kernel is stream-ordered before any reuse of their memory)."""

    __slots__ = ("device", "stream")

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self.stream = torch.cuda.current_stream().cuda_stream

    def __call__(self, name: str, grid: Any, block: int, args: list, shared_mem: int = 0) -> None:
        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        ll_pack.launch(
            name, grid, block, values, device=self.device, stream=self.stream, shared_mem=shared_mem
        )


def _idx64(t: torch.Tensor, what: str) -> int:
    if t.dtype not in (torch.int64, torch.int32):
        raise EPValueError(f"{what}: expected int64 or int32 expert ids, got {t.dtype}")
    return int(t.dtype == torch.int64)


def _vec(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (the kernels move rows in 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def pack(
    recv_x: torch.Tensor,
    recv_idx: torch.Tensor,
    meta: torch.Tensor,
    num_valid: torch.Tensor,
    *,
    num_ranks: int,
    epr: int,
    tokens_per_rank: int,
    by_key: bool,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked layout of ep's dispatch output: ``(recv (bf16 [epr, N*M, H] or (fp8, scales column-major)),
    recv_count [epr] int32, src_info [epr, N*M] int32, layout_range [epr, N] int64, lane_slot [R, K] int64,
    lane_ok [R, K] bool)``. ``meta`` is ``recv_src_metadata`` ([R, *] int32, column 0 = src_rank*M + token),
    ``num_valid`` a one-element int32 device tensor (the true row count). ``by_key``: the rows are not in V1's
    order (hybrid regions, a non-deterministic dispatch); the layout scans them through their source keys."""
    rows, h = int(recv_x.shape[0]), int(recv_x.shape[1])
    k = int(recv_idx.shape[1])
    if k > MAX_TOPK:
        raise EPValueError(f"low_latency_dispatch: num_topk={k} > {MAX_TOPK} (the kernels' lane limit)")
    dev = recv_x.device
    slots = num_ranks * tokens_per_rank
    recv_x = _vec(recv_x)
    recv_idx = recv_idx.contiguous()
    if meta.stride(1) != 1 or meta.dtype != torch.int32:
        meta = meta.to(torch.int32).contiguous()
    idx64 = _idx64(recv_idx, "low_latency_dispatch: recv_topk_idx")
    lane_slot = torch.empty(rows, k, dtype=torch.int64, device=dev)
    lane_ok = torch.empty(rows, k, dtype=torch.bool, device=dev)
    src_info = torch.empty(epr, slots, dtype=torch.int32, device=dev)
    recv_count = torch.empty(epr, dtype=torch.int32, device=dev)
    layout_range = torch.empty(epr, num_ranks, dtype=torch.int64, device=dev)
    run = _Launch()
    order = None
    scan_len = rows
    if by_key:  # rows grouped by region (hybrid) or in any order: scan them in (source rank, token) order
        order = torch.empty(slots, dtype=torch.int32, device=dev)
        run("ep_ll_order", 1, 1024, [meta, meta.stride(0), num_valid, slots, order])
        scan_len = slots
    args = [recv_idx, idx64, k, meta, meta.stride(0), num_valid, order, rows, scan_len, tokens_per_rank,
            num_ranks, slots, lane_slot, lane_ok, src_info, recv_count, layout_range]  # fmt: skip
    run("ep_ll_layout", epr, 256, args, shared_mem=4 * num_ranks)
    if not use_fp8:
        out = torch.empty(epr, slots, h, dtype=torch.bfloat16, device=dev)
        vecs = h * 2 // 16
        if rows:
            args = [recv_x, vecs, lane_slot, lane_ok, k, num_valid, out]
            run("ep_ll_pack_bf16", (rows, -(-vecs // 256)), 256, args)
        return out, recv_count, src_info, layout_range, lane_slot, lane_ok
    q, s_store = _fp8_outputs(epr, slots, h, use_ue8m0, dev)
    if rows:
        args = [recv_x, h, lane_slot, lane_ok, k, num_valid, q, s_store, slots, int(round_scale),
                int(use_ue8m0)]  # fmt: skip
        run("ep_ll_pack_fp8", (rows, -(-h // 1024)), 256, args)
    return (q, s_store.transpose(1, 2)), recv_count, src_info, layout_range, lane_slot, lane_ok


def _fp8_outputs(epr: int, slots: int, h: int, use_ue8m0: bool, dev: Any) -> tuple[Any, Any]:
    """A dispatch's FP8 rows [epr, slots, h] and their scales' storage [epr, G, slots] float32 (ue8m0: int32
    [epr, G / 4, slots], four exponent bytes a word); V1 returns it transposed (the last two dimensions column-major)."""
    g = h // 128 // (4 if use_ue8m0 else 1)
    s = torch.empty(epr, g, slots, dtype=torch.int32 if use_ue8m0 else torch.float32, device=dev)
    return torch.empty(epr, slots, h, dtype=torch.float8_e4m3fn, device=dev), s


def gather_lanes(
    x: torch.Tensor,
    lane_slot: torch.Tensor,
    lane_ok: torch.Tensor,
    num_valid: torch.Tensor,
    lane0: int,
    lanes: int,
) -> torch.Tensor:
    """Wide combine rows ``[R, lanes * H]``: row r's lanes ``lane0 ..`` from the packed ``x [epr, N*M, H]`` (zeros
    where the lane is not here); rows past ``num_valid`` are left unwritten (ep's combine does not read them)."""
    h = int(x.shape[-1])
    rows, k = int(lane_slot.shape[0]), int(lane_slot.shape[1])
    x = _vec(x)
    wide = torch.empty(rows, lanes * h, dtype=x.dtype, device=x.device)
    vecs = h * 2 // 16
    if rows:
        args = [x, vecs, lane_slot, lane_ok, k, lane0, lanes, num_valid, wide]
        _Launch()("ep_ll_gather", (rows, -(-vecs // 256)), 256, args)
    return wide


def weighted_sum(
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    lane0: int,
    lanes: int,
    acc: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """One group of lanes of the combine's weighted sum: ``y [T, lanes * H]`` bf16 (an ep combine's output).
    ``acc`` (fp32 [T, H]) carries the sum between groups: read unless ``lane0 == 0``, written unless this group
    ends at K, where ``out`` ([T, H] bf16, contiguous) receives the one bf16 rounding."""
    t, k = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    h = int(y.shape[-1]) // lanes
    first, last = lane0 == 0, lane0 + lanes == k
    if t == 0:
        return
    vecs = h // 8
    args = [_vec(y), h, topk_idx.contiguous(), _idx64(topk_idx, "low_latency_combine: topk_idx"),
            topk_weights.contiguous(), k, lane0, lanes, acc, int(first), int(last), out]  # fmt: skip
    _Launch()("ep_ll_weighted_sum", (-(-vecs // 128), t), 128, args)


# ---------------------------------------------------------------------------------------------------------------------
# low-latency mode's own kernels (ep_core.ll_native, include/ep_core/ll_native.cuh)


def local_direct_enabled() -> bool:
    """``EPKIT_LL_LOCAL_DIRECT`` (ours, default 1): the native kernels' local shortcut without a hook (a rank's own
    experts read their rows where they lie: one pass instead of two); 0 sends them through the buffer like a peer's."""
    return _env.ll_local_direct()


def native_refusal(inner: Any) -> str:
    """Why the native kernels cannot run on ``inner``'s storage ('' when they can). They write straight into the
    peers' regions, so every peer's memory must be mapped in this process: ipc, the loopback domain, and the nccl
    transport (``NcclStorage.peer_bases``: the window's LSA pointers) where NCCL's LSA team is the whole group
    (checked bitwise over nccl on one rank on an H100, 2026-12-07). The reason is the same on every rank (the
    storage's kind and team)."""
    try:
        rt = inner._rt()
        storage = rt.storage
    except Exception:  # a destroyed buffer
        return "the inner buffer is destroyed"
    from ep_core.transports.nccl import NcclStorage

    if NcclStorage.lsa_team_short(storage, rt.num_ranks):  # peers outside the LSA team: not reachable
        n = int(rt.num_ranks)
        return (
            f"the nccl transport reaches {storage.lsa_size} of the {n} ranks by load/store (NCCL's LSA team)"
        )
    if not hasattr(storage, "peer_bases") or getattr(storage, "array_device", "cuda") != "cuda":
        return f"the {type(storage).__name__} storage does not map the peers' GPU memory into this process"
    return ""


class NativeRegion:
    """One rank's low-latency region at the front of its inner buffer's symmetric data region (``num_bytes`` of
    ``ll_native.region_layout``): the peers' bases as a device table, the host-mapped timeout record, the half the
    next call uses (V1's double buffer: every dispatch and every combine toggles it) and the grids (the receive
    kernels, which wait for peers, keep to this rank's share of the SMs so that every rank sharing the GPU fits)."""

    def __init__(
        self, inner: Any, rank: int, num_ranks: int, num_experts: int, m: int, num_topk: int, hidden: int
    ) -> None:
        from ep_core import ll_native

        rt = inner._rt()
        self.inner = inner
        self.rank, self.num_ranks, self.num_experts = int(rank), int(num_ranks), int(num_experts)
        self.epr = num_experts // num_ranks
        self.m, self.num_topk, self.hidden = int(m), int(num_topk), int(hidden)
        self.layout = ll_native.region_layout(self.epr, num_ranks, num_experts, m, num_topk, hidden)
        if int(rt.data.nbytes) < self.layout.total_bytes:
            raise EPValueError(
                f"low-latency region: {self.layout.total_bytes} bytes needed, the buffer's data region has "
                f"{int(rt.data.nbytes)}"
            )
        bases = [int(b) + int(rt.num_workspace_bytes) for b in rt.storage.peer_bases(num_ranks)]
        self.own_base = bases[self.rank]
        dev = torch.device("cuda", torch.cuda.current_device())
        self.peers = torch.tensor(bases, dtype=torch.int64, device=dev)
        # host mapped, read without a sync: [0..4) the timeout record, [4 + r] the mask generation + 1 when a
        # kernel masked rank r after a timeout (rank masking; ll_shrink.NativeShrink merges it), then the signature
        # record (issue 41; `check`)
        self.herr = torch.zeros(ll_native.herr_words(self.num_ranks), dtype=torch.int32).pin_memory()
        # the same memory: a numpy read costs less than a tensor's on the hot path
        self.words = self.herr.numpy()
        self.timeout_ms = max(1, min(int(float(rt.config.num_gpu_timeout_secs) * 1000), (1 << 31) - 1))
        sms = int(torch.cuda.get_device_properties(dev).multi_processor_count)
        devices = getattr(rt.storage, "rank_devices", None) or []
        here = sum(1 for d in devices if d == devices[self.rank]) if len(devices) > self.rank else 1
        # ranks sharing the GPU: all their spinning receives together hold at most a quarter of the SMs, leaving the
        # rest to the sends they wait for and to the ranks' own work. Measured on the H100 (EP8 loopback decode step,
        # `profile_ll_native.py --step`, 2026-12-07): sms // here = 16 blocks a rank timed out beside elementwise
        # work; 8 and 4 passed with and without a GEMM, 4 the fastest
        self.recv_blocks = 2 * sms if here <= 1 else max(1, sms // (4 * here))
        self.send_blocks = 2 * sms
        self.next_half = 0
        _count_calls(self)

    def take_half(self, dispatch: bool = False) -> int:
        """The half this call uses (every call toggles it, refused ones too: ``native_abort``); counts the calls and
        the dispatches (a combine's signature names its dispatch by this count, equal on every rank) and keeps the
        call's record token (the kernels' ``envelope_token``: the receive advances the half's epoch of the op)."""
        h = self.next_half
        self.next_half ^= 1
        self.calls += 1
        self.dispatches += int(dispatch)
        op = 0 if dispatch else 1
        self.epochs[h][op] += 1
        self.token = (self.epochs[h][op] * 2 + h) * 2 + op
        return h

    def half_ptr(self, half: int) -> int:
        return self.own_base + self.layout.half_offset(half)

    def check(self, op: str, at_call: int = 0) -> None:
        """Raise what the receive kernels recorded (host-mapped words, no sync): a timeout (sticky: the region is
        unusable until rebuilt) or a new signature record (`raise_record`). ``at_call``: the token of the call whose
        receive was just issued (the CPU stand-in's receive has run by then; a GPU kernel rarely has): a record of that
        call is raised as at the call itself, any other as recorded by an earlier call."""
        check_region(self, op, at_call)


# ---------------------------------------------------------------------------------------------------------------------
# the kernels' signature words (issue 41; ``ep_lln::envelope_bad`` compares them): what every rank must agree on for a
# call rides in its flags, so the default envelope (``ll_native_agree="change"``) needs no host step per call

ABORT_BIT = 1 << 31
_DISPATCH_BITS = {16: "use_fp8", 17: "round_scale", 18: "use_ue8m0"}  # bits 19-30: the sizes' digest
_COMBINE_BITS = {18: "use_logfmt"}  # bits 0-17: the handle's dispatch (its count mod 2^18), 19-30: the sizes
_SIZES = "sizes (num_max_dispatch_tokens_per_rank, num_experts, hidden, num_topk)"
# why a rank refused its call on the host (the abort word's low byte)
_REASONS = {
    1: "an argument error",
    2: "a type error",
    3: "a state error (a destroyed or rebuilt buffer, a stale handle, a refusal until reset())",
    4: "an unsupported argument",
    5: "a disagreement in a host step",
    6: "a host wait that expired",
}


def _count_calls(reg: Any) -> None:
    reg.calls = reg.dispatches = 0
    reg.epochs = [[0, 0], [0, 0]]  # per half: the dispatches and the combines (the kernels' ctrl epochs)
    reg.token = 0  # the last call's record token (`take_half`)
    reg.seen = 0  # the last signature record raised (its token)


def _sizes_digest(reg: Any) -> int:
    """Bits 19-30 of both words: a digest of the region's sizes (computed once per region)."""
    digest = reg.__dict__.get("_sizes_digest")
    if digest is None:
        import zlib

        key = f"{reg.m},{reg.num_experts},{reg.hidden},{reg.num_topk}".encode()
        digest = reg._sizes_digest = (zlib.crc32(key) & 0xFFF) << 19
    return digest


def dispatch_sig(reg: Any, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> int:
    """The dispatch's signature word (bit 31 clear; the kernels put the count below bit 16)."""
    return _sizes_digest(reg) | int(use_fp8) << 16 | int(round_scale) << 17 | int(use_ue8m0) << 18


def combine_sig(reg: Any, use_logfmt: bool, dispatch: int) -> int:
    """The combine's signature word: LogFMT, the sizes and which dispatch's handle (its ``reg.dispatches``)."""
    return _sizes_digest(reg) | int(use_logfmt) << 18 | (int(dispatch) & 0x3FFFF)


def abort_word(exc: BaseException) -> int:
    """The abort word of a call refused with ``exc`` (as a signed int32, for the launch)."""
    from ep_core.errors import EPMismatchError, EPStateError, EPTimeoutError

    if isinstance(exc, EPMismatchError):
        reason = 5
    elif isinstance(exc, EPTimeoutError):
        reason = 6
    elif isinstance(exc, EPStateError):
        reason = 3
    elif isinstance(exc, NotImplementedError):
        reason = 4
    elif isinstance(exc, TypeError):
        reason = 2
    elif isinstance(exc, ValueError):
        reason = 1
    else:
        reason = 0
    return (ABORT_BIT | reason) - (1 << 32)


def check_region(reg: Any, op: str, at_call: int) -> None:
    """``NativeRegion.check`` (and the CPU stand-in's): the sticky timeout record, then a new signature record
    (raised as at the call when its token is ``at_call``)."""
    words = reg.words
    if words[0] != 0:
        from ep_core.errors import EPTimeoutError

        rank, peer, tag = (int(v) for v in words[1:4])
        what = "low_latency_dispatch counts" if tag == 1 else "low_latency_combine flags"
        raise EPTimeoutError(
            rank, what, peer, None,
            f"{op} (rank {rank}): timed out waiting for rank {peer} ({what}); the low-latency region is "
            "unusable until the buffer is rebuilt",
        )  # fmt: skip
    base = 4 + reg.num_ranks
    token = int(words[base])
    if token != 0 and token != reg.seen:
        reg.seen = token
        raise_record(reg, op, [int(v) for v in words[base + 1 : base + 5]], token == at_call)


def raise_record(reg: Any, op: str, rec: list[int], at_call: bool) -> None:
    """Raise a signature record ``[peer, tag, their word, this rank's word]``: ``EPPeerError`` naming the rank that
    refused the call (announced when read at the call itself: every rank raised at that call, the ranks stay in step),
    ``EPMismatchError`` naming the differing field. Read at a later call (the kernels ran after their call returned
    undefined results), the error puts the buffer out of step: every operation is refused until ``reset()``."""
    from ep_core.errors import EPMismatchError, EPPeerError

    peer, tag, theirs, mine = rec
    theirs &= 0xFFFFFFFF
    mine &= 0xFFFFFFFF
    call = "low_latency_dispatch" if tag == 1 else "low_latency_combine"
    when = (
        ""
        if at_call
        else f" (recorded by the kernels of an earlier {call}, whose results were undefined; raised at this rank's next "
        "call: every operation is refused until reset() is called on every rank)"
    )
    if theirs & ABORT_BIT:
        reason = _REASONS.get(theirs & 0xFF, "an error")
        raise EPPeerError(
            f"{op} (rank {reg.rank}): rank {peer} refused its {call} before its kernels ran ({reason}; it raised the "
            f"error there); nothing was paired{when}",
            ranks=(peer,),
            announced=at_call,
        )
    bits = _DISPATCH_BITS if tag == 1 else _COMBINE_BITS
    diff = (theirs ^ mine) & (0x7FFF0000 if tag == 1 else 0x7FFFFFFF)
    fields: dict = {}
    for bit, name in bits.items():
        if diff >> bit & 1:
            fields[name] = {peer: bool(theirs >> bit & 1), reg.rank: bool(mine >> bit & 1)}
    if diff & 0x7FF80000:
        fields["sizes"] = {peer: "other", reg.rank: "these"}
    if tag != 1 and diff & 0x3FFFF:
        fields["handle"] = {peer: "another dispatch's", reg.rank: "this rank's"}
    said = "; ".join(
        f"{_SIZES if k == 'sizes' else k} differs (rank {peer}: {v[peer]}, rank {reg.rank}: {v[reg.rank]})"
        for k, v in fields.items()
    )
    raise EPMismatchError(
        f"{op} (rank {reg.rank}): the ranks disagree on the {call}: {said} (the kernels' signature words); nothing "
        f"returned by it is valid; every rank raises; call reset() on every rank to go on{when}",
        fields=fields,
    )


def native_abort(reg: NativeRegion, op: str, exc: BaseException) -> None:
    """This rank refused its ``op`` call on the host before its kernels ran: launch ``ep_lln_abort`` on the stream
    its kernels would have run on (the current one, after the communication stream's work: the abort reads the half's
    epoch the calls before it advanced), so that the peers' receives of that call end at once and raise naming this
    rank, and the epochs stay in step."""
    from .. import _streams

    which = 0 if op == "low_latency_dispatch" else 1
    comm = _streams._streams.get(torch.cuda.current_device()) if torch.cuda.is_available() else None
    if comm is not None and comm != torch.cuda.current_stream():  # none: no call ran on the comm stream yet
        torch.cuda.current_stream().wait_stream(comm)
    half = reg.take_half(dispatch=which == 0)
    args = [reg.peers, reg.own_base, reg.half_ptr(half), reg.num_topk, reg.hidden, reg.num_experts, reg.num_ranks,
            reg.rank, reg.m, which, abort_word(exc), reg.own_base]  # fmt: skip
    _NativeLaunch()("ep_lln_abort", 1, 256, args)


def native_dispatch(
    reg: NativeRegion,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    stats: torch.Tensor | None,
    local_direct: bool = False,
    mask: torch.Tensor | None = None,
    sig: int = 0,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """Launch the dispatch send now; returns ``(recv, recv_count, src_info, layout_range, lanes, lane_pos,
    receive)`` where ``receive()`` launches the receive (on the then-current stream) that fills the outputs.
    ``lane_pos`` [T, K] int32: each (token, first lane of its expert)'s position in this rank's block of the expert
    (the combine's local shortcut reads it). ``local_direct``: the receive follows the send at once (no hook), so
    this rank's own experts take their rows from ``x`` (or the FP8 staging) in the receive instead of a message
    through the buffer: one pass instead of two for the local share. ``mask``: the rank mask (int32 [N + 1] on the
    device, ``ll_shrink.NativeShrink``), None = no masking. ``sig``: the call's signature word (`dispatch_sig`)."""
    run = _NativeLaunch()
    dev = x.device
    n, epr, m, h, k = reg.num_ranks, reg.epr, reg.m, reg.hidden, reg.num_topk
    slots = n * m
    topk = topk_idx.contiguous()
    idx64 = _idx64(topk, "low_latency_dispatch: topk_idx")  # refused before the half is taken (no launch yet)
    half = reg.take_half(dispatch=True)
    own_half = reg.half_ptr(half)
    x = _vec(x)
    t = int(x.shape[0])
    err = reg.own_base  # the region's front: the device error word
    groups = h // 128
    # one rank with the local shortcut: no send (the receive lists this rank's rows and reads them where they lie)
    sends = n > 1 or not local_direct
    # FP8: cast once per token into a staging buffer, the send's and the local rows' payload; by token
    # (EPKIT_LL_OWN_BY_TOKEN, under evaluation; receive local_direct 2) the receive writes this rank's own rows from x
    # token by token (FP8: cast there), so only messages need the staging
    by_token = local_direct and _env.ll_own_by_token()
    payload, pstride = x, h * 2
    if use_fp8 and (sends or not by_token):
        stride = -(-(h + 4 * groups) // 16) * 16
        payload = torch.empty(max(t, 1), stride, dtype=torch.uint8, device=dev)
        if t:
            run("ep_lln_cast_fp8", t, 256, [x, h, int(round_scale), payload, stride])
        pstride = stride
    lane_pos = torch.empty(max(t, 1), k, dtype=torch.int32, device=dev)
    send = [payload, pstride, int(round_scale), topk, idx64, t, k, h, reg.num_experts, n, reg.rank, m, reg.peers,
            reg.own_base, own_half, int(use_fp8), int(local_direct), lane_pos, err, reg.herr.data_ptr(), mask,
            sig]  # fmt: skip
    if sends:
        run("ep_lln_dispatch_send", min(reg.num_experts, reg.send_blocks), 512, send, shared_mem=8 * m)
    out, s_store = _fp8_outputs(epr, slots, h, use_ue8m0, dev) if use_fp8 else (None, None)
    if not use_fp8:
        out = torch.empty(epr, slots, h, dtype=torch.bfloat16, device=dev)
    recv: Any = (out, s_store.transpose(1, 2)) if use_fp8 else out
    src_info = torch.empty(epr, slots, dtype=torch.int32, device=dev)
    lanes = torch.empty(epr, slots, dtype=torch.int32, device=dev)
    recv_count = torch.empty(epr, dtype=torch.int32, device=dev)
    layout_range = torch.empty(epr, n, dtype=torch.int64, device=dev)
    in_kernel = stats is not None and stats.dtype == torch.int32 and stats.is_contiguous() and stats.is_cuda

    def receive() -> None:
        args = [k, h, reg.num_experts, n, reg.rank, m, own_half, int(use_fp8), int(use_ue8m0), out, s_store,
                src_info, lanes, recv_count, layout_range, stats if in_kernel else None, x if by_token else payload,
                h * 2 if by_token else pstride, int(round_scale), topk, idx64, t, 2 if by_token else int(local_direct),
                lane_pos, reg.timeout_ms, err, reg.herr.data_ptr(), mask, sig]  # fmt: skip
        smem = 4 * (n + 1) + (8 * m if local_direct else 0) + (4 * epr if by_token else 0)
        _NativeLaunch()("ep_lln_dispatch_recv", min(epr, reg.recv_blocks), 512, args, shared_mem=smem)
        if stats is not None and not in_kernel:
            stats.add_(recv_count.to(stats.dtype))

    return recv, recv_count, src_info, layout_range, lanes, lane_pos, receive


def native_combine(
    reg: NativeRegion,
    x: torch.Tensor,
    src_info: torch.Tensor,
    lanes: torch.Tensor,
    layout_range: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None,
    lane_pos: torch.Tensor | None = None,
    local_direct: bool = False,
    use_logfmt: bool = False,
    mask: torch.Tensor | None = None,
    sig: int = 0,
) -> tuple[torch.Tensor, Any]:
    """Launch the combine send now; returns ``(combined, receive)``, ``receive()`` launching the weighted reduction
    into ``combined`` ([T, hidden] bf16; ``out`` when it is contiguous and 16-byte aligned, else copied into it).
    ``use_logfmt``: the ``_logfmt`` kernels (rows LogFMT-10 encoded by the send, decoded by the receive; every row
    through the buffer, so ``local_direct`` is off). ``sig``: the call's signature word (`combine_sig`)."""
    suffix = "_logfmt" if use_logfmt else ""
    if use_logfmt:
        local_direct = False
    run = _NativeLaunch()
    n, epr, m, h, k = reg.num_ranks, reg.epr, reg.m, reg.hidden, reg.num_topk
    topk = topk_idx.contiguous()
    idx64 = _idx64(topk, "low_latency_combine: topk_idx")  # refused before the half is taken (no launch yet)
    half = reg.take_half()
    own_half = reg.half_ptr(half)
    x = _vec(x)
    err = reg.own_base
    local_direct = bool(local_direct) and lane_pos is not None
    send = [x, src_info, lanes, layout_range, k, h, reg.num_experts, n, reg.rank, m, reg.peers, reg.own_base,
            own_half, int(local_direct), err, reg.herr.data_ptr(), mask, sig]  # fmt: skip
    if n > 1 or not local_direct:  # one rank with the local shortcut: every row stays in x for the receive
        run("ep_lln_combine_send" + suffix, min(epr, reg.send_blocks), 512, send, shared_mem=4 * (n + 1))
    t = int(topk_idx.shape[0])
    direct = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
    dest = out if direct else torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    w = topk_weights.contiguous()

    def receive() -> None:
        # a warp per (token, part of at least 32 vectors: a vector a lane); 16 warps a block, each with its
        # token's lanes in shared memory (20 bytes a lane)
        warps = t * max(1, (h // 8) // 32)
        # 256 threads of at most 64 registers: a spinning receive block leaves room on its SM for a GEMM CTA of
        # another rank sharing the GPU (512 threads did not: the EP8 loopback decode step timed out, session 4)
        grid = max(1, min(-(-warps // 8), reg.recv_blocks))
        args = [topk, idx64, w, t, k, h, reg.num_experts, n, reg.rank, m, own_half, dest, x, layout_range,
                lane_pos, int(local_direct), reg.timeout_ms, err, reg.herr.data_ptr(), mask, sig]  # fmt: skip
        # no token: the kernel still has to see every flag of this call (its epoch)
        _NativeLaunch()("ep_lln_combine_recv" + suffix, grid, 256, args, shared_mem=20 * 8 * k)
        if out is not None and not direct:
            out.copy_(dest)

    return (out if out is not None else dest), receive


def native_clean(reg: NativeRegion, mask: torch.Tensor, gen: int) -> None:
    """Launch ``ep_lln_clean`` (rank masking's rejoin, a collective kernel of every rank: unmask all, reset the
    epochs and flags of both halves between two device barriers; ``gen`` the count of cleans so far, equal on every
    rank) on the current stream; the next call uses half 0."""
    args = [reg.peers, reg.own_base, reg.num_topk, reg.hidden, reg.num_experts, reg.num_ranks, reg.rank, reg.m,
            int(gen), reg.timeout_ms, reg.own_base, reg.herr.data_ptr(), mask]  # fmt: skip
    _NativeLaunch()("ep_lln_clean", 1, 256, args)
    reg.next_half = 0
    reg.words[4 + reg.num_ranks :] = 0  # the kernel restarts the epochs (the record's tokens) and its err[1]
    reg.seen = 0
    reg.epochs = [[0, 0], [0, 0]]


class _NativeLaunch(_Launch):
    def __call__(self, name: str, grid: Any, block: int, args: list, shared_mem: int = 0) -> None:
        from ep_core import ll_native

        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        ll_native.launch(
            name, grid, block, values, device=self.device, stream=self.stream, shared_mem=shared_mem
        )
