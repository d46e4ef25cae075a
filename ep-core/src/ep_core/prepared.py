"""The prepared-operation cache: a repeated dispatch / combine of the same shapes reuses its validated request.

Validation and planning depend only on what shapes the launch: every array's dtype, shape, byte strides and device,
the scalars and flags (with their types: `True` is not `1` here), the handle's layout fields and the executor's
device attributes. `PreparedOps` keys its entries by exactly those, so a hit passed the very same checks and
resolved the very same SM / QP counts; it only reads the pointers (`describe`), checks the handle
(`validation.check_handle`, cached by fingerprint), the allocator and the stream, and builds the request. A key
never seen, or an argument the key cannot describe, goes through the full validation, which raises exactly what an
uncached call raises; entries are added only after it succeeded, so an error is never cached. One `PreparedOps`
belongs to one buffer. `Operations`, `EPBuffer`'s base class, is the road of one call through it: argument record ->
key -> entry -> the entry's plan (`op_plan`) or the executor's full path (ep-core's README, "The road of one call").
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

from ep_core._env import knobs
from ep_core.device_array import describe, describe_all
from ep_core.errors import EPConfigError, EPValueError
from ep_core.handle import EPHandle
from ep_core.requests import (
    BufferConfig,
    CombineArgs,
    CombineRequest,
    CombineResult,
    DispatchArgs,
    DispatchRequest,
    DispatchResult,
    PreparedToken,
)
from ep_core.validation import (
    check_allocator,
    check_stream,
    checked_fingerprint,
    trust_handle,
    validate_combine,
    validate_dispatch,
)

__all__ = ["Operations", "PreparedOps"]

# distinct shapes of one buffer; a workload cycling through more is cleared and re-validated
_MAX_ENTRIES = 256

# request fields that change from call to call (everything else comes from the entry)
_DISPATCH_PER_CALL = frozenset(
    "x sf topk_idx topk_weights handle cumulative_local_expert_recv_stats allocator stream "  # noqa: SIM905
    "previous_event previous_event_before_epilogue".split()
)
_COMBINE_PER_CALL = frozenset(
    "x handle topk_weights bias allocator stream previous_event previous_event_before_epilogue".split()  # noqa: SIM905
)


def _fields(record: type, names: str) -> Any:
    """A getter of the named fields of an argument record, as one tuple (one C call per key)."""
    return operator.itemgetter(*map(record._fields.index, names.split()))


# the scalars and flags of a key (the arrays, the handle and the events are keyed by their layout / presence)
_dispatch_scalars = _fields(
    DispatchArgs,
    "num_experts num_max_tokens_per_rank expert_alignment num_sms num_qps async_with_compute_stream "
    "allocate_on_comm_stream do_handle_copy do_cpu_sync do_expand do_zero_padding use_tma_aligned_col_major_sf "
    "zero_copy",
)
_combine_scalars = _fields(
    CombineArgs, "num_sms num_qps async_with_compute_stream allocate_on_comm_stream zero_copy"
)

_new = object.__new__
_set = object.__setattr__


# What the checks read from an array (everything but the pointer and the object).
_layout = operator.attrgetter("dtype", "shape", "strides", "device", "device_id")
# the executor attributes the rules and the SM planner read, with the defaults of an executor that lacks one
_DEVICE = {"array_device": "cuda", "device_id": 0, "num_device_sms": 0, "nvlink_gbs": None, "rdma_gbs": None}
_device_attrs = operator.attrgetter(*_DEVICE)


def _handle_key(fingerprint: tuple) -> tuple:
    """The handle's part of a key, from its `validation.handle_fingerprint`: the scalar fields the dispatch /
    combine rules and resolved defaults read, and the shape of its `topk_idx` (num_tokens, num_topk; a torch.Size
    compares and hashes as its tuple); its arrays are checked by `check_handle` on every call."""
    shape = fingerprint[0][2][0]
    if shape is None:
        raise TypeError  # no topk_idx shape: the full validation names the rule
    return fingerprint[0][1], shape


def _typed(values: tuple) -> tuple:
    """Scalars with their types (so that 1 and True, or 16 and 16.0, are different keys)."""
    return values, tuple(map(type, values))


def _allocator(allocator: Any, target: Any) -> Any:
    """`validation.check_allocator`, its common case (a callable) here."""
    return allocator if allocator is not None and callable(allocator) else check_allocator(allocator, target)


def _stream(stream: Any) -> int:
    """`validation.check_stream`, its common case (the raw handle ep_torch passes) here."""
    return stream if type(stream) is int and stream >= 0 else check_stream(stream)


def _build(cls: type, fields: dict, per_call: dict) -> Any:
    """A frozen request from its cached fields and this call's (no per-field `object.__setattr__`)."""
    req = _new(cls)
    _set(req, "__dict__", {**fields, **per_call})
    return req


