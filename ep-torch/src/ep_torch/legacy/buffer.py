"""DeepEP V1's ``Buffer`` and ``Config`` on ep's V2 runtime: ``from ep_torch import Buffer`` replaces
``from deep_ep import Buffer``. What matches V1, what differs, the keywords of ours and low-latency mode's numerics
are ep-torch's README ("DeepEP V1 `Buffer`").

Normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``) runs one deterministic non-expand dispatch of an
inner ``ElasticBuffer``: its rows are already V1's (one per (source token, this rank), source rank then token order;
``recv_topk_idx`` local with -1). V1 differences translated here: ``recv_topk_weights`` is 0 on lanes whose expert is
not on this rank, the handle is V1's 6-tuple (with ep's handle inside for combine), ``num_worst_tokens`` pads rows.
Ranks on several nodes: V1's internode order and 10-tuple handle (``legacy.internode``). It runs on the caller's
stream (after ``previous_event``); ``async_finish`` returns an event recorded there.

Low-latency mode (``legacy.low_latency``; numerics: ``legacy.reference``) runs the native kernels
(``legacy.ll_kernels.native_*``, ``ep_core.ll_native``) where the transport maps the peers' memory and
``ll_native`` allows (None: unless an adapter-only ``ll_*`` option is given or ``EPKIT_LL_NATIVE=0``), else the
adapter over an inner ``ElasticBuffer``; the adapter's keywords (``ll_lanes_per_combine``, ``ll_use_kernels``,
``ll_deterministic``, ``ll_combine_num_sms``, ``ll_zero_copy``) do not apply to the native kernels. Rank masking:
``legacy.ll_shrink``; LogFMT: ``legacy.logfmt``; ``get_local_buffer_tensor``: ``legacy.local_tensor``.

Collective safety (``ep_core.rank_state``): every operation checks its arguments first; a rank that refuses its call
tells its peers in their pending step (they raise ``EPPeerError`` naming it), a normal dispatch's one host exchange
carries an envelope (ranks that disagree all raise ``EPMismatchError``), and after a disagreement, a timeout or a
lost peer every operation is refused until ``reset()`` (ours, a collective) on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from ep_core.buffer_base import align
from ep_core.envelope import Channel
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError, EPTypeError, EPValueError
from ep_core.rank_state import Guard, RankState
from ep_core.topology import MAX_TOPK as _MAX_TOPK

from .. import _env
from ..bootstrap import ProcessGroupBootstrap
from ..buffer import ElasticBuffer
from ..event import EventHandle, EventOverlap
from ..transport_choice import choose_transport, make_core_transport
from . import internode
from .checks import _check_topk
from .config import Config, default_combine_config, default_dispatch_config
from .fp8 import per_token_cast_to_fp8
from .guard import _dispatch_target, _guarded, _normal_target
from .handle import V1Handle, V1InternodeHandle
from .internode import internode_handle_tensors, predicted_nvl_ranks, tokens_per_rdma_rank, v1_row_order
from .ll_mode import LowLatencyMode
from .low_latency import LowLatencyHandle

__all__ = ["Buffer", "Config", "LowLatencyHandle", "V1Handle", "V1InternodeHandle", "per_token_cast_to_fp8"]


class _InnerBuffer(ElasticBuffer):
    """An inner buffer of V1's ``Buffer``: on that buffer's bootstrap, so that its steps and the V1 buffer's own
    exchange are one sequence (one ``ep_core.rank_state.RankState``)."""

    def __init__(self, bootstrap: ProcessGroupBootstrap, group: Any, **kwargs: Any) -> None:
        self._shared_bootstrap = bootstrap
        super().__init__(group, **kwargs)

    def _connect(self, group: Any, transport: str | None, explicitly_destroy: bool) -> Any:
        self.group = dist.group.WORLD if group is None else group
        self.bootstrap = self._shared_bootstrap
        self.transport_choice = choose_transport(
            transport, self.bootstrap, self.group, explicitly_destroy=explicitly_destroy
        )
        return make_core_transport(self.transport_choice)


class _InnerAnnounce:
    """Announce a refusal in an inner buffer's pending step (``EPBuffer.announce_error`` with the step read now)."""

    __slots__ = ("core", "step")

    def __init__(self, core: Any) -> None:
        self.core = core
        self.step = core._step()

    def __call__(self, op: str, exc: BaseException) -> None:
        self.core.announce_error(op, exc, self.step)


