"""DeepEP V1's ``Buffer`` and ``Config`` on ep's V2 runtime: ``from ep_torch import Buffer`` replaces
``from deep_ep import Buffer``.

Normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``) runs one deterministic non-expand dispatch of an
inner ``ElasticBuffer``: its rows are already V1's (one per (source token, this rank), source rank then token order;
``recv_topk_idx`` local with -1). V1 differences translated here: ``recv_topk_weights`` is 0 on lanes whose expert is
not on this rank, the handle is V1's 6-tuple (with ep's handle inside for combine), ``num_worst_tokens`` pads rows.

Low-latency mode is a torch epilogue over the same dispatch: the rows are scattered into the packed masked layout
``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` (expert e's rows in source order), with
FP8 cast in torch. A fused kernel epilogue (and a split send/wait) is later work: ``hook()`` is a no-op and the data
is complete when the call returns. ``low_latency_combine`` weights by ``topk_weights`` like V1: it sends the weights
to the expert ranks (a cached dispatch), weights and sums each token's local experts there (fp32, rounded to bf16)
and runs ep's unweighted combine, so results are close to V1's (one extra bf16 rounding per rank), not bitwise.

Keywords without meaning in ep (``num_nvl_bytes``, ``num_rdma_bytes``, ``num_qps_per_rank``,
``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``, ``comm``) are accepted and ignored: ep sizes
its own buffer. Ours, keyword only: ``num_max_tokens_per_rank`` and ``hidden`` size the inner buffer up front;
without them each non-cached normal dispatch all-reduces (tokens, hidden) to size it (one small collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPStateError, EPTypeError, EPValueError

from .buffer import ElasticBuffer
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "V1Handle"]


class Config:
    """V1's ``deep_ep.Config``: SM count and chunk sizes. ep's kernels plan their own chunks; the values are kept for
    callers that read them, and ``num_sms`` is passed on to ep's dispatch/combine."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        if num_sms <= 0 or num_sms % 2:
            raise AssertionError(f"Config: num_sms must be a positive even number, got {num_sms}")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """V1's formula shape: channels x ranks x recv tokens x token bytes, 128-byte aligned."""
        channels = self.num_sms // 2
        return _align(channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 256), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # ep has no separate RDMA buffer (no NVSHMEM)

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
            f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
            f"{self.num_max_rdma_chunked_recv_tokens}))"
        )


# V1's recommended (nvl send, nvl recv, rdma send, rdma recv) chunk sizes per rank count
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


def _table(table: dict, num_ranks: int) -> tuple:
    if num_ranks == 1:
        return table[2]  # one rank: any entry (ep runs EP1 too)
    if num_ranks not in table:
        raise EPValueError(
            f"num_ranks: unsupported number of EP ranks {num_ranks} (V1's table: {sorted(table)})"
        )
    return table[num_ranks]


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class V1Handle(tuple):
    """V1's intranode handle ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)``. ep computes ``rank_prefix_matrix`` [N, N] int32 (column j: inclusive prefix over
    source ranks of tokens sent to rank j), ``recv_src_idx`` [R] int32 (source token of each row) and
    ``is_token_in_rank`` [T, N] bool; the channel matrices and ``send_head`` describe V1's channel kernels, which ep
    does not have: they are None. ``ep_handle`` is ep's own handle, used by combine and cached dispatch."""

    ep_handle: Any
    num_rows: int  # rows the caller sees (num_worst_tokens when given)

    def __new__(cls, items: tuple, ep_handle: Any, num_rows: int) -> V1Handle:
        obj = super().__new__(cls, items)
        obj.ep_handle = ep_handle
        obj.num_rows = num_rows
        return obj


class _LowLatencyHandle(tuple):
    """V1's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:
    ``src_info`` [E_local, N*M] int32 (source token of each packed row, -1 past recv_count), ``layout_range``
    [E_local, N] int64 ((offset << 32) | count of each source rank's block, V1's packing). ``ep_handle``, ``rows``
    (packed row -> dispatch row) and ``recv_count`` drive combine."""

    ep_handle: Any
    rows: torch.Tensor
    recv_count: torch.Tensor
    recv_idx: torch.Tensor  # the dispatch rows' local expert ids (-1 elsewhere)

    def __new__(
        cls, items: tuple, ep_handle: Any, rows: torch.Tensor, recv_count: torch.Tensor
    ) -> _LowLatencyHandle:
        obj = super().__new__(cls, items)
        obj.ep_handle, obj.rows, obj.recv_count = ep_handle, rows, recv_count
        return obj


