"""DeepEP 2.5's redundant-expert load balancing on ``EPBuffer``: ``lb_allocation_plan_or_num_bytes``,
``lb_prefetch_weights``, ``lb_reduce_grads``, ``lb_get_theoretical_num_sms``.

``EPBuffer(..., lb_allocation_plan_or_num_bytes=plan_or_bytes)`` adds an LB region of that many bytes (a multiple
of ``get_num_allocation_alignment()``; a ``BufferAllocator`` plan is materialised into it in place, and every rank
of the group must plan the same tensors: checked at construction). ``buffer.num_lb_bytes`` and
``buffer.lb_storage`` (1-D uint8, None without a region) describe it. The redundant tensors must lie in the region,
as DeepEP requires (so code written for ep runs on DeepEP).

- ``lb_prefetch_weights(redundant_expert_weights, expert_weights, redundancy_mapping, num_sms=0,
  previous_event=None)``: fills every slot of this rank's row of ``redundancy_mapping`` with its expert's weights
  (one tensor or a sequence of tensors, paired by position; bytes per expert equal on both sides and a multiple of
  ``get_num_tma_alignment()``); empty slots (-1) keep their bytes.
- ``lb_reduce_grads(redundant_expert_grads, expert_grads, redundancy_mapping, num_sms=0, previous_event=None)``:
  ``expert_grads`` ([L, hidden] fp32) += the redundant gradients ([R, hidden] fp32) of every slot holding that
  expert, added in ascending (LSA rank, slot) order (deterministic; DeepEP's atomics add in any order).

Both return an ``EventOverlap`` recorded on the current stream after the work, run on the current stream after
``previous_event``, and are collectives: every rank of the buffer's group calls them (DeepEP: every rank of the
NVLink domain). Semantics and the oracle are ``ep_core.load_balance``.

How the bytes move: two roads, chosen at construction, the same on every rank (``buffer.lb_path``;
``buffer.lb_path_reason`` says why not the first):

- ``"symmetric"``, where the buffer's transport gives the peers load/store access (``ipc``: processes sharing a GPU
  or one node; ``nccl`` where NCCL's LSA team is the whole group) and the group is one LSA domain: the LB region is a
  symmetric allocation of its own (``ep_core.side_allocation``, ``[region | sync words]``, every rank's mapped here),
  and ``ep_core.lb_copy``'s kernels move the bytes on the current stream, on ``num_sms`` blocks (0:
  ``lb_get_theoretical_num_sms()``; at most the device's SMs). A prefetch is a push, as DeepEP's (its
  ``expert_weights`` may be any device memory): the owner copies each of its experts' rows into every slot that holds
  it, its own and the peers' (16-byte vectors). A reduce is a pull: each owner reads the gradients of every slot
  that holds one of its experts from the peers' regions and adds them in ascending (LSA rank, slot) order, one fp32
  add each (bitwise the other road). Both sit between two barriers of the domain (one block each): no rank writes
  or reads a slot before every peer's stream reached the call, none leaves (and reuses its slots) before every
  peer's copies and reads are done. Every wait is bounded by the buffer's ``num_gpu_timeout_secs``; one that
  expires is recorded in host-mapped memory, the kernels of later calls do nothing, and the next call raises
  ``EPTimeoutError`` naming the peer (sticky: rebuild the buffer). The address tables (``lb_copy.prefetch_tasks``,
  ``lb_copy.reduce_table``) go to the GPU once per distinct call (the last one per kind is kept).
- ``"all_to_all"`` elsewhere (the CPU backend, hybrid mode, nccl across LSA teams): a slot filled from this rank's own
  expert is one device copy (``Tensor.copy_``); the others go through one ``all_to_all_single`` of the group per
  tensor (NCCL on CUDA; gloo through host memory) and a copy into place; the LB region is this rank's own memory and
  ``num_sms`` is validated only. Where load/store was expected but the symmetric allocation failed on some rank,
  every rank takes this road with a warning naming the reason.

``lb_get_redundancy_mapping(num_recv_tokens_per_expert, num_redundant_experts)`` (DeepEP 2.6's name; its source was
not available to ep, so the signature and the algorithm are ep's): a collective of the group that gathers every
rank's per-local-expert token counts (``[num_local_experts]`` int32/int64, e.g. the ``cumulative_local_expert_recv_stats``
that ``dispatch`` accumulates) and returns this rank's LSA domain's mapping ``[num_nvlink_ranks,
num_redundant_experts]`` int32 on the counts' device, the same on every rank of the domain, ready for
``lb_prefetch_weights``: ``ep_core.load_balance.plan_redundancy_mapping``'s greedy (the largest load per instance
first, onto the least loaded rank that may host it; never a rank's own expert, never twice on one rank). Enveloped
(``ep_core.envelope``): a rank whose arguments are refused announces it, its peers raise ``EPPeerError`` naming it;
ranks that disagree on ``num_local_experts`` or ``num_redundant_experts`` all raise ``EPMismatchError``.

``lb_get_theoretical_num_sms()`` is DeepEP 2.5's estimate (``ep_core.load_balance.lb_num_sms`` with 2.5's per-SM
rates, 180 GB/s read and 45 write) over ep's scale-up bandwidth (``EPKIT_NVLINK_GBS`` or detection).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ep_core.buffer_base import NUM_ALLOCATION_ALIGN_BYTES, NUM_TMA_ALIGN_BYTES
from ep_core.buffer_base import BufferAllocator as _CorePlan
from ep_core.envelope import Channel
from ep_core.errors import EPMismatchError, EPStateError, EPTypeError, EPValueError
from ep_core.load_balance import check_redundancy_mapping, lb_num_sms, lb_routes, plan_redundancy_mapping
from ep_core.planner import PlannerPolicy

from .buffer_base import BufferAllocator
from .event import EventHandle, EventOverlap

__all__ = ["LoadBalance"]


class LoadBalance:
    """The ``lb_*`` part of ``EPBuffer`` (a mixin before ``ElasticBuffer`` in its bases; the constructor's signature
    is ``ep_torch.epbuffer_surface``'s)."""

    def __init__(
        self, *args: Any, lb_allocation_plan_or_num_bytes: BufferAllocator | int = 0, **kwargs: Any
    ) -> None:
        # checked before the buffer is built (a collective)
        num = _lb_num_bytes(lb_allocation_plan_or_num_bytes)
        super().__init__(*args, **kwargs)
        self._init_lb(lb_allocation_plan_or_num_bytes, num)

    # ----------------------------------------------------------------------------------------------------------------
    # the LB region

    def _init_lb(self, plan_or_bytes: BufferAllocator | int, num: int) -> None:
        plan = plan_or_bytes if isinstance(plan_or_bytes, BufferAllocator) else None
        # every rank must lay the region out alike (peers address slots by offset): compare the plans
        core = plan._plan if plan is not None else _CorePlan()
        if plan is None and num:
            core.tensor("lb", (num,), "uint8")
        core.check(self.bootstrap)
        self.num_lb_bytes = num
        self._lb_sym: _SymmetricLB | None = None
        # which road the bytes take (module docstring): "symmetric" (the kernels) or "all_to_all", and why not the
        # kernels ("" on the symmetric road)
        self.lb_path, self.lb_path_reason = "all_to_all", "no LB region"
        if num:
            why = _symmetric_refusal(self)
            if not why:  # a collective: every rank reaches this alike (the refusal is the same on every rank)
                self._lb_sym, why = _SymmetricLB.create(self, num)
                if self._lb_sym is None:  # load/store was expected: not silently
                    warnings.warn(
                        f"lb_prefetch_weights / lb_reduce_grads go through all_to_all_single (rank {self.rank_idx}): "
                        f"the LB region's symmetric allocation failed ({why})",
                        stacklevel=3,
                    )
            if self._lb_sym is not None:
                self.lb_path, self.lb_path_reason = "symmetric", ""
            else:
                self.lb_path_reason = why
        self.lb_storage: torch.Tensor | None = None
        if self._lb_sym is not None:
            self.lb_storage = self._lb_sym.storage
        elif num:
            self.lb_storage = torch.zeros(num, dtype=torch.uint8, device=self.device)
        if plan is not None and self.lb_storage is not None:
            plan.materialize(self.lb_storage)

    def destroy(self) -> None:
        super().destroy()  # type: ignore[misc]
        self.lb_storage = None
        sym, self._lb_sym = getattr(self, "_lb_sym", None), None
        if sym is not None:
            sym.close()  # after the runtime's destroy: synchronized, and a barrier (no peer copies any more)

    def lb_get_theoretical_num_sms(self) -> int:
        """SMs that keep up with the scale-up bandwidth reading expert weights and writing them to a peer (even)."""
        cached = getattr(self, "_lb_num_sms", None)
        if cached is None:
            from ep_core.planner import detect_scaleup_gbs

            nvlink_gbs = detect_scaleup_gbs(max(int(self.num_nvlink_ranks), 2))[0]
            # DeepEP 2.5's per-SM HBM rates (the planner's V2_5 policy: 180 read, 45 write), not V2's 200 / 50
            cached = self._lb_num_sms = lb_num_sms(nvlink_gbs, *PlannerPolicy.V2_5.sm_gbs)
        return cached

    def lb_get_redundancy_mapping(
        self, num_recv_tokens_per_expert: torch.Tensor, num_redundant_experts: int
    ) -> torch.Tensor:
        """This LSA domain's redundancy mapping for the loads every rank gives (a collective; module docstring)."""
        op = "lb_get_redundancy_mapping"
        state = getattr(self.bootstrap, "rank_state", None)
        channel = Channel(self.bootstrap, state)
        with channel.state.guard(op, channel.announce):
            self._rt()
            counts = num_recv_tokens_per_expert
            if not isinstance(counts, torch.Tensor):
                raise EPTypeError(
                    f"{op}: num_recv_tokens_per_expert must be a torch tensor, got {type(counts).__name__}"
                )
            if counts.dtype not in (torch.int32, torch.int64) or counts.dim() != 1 or counts.numel() < 1:
                raise EPValueError(
                    f"{op}: num_recv_tokens_per_expert must be a 1-D int32/int64 tensor [num_local_experts > 0], "
                    f"got {tuple(counts.shape)} {counts.dtype}"
                )
            if isinstance(num_redundant_experts, bool) or not isinstance(num_redundant_experts, int):
                raise EPTypeError(
                    f"{op}: num_redundant_experts must be an int, got {num_redundant_experts!r}"
                )
            if num_redundant_experts < 0:
                raise EPValueError(f"{op}: num_redundant_experts must be >= 0, got {num_redundant_experts}")
            host = counts.detach().cpu().numpy().astype(np.int64)
            if (host < 0).any():
                raise EPValueError(f"{op}: num_recv_tokens_per_expert must be >= 0 (token counts)")
            every = channel.exchange(
                op,
                {"num_local_experts": int(host.size), "num_redundant_experts": num_redundant_experts},
                host.tolist(),
            )
        nvl = int(self.num_nvlink_ranks)
        base = int(self.rank_idx) - int(self.rank_idx) % nvl
        loads = np.asarray(every[base : base + nvl], dtype=np.int64)
        return torch.from_numpy(plan_redundancy_mapping(loads, num_redundant_experts)).to(counts.device)

    # ----------------------------------------------------------------------------------------------------------------
    # prefetch and reduce

    def lb_prefetch_weights(
        self,
        redundant_expert_weights: Sequence[torch.Tensor] | torch.Tensor,
        expert_weights: Sequence[torch.Tensor] | torch.Tensor,
        redundancy_mapping: torch.Tensor,
        num_sms: int = 0,
        previous_event: EventHandle | None = None,
    ) -> EventOverlap:
        """Fill this rank's redundant slots with their experts' weights (a collective; see the module docstring)."""
        op = "lb_prefetch_weights"
        channel = self._lb_channel()
        with channel.state.guard(op, channel.announce):
            pairs, mapping, routes = self._lb_prefetch_args(
                redundant_expert_weights, expert_weights, redundancy_mapping, num_sms
            )
            _wait(previous_event)
            if self._lb_sym is not None:
                self._lb_sym.check(op)
            self._lb_agree(
                channel, op, mapping, [int(src[0].nbytes) if src.shape[0] else 0 for _, src in pairs]
            )
        if self._lb_sym is not None:
            grid = self._lb_grid(num_sms)
            self._lb_sym.prefetch(routes, pairs, grid)
            return EventOverlap(EventHandle(device=self.device))
        me = routes.lsa_rank
        for dst, src in pairs:
            for local, slot in routes.send[me]:  # this rank's own experts into its own slots
                dst[slot].copy_(src[local])
            if self.num_ranks > 1:
                send = [routes.send[s] if s != me else () for s in range(len(routes.send))]
                got = self._lb_exchange(
                    src,
                    [[lo for lo, _ in p] for p in send],
                    [len(v) if s != me else 0 for s, v in enumerate(routes.recv)],
                )
                k = 0
                for s, slots in enumerate(routes.recv):
                    if s == me:
                        continue
                    for slot in slots:
                        dst[slot].copy_(got[k])
                        k += 1
        return EventOverlap(EventHandle(device=self.device))

    def _lb_prefetch_args(
        self,
        redundant_expert_weights: Any,
        expert_weights: Any,
        redundancy_mapping: torch.Tensor,
        num_sms: int,
    ) -> tuple[list, np.ndarray, Any]:
        """``lb_prefetch_weights``' checks: the (slot rows, expert rows) pairs, the mapping and its routes."""
        dsts = _as_list(redundant_expert_weights, "redundant_expert_weights")
        srcs = _as_list(expert_weights, "expert_weights")
        if len(dsts) != len(srcs):
            raise EPValueError(
                f"lb_prefetch_weights: {len(dsts)} redundant tensors but {len(srcs)} expert tensors (pair them)"
            )
        num_local = int(srcs[0].shape[0]) if srcs[0].dim() else 0
        mapping, routes = self._lb_mapping(redundancy_mapping, num_local, "lb_prefetch_weights")
        pairs = []
        for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
            self._lb_check_region(dst, f"redundant_expert_weights[{i}]")
            if not src.is_contiguous() or src.dim() < 1 or src.shape[0] != num_local or num_local < 1:
                raise EPValueError(
                    f"lb_prefetch_weights: expert_weights[{i}] must be contiguous [num_local_experts={num_local}, ...] "
                    f"with num_local_experts > 0, got {tuple(src.shape)}"
                )
            if dst.dim() < 1 or dst.shape[0] != mapping.shape[1]:
                raise EPValueError(
                    f"lb_prefetch_weights: redundant_expert_weights[{i}] must be [num_redundant_experts="
                    f"{mapping.shape[1]}, ...], got {tuple(dst.shape)}"
                )
            per = src.nbytes // num_local
            if (dst.shape[0] and dst.nbytes // dst.shape[0] != per) or per % NUM_TMA_ALIGN_BYTES:
                raise EPValueError(
                    f"lb_prefetch_weights: pair {i}: bytes per expert must match ({per} in expert_weights, "
                    f"{dst.nbytes // max(dst.shape[0], 1)} in redundant_expert_weights) and be a multiple of "
                    f"{NUM_TMA_ALIGN_BYTES}"
                )
            if src.device != dst.device:
                raise EPValueError(f"lb_prefetch_weights: pair {i}: tensors on {src.device} and {dst.device}")
            pairs.append((_rows(dst), _rows(src)))
        self._lb_num_sms_arg(num_sms)
        return pairs, mapping, routes

    def lb_reduce_grads(
        self,
        redundant_expert_grads: torch.Tensor,
        expert_grads: torch.Tensor,
        redundancy_mapping: torch.Tensor,
        num_sms: int = 0,
        previous_event: EventHandle | None = None,
    ) -> EventOverlap:
        """Add the redundant slots' gradients into their experts' ``expert_grads`` (a collective; accumulates)."""
        op = "lb_reduce_grads"
        channel = self._lb_channel()
        with channel.state.guard(op, channel.announce):
            mapping, routes = self._lb_reduce_args(
                redundant_expert_grads, expert_grads, redundancy_mapping, num_sms
            )
            _wait(previous_event)
            if self._lb_sym is not None:
                self._lb_sym.check(op)
            self._lb_agree(channel, op, mapping, [int(expert_grads.shape[1]) * 4])
        red, grads = redundant_expert_grads, expert_grads
        if self._lb_sym is not None:
            self._lb_sym.reduce(routes, red, grads, self._lb_grid(num_sms))
            return EventOverlap(EventHandle(device=self.device))
        me = routes.lsa_rank
        chunks: dict[int, torch.Tensor] = {}
        if self.num_ranks > 1:  # this rank's slots go back to their experts' owners
            send = [list(routes.recv[s]) if s != me else [] for s in range(len(routes.recv))]
            got = self._lb_exchange(red, send, [len(p) if s != me else 0 for s, p in enumerate(routes.send)])
            k = 0
            for s, p in enumerate(routes.send):
                if s != me and p:
                    chunks[s] = got[k : k + len(p)]
                    k += len(p)
        for s, p in enumerate(routes.send):  # ascending (LSA rank, slot)
            for j, (local, slot) in enumerate(p):
                row = red[slot] if s == me else chunks[s][j]
                grads[local].add_(row)
        return EventOverlap(EventHandle(device=self.device))

    def _lb_reduce_args(
        self, red: torch.Tensor, grads: torch.Tensor, redundancy_mapping: torch.Tensor, num_sms: int
    ) -> tuple[np.ndarray, Any]:
        """``lb_reduce_grads``' checks: the mapping and its routes."""
        if not isinstance(red, torch.Tensor) or not isinstance(grads, torch.Tensor):
            raise EPTypeError("lb_reduce_grads: redundant_expert_grads and expert_grads must be tensors")
        for name, t in (("redundant_expert_grads", red), ("expert_grads", grads)):
            if t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous():
                raise EPValueError(
                    f"lb_reduce_grads: {name} must be a contiguous 2-D float32 tensor, got {tuple(t.shape)} {t.dtype}"
                )
        if red.shape[1] != grads.shape[1] or grads.shape[0] < 1:
            raise EPValueError(
                f"lb_reduce_grads: expected [num_redundant_experts, hidden] and [num_local_experts > 0, hidden], got "
                f"{tuple(red.shape)} and {tuple(grads.shape)}"
            )
        if (red.shape[1] * 4) % NUM_TMA_ALIGN_BYTES:
            raise EPValueError(
                f"lb_reduce_grads: hidden * 4 bytes must be a multiple of {NUM_TMA_ALIGN_BYTES}"
            )
        self._lb_check_region(red, "redundant_expert_grads")
        mapping, routes = self._lb_mapping(redundancy_mapping, int(grads.shape[0]), "lb_reduce_grads")
        if red.shape[0] != mapping.shape[1]:
            raise EPValueError(
                f"lb_reduce_grads: redundant_expert_grads must have num_redundant_experts={mapping.shape[1]} rows"
            )
        self._lb_num_sms_arg(num_sms)
        return mapping, routes

    # ----------------------------------------------------------------------------------------------------------------
    # helpers

    def _lb_channel(self) -> Channel:
        return Channel(self.bootstrap, getattr(self.bootstrap, "rank_state", None))

    def _lb_agree(self, channel: Channel, op: str, mapping: np.ndarray, row_bytes: list[int]) -> None:
        """The call's one enveloped host step before any bytes move: every rank's row sizes (the envelope: ranks that
        differ all raise ``EPMismatchError``) and mapping, which every rank of an LSA domain must hold alike (the
        all-to-all's split sizes come from it: different mappings would pair the wrong rows). A rank that refused
        its arguments meets this step with its announcement instead (``EPPeerError`` naming it)."""
        nvl = int(self.num_nvlink_ranks)
        every = channel.exchange(
            op,
            {"row_bytes": tuple(row_bytes), "num_redundant_experts": int(mapping.shape[1])},
            mapping.tobytes(),
        )
        base = int(self.rank_idx) - int(self.rank_idx) % nvl
        differ = [base + i for i in range(nvl) if every[base + i] != every[base]]
        if differ:
            raise EPMismatchError(
                f"{op} (rank {self.rank_idx}): ranks {differ} of this LSA domain hold a different redundancy_mapping "
                f"than rank {base}; every rank of a domain must pass the same mapping (every rank raises this error; "
                "the buffer refuses every operation until reset())"
            )

    def _lb_mapping(self, mapping: torch.Tensor, num_local: int, op: str) -> tuple[np.ndarray, Any]:
        if not isinstance(mapping, torch.Tensor):
            raise EPTypeError(
                f"{op}: redundancy_mapping must be a torch tensor, got {type(mapping).__name__}"
            )
        nvl = int(self.num_nvlink_ranks)
        # the routes of the last mapping, while that tensor is unchanged (its version counter): no device-to-host
        # read of a CUDA mapping on every call
        try:
            key: tuple | None = (mapping, mapping._version, num_local)
        except RuntimeError:  # an inference-mode tensor has no version counter: read it each time
            key = None
        last = getattr(self, "_lb_last", None)
        if key is not None and last is not None and last[0][0] is mapping and last[0][1:] == key[1:]:
            return last[1]
        m = check_redundancy_mapping(mapping.detach().cpu().numpy(), nvl, max(num_local, 1))
        got = (m, lb_routes(m, int(self.rank_idx) % nvl, max(num_local, 1)))
        self._lb_last = (key, got) if key is not None else None
        return got

    def _lb_check_region(self, t: torch.Tensor, name: str) -> None:
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise EPValueError(f"{name}: must be a contiguous tensor")
        storage = getattr(self, "lb_storage", None)
        if storage is None:
            raise EPStateError(
                f"{name}: this buffer has no LB region; build it with lb_allocation_plan_or_num_bytes= (a "
                "BufferAllocator plan or a byte count)"
            )
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.numel()
        if t.device != storage.device or not (lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi):
            raise EPValueError(
                f"{name}: must lie in this buffer's LB region (lb_storage or a tensor of its plan)"
            )

    def _lb_num_sms_arg(self, num_sms: int) -> int:
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise EPValueError(
                f"num_sms: expected an int >= 0 (0 = lb_get_theoretical_num_sms()), got {num_sms!r}"
            )
        return num_sms + num_sms % 2

    def _lb_grid(self, num_sms: int) -> int:
        """The kernels' blocks: ``num_sms`` (0: ``lb_get_theoretical_num_sms()``), at most the device's SMs."""
        sms = int(num_sms) or self.lb_get_theoretical_num_sms()
        return max(1, min(sms, self._lb_sym.device_sms if self._lb_sym is not None else sms))

    def _lb_exchange(self, rows: torch.Tensor, send: list[list[int]], recv_counts: list[int]) -> torch.Tensor:
        """One ``all_to_all_single`` over the group: rows ``send[s]`` of ``rows`` to LSA rank ``s`` of this rank's
        NVLink domain; returns the ``sum(recv_counts)`` rows received, by source LSA rank."""
        nvl = int(self.num_nvlink_ranks)
        base = int(self.rank_idx) - int(self.rank_idx) % nvl
        n = int(self.num_ranks)
        in_splits, out_splits = [0] * n, [0] * n
        for s in range(nvl):
            in_splits[base + s], out_splits[base + s] = len(send[s]), recv_counts[s]
        index = torch.tensor([i for p in send for i in p], dtype=torch.int64, device=rows.device)
        out_buf = torch.index_select(rows, 0, index)
        host = dist.get_backend(self.group) != "nccl" and rows.is_cuda  # gloo exchanges host tensors
        if host:
            out_buf = out_buf.cpu()
        got = out_buf.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(
            got, out_buf, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group
        )
        return got.to(rows.device) if host else got


def _lb_num_bytes(plan_or_bytes: BufferAllocator | int) -> int:
    plan = plan_or_bytes if isinstance(plan_or_bytes, BufferAllocator) else None
    if plan is not None and plan.materialized:
        raise EPStateError(
            "lb_allocation_plan_or_num_bytes: the plan was materialized already (one buffer per plan)"
        )
    num = plan.num_bytes if plan is not None else plan_or_bytes
    if isinstance(num, bool) or not isinstance(num, int) or num < 0 or num % NUM_ALLOCATION_ALIGN_BYTES:
        raise EPValueError(
            f"lb_allocation_plan_or_num_bytes: expected a BufferAllocator or a byte count >= 0 that is a multiple "
            f"of {NUM_ALLOCATION_ALIGN_BYTES} (get_num_allocation_alignment()), got {plan_or_bytes!r}"
        )
    return num


def _as_list(x: Sequence[torch.Tensor] | torch.Tensor, name: str) -> list[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x)
    if not items or any(not isinstance(t, torch.Tensor) for t in items):
        raise EPValueError(f"{name}: expected a tensor or a nonempty sequence of tensors (no None)")
    return items


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, bytes per row]`` uint8 (a view; ``t`` contiguous)."""
    return t.view(torch.uint8).view(t.shape[0], -1) if t.shape[0] else t.reshape(0, 0).view(torch.uint8)


def _wait(previous_event: Any) -> None:
    handle = getattr(previous_event, "event", previous_event)
    if isinstance(handle, EventHandle):
        handle.current_stream_wait()


def _symmetric_refusal(buf: Any) -> str:
    """Why the LB region cannot be symmetric memory moved by the kernels ('' when it can); the same on every rank
    (the device type, the storage's kind and team, the domains)."""
    if buf.device.type != "cuda":
        return "the CPU backend (tensors in host memory)"
    from ep_core.transports.nccl import NcclStorage

    rt = buf._rt()
    storage, n = rt.storage, int(buf.num_ranks)
    if NcclStorage.lsa_team_short(storage, n):
        return f"the nccl transport reaches {storage.lsa_size} of the {n} ranks by load/store (its LSA team)"
    if not hasattr(storage, "peer_bases") or getattr(storage, "array_device", "cuda") != "cuda":
        return f"the {type(storage).__name__} storage does not map the peers' GPU memory into this process"
    if int(buf.num_nvlink_ranks) != n:
        return (
            f"the LSA domains hold {int(buf.num_nvlink_ranks)} of the {n} ranks (hybrid mode, several nodes)"
        )
    return ""


class _SymmetricLB:
    """The LB region as symmetric memory (``[region | sync words]``, ``ep_core.side_allocation``: every rank's
    mapped here) and the calls that move its bytes with ``ep_core.lb_copy``'s kernels on the current stream."""

    def __init__(self, buf: Any, alloc: Any, num: int) -> None:
        from ep_core import lb_copy

        from .elastic_copy_engine import byte_view

        n = int(buf.num_ranks)
        self.alloc, self.num = alloc, num
        self.rank, self.num_ranks = int(buf.rank_idx), n
        self.device = buf.device
        self.ordinal = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.bases = [int(alloc.peer_ptr(r)) for r in range(n)]
        self.storage = byte_view(self.bases[self.rank], num, self.device)
        off = lb_copy.sync_offset(num)
        self.sync = torch.tensor([b + off for b in self.bases], dtype=torch.int64, device=self.device)
        # host mapped, read without a sync: (raised, rank, peer, tag) of a barrier that timed out
        self.herr = torch.zeros(4, dtype=torch.int32).pin_memory()
        secs = float(buf._rt().config.num_gpu_timeout_secs)
        self.timeout_ms = max(1, min(int(secs * 1000), (1 << 31) - 1))
        self.device_sms = int(torch.cuda.get_device_properties(self.device).multi_processor_count)
        self.generation = 0
        self._tables: dict[str, tuple[bytes, torch.Tensor]] = {}
        # the last call's (kind, blocks, tasks or entries): what the benchmark reports
        self.last_launch: tuple[str, int, int] | None = None

    @classmethod
    def create(cls, buf: Any, num: int) -> tuple[_SymmetricLB | None, str]:
        """A collective: the allocation on every rank (zeroed), exchanged; ``(None, reason)`` on every rank when any
        rank could not make it."""
        from ep_core.lb_copy import SYNC_BYTES
        from ep_core.side_allocation import create_exchanged

        torch.cuda.synchronize()
        extra = -(-SYNC_BYTES // NUM_ALLOCATION_ALIGN_BYTES) * NUM_ALLOCATION_ALIGN_BYTES
        alloc, why = create_exchanged(
            buf.bootstrap, num + extra, device=torch.cuda.current_device(), zero=True
        )
        return (cls(buf, alloc, num), "") if alloc is not None else (None, why)

    def check(self, op: str) -> None:
        """Raise the timeout a barrier recorded (host-mapped words, no sync); sticky."""
        if int(self.herr[0]) != 0:
            from ep_core.errors import EPTimeoutError

            rank, peer, tag = (int(v) for v in self.herr[1:4])
            what = "the entry barrier" if tag == 1 else "the exit barrier"
            raise EPTimeoutError(
                rank, f"lb.{what.split()[1]}", peer, None,
                f"{op} (rank {rank}): timed out in {what} of lb_prefetch_weights / lb_reduce_grads waiting for rank "
                f"{peer}; every rank must call them alike. The LB region is unusable until the buffer is rebuilt",
            )  # fmt: skip

    def _table(self, kind: str, rows: np.ndarray) -> torch.Tensor:
        """The table on the device; the last one per kind is kept and reused while its bytes are the same."""
        key = rows.tobytes()
        last = self._tables.get(kind)
        if last is not None and last[0] == key:
            return last[1]
        host = torch.from_numpy(np.ascontiguousarray(rows).reshape(-1)).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        self._tables[kind] = (key, dev)
        return dev

    def _launch(self, kind: str, rows: np.ndarray, count: int, grid: int, hidden: int = 0) -> None:
        from ep_core import lb_copy

        table = self._table(kind, rows) if count else None
        self.generation += 1
        lb_copy.launch(
            kind, table.data_ptr() if table is not None else 0, count, hidden=hidden,
            sync_table=self.sync.data_ptr(), rank=self.rank, num_ranks=self.num_ranks, generation=self.generation,
            timeout_ms=self.timeout_ms, herr=self.herr.data_ptr(), num_sms=grid, device=self.ordinal,
            stream=torch.cuda.current_stream(self.device).cuda_stream,
        )  # fmt: skip
        self.last_launch = (kind, grid, count)

    def prefetch(self, routes: Any, pairs: list, grid: int) -> None:
        from ep_core import lb_copy

        spec = [(dst.data_ptr(), src.data_ptr(), int(src.shape[1])) for dst, src in pairs if src.shape[0]]
        tasks = lb_copy.prefetch_tasks(routes, spec, self.bases)
        self._launch("copy", tasks, int(tasks.shape[0]), grid)

    def reduce(self, routes: Any, red: torch.Tensor, grads: torch.Tensor, grid: int) -> None:
        from ep_core import lb_copy

        hidden = int(grads.shape[1])
        flat, entries = lb_copy.reduce_table(
            routes, grads.data_ptr(), red.data_ptr(), hidden * 4, int(grads.shape[0]), self.bases
        )
        self._launch("reduce", flat, entries, grid, hidden)

    def close(self) -> None:
        self._tables = {}
        self.storage = None
        alloc, self.alloc = self.alloc, None
        if alloc is not None:
            alloc.close()