def _drop(inner: ElasticBuffer | None) -> None:
    """Release ``inner``'s resources on this rank alone (its peers may be anywhere: after a failure)."""
    rt = getattr(inner, "runtime", None)
    if rt is None or rt.destroyed:
        return
    if torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        # a kernel of this rank still in flight (a receive waiting, bounded by its GPU timeout, or an abort just
        # posted) must end before its region is unmapped
        torch.cuda.synchronize()
    try:
        rt._destroyed = True
        rt._release(collective=False)
    finally:
        inner.runtime = None


class Buffer(LowLatencyMode):
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
        ll_lanes_per_combine: int = 0,
        ll_use_kernels: bool | None = None,
        ll_deterministic: bool = True,
        ll_combine_num_sms: int = 0,
        ll_zero_copy: bool | None = None,
        ll_native: bool | None = None,
        num_cpu_timeout_secs: float | None = None,
    ) -> None:
        if num_cpu_timeout_secs is None:
            num_cpu_timeout_secs = _env.cpu_timeout_secs()
        if (
            isinstance(num_cpu_timeout_secs, bool)
            or not isinstance(num_cpu_timeout_secs, (int, float))
            or not (num_cpu_timeout_secs > 0)
        ):
            raise EPValueError(
                f"num_cpu_timeout_secs: expected a positive number of seconds, got {num_cpu_timeout_secs!r}"
            )
        self.num_cpu_timeout_secs = float(num_cpu_timeout_secs)
        # the host steps of a process group (`_bind_group`); None: loopback
        self._channel: Channel | None = None
        self._builds = 0  # inner buffers built so far (handles record which one made them)
        if group is None and comm is not None:
            raise NotImplementedError(
                "Buffer: comm= (an mpi4py communicator); pass a torch.distributed group"
            )
        adapter = ll_lanes_per_combine, ll_combine_num_sms, not ll_deterministic  # set: the adapter's options
        adapter += (ll_use_kernels is not None, ll_zero_copy is not None)
        ll_native = _env.ll_native_choice(ll_native, adapter)
        self.enable_shrink, self._shrink = bool(enable_shrink), None
        if enable_shrink:  # refused where not implemented before anything is built
            self._make_shrink(transport, check_only=True, ll_native=ll_native)
        self._bind_group(group, transport)
        # legacy.ll_shrink: the CPU backend's masked exchange, or the native kernels' device mask on CUDA
        self._shrink = self._make_shrink(transport, ll_native=ll_native) if enable_shrink else None
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._transport = transport
        self.ll_lanes_per_combine = int(ll_lanes_per_combine)
        self.ll_use_kernels = ll_use_kernels
        self.ll_deterministic = bool(ll_deterministic)
        self.ll_combine_num_sms = int(ll_combine_num_sms)
        self.ll_zero_copy = None if ll_zero_copy is None else bool(ll_zero_copy)
        self.ll_native = ll_native  # None: the adapter; "auto": native where the peers are mapped
        self._ll_region: Any = None  # legacy.ll_kernels.NativeRegion when the native kernels run
        self._inner: ElasticBuffer | None = None
        self._sized = (0, 0)
        self._destroyed = False
        self._ll_combine_buffers: list[torch.Tensor | None] = [None, None]
        self._ll_inner: ElasticBuffer | None = None
        self._ll_key: tuple[int, int, int, bool] | None = None
        self._ll_idx = 0
        self._ll_build = 0
        self._user_sized = num_max_tokens_per_rank > 0 and hidden > 0
        if self._user_sized:
            self._ensure(int(num_max_tokens_per_rank), int(hidden))

    def _bind_group(self, group: dist.ProcessGroup | None, transport: str | None) -> None:
        """``group``, ``rank``, ``group_size`` and the predicted node size (``ep_torch.loopback`` binds a rank of a
        loopback group instead)."""
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        # one bootstrap and one step sequence for this buffer's own exchange and its inner buffers' (ep_core.rank_state)
        boot = ProcessGroupBootstrap(self.group, timeout_secs=self.num_cpu_timeout_secs)
        boot.rank_state = RankState(self.rank, "Buffer")
        self._channel = Channel(boot)
        # S_u before the inner buffer exists: get_dispatch_layout's num_tokens_per_rdma_rank needs the node size
        self._nvl_ranks = predicted_nvl_ranks(self.group, transport)

    def _new_inner(self, **kwargs: Any) -> ElasticBuffer:
        """A new inner ``ElasticBuffer`` over this buffer's group and bootstrap (a collective; ``ep_torch.loopback``
        builds the ranks of a loopback group together instead)."""
        assert self._channel is not None
        return _InnerBuffer(
            self._channel.bootstrap,
            self.group,
            transport=self._transport,
            num_cpu_timeout_secs=self.num_cpu_timeout_secs,
            **kwargs,
        )

    # ----------------------------------------------------------------------------------------------------------------
    # collective safety

    @property
    def _state(self) -> RankState | None:
        return None if self._channel is None else self._channel.state

    def _guard(self, op: str, inner: ElasticBuffer | None = None, host: bool = False) -> Any:
        """The block of one operation (``ep_core.rank_state.Guard``): refused while the ranks are out of step; an
        error leaving it before this rank took part in a step is announced where the peers wait: in ``inner``'s step
        (its host exchange, or on the GPU its device sequence number) when given and alive, else in this buffer's
        host step (``host``: the operation's first step is this buffer's own exchange, or no inner buffer exists
        yet whose kernels the peers could be in)."""
        state = self._state
        if state is None:  # loopback ranks (threads): their inner buffers announce for themselves
            return contextlib.nullcontext()
        announce = getattr(self._shrink, "announce", None)  # CPU backend: its steps are the masked exchange's
        if announce is not None and op.startswith("low_latency"):
            return Guard(state, op, announce)
        core = None if inner is None else inner.runtime
        if core is not None and not core._destroyed:
            return Guard(state, op, _InnerAnnounce(core))
        if host or self._host_steps():
            return Guard(state, op, self._channel.announce)
        return Guard(state, op, None)

    def _host_steps(self) -> bool:
        """Whether the peers' pending step is on the host whatever the operation: no inner buffer was built yet (the
        next one's construction is a host exchange), or the inner buffers run on the CPU reference backend."""
        for inner in (self._inner, self._ll_inner):
            core = getattr(inner, "runtime", None)
            if core is not None and not core.destroyed:
                return getattr(core.executor, "channel", None) is not None
        return self._builds == 0 or self._channel is None or self._channel.bootstrap.device.type == "cpu"

    def _stamp(self, handle: Any, build: int) -> Any:
        """Record on ``handle`` which buffer, generation and inner build made it (``_check_handle``)."""
        state = self._state
        handle._ep_owner = (None if state is None else state.ident, self._generation(), build)
        return handle

    def _generation(self) -> int:
        state = self._state
        return 0 if state is None else state.generation

    def _check_handle(self, op: str, handle: Any, build: int) -> None:
        """A handle of another buffer, of an inner buffer since rebuilt, or from before a ``reset()`` is refused by
        name (its tensors index rows of another layout)."""
        owner = getattr(handle, "_ep_owner", None)
        state = self._state
        me = None if state is None else state.ident
        if owner is None or owner[0] != me:
            raise EPValueError(
                f"{op} (rank {self.rank}): handle comes from another Buffer (each handle works only with the buffer "
                "whose dispatch made it)"
            )
        if owner[1] != self._generation() or owner[2] != build:
            raise EPStateError(
                f"{op} (rank {self.rank}): handle is stale: this buffer was "
                + ("reset" if owner[1] != self._generation() else "rebuilt (new sizes) or destroyed")
                + " since the dispatch that made it; dispatch again"
            )

    def reset(self) -> None:
        """(ours; DeepEP's V1 has none) Recover after a failure: a collective, every rank calls it. After a
        disagreement (``EPMismatchError``), a timeout or a lost peer every operation is refused; ``reset()``
        resynchronises the ranks (whatever step each was at) and, when any rank had failed, drops the inner buffers
        on every rank (rebuilt at the next call); handles from before are refused."""
        if self._channel is None:
            for inner in (self._inner, self._ll_inner):
                if inner is not None and inner.runtime is not None:
                    inner.reset()
            return
        if self._channel.reset():
            for inner in (self._inner, self._ll_inner):
                _drop(inner)
            self._inner, self._ll_inner, self._ll_key, self._sized = None, None, None, (0, 0)

    # ----------------------------------------------------------------------------------------------------------------
    # lifecycle and static helpers

    def _ensure(self, tokens: int, hidden: int) -> ElasticBuffer:
        """The inner buffer, (re)built collectively when (tokens, hidden) exceed what it was sized for."""
        if self._destroyed:
            raise EPStateError("Buffer: used after destroy(); create a new buffer")
        if self._inner is None or tokens > self._sized[0] or hidden != self._sized[1]:
            if self._inner is not None:
                old, self._inner = self._inner, None
                old.destroy()
            tokens = max(tokens, self._sized[0], 1)
            self._builds += 1
            self._inner = self._new_inner(
                num_max_tokens_per_rank=tokens,
                hidden=hidden,
                deterministic=True,  # V1 row order: source rank, then source token
                explicitly_destroy=True,
            )
            self._sized = (tokens, hidden)
        return self._inner

    def _domain(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvl_ranks)``: the inner buffer's physical domain, else the predicted one."""
        if self._inner is not None:
            return tuple(int(v) for v in self._inner.get_physical_domain_size())  # type: ignore[return-value]
        return self.group_size // self._nvl_ranks, self._nvl_ranks

    def _check_size(self, tokens: int, hidden: int) -> None:
        """Sized up front: a larger call is an error (a rebuild on one rank alone would hang)."""
        if (
            self._user_sized
            and self._inner is not None
            and (tokens > self._sized[0] or hidden != self._sized[1])
        ):
            raise EPValueError(
                f"dispatch (rank {self.rank}): x is [{tokens}, {hidden}], the buffer was built for "
                f"num_max_tokens_per_rank={self._sized[0]}, hidden={self._sized[1]}"
            )

    def _exchange_layout(
        self,
        config: dict,
        tokens: int,
        hidden: int,
        sent: torch.Tensor,
        num_worst_tokens: int,
        num_tokens_per_expert: torch.Tensor | None = None,
    ) -> tuple[ElasticBuffer, list]:
        """A normal dispatch's one host step (an enveloped exchange: ranks that disagree on ``config`` all raise):
        every rank's (tokens, tokens sent per rank, num_worst_tokens, its ``num_tokens_per_expert`` or None). The
        inner buffer is (re)built for the largest token count when not sized up front (every rank alike), and a rank
        whose rows would exceed its ``num_worst_tokens`` makes every rank raise, naming it, before any row moves."""
        assert self._channel is not None
        per_expert = (
            None if num_tokens_per_expert is None else [int(v) for v in num_tokens_per_expert.tolist()]
        )
        mine = (tokens, [int(v) for v in sent.tolist()], int(num_worst_tokens), per_expert)
        every = self._channel.exchange("dispatch.layout", config, mine)
        recv = [sum(e[1][j] for e in every) for j in range(self.group_size)]
        over = [r for r, e in enumerate(every) if 0 < e[2] < recv[r]]
        if over:
            text = ", ".join(
                f"rank {r} would receive {recv[r]} tokens > num_worst_tokens={every[r][2]}" for r in over
            )
            if self.rank in over:
                raise EPValueError(f"dispatch (rank {self.rank}): {text}")
            raise EPPeerError(
                f"dispatch (rank {self.rank}): {text}; every rank leaves this dispatch",
                ranks=tuple(over),
                announced=True,
            )
        if self._user_sized and self._inner is not None:
            return self._inner, every
        return self._ensure(max(e[0] for e in every), hidden), every

    def destroy(self) -> None:
        """Release the inner buffer (collective). V1's rule: only with ``explicitly_destroy=True``. Out of step (a
        failure recorded), this rank releases its own without meeting the peers."""
        if not self.explicitly_destroy:
            raise EPStateError("destroy: `explicitly_destroy` flag must be set (V1's rule)")
        if self._destroyed:
            raise EPStateError("destroy: the buffer was destroyed already")
        state = self._state
        if state is not None and state.failure is not None:
            for inner in (self._inner, self._ll_inner):
                _drop(inner)
        else:
            for name in ("_inner", "_ll_inner"):
                inner = getattr(self, name)
                if inner is not None:
                    inner.destroy()  # a disagreement raises here and leaves the buffer as it was
                    setattr(self, name, None)
        self._inner, self._ll_inner, self._destroyed = None, None, True

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
        from .._streams import comm_stream

        return comm_stream(torch.cuda.current_device()) if torch.cuda.is_available() else None

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """V1's recommended table (SM count from ``set_num_sms``); ep passes ``num_sms`` on, the chunk sizes are
        informational."""
        return default_dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_combine_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """V1's formula shape (send + recv buffers, double-buffered, 128-byte aligned); ep sizes its own buffer."""
        msg = hidden * 2 + 16
        per = num_max_dispatch_tokens_per_rank * msg * (num_experts + num_ranks)
        return align(2 * per, 128)

    # ----------------------------------------------------------------------------------------------------------------
    # normal mode

    @_guarded("get_dispatch_layout")
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [N] int32, num_tokens_per_rdma_rank [nodes] int32 (None on one node),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, N] bool, event)``, computed in torch from
        ``topk_idx``."""
        _check_topk(topk_idx, num_experts, self.group_size, self.rank)
        _wait_previous(previous_event)
        n = self.group_size
        epr = num_experts // n
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // epr, torch.full_like(topk_idx, n))
        in_rank = torch.zeros(topk_idx.shape[0], n + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, dest, True)
        is_token_in_rank = in_rank[:, :n].contiguous()
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        # a scatter, not bincount of a masked select (that reads the mask's size on the host)
        slot = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts)).flatten().to(torch.int64)
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
        per_expert = per_expert.scatter_add_(0, slot, torch.ones_like(slot))[:num_experts].to(torch.int32)
        nodes, nvl = self._domain()
        per_rdma = tokens_per_rdma_rank(is_token_in_rank, nvl) if nodes > 1 else None
        return per_rank, per_rdma, per_expert, is_token_in_rank, self._done(async_finish, topk_idx.is_cuda)

    @_guarded("dispatch", _dispatch_target)
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
        _wait_previous(previous_event)
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
            self._check_handle("dispatch", handle, self._builds)
            if inner is None:
                raise EPStateError("dispatch: handle given but the buffer was rebuilt or destroyed")
            recv_x, _, _, _, _ = inner.dispatch(x, handle=handle.ep_handle, num_sms=num_sms)
            if handle.perm is not None:
                recv_x = _take(recv_x, handle.perm)
            done = self._done(async_finish, data.is_cuda)
            return self._rows(recv_x, handle.num_rows), None, None, None, None, done
        if num_tokens_per_expert is None or num_tokens_per_rank is None or is_token_in_rank is None:
            raise EPValueError(
                f"dispatch (rank {self.rank}): num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert are "
                "required without a handle (get_dispatch_layout gives them)"
            )
        num_experts = int(num_tokens_per_expert.numel())
        if topk_idx is None and topk_weights is not None:
            raise EPValueError(f"dispatch (rank {self.rank}): topk_weights without topk_idx")
        if topk_idx is not None:
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
        n = self.group_size
        tokens = int((topk_idx if topk_idx is not None else data).shape[0])
        if (
            not isinstance(is_token_in_rank, torch.Tensor)
            or tuple(is_token_in_rank.shape) != (tokens, n)
            or is_token_in_rank.dtype != torch.bool
        ):
            raise EPValueError(
                f"dispatch (rank {self.rank}): is_token_in_rank must be a [{tokens}, {n}] bool tensor "
                "(get_dispatch_layout gives it)"
            )
        if data.dim() != 2 or int(data.shape[0]) != tokens:
            raise EPValueError(
                f"dispatch (rank {self.rank}): x must be [num_tokens={tokens}, hidden], got {tuple(data.shape)}"
            )
        with_topk = topk_idx is not None
        self._check_size(tokens, int(data.shape[1]))
        inner, every = self._exchange_layout(
            {
                "num_experts": num_experts,
                "hidden": int(data.shape[1]),
                "x": str(data.dtype),
                "scales": isinstance(x, tuple),
                "topk_idx": with_topk,
                "num_topk": int(topk_idx.shape[1]) if with_topk else 0,
                "topk_weights": topk_weights is not None,
            },
            tokens,
            int(data.shape[1]),
            is_token_in_rank.sum(0, dtype=torch.int32).cpu(),
            num_worst_tokens,
            # V1's layout-only dispatch counts the experts' tokens from every rank's num_tokens_per_expert
            None if with_topk else num_tokens_per_expert,
        )
        if with_topk:
            lanes = topk_idx
            if topk_weights is None:
                topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        else:  # V1's layout-only dispatch: each token once to each rank of is_token_in_rank
            lanes = _rank_lanes(is_token_in_rank, num_experts // n, self.rank)
            topk_weights = torch.zeros(lanes.shape, dtype=torch.float32, device=lanes.device)
        recv_x, recv_idx, recv_w, ep_handle, _ = inner.dispatch(
            x,
            topk_idx=lanes,
            topk_weights=topk_weights.float(),
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_sms=num_sms,
            do_cpu_sync=True,
        )
        num_recv = int(recv_idx.shape[0])
        nodes, nvl = self._domain()
        perm = None
        if nodes > 1:  # V1's internode rows: source rank, then token (ep's hybrid rows are grouped by region)
            perm = v1_row_order(ep_handle.recv_src_metadata, num_recv, recv_idx.device)
            recv_x, recv_idx, recv_w = _take(recv_x, perm), recv_idx[perm], recv_w[perm]
        # V1: a lane whose expert is not on this rank carries weight 0 (ep sends the full row)
        recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))
        if with_topk:
            counts = list(ep_handle.num_recv_tokens_per_expert_list)
        else:  # V1 counts the experts' tokens from num_tokens_per_expert (ep's lanes above are per rank)
            counts = self._expert_counts(every, self.rank, expert_alignment)
        rows = num_recv
        if num_worst_tokens > 0:
            if num_recv > num_worst_tokens:
                raise EPValueError(
                    f"dispatch (rank {self.rank}): received {num_recv} tokens > num_worst_tokens={num_worst_tokens}"
                )
            rows, counts = num_worst_tokens, []  # V1: an empty per-expert list with num_worst_tokens
            recv_x = self._rows(recv_x, rows)
            recv_idx = _pad(recv_idx, rows, -1)
            recv_w = _pad(recv_w, rows, 0)
        items = self._handle_tensors(ep_handle, is_token_in_rank, lanes, every)
        rank_prefix_matrix = items[0]
        if perm is None:
            v1: V1Handle = self._stamp(V1Handle(items, ep_handle, rows), self._builds)
        else:
            _, _, _, _, itr, _ = items
            meta = torch.as_tensor(ep_handle.recv_src_metadata)[:num_recv, 0].to(torch.int64).to(perm.device)
            tensors = internode_handle_tensors(
                self.group, self.rank, nvl, int(ep_handle.num_max_tokens_per_rank), itr, rank_prefix_matrix,
                meta[perm], self._gather_bits(),
            )  # fmt: skip
            v1 = self._stamp(V1InternodeHandle(tensors, ep_handle, rows, perm), self._builds)
        # what combine's weight reduction needs: rows per source rank (V1 rows are source rank, then token) and
        # the tokens this rank sent to each rank
        v1.rank_prefix_matrix, v1.is_token_in_rank = rank_prefix_matrix, items[4]
        if not with_topk:
            return recv_x, None, None, counts, v1, self._done(async_finish, data.is_cuda)
        return recv_x, recv_idx, recv_w, counts, v1, self._done(async_finish, data.is_cuda)

    def _gather_bits(self) -> Any:
        """The all-gather of ``internode_handle_tensors`` as an enveloped, bounded step of this buffer's ``Channel``
        (``dispatch.internode``): a peer that failed after the dispatch announces or is met by another envelope,
        instead of pairing with a raw collective. None for loopback ranks (the group's own collective)."""
        if self._channel is None:
            return None
        channel = self._channel

        def gather(bits: torch.Tensor) -> list[torch.Tensor]:
            host = bits.cpu().numpy().copy()
            every = channel.exchange("dispatch.internode", {"bits": tuple(host.shape)}, host)
            return [torch.from_numpy(b).to(bits.device) for b in every]

        return gather

    @staticmethod
    def _expert_counts(every: list, rank: int, expert_alignment: int) -> list[int]:
        """V1's ``num_recv_tokens_per_expert_list`` of a layout-only dispatch: every rank's ``num_tokens_per_expert``
        (carried by the dispatch's host step) summed, this rank's experts, each aligned up to ``expert_alignment``."""
        total = [sum(col) for col in zip(*(e[3] for e in every))]
        epr = len(total) // len(every)
        return [align(int(c), expert_alignment) for c in total[rank * epr : (rank + 1) * epr]]

    def _handle_tensors(
        self, ep_handle: Any, is_token_in_rank: Any, topk_idx: torch.Tensor, every: list | None = None
    ) -> tuple:
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
        if every is not None:  # the dispatch's host step carried every rank's counts
            gathered = torch.tensor([e[1] for e in every], dtype=torch.int32)
        else:
            sent = is_token_in_rank.sum(0, dtype=torch.int32)
            if dist.get_backend(self.group) != "nccl":
                sent = sent.cpu()  # a gloo group (shared-GPU processes) gathers host tensors
            parts = [torch.empty_like(sent) for _ in range(n)]
            dist.all_gather(parts, sent, group=self.group)
            gathered = torch.stack(parts)
        rank_prefix_matrix = gathered.cumsum(0, dtype=torch.int32).to(dev)
        return (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None)

    @staticmethod
    def _rows(recv_x: Any, rows: int) -> Any:
        if isinstance(recv_x, tuple):
            return tuple(_pad(t, rows, 0) for t in recv_x)
        return _pad(recv_x, rows, 0)

    @_guarded("combine", _normal_target)
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
        ``(combined_x, combined_topk_weights, event)``. ``combined_topk_weights[t, k]`` is V1's: the fp32 sum,
        from 0.0 over the ranks the token went to in ascending order, of the lane-k weight each sends back (a
        weight the caller changed on a lane whose expert is elsewhere counts too). One ``all_to_all_single`` of
        the [rows, K] weights over the group carries them."""
        if not isinstance(handle, V1Handle):
            raise EPTypeError(f"combine: handle must come from Buffer.dispatch, got {type(handle).__name__}")
        self._check_handle("combine", handle, self._builds)
        if x.shape[0] != handle.num_rows:
            raise EPValueError(
                f"combine (rank {self.rank}): x has {x.shape[0]} rows, the handle's dispatch received {handle.num_rows}"
            )
        if self._inner is None:
            raise EPStateError("combine: the buffer was destroyed")
        _wait_previous(previous_event)
        ep_handle = handle.ep_handle
        rows = int(ep_handle.num_recv_tokens)
        w = None if topk_weights is None else topk_weights[:rows].float()
        x = x[:rows]
        if handle.perm is not None:  # back to ep's row order: ep rows = V1 rows[inverse of perm]
            inv = torch.argsort(handle.perm)
            x = x[inv]
            w = None if w is None else w[inv]
        num_sms = (config or self.get_combine_config(self.group_size)).num_sms
        splits = None
        if topk_weights is not None:  # checked before any step: nothing may fail between the steps
            if topk_weights.dim() != 2 or topk_weights.shape[0] < rows:
                raise EPValueError(
                    f"combine (rank {self.rank}): topk_weights must be [{handle.num_rows}, num_topk], got "
                    f"{tuple(topk_weights.shape)}"
                )
            splits = self._weight_splits(handle)
        out, _, _ = self._inner.combine(x, ep_handle, bias=bias, num_sms=num_sms)
        out_w = None if topk_weights is None else self._reduce_weights(splits, topk_weights[:rows].float())
        return out, out_w, self._done(async_finish, x.is_cuda)

    def _weight_splits(self, handle: V1Handle) -> tuple:
        """(rows received from each rank, tokens sent to each rank, the token ids sent to each rank) of ``handle``:
        host split sizes of the weight reduction, read once per handle."""
        splits = getattr(handle, "weight_splits", None)
        if splits is None:
            itr = handle.is_token_in_rank
            col = handle.rank_prefix_matrix[:, self.rank].to(torch.int64).cpu()
            recv = torch.diff(col, prepend=col.new_zeros(1)).tolist()
            sent = [int(v) for v in itr.sum(0).cpu().tolist()]
            tokens = [itr[:, r].nonzero().flatten() for r in range(self.group_size)]
            splits = handle.weight_splits = ([int(v) for v in recv], sent, tokens, int(itr.shape[0]))
        return splits

    def _reduce_weights(self, splits: tuple, w: torch.Tensor) -> torch.Tensor:
        """V1's combined top-k weights: each receiving rank sends its ``[rows, K]`` weights back to the rows' source
        ranks (V1 rows are source rank, then token), and each source adds them, from 0.0 in ascending rank order,
        at the tokens it sent to that rank (``is_token_in_rank``'s token order).

        One enveloped host step of this buffer's ``Channel`` (``combine.weights``: bounded by the timeout, checked
        against every peer) carries every rank's split sizes, so ranks whose handles come from different dispatches
        (or whose K differ) all raise ``EPMismatchError`` instead of pairing rows, and a peer that skipped its
        weights (it combined without ``topk_weights``) meets another operation's envelope and both raise. On a gloo
        group the step carries the weights too; on an nccl group one ``all_to_all_single`` of device tensors follows
        the step (every rank agreed on every size before it)."""
        recv, sent, tokens, num_tokens = splits
        n, k = self.group_size, int(w.shape[1])
        # gloo exchanges host tensors; a loopback group's ranks (no ProcessGroup) exchange them on their channel
        host = self.group is None or dist.get_backend(self.group) != "nccl"
        src = w.contiguous().cpu() if host else w.contiguous()
        assert self._channel is not None  # (a GPU loopback group, which has none, refuses normal mode)
        mine: tuple = (recv, sent, None)
        if host:
            parts = torch.split(src, recv)
            mine = (recv, sent, [p.numpy().copy() for p in parts])
        every = self._channel.exchange("combine.weights", {"num_topk": k}, mine)
        bad = [
            f"rank {j} sends {every[j][0][r]} rows to rank {r}, which sent it {every[r][1][j]} tokens"
            for r in range(n)
            for j in range(n)
            if every[j][0][r] != every[r][1][j]
        ]
        if bad:
            raise EPMismatchError(
                f"combine (rank {self.rank}): the ranks' handles come from different dispatches ("
                + "; ".join(bad[:4])
                + "); every rank must combine with the handle of the same dispatch (every rank raises this error; "
                "the buffer refuses every operation until reset())",
                fields={"handle": [tuple(e[0]) for e in every]},
            )
        if host:
            pieces = [torch.from_numpy(every[j][2][self.rank]) for j in range(n)]
            back = torch.cat(pieces) if pieces else src.new_empty((0, k))
        else:
            back = src.new_empty((sum(sent), k))
            dist.all_to_all_single(
                back, src, output_split_sizes=sent, input_split_sizes=recv, group=self.group
            )
        return self._add_weights(back.to(w.device), tokens, sent, num_tokens)

    @staticmethod
    def _add_weights(back: torch.Tensor, tokens: list, sent: list, num_tokens: int) -> torch.Tensor:
        """Each source's sum of the weights sent back, from 0.0 in ascending rank order."""
        out = torch.zeros((num_tokens, back.shape[1]), dtype=torch.float32, device=back.device)
        start = 0
        for r, cnt in enumerate(sent):
            if cnt:
                out.index_add_(0, tokens[r], back[start : start + cnt])
                start += cnt
        return out

    internode_dispatch = internode.internode_dispatch
    internode_combine = internode.internode_combine

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """A view of this rank's own buffer memory (``legacy.local_tensor``: which region, ``offset`` in bytes)."""
        from .local_tensor import local_buffer_tensor

        return local_buffer_tensor(self, dtype, size, offset, use_rdma_buffer)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """ep compiles its kernels at run time for the device present (no fixed build arch)."""
        return torch.cuda.is_available()

    @staticmethod
    def _done(async_finish: bool, cuda: bool) -> EventOverlap:
        # normal mode runs on the caller's stream: the event (async_finish) is recorded there after the work
        if not async_finish:
            return EventOverlap(None)
        return EventOverlap(EventHandle(device="cuda" if cuda else "cpu"))


def _wait_previous(previous_event: Any) -> None:
    """V1's ``previous_event``: normal mode runs on the caller's stream, which first waits for the event."""
    handle = getattr(previous_event, "event", previous_event)
    if isinstance(handle, EventHandle):
        handle.current_stream_wait()
    elif previous_event is not None and handle is not None:
        raise EPTypeError(
            f"previous_event: expected an EventOverlap (Buffer.capture()), got {type(previous_event).__name__}"
        )


def _rank_lanes(is_token_in_rank: torch.Tensor, experts_per_rank: int, rank: int) -> torch.Tensor:
    """Top-k lanes that send each token once to each rank of ``is_token_in_rank`` [T, N]: lane j of token t holds
    the first expert of its j-th destination rank, -1 past its last (at most ``MAX_TOPK`` destinations a token)."""
    t, n = int(is_token_in_rank.shape[0]), int(is_token_in_rank.shape[1])
    dev = is_token_in_rank.device
    first = torch.arange(n, dtype=torch.int64, device=dev) * experts_per_rank
    lanes = torch.where(
        is_token_in_rank.bool(), first.expand(t, n), torch.full((t, n), -1, dtype=torch.int64, device=dev)
    )
    if n <= _MAX_TOPK:
        return lanes
    # more ranks than lanes: each token's destinations first (a stable sort keeps them in rank order)
    order = torch.sort((lanes < 0).to(torch.int8), dim=1, stable=True).indices
    lanes = torch.gather(lanes, 1, order)
    if t and bool((lanes[:, _MAX_TOPK:] >= 0).any()):  # a host read: this dispatch syncs the host anyway
        raise EPValueError(
            f"dispatch (rank {rank}): without topk_idx a token may go to at most {_MAX_TOPK} ranks "
            "(pass topk_idx)"
        )
    return lanes[:, :_MAX_TOPK].contiguous()


def _take(recv_x: Any, perm: torch.Tensor) -> Any:
    """Rows ``perm`` of recv_x (a tensor or V1's (data, scales) tuple)."""
    if isinstance(recv_x, tuple):
        return tuple(t[perm] for t in recv_x)
    return recv_x[perm]


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    extra = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra])
