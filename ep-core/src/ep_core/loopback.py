"""The loopback domain: N ranks in one process on one GPU, each with its own symmetric buffer, workspace and stream.

The kernels and the protocol are the production ones (ipc transport): every rank's peer table points at the other
ranks' buffers. All blocks of all ranks must be resident at once, so `num_ranks * num_sms` may not exceed the
device's SMs (checked); the N grids are launched plainly (a cooperative launch guarantees one grid's residency,
not N grids'), RankDriver with `num_ranks_on_device = N`.

Errors: after a failed wait every rank refuses to launch until `reset()` (all ranks at once); `dispatch`/`combine`
check every rank before launching any, and hold frees that wait for the whole device until every rank has launched
(`_cuda.frees_deferred`).

The calls mirror `ep_core.reference.dispatch/combine` (lists indexed by rank), so tests compare the two directly:

>>> dom = LoopbackDomain(8, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
>>> outs = dom.dispatch(xs, topk_idxs, topk_weights, num_experts=256)
>>> comb = dom.combine([o.recv_x for o in outs], [o.handle for o in outs])

Emulated nodes: `num_scaleup_ranks=S_u < N` groups ranks `r // S_u` into nodes: hybrid mode (include/ep_core/
hybrid.cuh), or with `allow_hybrid_mode=False` direct mode across nodes (include/ep_core/direct_xnode.cuh).
Inputs may be device or numpy arrays; outputs are `DeviceArray`s (`DispatchResult.to_reference()`: numpy).
`ProcessRank` is the same rank for one process of a multi-process group (buffers exchanged through ep_symmem).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ep_layout
import numpy as np

from ep_core.errors import EPConfigError, EPStateError, EPTimeoutError, EPTypeError, EPValueError
from ep_core.kernels import _cuda
from ep_core.kernels._cuda import DeviceArray, DeviceBuffer, Stream
from ep_core.kernels.plan import KernelConfig, check_coresident, default_num_sms, epilogue_share, plan_regions
from ep_core.kernels.rank_driver import (
    CombineResult,
    DispatchResult,
    RankDriver,
    RankResources,
    count_ranks_on_device,
)
from ep_core.topology import resolve_scaleup_ranks
from ep_core.transports.ipc import IpcBuffer
from ep_core.validation import validate_rank_routing

__all__ = ["LoopbackDomain", "ProcessRank", "domain_data_bytes"]


def domain_data_bytes(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    num_scaleup_ranks: int | None = None,
) -> int:
    """GPU buffer bytes (after the workspace) that serve bf16 and FP8 dispatch and both combine layouts; with
    `num_scaleup_ranks < num_ranks`, the hybrid regions too (sized for the most experts per rank: the count blocks
    grow with them)."""
    cfg = KernelConfig(num_ranks, num_topk, hidden, num_scaleup_ranks=num_scaleup_ranks or num_ranks)
    need = 0
    most = min(ep_layout.NUM_MAX_EXPERTS, 256 * num_ranks) // num_ranks * num_ranks
    for n_e in (num_ranks, most) if cfg.is_hybrid else (num_ranks,):
        plan = plan_regions(cfg, n_e, num_max_tokens_per_rank)
        need = max(need, plan.dispatch_bytes, plan.combine_bytes)
    hint = max(
        ep_layout.size_hint_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk, False, amr)
        for amr in (True, False)
    )
    return ep_layout.align(max(need, hint), ep_layout.NUM_SYMMETRIC_ALIGN_BYTES)


def _check_hybrid_flag(allow_hybrid_mode: Any) -> bool:
    if not isinstance(allow_hybrid_mode, bool):
        raise EPValueError(f"allow_hybrid_mode: expected a bool, got {allow_hybrid_mode!r}")
    return allow_hybrid_mode


def _logical_ranks(num_ranks: int, ranks_per_node: int, allow_hybrid_mode: bool) -> tuple[int, int]:
    """`(S_u, ranks per node)` of the kernels (RankDriver's `num_scaleup_ranks`, `num_nvlink_ranks`): hybrid mode
    `(S_u, S_u)`; direct mode across nodes `(N, S_u)` (the handle has N regions, as direct mode)."""
    if allow_hybrid_mode:
        return ranks_per_node, ranks_per_node
    return num_ranks, ranks_per_node


def _upload(a: Any, stream: Stream) -> Any:
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(_upload(v, stream) for v in a)
    if isinstance(a, np.ndarray):
        return DeviceArray.from_numpy(a, stream)
    return a


class LoopbackDomain:
    """N ranks of a direct-mode domain in this process, on the current GPU. `prefer_overlap_with_compute` as in
    `EPBuffer`: False runs each rank's copy epilogue on its share of the GPU instead of the op's `num_sms`."""

    def __init__(
        self,
        num_ranks: int,
        *,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        num_sms: int = 0,
        num_bytes: int | None = None,
        gpu_timeout_secs: float = 100.0,
        cpu_timeout_secs: float = 300.0,
        use_symmem: bool = False,
        num_warps: int | None = None,
        num_scaleup_ranks: int | None = None,
        allow_hybrid_mode: bool = True,
        prefer_overlap_with_compute: bool = True,
    ) -> None:
        if not isinstance(prefer_overlap_with_compute, bool):
            raise EPTypeError(
                f"prefer_overlap_with_compute: expected a bool, got {type(prefer_overlap_with_compute).__name__}"
            )
        if not 1 <= num_ranks <= ep_layout.NUM_MAX_RANKS:
            raise EPValueError(f"num_ranks: expected 1..{ep_layout.NUM_MAX_RANKS}, got {num_ranks}")
        # Emulated nodes: ranks r // S_u form a node. S_u = N (the default) is direct mode; S_u < N runs the hybrid
        # kernels with the emulated scale-out put (load/store between the "nodes"), or with allow_hybrid_mode=False
        # direct mode across nodes (the same put to every rank of another node). Checked before any GPU work.
        self.num_scaleup_ranks = resolve_scaleup_ranks(int(num_ranks), num_scaleup_ranks)
        self.allow_hybrid_mode = _check_hybrid_flag(allow_hybrid_mode)
        self.num_ranks = int(num_ranks)
        self.num_max_tokens = int(num_max_tokens_per_rank)
        # a hardware queue per rank stream and per captured branch where the context is not made yet (one kernel at a
        # time per stream runs on fewer, but a graph's chained branches may not)
        _cuda.reserve_connections(2 * self.num_ranks + 1)
        self.device_sms = _cuda.num_device_sms()
        if num_sms == 0:
            num_sms = default_num_sms(self.device_sms, self.num_ranks)
        check_coresident(self.num_ranks, num_sms, self.device_sms)
        self.num_sms = int(num_sms)
        su, nvl = _logical_ranks(self.num_ranks, self.num_scaleup_ranks, self.allow_hybrid_mode)
        data = num_bytes or domain_data_bytes(self.num_ranks, self.num_max_tokens, hidden, num_topk, su)
        self.buffers = IpcBuffer.create_loopback(self.num_ranks, data, use_symmem=use_symmem)
        self.streams = [Stream() for _ in range(self.num_ranks)]
        self.ranks: list[RankDriver] = []
        for r in range(self.num_ranks):
            res = RankResources(
                r,
                self.num_ranks,
                self.buffers.bases[r],
                data,
                self.buffers.peer_table,
                self.streams[r],
                num_ranks_on_device=self.num_ranks,
            )
            self.ranks.append(
                RankDriver(
                    res,
                    num_max_tokens_per_rank=self.num_max_tokens,
                    gpu_timeout_secs=gpu_timeout_secs,
                    cpu_timeout_secs=cpu_timeout_secs,
                    num_warps=num_warps,
                    num_scaleup_ranks=su,
                    num_nvlink_ranks=nvl,
                    # False: each rank's copy epilogue on its share of the GPU (device SMs // ranks), as the
                    # epilogue of one rank per GPU would run on the whole device
                    epilogue_sms=epilogue_share(prefer_overlap_with_compute, self.device_sms, self.num_ranks),
                )
            )
        self._closed = False

    def _check(self, name: str, seq: Any) -> list:
        if seq is None:
            return [None] * self.num_ranks
        seq = list(seq)
        if len(seq) != self.num_ranks:
            raise EPValueError(f"{name}: expected {self.num_ranks} entries (one per rank), got {len(seq)}")
        return seq

    def _sms(self, num_sms: int) -> int:
        sms = num_sms or self.num_sms
        check_coresident(self.num_ranks, sms, self.device_sms)
        return sms

    def dispatch(
        self,
        xs: Sequence[Any],
        topk_idxs: Sequence[Any] | None = None,
        topk_weights: Sequence[Any] | None = None,
        *,
        sf: Sequence[Any] | None = None,
        num_experts: int | None = None,
        expert_alignment: int | None = None,
        do_expand: bool | None = None,
        deterministic: bool = False,
        do_cpu_sync: bool | None = None,
        use_tma_aligned_col_major_sf: bool = False,
        do_zero_padding: bool = False,
        handles: Sequence[Any] | None = None,
        num_sms: int = 0,
        cumulative_local_expert_recv_stats: Sequence[Any] | None = None,
        zero_copy: bool = False,
    ) -> list[DispatchResult]:
        """Dispatch on every rank (same keywords as `ep_core.reference.dispatch`). `zero_copy`: each rank's outputs
        are views of its receive region, stored there by the dispatch kernel (no copy epilogue; deterministic row
        order; `RankDriver.launch_dispatch`), valid until the next operation on the domain."""
        hs = self._handles("dispatch", handles)
        xs = self._check("xs", xs)
        idxs = self._check("topk_idxs", topk_idxs)
        ws = self._check("topk_weights", topk_weights)
        sfs = self._check("sf", sf)
        stats = self._check("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats)
        sms = 0 if (handles is not None and num_sms == 0) else self._sms(num_sms)
        # no free waits for the device between the ranks' launches (the ranks launched so far wait for the rest)
        with _cuda.frees_deferred():
            xs = [_upload(x, s) for x, s in zip(xs, self.streams)]
            idxs = [_upload(i, s) for i, s in zip(idxs, self.streams)]
            for r in range(self.num_ranks):  # every rank's routing before any rank launches
                validate_rank_routing(xs[r], idxs[r], hs[r])
            pend = []
            for r, rank in enumerate(self.ranks):
                s = self.streams[r]
                pend.append(
                    rank.launch_dispatch(
                        xs[r],
                        idxs[r],
                        _upload(ws[r], s),
                        sf=_upload(sfs[r], s),
                        num_experts=num_experts,
                        expert_alignment=expert_alignment,
                        do_expand=do_expand,
                        do_cpu_sync=do_cpu_sync,
                        deterministic=deterministic,
                        do_zero_padding=do_zero_padding,
                        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                        handle=hs[r],
                        num_sms=sms,
                        cumulative_local_expert_recv_stats=stats[r],
                        zero_copy=zero_copy,
                    )
                )
            try:
                return [rank.finish_dispatch(p) for rank, p in zip(self.ranks, pend)]
            except EPTimeoutError:
                self._drain()
                raise

    def combine(
        self,
        xs: Sequence[Any],
        handles: Sequence[Any],
        *,
        topk_weights: Sequence[Any] | None = None,
        bias: Sequence[Any] | None = None,
        allow_multiple_reduction: bool = True,
        num_sms: int = 0,
        zero_copy: bool = False,
    ) -> list[CombineResult]:
        """Combine on every rank (same keywords as `ep_core.reference.combine`). `zero_copy`: each `xs[r]` is rank
        r's `combine_buffers(handles, hidden)[r]` with its rows written in place; the kernels read them there
        (one pass less; `RankDriver.combine_buffer`)."""
        hs = self._handles("combine", handles)
        xs = self._check("xs", xs)
        ws = self._check("topk_weights", topk_weights)
        bs = self._check("bias", bias)
        # zero-copy: every rank's buffer before any rank launches (a launched rank would wait for the others)
        if zero_copy:
            for rank, x, h, w in zip(self.ranks, xs, hs, ws):
                rank.check_zero_copy(x, h, w)
        # as in dispatch: no synchronizing free between the ranks' launches
        with _cuda.frees_deferred():
            out = []
            for r, rank in enumerate(self.ranks):
                s = self.streams[r]
                out.append(
                    rank.combine(
                        _upload(xs[r], s),
                        hs[r],
                        topk_weights=_upload(ws[r], s),
                        bias=_upload(bs[r], s),
                        allow_multiple_reduction=allow_multiple_reduction,
                        num_sms=num_sms,
                        report_input_error=False,
                        zero_copy=zero_copy,
                    )
                )
            for rank in self.ranks:  # every rank has launched: a report now leaves no rank waiting
                rank._report_input_error()
        return out

    def combine_buffers(self, handles: Sequence[Any], hidden: int) -> list[Any]:
        """Every rank's zero-copy combine buffer for its handle (`RankDriver.combine_buffer`): bf16 [received rows,
        hidden] device arrays to write the expert outputs into, then `combine(buffers, handles, zero_copy=True)`."""
        hs = self._handles("combine_buffers", handles, guard=False)
        return [rank.combine_buffer(h, hidden) for rank, h in zip(self.ranks, hs)]

    def _handles(self, op: str, handles: Any, guard: bool = True) -> list:
        """`op`'s handles, one per rank (`_check`), on an open domain; `guard`: every rank's failure check (and its
        handle's) before any rank launches (a rank that raised would leave its peers' kernels waiting for it until
        their timeout)."""
        if self._closed:
            raise EPStateError(f"{op}: the domain is closed")
        hs = self._check("handles", handles)
        if guard:
            for rank, handle in zip(self.ranks, hs):
                rank.guard()
                rank._check_handle(handle)
        return hs

    def _drain(self, strict: bool = False) -> None:
        # a rank's kernel may legitimately run until its GPU timeout: wait as long as the host timeout allows
        for r, (s, rank) in enumerate(zip(self.streams, self.ranks)):
            if not s.synchronize(rank.cpu_timeout_secs) and strict:
                raise EPTimeoutError(r, "cpu.drain", "stream", "not drained")

    def synchronize(self) -> None:
        """Wait for every rank's stream and raise the first recorded kernel error."""
        self._drain()
        for rank in self.ranks:
            rank.check_errors(synchronize=True)  # drained already: confirms earlier no-sync handles

    def reset(self) -> None:
        """Clear every rank's error state, workspace and scratch (after an error; all ranks together). The order of
        `RankDriver.reset_state` with barriers, in one thread: drain every rank (no kernel runs or writes into a peer),
        zero every rank, drain every rank (no rank launches before all are zeroed)."""
        self._drain(strict=True)
        for rank in self.ranks:
            rank.fail_unconfirmed_handles()  # a reset follows a failure: in-flight handles may hold garbage
            rank._zero_state()
        self._drain(strict=True)
        for rank in self.ranks:
            rank._status.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._drain()
        self._closed = True
        self.ranks = []
        self.buffers.close()

    def __enter__(self) -> LoopbackDomain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProcessRank(RankDriver):
    """One rank per process: a symmetric buffer exchanged with the other processes through ep_symmem
    (`memory="symmem"`, the default) or through CUDA IPC handles (`memory="cuda_ipc"`)."""

    check_routing = True  # (`DispatchLaunch.check_routing`)

    def __init__(
        self,
        bootstrap: Any,
        *,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        num_bytes: int | None = None,
        gpu_timeout_secs: float = 100.0,
        cpu_timeout_secs: float = 300.0,
        num_warps: int | None = None,
        memory: str = "symmem",
        cooperative: bool | None = None,
        num_scaleup_ranks: int | None = None,
        allow_hybrid_mode: bool = True,
    ) -> None:
        size = int(bootstrap.size)
        # ranks per node: the argument, else EPKIT_SCALEUP_RANKS, else one node (direct mode); several nodes run
        # hybrid mode, or direct mode across nodes with allow_hybrid_mode=False (as LoopbackDomain)
        self.num_scaleup_ranks = resolve_scaleup_ranks(size, num_scaleup_ranks, use_env=True)
        self.allow_hybrid_mode = _check_hybrid_flag(allow_hybrid_mode)
        su, nvl = _logical_ranks(size, self.num_scaleup_ranks, self.allow_hybrid_mode)
        data = num_bytes or domain_data_bytes(size, num_max_tokens_per_rank, hidden, num_topk, su)
        self.buffer = IpcBuffer.create_exchanged(bootstrap, data, memory)
        self.bootstrap = bootstrap
        on_device = count_ranks_on_device(self.buffer.rank_devices, int(bootstrap.rank))
        res = RankResources(
            int(bootstrap.rank),
            size,
            self.buffer.bases[0],
            data,
            self.buffer.peer_table,
            Stream(),
            num_ranks_on_device=on_device,
        )
        super().__init__(
            res,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            gpu_timeout_secs=gpu_timeout_secs,
            cpu_timeout_secs=cpu_timeout_secs,
            num_warps=num_warps,
            cooperative=cooperative,
            num_scaleup_ranks=su,
            num_nvlink_ranks=nvl,
        )

    def reset(self) -> None:
        """Clear the error state, workspace and scratch of every rank after a failure: a collective (every process
        calls it), ordered by the bootstrap's barrier (`RankDriver.reset_state`)."""
        self.reset_state(self.bootstrap.barrier)

    def close(self) -> None:
        self.stream.synchronize(60.0)
        self.bootstrap.barrier()
        self.buffer.close()


_ = (DeviceBuffer, EPConfigError)
