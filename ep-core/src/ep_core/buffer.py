"""`EPBuffer`: the framework-agnostic EP buffer (SPEC §1). Validates every call, then delegates to an executor.

    from ep_core import EPBuffer, LocalBootstrap
    buf = EPBuffer(LocalBootstrap(), transport="reference", num_max_tokens_per_rank=128, hidden=256, num_topk=4)
    out = buf.dispatch(x, topk_idx, topk_weights, num_experts=8, allocator=my_alloc)
    res = buf.combine(expert_out, out.handle, allocator=my_alloc)

`transport`: a `Transport` object, or a name: "reference" (host arrays, `ReferenceExecutor`), or any other name
`n`, resolved as `ep_core.transports.<n>.make_transport()` (the GPU transports, e.g. "ipc", "nccl").
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from ep_core import elastic_memory, planner
from ep_core.bootstrap import Bootstrap, check_bootstrap
from ep_core.buffer_base import BufferBase
from ep_core.envelope import Channel
from ep_core.errors import EPConfigError, EPMismatchError, EPStateError, EPTypeError, EPValueError
from ep_core.executor import (
    BufferConfig,
    CombineResult,
    DispatchResult,
    Executor,
    ReferenceTransport,
    Transport,
)
from ep_core.handle import EPHandle
from ep_core.planner import PlannerPolicy
from ep_core.prepared import Operations, PreparedOps
from ep_core.rank_state import breaks_step
from ep_core.requests import CombineArgs, DispatchArgs
from ep_core.topology import MAX_TOPK, Topology
from ep_core.validation import _check_flag, check_handle, check_zero_copy_args

__all__ = ["SYMMETRIC_ALIGN_BYTES", "EPBuffer", "resolve_transport"]

SYMMETRIC_ALIGN_BYTES = 2 << 20


def resolve_transport(transport: Any) -> Transport:
    """A `Transport` from an object or a name (see the module doc)."""
    if isinstance(transport, str):
        if transport == "reference":
            return ReferenceTransport()
        name = f"ep_core.transports.{transport}"
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if exc.name != name:  # the transport exists, something it needs does not
                raise EPConfigError(f"transport {transport!r}: {name} cannot be imported ({exc})") from exc
            raise EPConfigError(
                f"transport: unknown transport {transport!r} ({exc}); use 'reference', 'ipc', 'nccl' or pass a "
                "Transport object"
            ) from exc
        return module.make_transport()
    if not isinstance(transport, Transport):
        raise EPTypeError(
            "transport: expected a name or an object with num_nvlink_ranks(), allocate() and create_executor(), "
            f"got {type(transport).__name__}"
        )
    return transport


def _nonneg_int(name: str, value: Any, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (hi is not None and value > hi):
        rng = f"[0, {hi}]" if hi is not None else ">= 0"
        raise EPValueError(f"{name}: expected an int {rng}, got {value!r}")
    return value


class EPBuffer(BufferBase, Operations):
    """An expert-parallel communication buffer of one rank (constructor keywords as DeepEP's ElasticBuffer, plus
    `transport`, `num_experts`, `num_nvlink_ranks`, `policy` and `executor`; the calls' road: its base `Operations`)."""

    def __init__(
        self,
        bootstrap: Bootstrap,
        *,
        transport: Any,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        num_experts: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: float = 300,
        num_gpu_timeout_secs: float = 100,
        explicitly_destroy: bool = False,
        num_nvlink_ranks: int | None = None,
        policy: PlannerPolicy = PlannerPolicy.V2_5,
        executor: Executor | None = None,
    ) -> None:
        self._destroyed = True  # until fully built
        boot = check_bootstrap(bootstrap)
        set_timeout = getattr(boot, "set_timeout", None)
        if (
            set_timeout is not None
            and isinstance(num_cpu_timeout_secs, (int, float))
            and num_cpu_timeout_secs > 0
        ):
            set_timeout(num_cpu_timeout_secs)  # the construction's exchanges are bounded too
        try:  # a rank refusing its arguments tells its peers in the construction's exchange (they raise naming it)
            tr = resolve_transport(transport)
            for name, v in (
                ("use_fp8_dispatch", use_fp8_dispatch),
                ("deterministic", deterministic),
                ("allow_hybrid_mode", allow_hybrid_mode),
                ("allow_multiple_reduction", allow_multiple_reduction),
                ("prefer_overlap_with_compute", prefer_overlap_with_compute),
                ("explicitly_destroy", explicitly_destroy),
            ):
                _check_flag(name, v)
            m = _nonneg_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
            h = _nonneg_int("hidden", hidden)
            k = _nonneg_int("num_topk", num_topk, MAX_TOPK)
            e = _nonneg_int("num_experts", num_experts)
            _nonneg_int("sl_idx", sl_idx)
            _nonneg_int("num_allocated_qps", num_allocated_qps)
            cpu = _nonneg_int("num_cpu_bytes", num_cpu_bytes)
            for name, v in (
                ("num_cpu_timeout_secs", num_cpu_timeout_secs),
                ("num_gpu_timeout_secs", num_gpu_timeout_secs),
            ):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                    raise EPValueError(f"{name}: expected a positive number of seconds, got {v!r}")
            if not isinstance(policy, PlannerPolicy):
                raise EPTypeError(f"policy: expected a PlannerPolicy, got {policy!r}")
            nvl = num_nvlink_ranks if num_nvlink_ranks is not None else tr.num_nvlink_ranks(boot)
            topology = Topology(boot.size, nvl, allow_hybrid_mode)
            if e:
                topology.check_num_experts(e)
            if num_bytes is None:
                if cpu:
                    raise EPValueError("num_bytes: required when num_cpu_bytes > 0")
                if m <= 0 or h <= 0:
                    raise EPValueError(
                        "num_bytes: not given, so num_max_tokens_per_rank and hidden must be > 0 to size the buffer "
                        f"(got {m} and {h})"
                    )
                num_bytes = planner.get_buffer_size_hint(
                    topology, m, h, k, use_fp8_dispatch, allow_multiple_reduction
                )
            if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes <= 0:
                raise EPValueError(f"num_bytes: expected a positive int, got {num_bytes!r}")
            if num_bytes % SYMMETRIC_ALIGN_BYTES or cpu % SYMMETRIC_ALIGN_BYTES:
                raise EPValueError(
                    f"num_bytes/num_cpu_bytes: expected multiples of 2 MiB, got {num_bytes} and {cpu}; use "
                    "get_buffer_size_hint()"
                )
            if cpu > num_bytes:
                raise EPValueError(f"num_cpu_bytes: expected <= num_bytes ({num_bytes}), got {cpu}")
            import ep_layout

            workspace = ep_layout.WorkspaceLayout.get_num_aligned_bytes()
            qps = num_allocated_qps or planner.default_num_allocated_qps(topology)
        except Exception as exc:
            with contextlib.suppress(Exception):  # best effort: the caller raises its own error
                Channel(boot).announce("construct", exc)
            raise
        # the construction's envelope (before anything is allocated): ranks built with different sizes or modes
        # raise EPMismatchError together here instead of at their first operation, or with garbage
        Channel(boot).exchange(
            "construct",
            {
                "transport": type(tr).__name__,
                "num_bytes": num_bytes,
                "num_cpu_bytes": cpu,
                "num_max_tokens_per_rank": m,
                "hidden": h,
                "num_topk": k,
                "num_experts": e,
                "num_nvlink_ranks": nvl,
                "use_fp8_dispatch": use_fp8_dispatch,
                "deterministic": deterministic,
                "allow_hybrid_mode": allow_hybrid_mode,
                "allow_multiple_reduction": allow_multiple_reduction,
                "explicitly_destroy": explicitly_destroy,
                "policy": policy.name,
            },
        )
        storage = elastic_memory.allocate_storage(tr, boot, workspace + num_bytes, cpu)  # [GPU | host]
        super().__init__(boot, storage, num_workspace_bytes=workspace, explicitly_destroy=explicitly_destroy)
        self._destroyed = True  # until the executor exists
        self.transport = tr
        self.topology = topology
        self.config = BufferConfig(
            rank=boot.rank,
            num_ranks=boot.size,
            topology=topology,
            num_bytes=num_bytes,
            num_cpu_bytes=cpu,
            num_workspace_bytes=workspace,
            num_max_tokens_per_rank=m,
            hidden=h,
            num_topk=k,
            num_experts=e,
            use_fp8_dispatch=use_fp8_dispatch,
            deterministic=deterministic,
            allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute,
            sl_idx=sl_idx,
            num_allocated_qps=qps,
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            explicitly_destroy=explicitly_destroy,
            policy=policy,
        )
        self._executor = executor if executor is not None else tr.create_executor(self.config, self)
        if not isinstance(self._executor, Executor):
            raise EPTypeError(f"executor: expected an Executor, got {type(self._executor).__name__}")
        # the validated requests by call signature; their plans are in the rank's plan cache (`RankDriver.plans`)
        self._prepared = PreparedOps(self.config)
        self._lanes: dict = {}  # the kept plans of the framework's last calls by kind (`keep_lane`)
        self._destroyed = False
        boot.barrier()

    # properties mirroring DeepEP's attributes ------------------------------------------------------------------
    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def num_bytes(self) -> int:
        return self.config.num_bytes

    @property
    def num_max_tokens_per_rank(self) -> int:
        return self.config.num_max_tokens_per_rank

    @property
    def num_allocated_qps(self) -> int:
        return self.config.num_allocated_qps

    @property
    def rank_idx(self) -> int:
        return self.config.rank

    def get_physical_domain_size(self) -> tuple[int, int]:
        """`(num_rdma_ranks, num_nvlink_ranks)`."""
        return self.topology.physical_domain_size

    def get_logical_domain_size(self) -> tuple[int, int]:
        """`(S_o, S_u)`."""
        return self.topology.logical_domain_size

    # planner -------------------------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(
        topology: Topology,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """GPU buffer bytes for a topology (see `ep_core.planner.get_buffer_size_hint`)."""
        return planner.get_buffer_size_hint(
            topology, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_multiple_reduction
        )

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 0,
        sm_write_gbs: float = 0,
    ) -> int:
        """The planner's SM count for this buffer (policy, topology, device SMs; 0 GB/s = detect, or for the per-SM
        rates the policy's)."""
        ex = self._executor
        return planner.get_theoretical_num_sms(
            self.topology,
            num_experts,
            num_topk,
            num_device_sms=ex.num_device_sms,
            nvlink_gbs=nvlink_gbs or getattr(ex, "nvlink_gbs", None),
            rdma_gbs=rdma_gbs or getattr(ex, "rdma_gbs", None),
            sm_read_gbs=sm_read_gbs,
            sm_write_gbs=sm_write_gbs,
            prefer_overlap_with_compute=self.config.prefer_overlap_with_compute,
            num_scaleout_topk=num_scaleout_topk,
            policy=self.config.policy,
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return planner.get_theoretical_num_qps(self.topology, num_sms, self.config.num_allocated_qps)

    # operations ----------------------------------------------------------------------------------------------
    def dispatch(
        self,
        x: Any,
        topk_idx: Any = None,
        topk_weights: Any = None,
        *,
        cumulative_local_expert_recv_stats: Any = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        allocator: Any = None,
        stream: int = 0,
        zero_copy: bool = False,
    ) -> DispatchResult:
        """Validate (SPEC §6) and run a dispatch; returns the executor's `DispatchResult`. `zero_copy=True`: the
        four outputs are views of this rank's receive region (deterministic row order, valid until the next dispatch
        or combine on this buffer; bf16 `recv_x` is `combine_buffer(handle)`'s memory), the handle an ordinary one."""
        return self.run_dispatch(
            DispatchArgs(
                x,
                topk_idx,
                topk_weights,
                cumulative_local_expert_recv_stats,
                num_experts,
                num_max_tokens_per_rank,
                expert_alignment,
                num_sms,
                num_qps,
                previous_event,
                previous_event_before_epilogue,
                async_with_compute_stream,
                allocate_on_comm_stream,
                handle,
                do_handle_copy,
                do_cpu_sync,
                do_expand,
                do_zero_padding,
                use_tma_aligned_col_major_sf,
                allocator,
                stream,
                zero_copy,
            )
        )

    def launch_dispatch_deferred(self, args: DispatchArgs) -> Any:
        """DeepEP 2.5's `defer_epilogue` on an executor that splits a dispatch (`launch_dispatch_deferred`, the
        GPU's): `args` validated as `run_dispatch` does, the dispatch kernel launched, and `finish(stream)` returned,
        which runs the rest on `stream`'s order and returns the `DispatchResult` (each step announced as the
        dispatch's). No other operation of this buffer may start before `finish` (ep_torch refuses them)."""
        return self._launch_deferred("dispatch", self._prepared.dispatch, args, self._trust_new)

    def launch_combine_deferred(self, args: CombineArgs) -> Any:
        """`launch_dispatch_deferred` of a combine (`GpuExecutor.launch_combine_deferred`): `args` validated as
        `run_combine` does (`defer_epilogue`, the reason of this call, aside), the send part launched, and
        `finish(stream)` returned, which launches the reduce in `stream`'s order and returns the `CombineResult`."""
        return self._launch_deferred("combine", self._prepared.combine, args._replace(defer_epilogue=False))

    def _launch_deferred(self, op: str, prepare: Any, args: Any, after: Any = None) -> Any:
        """The deferred `op`: its request (`prepare`), the executor's `launch_<op>_deferred`, and the `finish` of
        both halves in `op`'s announcing blocks; `after(request, result)` at the finish."""
        with self.announcing(op):
            if self._destroyed:
                self._check_alive()  # raises
            ex = self._executor
            launch = getattr(ex, f"launch_{op}_deferred", None)
            if launch is None or args.zero_copy:
                raise EPConfigError(
                    f"defer_epilogue: the executor {type(ex).__name__} runs a {op} in one step (or zero_copy "
                    f"was asked); {op} without defer_epilogue"
                )
            if getattr(args, "out_dtype", None) is not None:
                raise EPValueError(
                    "out_dtype: not with defer_epilogue (ep_torch's combine refuses the pair too)"
                )
            req = prepare(ex, args)
            finish = launch(req)

        def done(stream: int) -> Any:
            with self.announcing(op):
                res = finish(stream)
                if after is not None:
                    after(req, res)
                return res

        return done

    def combine(
        self,
        x: Any,
        handle: EPHandle,
        topk_weights: Any = None,
        bias: Any = None,
        *,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        allocator: Any = None,
        stream: int = 0,
        zero_copy: bool = False,
    ) -> CombineResult:
        """Validate (SPEC §6) and run a combine; returns the executor's `CombineResult`. `zero_copy=True`: `x` is
        `combine_buffer(handle)` with the expert outputs written in place (`combine_buffer`)."""
        return self.run_combine(
            CombineArgs(
                x,
                handle,
                topk_weights,
                bias,
                num_sms,
                num_qps,
                previous_event,
                previous_event_before_epilogue,
                async_with_compute_stream,
                allocate_on_comm_stream,
                allocator,
                stream,
                zero_copy,
            )
        )

    def combine_buffer(self, handle: EPHandle, hidden: int | None = None) -> Any:
        """This rank's combine buffer for `handle`: bf16 `[received rows, hidden]` (default hidden: the buffer's),
        the executor's array type, where the caller writes its expert outputs for `combine(buffer, handle,
        zero_copy=True)` (direct mode, non-expanded handles; valid until the next dispatch or combine)."""
        self._check_alive()
        if hidden is None:
            hidden = self.config.hidden
        ex = self._executor
        if not hasattr(ex, "combine_buffer"):
            raise EPConfigError(f"zero_copy: the executor {type(ex).__name__} has no combine buffer")
        h = check_handle(self.config, ex, handle)
        check_zero_copy_args(h, hidden=hidden)
        return ex.combine_buffer(h, hidden)

    # lifecycle -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Recover after a failed operation (a timeout, a peer's abort): a collective, every rank calls it.

        After a failure every later call raises the recorded error instead of launching (outputs are never left
        silently uninitialized); `reset()` drains this rank, meets the peers, zeroes the workspace and scratch,
        and meets them again, after which the buffer works as new. Handles of no-sync dispatches that were in
        flight during the failure stay refused: dispatch again without `handle=`."""
        self._check_alive()
        reset = getattr(self._executor, "reset", None)
        if reset is None:
            raise EPStateError(f"reset: the executor {type(self._executor).__name__} cannot be reset")
        channel = getattr(self._executor, "channel", None)
        # resynchronise the host steps first (ep_core.rank_state): every rank, any step
        if channel is not None:
            channel.reset()
        reset()

    def _device_barrier(self) -> None:
        self._executor.barrier()

    def destroy(self) -> None:
        """Collective: barrier, then release. When the barrier finds the ranks disagreeing (a peer is in another
        operation) or a peer's announced error, nothing is released: the buffer stays as it was (reset() or
        destroy() again on every rank). On a buffer out of step (a failure recorded, `ep_core.rank_state`), this
        rank releases its own resources without meeting the peers."""
        self._check_alive()
        state = getattr(getattr(self._executor, "channel", None), "state", None)
        if state is not None and state.failure is not None:
            self._destroyed = True
            self._release(collective=False)
            return
        try:
            self._device_barrier()
        except Exception as exc:
            if not breaks_step(exc) or isinstance(exc, EPMismatchError):
                raise  # the peers are elsewhere (or one refused): nothing released, the ranks stay as they were
            self._destroyed = True
            self._release(collective=True)
            raise
        self._destroyed = True
        self._release(collective=True)

    def _release(self, *, collective: bool) -> None:
        lanes = self.__dict__.get("_lanes")
        if lanes:  # the plans hold the executor
            lanes.clear()
        try:
            ex = getattr(self, "_executor", None)
            if ex is not None:
                ex.destroy()
        finally:
            super()._release(collective=collective)