def _no_hook() -> None:
    """ep's low-latency data is complete when the call returns (the split send/wait is later work)."""


class Buffer:
    """DeepEP V1's ``Buffer``: normal mode and low-latency mode on ep's runtime (see the module docstring)."""

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        use_fabric: bool = False,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        transport: str | None = None,
    ) -> None:
        if group is None and comm is not None:
            raise NotImplementedError(
                "Buffer: comm= (an mpi4py communicator); pass a torch.distributed group"
            )
        if enable_shrink:
            raise NotImplementedError("Buffer: enable_shrink=True (elastic shrink of V1 low-latency mode)")
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._transport = transport
        self._inner: ElasticBuffer | None = None
        self._sized = (0, 0)
        self._destroyed = False
        self._ll_combine_buffers: list[torch.Tensor | None] = [None, None]
        self._ll_idx = 0
        self._user_sized = num_max_tokens_per_rank > 0 and hidden > 0
        if self._user_sized:
            self._ensure(int(num_max_tokens_per_rank), int(hidden))

    # ----------------------------------------------------------------------------------------------------------------
    # lifecycle and static helpers

    def _ensure(self, tokens: int, hidden: int) -> ElasticBuffer:
        """The inner buffer, (re)built collectively when (tokens, hidden) exceed what it was sized for."""
        if self._destroyed:
            raise EPStateError("Buffer: used after destroy(); create a new buffer")
        if self._inner is None or tokens > self._sized[0] or hidden != self._sized[1]:
            if self._inner is not None:
                self._inner.destroy()
            tokens = max(tokens, self._sized[0], 1)
            self._inner = ElasticBuffer(
                self.group,
                num_max_tokens_per_rank=tokens,
                hidden=hidden,
                deterministic=True,  # V1 row order: source rank, then source token
                explicitly_destroy=True,
                transport=self._transport,
            )
            self._sized = (tokens, hidden)
        return self._inner

    def _size_collectively(self, tokens: int, hidden: int) -> ElasticBuffer:
        """Sized up front: no collective, and a larger call is an error (a rebuild on one rank alone would hang).
        Otherwise the ranks agree on the largest (tokens, hidden) first, so all of them rebuild together or none."""
        if self._user_sized and self._inner is not None:
            if tokens > self._sized[0] or hidden != self._sized[1]:
                raise EPValueError(
                    f"dispatch (rank {self.rank}): x is [{tokens}, {hidden}], the buffer was built for "
                    f"num_max_tokens_per_rank={self._sized[0]}, hidden={self._sized[1]}"
                )
            return self._inner
        dev = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([tokens, hidden], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return self._ensure(int(t[0]), int(t[1]))

    def destroy(self) -> None:
        """Release the inner buffer (collective). V1's rule: only with ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise EPStateError("destroy: `explicitly_destroy` flag must be set (V1's rule)")
        if self._inner is not None:
            self._inner.destroy()
        self._inner, self._destroyed = None, True

    def is_available(self) -> bool:
        return not self._destroyed

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms <= 0 or new_num_sms % 2:
            raise AssertionError(
                f"set_num_sms: new_num_sms must be a positive even number, got {new_num_sms}"
            )
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        from ._streams import comm_stream

        return comm_stream(torch.cuda.current_device()) if torch.cuda.is_available() else None

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """V1's recommended table (SM count from ``set_num_sms``); ep passes ``num_sms`` on, the chunk sizes are
        informational."""
        return Config(Buffer.num_sms, *_table(_DISPATCH_CONFIGS, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, *_table(_COMBINE_CONFIGS, num_ranks))

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """V1's formula shape (send + recv buffers, double-buffered, 128-byte aligned); ep sizes its own buffer."""
        msg = hidden * 2 + 16
        per = num_max_dispatch_tokens_per_rank * msg * (num_experts + num_ranks)
        return _align(2 * per, 128)

    # ----------------------------------------------------------------------------------------------------------------
    # normal mode

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [N] int32, None (intranode), num_tokens_per_expert [E] int32, is_token_in_rank
        [T, N] bool, event)``, computed in torch from ``topk_idx``."""
        _check_topk(topk_idx, num_experts, self.group_size, self.rank)
        n = self.group_size
        epr = num_experts // n
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // epr, torch.full_like(topk_idx, n))
        in_rank = torch.zeros(topk_idx.shape[0], n + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, dest, True)
        is_token_in_rank = in_rank[:, :n].contiguous()
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        per_expert = torch.bincount(topk_idx[valid].flatten(), minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, is_token_in_rank, self._done(async_finish)

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: V1Handle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, Any, Any, list[int] | None, V1Handle, EventOverlap]:
        """V1 normal dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``; a cached dispatch (``handle=``) returns ``(recv_x, None, None, None, None, event)``."""
        data = x[0] if isinstance(x, tuple) else x
        num_sms = (config or self.get_dispatch_config(self.group_size)).num_sms
        if handle is not None:
            if not isinstance(handle, V1Handle):
                raise EPTypeError(
                    f"dispatch: handle must come from Buffer.dispatch, got {type(handle).__name__}"
                )
            if topk_idx is not None or topk_weights is not None:
                raise EPValueError(
                    "dispatch: a cached dispatch (handle=) takes neither topk_idx nor topk_weights"
                )
            inner = self._ensure(*self._sized) if self._inner is not None else None
            if inner is None:
                raise EPStateError("dispatch: handle given but the buffer was rebuilt or destroyed")
            recv_x, _, _, _, _ = inner.dispatch(x, handle=handle.ep_handle, num_sms=num_sms)
            return self._rows(recv_x, handle.num_rows), None, None, None, None, self._done(async_finish)
        if (
            topk_idx is None
            or num_tokens_per_expert is None
            or num_tokens_per_rank is None
            or is_token_in_rank is None
        ):
            raise EPValueError(
                f"dispatch (rank {self.rank}): topk_idx, num_tokens_per_rank, is_token_in_rank and "
                "num_tokens_per_expert are required without a handle (get_dispatch_layout gives them)"
            )
        num_experts = int(num_tokens_per_expert.numel())
        _check_topk(topk_idx, num_experts, self.group_size, self.rank)
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise EPValueError(
                f"dispatch (rank {self.rank}): topk_weights shape {tuple(topk_weights.shape)} must equal "
                f"topk_idx shape {tuple(topk_idx.shape)}"
            )
        if expert_alignment < 1:
            raise EPValueError(
                f"dispatch (rank {self.rank}): expert_alignment must be >= 1, got {expert_alignment}"
            )
        inner = self._size_collectively(int(data.shape[0]), int(data.shape[1]))
        if topk_weights is None:
            topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        recv_x, recv_idx, recv_w, ep_handle, _ = inner.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights.float(),
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_sms=num_sms,
            do_cpu_sync=True,
        )
        num_recv = int(recv_idx.shape[0])
        # V1: a lane whose expert is not on this rank carries weight 0 (ep sends the full row)
        recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))
        counts = list(ep_handle.num_recv_tokens_per_expert_list)
        rows = num_recv
        if num_worst_tokens > 0:
            if num_recv > num_worst_tokens:
                raise EPValueError(
                    f"dispatch (rank {self.rank}): received {num_recv} tokens > num_worst_tokens={num_worst_tokens}"
                )
            rows, counts = num_worst_tokens, None  # V1: no per-expert list with num_worst_tokens
            recv_x = self._rows(recv_x, rows)
            recv_idx = _pad(recv_idx, rows, -1)
            recv_w = _pad(recv_w, rows, 0)
        v1 = V1Handle(self._handle_tensors(ep_handle, is_token_in_rank, topk_idx), ep_handle, rows)
        return recv_x, recv_idx, recv_w, counts, v1, self._done(async_finish)

    def _handle_tensors(self, ep_handle: Any, is_token_in_rank: Any, topk_idx: torch.Tensor) -> tuple:
        n = self.group_size
        dev = topk_idx.device
        meta = ep_handle.recv_src_metadata
        meta = torch.as_tensor(meta) if not isinstance(meta, torch.Tensor) else meta
        rows = int(ep_handle.num_recv_tokens)
        m = int(ep_handle.num_max_tokens_per_rank)
        recv_src_idx = (meta[:rows, 0] % m).to(torch.int32).to(dev)
        if is_token_in_rank is None:
            epr = ep_handle.num_experts // n
            dest = torch.where(topk_idx >= 0, topk_idx // epr, torch.full_like(topk_idx, n))
            full = torch.zeros(topk_idx.shape[0], n + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)
            is_token_in_rank = full[:, :n].contiguous()
        sent = is_token_in_rank.sum(0, dtype=torch.int32)
        if dist.get_backend(self.group) != "nccl":
            sent = sent.cpu()  # a gloo group (shared-GPU processes) gathers host tensors
        gathered = [torch.empty_like(sent) for _ in range(n)]
        dist.all_gather(gathered, sent, group=self.group)
        rank_prefix_matrix = torch.stack(gathered).cumsum(0, dtype=torch.int32).to(dev)
        return (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None)

    @staticmethod
    def _rows(recv_x: Any, rows: int) -> Any:
        if isinstance(recv_x, tuple):
            return tuple(_pad(t, rows, 0) for t in recv_x)
        return _pad(recv_x, rows, 0)

    def combine(
        self,
        x: torch.Tensor,
        handle: V1Handle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """V1 normal combine: the unweighted sum of each source token's received rows (plus bias), returning
        ``(combined_x, combined_topk_weights, event)``. ``combined_topk_weights[t, k]`` is the weight the owner of
        lane k sent back; V1 sums all ranks' weights, which is the same when non-owner lanes carry 0 (as dispatch
        returns them)."""
        if not isinstance(handle, V1Handle):
            raise EPTypeError(f"combine: handle must come from Buffer.dispatch, got {type(handle).__name__}")
        if x.shape[0] != handle.num_rows:
            raise EPValueError(
                f"combine (rank {self.rank}): x has {x.shape[0]} rows, the handle's dispatch received {handle.num_rows}"
            )
        if self._inner is None:
            raise EPStateError("combine: the buffer was destroyed")
        ep_handle = handle.ep_handle
        rows = int(ep_handle.num_recv_tokens)
        w = None if topk_weights is None else topk_weights[:rows].float()
        num_sms = (config or self.get_combine_config(self.group_size)).num_sms
        out, out_w, _ = self._inner.combine(x[:rows], ep_handle, topk_weights=w, bias=bias, num_sms=num_sms)
        return out, out_w, self._done(async_finish)

    # ----------------------------------------------------------------------------------------------------------------
    # low-latency mode

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, _LowLatencyHandle, EventOverlap, Any]:
        """V1 low-latency dispatch into the packed masked layout: ``(recv_x [E_local, N*M, H] (bf16, or (fp8, scales
        [E_local, N*M, H/128] float32 | packed int32 with use_ue8m0)), recv_count [E_local] int32, handle, event,
        hook)``. ``recv_x[e, :recv_count[e]]`` are expert e's rows, source rank then source token."""
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "low_latency_dispatch: dispatch_wait_recv_cost_stats (no per-rank wait timers)"
            )
        if use_ue8m0 and not round_scale:
            raise EPValueError("low_latency_dispatch: use_ue8m0=True requires round_scale=True (V1's rule)")
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise EPValueError(f"low_latency_dispatch (rank {self.rank}): x must be [T, hidden] bfloat16")
        m = int(num_max_dispatch_tokens_per_rank)
        t, h = int(x.shape[0]), int(x.shape[1])
        if t > m:
            raise EPValueError(
                f"low_latency_dispatch (rank {self.rank}): {t} tokens > num_max_dispatch_tokens_per_rank={m}"
            )
        if use_fp8 and h % 128:
            raise EPValueError(
                f"low_latency_dispatch: hidden={h} must be a multiple of 128 with use_fp8=True"
            )
        n = self.group_size
        _check_topk(topk_idx, num_experts, n, self.rank)
        epr = num_experts // n
        inner = self._ensure(m, h)  # V1 contract: M and hidden equal on every rank, so no collective
        w = torch.ones(topk_idx.shape, dtype=torch.float32, device=x.device)
        recv_x, recv_idx, _, ep_handle, _ = inner.dispatch(
            x, topk_idx=topk_idx, topk_weights=w, num_experts=num_experts, do_cpu_sync=True
        )
        meta = torch.as_tensor(ep_handle.recv_src_metadata)[: recv_idx.shape[0], 0].to(x.device).long()
        src_rank, src_tok = meta // inner.num_max_tokens_per_rank, meta % inner.num_max_tokens_per_rank
        slots = n * m
        packed = torch.zeros(epr, slots, h, dtype=x.dtype, device=x.device)
        src_info = torch.full((epr, slots), -1, dtype=torch.int32, device=x.device)
        rows = torch.full((epr, slots), -1, dtype=torch.int64, device=x.device)
        layout_range = torch.zeros(epr, n, dtype=torch.int64, device=x.device)
        recv_count = torch.zeros(epr, dtype=torch.int32, device=x.device)
        for e in range(epr):
            sel = (recv_idx == e).any(1).nonzero().flatten()  # rows are in (source rank, token) order already
            c = int(sel.numel())
            packed[e, :c] = recv_x[sel]
            src_info[e, :c] = src_tok[sel].to(torch.int32)
            rows[e, :c] = sel
            recv_count[e] = c
            per = torch.bincount(src_rank[sel], minlength=n)
            offs = torch.cumsum(per, 0) - per
            layout_range[e] = (offs << 32) | per
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        handle = _LowLatencyHandle((src_info, layout_range, m, h, num_experts), ep_handle, rows, recv_count)
        handle.recv_idx = recv_idx
        out: Any = packed
        if use_fp8:
            out = per_token_cast_to_fp8(packed, round_scale=round_scale, use_ue8m0=use_ue8m0)
        return out, recv_count, handle, self._done(async_finish), _no_hook if return_recv_hook else None

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: _LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Any]:
        """V1 low-latency combine: ``combined_x[t] = sum_k topk_weights[t, k] * expert_k(x_t)`` from the packed
        ``x [E_local, N*M, H]`` bf16; returns ``(combined_x, event, hook)``."""
        if use_logfmt:
            raise NotImplementedError("low_latency_combine: use_logfmt=True (LogFMT compression)")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "low_latency_combine: combine_wait_recv_cost_stats (no per-rank wait timers)"
            )
        if not isinstance(handle, _LowLatencyHandle):
            raise EPTypeError(
                f"low_latency_combine: handle must come from low_latency_dispatch, got {type(handle)}"
            )
        if self._inner is None:
            raise EPStateError("low_latency_combine: the buffer was destroyed")
        if zero_copy:
            x = self._ll_combine_buffers[self._ll_idx ^ 1] if x is None else x
        epr = handle.rows.shape[0]
        if x.dim() != 3 or x.shape[0] != epr or x.shape[1] != handle.rows.shape[1] or x.shape[2] != handle[3]:
            raise EPValueError(
                f"low_latency_combine (rank {self.rank}): x must be [{epr}, {handle.rows.shape[1]}, hidden={handle[3]}], "
                f"got {tuple(x.shape)}"
            )
        if topk_weights.shape != topk_idx.shape:
            raise EPValueError("low_latency_combine: topk_weights must have topk_idx's shape")
        ep_handle = handle.ep_handle
        inner = self._inner
        # the weights travel to the expert ranks (a cached dispatch of a zero payload)
        zero = torch.zeros(topk_idx.shape[0], x.shape[2], dtype=torch.bfloat16, device=x.device)
        _, _, recv_w, _, _ = inner.dispatch(zero, handle=ep_handle, topk_weights=topk_weights.float())
        num_recv = int(ep_handle.num_recv_tokens)
        recv_idx_rows = torch.zeros(num_recv, x.shape[2], dtype=torch.float32, device=x.device)
        local_idx = handle.recv_idx
        for e in range(epr):
            c = int(handle.recv_count[e])
            r = handle.rows[e, :c]
            lanes = local_idx[r] == e  # [c, K]
            we = (recv_w[r].float() * lanes).sum(1, keepdim=True)
            recv_idx_rows.index_add_(0, r, x[e, :c].float() * we)
        combined, _, _ = inner.combine(recv_idx_rows.to(torch.bfloat16), ep_handle)
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, self._done(async_finish), _no_hook if return_recv_hook else None

    def get_next_low_latency_combine_buffer(self, handle: _LowLatencyHandle) -> torch.Tensor:
        """A zero-copy combine input of the packed shape, alternating between two buffers like V1."""
        epr, slots = handle.rows.shape
        h = handle[3]
        self._ll_idx ^= 1
        buf = self._ll_combine_buffers[self._ll_idx]
        if buf is None or buf.shape != (epr, slots, h):
            buf = torch.zeros(epr, slots, h, dtype=torch.bfloat16, device=handle.rows.device)
            self._ll_combine_buffers[self._ll_idx] = buf
        return buf

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """ep's workspace is zero between operations; only the zero-copy buffers are cleared."""
        for b in self._ll_combine_buffers:
            if b is not None:
                b.zero_()

    def get_local_buffer_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            "get_local_buffer_tensor: ep's symmetric storage is not exposed as a raw tensor"
        )

    @staticmethod
    def _done(async_finish: bool) -> EventOverlap:
        # every result is complete on the current stream when the call returns
        return (
            EventOverlap(EventHandle()) if async_finish and torch.cuda.is_available() else EventOverlap(None)
        )


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    extra = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra])