class PreparedOps:
    """Validated dispatch / combine requests of one buffer, by launch shape (module doc). An entry's token
    (`PreparedToken`) is its key in the rank's plan cache (`RankDriver.plans`, `ep_core.kernels.prepared_launch.
    PlanCache`), which holds the entry's plan (`ep_core.kernels.op_plan`). `sm_counts`: the SM counts the validator
    resolved (`validation.resolve_num_sms`; the buffer's policy and link bandwidths, which the rank's planner SM
    counts do not read, and an executor without a rank has none), so that a new signature does not plan again."""

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self._dispatch: dict[tuple, dict] = {}
        self._combine: dict[tuple, dict] = {}
        self.sm_counts: dict = {}
        # the key and entry of the last hit of each op: a call repeating the previous call's shapes (the common
        # case) compares its key with that one instead of hashing it and probing the table; the key is built in
        # full either way, so the match covers everything the checks read
        self._last_dispatch: tuple = (None, None)
        self._last_combine: tuple = (None, None)
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._dispatch.clear()
        self._combine.clear()
        self._last_dispatch = self._last_combine = (None, None)

    @staticmethod
    def _device(target: Any) -> tuple:
        try:  # an executor with all five (GpuExecutor): one attrgetter (`_DEVICE`)
            return _device_attrs(target)
        except AttributeError:
            return tuple([getattr(target, name, default) for name, default in _DEVICE.items()])

    def _store(self, table: dict, key: tuple, req: Any, per_call: frozenset) -> None:
        """Keep a validated request's fields under its key, with a new `PreparedToken` that this request and
        every later one served from the entry carry."""
        if len(table) >= _MAX_ENTRIES:
            table.clear()
            self._last_dispatch = self._last_combine = (None, None)
        _set(req, "prepared", PreparedToken())
        table[key] = {k: v for k, v in req.__dict__.items() if k not in per_call}

    # ------------------------------------------------------------------------------------------------- dispatch
    def dispatch_request(
        self,
        target: Any,
        x: Any,
        topk_idx: Any = None,
        topk_weights: Any = None,
        *,
        sm_cache: dict | None = None,
        **kwargs: Any,
    ) -> DispatchRequest:
        """`validation.make_dispatch_request` for this buffer, served from the cache when the shapes repeat."""
        return self.dispatch(target, DispatchArgs(x, topk_idx, topk_weights, **kwargs), sm_cache)

    def dispatch(self, target: Any, a: DispatchArgs, sm_cache: dict | None = None) -> DispatchRequest:
        """The request of one dispatch's arguments (`EPBuffer`'s road): from the entry of its key, or validated in
        full (`validation.validate_dispatch`) and kept. `zero_copy` is part of the key: its requests and their
        repeats are their own entries."""
        x, handle = a.x, a.handle
        try:
            stats = a.cumulative_local_expert_recv_stats
            if type(x) is tuple and len(x) == 2:
                xi, sfi, ti, wi, si = describe_all(x[0], x[1], a.topk_idx, a.topk_weights, stats)
                x_key: tuple = (_layout(xi), _layout(sfi))
            elif type(x) is tuple:
                raise TypeError  # the full validation names the rule
            else:
                xi, ti, wi, si = describe_all(x, a.topk_idx, a.topk_weights, stats)
                sfi = None
                x_key = _layout(xi)
            if handle is not None and type(handle) is not EPHandle:
                raise TypeError  # the full validation names the rule
            # the handle's key part, and the check of a hit (`check_handle`'s error, raised on a hit only)
            hfp, bad = (None, None) if handle is None else checked_fingerprint(self.config, target, handle)
            key = (
                x_key,
                None if ti is None else _layout(ti),
                None if wi is None else _layout(wi),
                None if si is None else _layout(si),
                None if hfp is None else _handle_key(hfp),
                a.previous_event is None,
                self._device(target),
                _typed(_dispatch_scalars(a)),
            )
            last = self._last_dispatch
            # the previous call's shapes again (the common repeat): one tuple comparison, no hash and probe
            entry = last[1] if key == last[0] else self._dispatch.get(key)
        except Exception:  # not describable here: the full validation raises (or accepts) it
            entry = key = None
        if entry is not None:
            if bad is not None:
                raise bad
            self.hits += 1
            self._last_dispatch = (key, entry)
            return _build(
                DispatchRequest,
                entry,
                {
                    "x": xi,
                    "sf": sfi,
                    "topk_idx": ti,
                    "topk_weights": wi,
                    "handle": handle,
                    "cumulative_local_expert_recv_stats": si,
                    "allocator": _allocator(a.allocator, target),
                    "stream": _stream(a.stream),
                    "previous_event": a.previous_event,
                    "previous_event_before_epilogue": a.previous_event_before_epilogue,
                },
            )
        self.misses += 1
        req = validate_dispatch(self.config, target, a, self.sm_counts if sm_cache is None else sm_cache)
        if key is not None:
            self._store(self._dispatch, key, req, _DISPATCH_PER_CALL)
        return req

    # -------------------------------------------------------------------------------------------------- combine
    def combine_request(
        self, target: Any, x: Any, handle: Any, topk_weights: Any = None, bias: Any = None, **kwargs: Any
    ) -> CombineRequest:
        """`validation.make_combine_request` for this buffer, served from the cache when the shapes repeat."""
        return self.combine(target, CombineArgs(x, handle, topk_weights, bias, **kwargs))

    def combine(self, target: Any, a: CombineArgs) -> CombineRequest:
        """The request of one combine's arguments (`EPBuffer`'s road; `zero_copy`, part of the key, its own
        entries)."""
        x, handle, topk_weights, bias = a.x, a.handle, a.topk_weights, a.bias
        try:
            if type(handle) is not EPHandle or type(x) in (tuple, list):
                raise TypeError  # the full validation names the rule
            hfp, bad = checked_fingerprint(self.config, target, handle)  # raised on a hit only
            if type(bias) is list or (type(bias) is tuple and len(bias) != 2):
                raise TypeError  # the full validation names the rule
            # (one call for the arrays; the common combine has only x)
            xi, wi = (describe(x), None) if topk_weights is None else describe_all(x, topk_weights)
            bi = () if bias is None else describe_all(*bias) if type(bias) is tuple else describe_all(bias)
            bias_key = None if bias is None else ("pair" if type(bias) is tuple else "one", *map(_layout, bi))
            key = (
                _layout(xi),
                None if wi is None else _layout(wi),
                bias_key,
                _handle_key(hfp),
                a.previous_event is None,
                self._device(target),
                _typed(_combine_scalars(a)),
            )
            last = self._last_combine
            entry = last[1] if key == last[0] else self._combine.get(key)
        except Exception:  # not describable here: the full validation raises (or accepts) it
            entry = key = None
        if entry is not None:
            if bad is not None:
                raise bad
            self.hits += 1
            self._last_combine = (key, entry)
            return _build(
                CombineRequest,
                entry,
                {
                    "x": xi,
                    "handle": handle,
                    "topk_weights": wi,
                    "bias": bi,
                    "allocator": _allocator(a.allocator, target),
                    "stream": _stream(a.stream),
                    "previous_event": a.previous_event,
                    "previous_event_before_epilogue": a.previous_event_before_epilogue,
                },
            )
        self.misses += 1
        req = validate_combine(self.config, target, a)
        if key is not None:
            self._store(self._combine, key, req, _COMBINE_PER_CALL)
        return req


