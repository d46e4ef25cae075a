"""The prepared-operation cache: a repeated dispatch / combine of the same shapes reuses its validated request.

Validation and planning depend only on what shapes the launch: every array's dtype, shape, byte strides and device,
the scalars and flags (with their types: `True` is not `1` here), the handle's layout fields and the executor's
device attributes. `PreparedOps` keys its entries by exactly those, so a hit passed the very same checks and
resolved the very same SM / QP counts; it only reads the pointers (`describe`), checks the handle
(`validation.check_handle`, cached by fingerprint), the allocator and the stream, and builds the request. A key
never seen, or an argument the key cannot describe, goes through the full validation, which raises exactly what an
uncached call raises; entries are added only after it succeeded, so an error is never cached. One `PreparedOps`
belongs to one buffer.
"""

from __future__ import annotations

import operator
from typing import Any

from ep_core.device_array import describe, describe_all
from ep_core.handle import EPHandle
from ep_core.requests import (
    BufferConfig,
    CombineArgs,
    CombineRequest,
    DispatchArgs,
    DispatchRequest,
    PreparedToken,
)
from ep_core.validation import (
    check_allocator,
    check_stream,
    checked_fingerprint,
    validate_combine,
    validate_dispatch,
)

__all__ = ["PreparedOps"]

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
_device_attrs = operator.attrgetter("array_device", "device_id", "num_device_sms", "nvlink_gbs", "rdma_gbs")


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
        """The executor attributes the rules and the SM planner read."""
        try:  # an executor with all five (GpuExecutor): one attrgetter
            return _device_attrs(target)
        except AttributeError:
            pass
        return (
            getattr(target, "array_device", "cuda"),
            getattr(target, "device_id", 0),
            getattr(target, "num_device_sms", 0),
            getattr(target, "nvlink_gbs", None),
            getattr(target, "rdma_gbs", None),
        )

    def _store(self, table: dict, key: tuple, req: Any, per_call: frozenset) -> None:
        """Keep a validated request's fields under its key, with a new `PreparedToken` that this request and
        every later one served from the entry carry."""
        if len(table) >= _MAX_ENTRIES:
            table.clear()
            self._last_dispatch = self._last_combine = (None, None)
        token = PreparedToken()
        _set(req, "prepared", token)
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