def _check_topk(topk_idx: Any, num_experts: int, num_ranks: int, rank: int) -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise EPValueError(f"topk_idx (rank {rank}): must be a 2-D tensor [num_tokens, num_topk]")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise EPValueError(f"topk_idx (rank {rank}): dtype must be int64 or int32, got {topk_idx.dtype}")
    if num_experts <= 0 or num_experts % num_ranks:
        raise EPValueError(
            f"num_experts (rank {rank}): {num_experts} must be a positive multiple of {num_ranks} ranks"
        )
    if topk_idx.numel() and int(topk_idx.max()) >= num_experts:
        raise EPValueError(
            f"topk_idx (rank {rank}): expert id {int(topk_idx.max())} >= num_experts={num_experts}"
        )


def per_token_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """V1's low-latency FP8 cast: per 128 channels, ``amax = max(|x|, 1e-4)``, ``scale = amax / 448`` (rounded up to
    a power of two with ``round_scale``), ``q = fp8_e4m3(x / scale)``. Scales are float32 ``[..., H/128]``; with
    ``use_ue8m0`` each scale's exponent byte, four per int32 (little-endian), ``[..., H/512]``; the last two
    dimensions of the scales are column-major like V1's."""
    *lead, h = x.shape
    g = x.float().reshape(*lead, h // 128, 128)
    amax = g.abs().amax(-1).clamp(min=1e-4)
    scale = amax / 448.0
    if round_scale:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    q = (g / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(*lead, h)
    if not use_ue8m0:
        return q, _col_major(scale)
    if (h // 128) % 4:
        raise EPValueError(f"use_ue8m0: hidden={h} must be a multiple of 512 (four scale bytes per int32)")
    exp = (scale.view(torch.int32) >> 23) & 0xFF
    exp = exp.reshape(*lead, h // 512, 4)
    packed = exp[..., 0] | (exp[..., 1] << 8) | (exp[..., 2] << 16) | (exp[..., 3] << 24)
    return q, _col_major(packed.to(torch.int32))


def _col_major(s: torch.Tensor) -> torch.Tensor:
    """Same values, the last two dimensions stored column-major (V1's TMA-friendly scale layout)."""
    return s.transpose(-1, -2).contiguous().transpose(-1, -2) if s.dim() >= 2 else s