class _Announcing:
    """`EPBuffer.announcing`'s context (a plain class: a generator-based context manager costs more per call)."""

    __slots__ = ("buffer", "op", "outer", "step")

    def __init__(self, buffer: Operations, op: str) -> None:
        self.buffer = buffer
        self.op = op

    def __enter__(self) -> None:
        buf = self.buffer
        self.outer = not buf._announcing_depth
        buf._announcing_depth += 1
        if self.outer:
            self.step = buf._step()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        buf = self.buffer
        buf._announcing_depth -= 1
        if self.outer and isinstance(exc, Exception):
            buf.announce_error(self.op, exc, self.step)
        return False


_NESTED = contextlib.nullcontext()  # `announcing` nested in an outer block of the same buffer (reusable)


def _plan_of(executor: Any, token: Any) -> Any:
    """The plan of a prepared entry's token in a GPU rank's one plan cache (`RankDriver.plans`), or None."""
    plans = getattr(getattr(executor, "rank", None), "plans", None)
    return None if token is None or plans is None else plans.get(token)


def _served(executor: Any, req: Any, full: Any) -> Any:
    """A request's result: its entry's plan serves it (`DispatchPlan.serve` / `CombinePlan.serve`; None where it
    declines), else `full(req)`, the executor's full path, which records the plan for the next call."""
    plan = _plan_of(executor, req.prepared)
    res = None if plan is None else plan.serve(executor, req)
    return full(req) if res is None else res


_SIBLINGS = 8  # the plans kept beside a kind's last one (`keep_lane`): a caller alternating between shapes


class Operations:
    """`EPBuffer`'s base class (the state is the buffer's): one call's road, record -> entry (`PreparedOps`) ->
    the entry's plan, the plan kept for the framework (`keep_lane`), the error announced to the peers."""

    _announcing_depth = 0  # nesting of `announcing` blocks (only the outermost announces)

    def run_dispatch(self, args: DispatchArgs, lane: tuple | None = None) -> DispatchResult:
        """`dispatch` of its argument record (ep_torch's road, and `dispatch`'s own): its request (`PreparedOps`; a
        zero-copy call, rule D18 too, under keys of its own), served by the entry's plan or the executor's full path;
        `lane`: `keep_lane`'s `(kind, match, scalars, handle)` for this call's plan."""
        return self._run("dispatch", self._dispatch, args, lane)

    def _run(self, op: str, run: Any, args: Any, lane: tuple | None) -> Any:
        # inside another block of this buffer (ep_torch's), which announces: no block of its own (`announcing`)
        if self._announcing_depth:
            res = run(args)
        else:
            with self.announcing(op):
                res = run(args)
        if lane is not None:
            self.keep_lane(lane[0], op, *lane[1:])
        return res

    def _dispatch(self, args: DispatchArgs) -> DispatchResult:
        if self._destroyed:
            self._check_alive()  # raises
        ex = self._executor
        req = self._prepared.dispatch(ex, args)
        # no silent ordinary dispatch
        if req.zero_copy and getattr(ex, "zero_copy_dispatch", False) is not True:
            raise EPConfigError(
                f"zero_copy: the executor {type(ex).__name__} has no zero-copy dispatch; dispatch without zero_copy"
            )
        res = _served(ex, req, ex.dispatch)
        self._last_dispatch = (req.prepared, req.x.dtype, req.allocator, req.do_handle_copy)  # `keep_lane`'s
        self._trust_new(req, res)
        return res

    def _trust_new(self, req: Any, res: DispatchResult) -> None:
        """A new handle from the library's own allocator (`validation.is_trusted_allocator`'s mark) passes the
        handle checks by construction: recorded as validated (`validation.trust_handle`) for its combine."""
        if req.handle is None and getattr(req.allocator, "ep_core_trusted", False) is True:
            trust_handle(self.config, self._executor, res.handle)

    def keep_lane(
        self, kind: str, op: str, match: Any, scalars: tuple, handle: EPHandle | None = None
    ) -> Any:
        """Keep the plan of this buffer's last `op` ("dispatch" or "combine") as the framework's lane `kind` (its
        `siblings`: up to `_SIBLINGS` plans kept before it for the same `scalars`, other arrays) and return it, or
        None where it cannot serve (`ep_core.kernels.kept_plan.keep`). The caller made that call with no handle
        (unless `handle`), previous events or comm-stream allocation; it calls the plan as `plan(x, topk_idx or
        handle, topk_weights, stream)` once a later call's scalars are `scalars` (the same object, or an equal int);
        `match(x, ...)` compares the arrays, `(x, topk_idx, topk_weights)` (FP8: `(data, scales, topk_idx,
        topk_weights)`) or `(x, topk_weights)` with a handle, and returns their pointers or None."""
        last = getattr(self, "_last_combine" if op == "combine" else "_last_dispatch", None)
        plan = None
        # (`EPKIT_EXPRESS_LANE=0` or no `match`: no plan to ask)
        if last is not None and not self._destroyed and match is not None and knobs.express_lane:
            token, x_dtype, allocator, copy = last
            kept = _plan_of(self._executor, token)
            if kept is not None and kept.op == op:
                kept.handle_copy = copy  # a dispatch's `do_handle_copy` (a combine's True: unread)
                from ep_core.kernels.kept_plan import keep  # (a GPU rank's plan: its package is loaded)

                plan = keep(kept, self, self._executor, x_dtype, allocator, match, handle)
        front = self._lanes.get(kind)
        if plan is not None:
            plan.scalars = scalars
            # the plans kept before it for the same scalars (values and types: one prepared key) stay beside it
            kin = front is not None and front is not plan and _typed(front.scalars) == _typed(scalars)
            if kin:
                plan.siblings = [p for p in (front, *front.siblings) if p is not plan][:_SIBLINGS]
                front.siblings = []
            elif plan is not front:
                plan.siblings = []
        self._lanes[kind] = plan
        return plan

    def run_combine(self, args: CombineArgs, lane: tuple | None = None) -> CombineResult:
        """`combine` of its argument record (ep_torch's road; a zero-copy call, rule C7 too, under request-cache
        keys of its own, whose repeats launch the zero-copy kernel: the executor checks each call's `x` is its
        combine buffer); `lane` as `run_dispatch`'s."""
        return self._run("combine", self._combine, args, lane)

    def _combine(self, args: CombineArgs) -> CombineResult:
        if self._destroyed:
            self._check_alive()  # raises
        if args.out_dtype is not None or args.defer_epilogue is not False:
            raise EPValueError(
                "out_dtype / defer_epilogue: the framework layer's fields of the combine record (ep_torch's "
                "ElasticBuffer.combine runs them); ep_core's combine takes None / False there"
            )
        ex = self._executor
        req = self._prepared.combine(ex, args)
        res = _served(ex, req, ex.combine)
        self._last_combine = (req.prepared, "bfloat16", req.allocator, True)  # `keep_lane`'s
        return res

    def announcing(self, op: str) -> _Announcing:
        """`with buf.announcing(op): ...`: an exception leaving the block is announced to the peers
        (`announce_error`, with the step counter read on entry). The one layer of announcement: a block nested in
        another one of the same buffer (ep_torch's call around this buffer's own `dispatch`) passes its exception
        on to the outermost, which announces it once."""
        if self._announcing_depth:  # inside another block of this buffer: that one announces, this is a no-op
            return _NESTED
        return _Announcing(self, op)

    def _step(self) -> int | None:
        """The host channel's step counter; for the GPU executors, whose kernels meet their peers on the device,
        the device-side launch counter (`launch_step`); None for an executor with neither."""
        executor = getattr(self, "_executor", None)
        channel = getattr(executor, "channel", None)
        if channel is not None:
            return channel.taken
        counter = getattr(executor, "launch_counter", None)  # (object, field): no call into the executor
        return getattr(executor, "launch_step", None) if counter is None else getattr(*counter)

    def announce_error(self, op: str, error: BaseException, step: int | None) -> None:
        """Announce `error` (about to be raised by this rank's `op`) to the peers, unless the call already took
        part in its exchange (`step` is the channel's counter when the call began): the peers waiting in that
        exchange raise `EPPeerError` naming this rank instead of pairing this rank's next call with theirs.
        Best effort: a failure of the announcement itself (a dead peer, a timeout) never hides `error`.
        GPU executors have no host exchange: a call that launched nothing gives up its device sequence number
        instead, so the kernels' envelopes make every rank raise at this rank's next launch."""
        executor = getattr(self, "_executor", None)
        channel = getattr(executor, "channel", None)
        if channel is None:  # a GPU executor's (`abandon_step`)
            if step is not None and getattr(executor, "launch_step", None) == step:
                executor.abandon_step()
            return
        if step is None or channel.taken != step:
            return
        try:
            channel.announce(op, error)
        except Exception as exc:  # the caller raises the original error
            error.__context__ = exc
