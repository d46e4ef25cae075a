"""Input validation of dispatch and combine (SPEC §6): every rule raises `EPValueError` / `EPTypeError` naming
the argument and the rule, before anything is launched. Shared by `ep_core.EPBuffer` and ep_torch.

`make_dispatch_request` / `make_combine_request` take a `BufferConfig`, a *target* (the executor: it provides
`array_device`, `device_id`, `num_device_sms` and optionally `nvlink_gbs` / `rdma_gbs`) and the user's arguments,
and return the frozen request the executor runs. Rules (each is tested in tests/test_core_validation.py):

dispatch
  D1  x is an array or a 2-tuple (data, sf); a list or another type is a TypeError
  D2  x (bf16) dtype is bfloat16; FP8 data is float8_e4m3fn (or uint8 bits); sf is 4-byte (float32/int32/uint32)
  D3  x, sf are 2-D; sf.shape[0] == num_tokens; x is contiguous (sf may have any strides)
  D4  every array lives on the executor's device (kind and id)
  D5  hidden * elem_size % 32 == 0 (token rows are 32-byte aligned), hidden > 0
  D6  num_tokens <= num_max_tokens_per_rank (M > 0)
  D7  topk_idx: required without a handle and forbidden with one; int64 or int32; [num_tokens, K]; contiguous;
      1 <= K <= 32
  D8  topk_weights: float32, [num_tokens, K] (second dim checked), contiguous
  D9  num_experts: required without a handle; multiple of N; <= 2048; <= 256 per rank; matches a handle's
  D10 expert_alignment >= 1 (matches a handle's); num_max_tokens_per_rank matches a handle's
  D11 handle: an EPHandle of this rank; do_cpu_sync=True with a handle is an error; do_expand matches the
      handle; handle arrays have the shapes of §2 (psum [S_u], metadata [R, K+2] int32, ...)
  D12 do_zero_padding requires do_expand
  D13 cumulative_local_expert_recv_stats: [epr] int32, contiguous; forbidden with a handle
  D14 num_sms: int >= 0 (0 = planner or the handle's), <= device SMs; num_qps: int >= 0, <= allocated QPs
  D15 previous_event requires allocate_on_comm_stream
  D16 buffer capacity: the dispatch buffers for (hidden, packs, K, M) fit num_bytes
  D17 allocator is callable
  D18 zero_copy: a bool; True needs no handle (not cached), do_expand=False, use_tma_aligned_col_major_sf=False and
      one NVLink domain (direct mode); the executor must offer it (`zero_copy_dispatch`)
combine
  C1  x: bfloat16, 2-D, contiguous, on the device; hidden * 2 % 32 == 0
  C2  handle: an EPHandle of this rank (required); x rows == handle rows (num_recv_tokens, or
      num_expanded_tokens in expand mode)
  C3  topk_weights: float32, contiguous, [rows, K] (non-expand) or [rows] (expand); not allowed in expand mode
      with allow_multiple_reduction=False
  C4  bias: None, one array or a tuple of exactly two; a list or another type is a TypeError; each bf16, 2-D,
      contiguous, [num_tokens, hidden], on the device
  C5  num_tokens (handle) <= num_max_tokens_per_rank
  C6  num_sms / num_qps as D14 (0 = the handle's SMs); previous_event as D15; capacity of the combine buffers
  C7  zero_copy: a bool; True needs a non-expanded handle and no topk_weights (the executor checks that x is its
      combine buffer)
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any

from ep_core import planner
from ep_core.device_array import ArrayInfo, describe
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import ARRAY_FIELDS, BLOCK_PARTS, MISSING, EPHandle
from ep_core.requests import BufferConfig, CombineArgs, CombineRequest, DispatchArgs, DispatchRequest
from ep_core.topology import MAX_TOPK

__all__ = [
    "check_allocator",
    "check_array",
    "check_handle",
    "check_stream",
    "check_zero_copy_dispatch_args",
    "checked_fingerprint",
    "handle_fingerprint",
    "make_combine_request",
    "make_dispatch_request",
    "resolve_num_sms",
    "trust_fingerprint",
    "trust_handle",
    "validate_combine",
    "validate_dispatch",
]

_INT_IDS = ("int64", "int32")
_FP8 = ("float8_e4m3fn", "uint8")
_SF = ("float32", "int32", "uint32")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_array(
    name: str,
    obj: Any,
    target: Any,
    *,
    dtypes: tuple[str, ...],
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
) -> ArrayInfo:
    """Describe `obj` and check dtype, rank, shape (None = any), contiguity and device against `target` (None: no
    device check)."""
    info = describe(obj, name)
    if info.dtype not in dtypes:
        raise EPTypeError(f"{name}: expected dtype {' or '.join(dtypes)}, got {info.dtype}")
    want_ndim = len(shape) if shape is not None else ndim
    if want_ndim is not None and info.ndim != want_ndim:
        raise EPValueError(f"{name}: expected a {want_ndim}-D array, got shape {info.shape}")
    if shape is not None and any(w is not None and w != g for w, g in zip(shape, info.shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise EPValueError(f"{name}: expected shape {want}, got {info.shape}")
    if contiguous and not info.is_contiguous:
        raise EPValueError(
            f"{name}: expected a contiguous (row-major) array, got strides {info.strides}; "
            "pass a contiguous copy"
        )
    if (
        target is None
    ):  # the kernel layer's own entry points (`validate_rank_routing`): its views check the device
        return info
    kind = getattr(target, "array_device", "cuda")
    dev = getattr(target, "device_id", 0)
    if info.device != kind or (kind == "cuda" and info.device_id != dev):
        raise EPValueError(
            f"{name}: expected an array on {kind}:{dev}, got one on {info.device}:{info.device_id}"
        )
    return info


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EPTypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def resolve_num_sms(
    config: BufferConfig,
    target: Any,
    num_sms: Any,
    num_experts: int,
    num_topk: int,
    handle: EPHandle | None = None,
    cache: dict | None = None,
) -> int:
    """`num_sms` validated; 0 = the handle's SMs, else the planner's (policy of the buffer)."""
    device_sms = int(getattr(target, "num_device_sms", 0)) or 1
    if not _is_int(num_sms) or num_sms < 0:
        raise EPValueError(f"num_sms: expected an int >= 0 (0 = automatic), got {num_sms!r}")
    if num_sms == 0:
        if handle is not None and handle.num_sms > 0:
            num_sms = handle.num_sms
        else:
            key = (num_experts, num_topk)
            if cache is not None and key in cache:
                return cache[key]
            num_sms = planner.get_theoretical_num_sms(
                config.topology,
                num_experts,
                num_topk,
                num_device_sms=device_sms,
                nvlink_gbs=getattr(target, "nvlink_gbs", None),
                rdma_gbs=getattr(target, "rdma_gbs", None),
                prefer_overlap_with_compute=config.prefer_overlap_with_compute,
                policy=config.policy,
            )
            if cache is not None:
                cache[key] = num_sms
    if num_sms > device_sms:
        raise EPValueError(f"num_sms: expected at most the device's {device_sms} SMs, got {num_sms}")
    return num_sms


def _resolve_num_qps(config: BufferConfig, num_qps: Any, num_sms: int) -> int:
    if not _is_int(num_qps) or num_qps < 0:
        raise EPValueError(f"num_qps: expected an int >= 0 (0 = automatic), got {num_qps!r}")
    if num_qps == 0:
        return planner.get_theoretical_num_qps(config.topology, num_sms, config.num_allocated_qps)
    if num_qps > config.num_allocated_qps:
        raise EPValueError(
            f"num_qps: allocated QPs are not enough: asked for {num_qps}, the buffer has {config.num_allocated_qps}; "
            "pass a larger num_allocated_qps to the constructor"
        )
    return num_qps


def check_stream(stream: Any) -> int:
    """The caller's stream handle: an int (0 = the default stream), or an object with an int `cuda_stream`
    (a torch / cupy stream)."""
    if type(stream) is int and stream >= 0:  # the raw handle ep_torch passes: no attribute lookup
        return stream
    if stream is None:
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise EPTypeError(
            f"stream: expected a stream handle (a non-negative int, 0 = the default stream, or an object with "
            f"cuda_stream), got {stream!r}"
        )
    return handle


def _check_events(previous_event: Any, allocate_on_comm_stream: Any, async_with_compute_stream: Any) -> None:
    _check_flag("allocate_on_comm_stream", allocate_on_comm_stream)
    _check_flag("async_with_compute_stream", async_with_compute_stream)
    if previous_event is not None and not allocate_on_comm_stream:
        raise EPValueError("previous_event: requires allocate_on_comm_stream=True")


# Handles that passed `check_handle` -> what was checked: the buffer config (by identity: it is frozen), the
# target's device and every scalar field the rules read (by value), every array field (the object itself, compared by
# identity and kept alive here so that its id cannot be reused) and its shape. A handle whose fingerprint is
# unchanged passed the very same checks; any field replaced, resized or re-shaped, another buffer or device: the full
# validation runs again. (An array mutated in place without a new shape, e.g. torch's `t.data = ...` with another
# dtype, is outside the handle's contract: handles are produced by dispatch and only read afterwards.)
_validated_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_handle_arrays = operator.attrgetter(*ARRAY_FIELDS)


# every scalar field a rule or a resolved default reads (`ep_core.prepared` keys its entries by them too)
_handle_scalars = operator.attrgetter(
    "do_expand",
    "num_experts",
    "num_max_tokens_per_rank",
    "expert_alignment",
    "num_sms",
    "num_recv_tokens",
    "num_expanded_tokens",
    "num_ranks",
    "rank",
)
_TUPLE_PER_ARRAY = (tuple,) * len(ARRAY_FIELDS)  # one per `_handle_arrays` field
_target_device = operator.attrgetter("array_device", "device_id")
_shape = operator.attrgetter("shape")


def handle_fingerprint(config: BufferConfig, target: Any, h: EPHandle) -> tuple:
    """What `check_handle` compares (no check made): `(by value, the arrays, the config)`: the target's device, the
    scalar fields and the arrays' shapes (`topk_idx`'s first) in one tuple (one comparison); the arrays and the
    buffer's config (frozen), compared by identity (kept alive with the entry, so that no other array can take an
    array's place)."""
    parts = h.__dict__.get(BLOCK_PARTS)
    if parts is None:
        arrays = _handle_arrays(h)
        try:
            shapes = tuple(map(_shape, arrays))
        except AttributeError:  # an absent array (None) or one without a shape
            shapes = tuple([getattr(a, "shape", None) for a in arrays])
    else:
        arrays, shapes = _block_arrays(h, parts)
    try:
        device = _target_device(target)
    except AttributeError:
        device = (getattr(target, "array_device", "cuda"), getattr(target, "device_id", 0))
    return (device, _handle_scalars(h), shapes), arrays, config


def _block_arrays(h: EPHandle, parts: tuple) -> tuple[tuple, tuple]:
    """`handle_fingerprint`'s arrays and shapes of a handle whose int32 arrays are in one block (`ep_core.handle`):
    a field still in the block, or read from it (the view the block made), counts as the block itself with the
    part's shape, so reading a field changes no fingerprint; a field replaced by another array counts as that
    array."""
    d = h.__dict__
    block, fields, size, in_block = parts
    if len(d) == size and in_block is not None:
        # as the dispatch left it (no field read or set since: that adds a key): the common case, without the loop;
        # `in_block[1]`: the metadata is the handle's own array (a CPU-sync dispatch's), else in the block too
        idx = d["topk_idx"]
        s = in_block[0]
        if not in_block[1]:
            return (idx, block, block, block, block, block), (idx.shape, *s)
        meta = d["recv_src_metadata"]
        return (idx, block, block, block, meta, block), (idx.shape, s[0], s[1], s[2], meta.shape, s[3])
    arrays, shapes = [], []
    for name in ARRAY_FIELDS:
        a = d.get(name, MISSING)
        part = fields.get(name)
        if part is not None and (a is MISSING or a is block.views[part]):
            arrays.append(block)
            shapes.append(block.shapes[part])
        else:
            if a is MISSING:
                a = getattr(h, name)
            arrays.append(a)
            shapes.append(getattr(a, "shape", None))
    return tuple(arrays), tuple(shapes)


def _cacheable(fingerprint: tuple) -> bool:
    """Shapes that compare by value (tuple, torch.Size) for every array present: anything else is validated every
    time."""
    return all(a is None or isinstance(shape, tuple) for a, shape in zip(fingerprint[1], fingerprint[0][2]))


def _fingerprint_matches(old: tuple, new: tuple) -> bool:
    # arrays and config by identity (never `==`: arrays compare elementwise), everything else by value
    return old[2] is new[2] and old[0] == new[0] and all(map(operator.is_, old[1], new[1]))


def check_handle(
    config: BufferConfig, target: Any, handle: Any, fingerprint: tuple | None = None
) -> EPHandle:
    """Validate `handle`'s fields and arrays for this buffer and target (D11), once per fingerprint. `fingerprint`:
    `handle_fingerprint(config, target, handle)` read by the caller in this same call (`PreparedOps` keys by it)."""
    if not isinstance(handle, EPHandle):
        raise EPTypeError(f"handle: expected the EPHandle returned by dispatch, got {type(handle).__name__}")
    try:
        if fingerprint is None:
            fingerprint = handle_fingerprint(config, target, handle)
        old = _validated_handles.get(handle)
        if old is not None and _fingerprint_matches(old, fingerprint):
            return handle
    except Exception:  # an odd array object or handle subclass: no cache, the full validation decides
        fingerprint = None
    _check_handle_arrays(config, target, handle)
    if fingerprint is not None and _cacheable(fingerprint):
        with contextlib.suppress(TypeError):  # not weak-referenceable: validated every time
            _validated_handles[handle] = fingerprint
    return handle


def checked_fingerprint(config: BufferConfig, target: Any, handle: EPHandle) -> tuple:
    """`(handle_fingerprint(...), None)`, or with the error `check_handle` raises on it in place of None, not raised:
    `PreparedOps` keys by the fingerprint and raises the error on a hit only (a miss: the full validation)."""
    fingerprint = handle_fingerprint(config, target, handle)
    try:
        check_handle(config, target, handle, fingerprint)
    except Exception as exc:
        return fingerprint, exc
    return fingerprint, None


def check_handle_key(config: BufferConfig, target: Any, handle: Any, key: tuple) -> bool:
    """Whether `handle` has a prepared entry's handle key `key` (its scalar fields and `topk_idx`'s shape, as
    `PreparedOps` keys it; a kept plan's, `ep_core.kernels.op_plan`), then `check_handle` (raising what it raises
    for a bad one); False, having checked nothing, for a handle of another key or type."""
    if type(handle) is not EPHandle:
        return False
    fp = handle_fingerprint(config, target, handle)
    if fp[0][1] != key[0] or fp[0][2][0] != key[1]:
        return False
    check_handle(config, target, handle, fp)
    return True


def trust_handle(config: BufferConfig, target: Any, handle: EPHandle) -> None:
    """Record a handle that `target`'s dispatch has just made as validated for this buffer and target, as
    `check_handle` records one that passed. Only for handles whose arrays come from an allocator marked
    `ep_core_trusted` (`is_trusted_allocator`: the executors' own, ep_torch's): those return exactly the shape,
    dtype and device asked for, so the handle passes every check by construction, and its first combine or cached
    dispatch compares its fingerprint instead of describing each array again (over 20 us on a 2-core host). A field
    replaced or re-shaped after this changes the fingerprint: the full validation runs then."""
    try:
        fingerprint = handle_fingerprint(config, target, handle)
        # every array of a new handle is there (`_cacheable` for the case where some may be None)
        if all(map(isinstance, fingerprint[0][2], _TUPLE_PER_ARRAY)):
            _validated_handles[handle] = fingerprint
    except Exception:  # an odd handle: its first use validates it in full
        return


def trust_fingerprint(handle: EPHandle, fingerprint: tuple) -> None:
    """`trust_handle` with the fingerprint the caller built (a kept plan, ep_core.kernels.op_plan: its by-value part is the same
    for every handle of one prepared entry, read once through `handle_fingerprint`)."""
    _validated_handles[handle] = fingerprint


def is_trusted_allocator(allocator: Any) -> bool:
    """Whether `allocator` is marked `ep_core_trusted = True` (a bound method reads its function's mark): it returns
    C-contiguous arrays of exactly the shape, dtype name and device it is asked for, on the executor's device."""
    return getattr(allocator, "ep_core_trusted", False) is True


def _check_handle_arrays(config: BufferConfig, target: Any, handle: EPHandle) -> None:
    if handle.num_ranks not in (0, config.num_ranks) or handle.rank not in (-1, config.rank):
        raise EPValueError(
            f"handle: made by rank {handle.rank} of {handle.num_ranks}, but this buffer is rank {config.rank} of "
            f"{config.num_ranks}"
        )
    su = config.topology.num_scaleup_ranks
    if handle.num_experts % config.num_ranks:
        raise EPValueError(
            f"handle: num_experts {handle.num_experts} is not a multiple of {config.num_ranks}"
        )
    epr = handle.num_experts // config.num_ranks
    idx = check_array("handle.topk_idx", handle.topk_idx, target, dtypes=_INT_IDS, ndim=2)
    k = idx.shape[1]
    # the int32 arrays and their shapes (SPEC §2); the slot index is checked in direct mode only
    int32_shapes = [
        ("psum_num_recv_tokens_per_scaleup_rank", (su,)),
        ("psum_num_recv_tokens_per_expert", (epr,)),
        ("num_unaligned_recv_tokens_per_expert", (epr,)),
        ("recv_src_metadata", (handle.num_recv_tokens, k + 2)),
    ]
    if not config.topology.is_hybrid:
        int32_shapes.append(("dst_buffer_slot_idx", (idx.shape[0], k)))
    for name, shape in int32_shapes:
        check_array(f"handle.{name}", getattr(handle, name), target, dtypes=("int32",), shape=shape)


@functools.lru_cache(maxsize=512)
def _dispatch_bytes(hidden: int, elem: int, packs: int, num_topk: int, topology: Any, m: int) -> int:
    """Bytes of the dispatch buffers (a pure function of its hashable arguments: memoized)."""
    import ep_layout

    token = ep_layout.make_dispatch_token_layout(hidden, elem, packs, num_topk)
    return ep_layout.dispatch_buffer_bytes(token, topology.to_layout(), m)


@functools.lru_cache(maxsize=512)
def _combine_bytes(hidden: int, num_topk: int, topology: Any, m: int, amr: bool) -> int:
    """Bytes of the combine buffers (a pure function of its hashable arguments: memoized)."""
    import ep_layout

    token = ep_layout.make_combine_token_layout(hidden, num_topk)
    return ep_layout.combine_buffer_bytes(token, topology.to_layout(), m, amr)


def _check_capacity(config: BufferConfig, what: str, needed: int) -> None:
    # the GPU part and the host part behind it (num_cpu_bytes): a region too big for the GPU part spills
    # (ep_core.elastic_memory, cost in planner.explain_memory)
    if needed > config.num_bytes:
        raise EPValueError(
            f"buffer: the {what} needs {needed} bytes, the buffer has {config.num_bytes} "
            f"({config.num_bytes - config.num_cpu_bytes} GPU + {config.num_cpu_bytes} host); "
            "build the buffer with a larger num_bytes (get_buffer_size_hint) or fewer tokens"
        )


def check_allocator(allocator: Any, target: Any) -> Callable:
    if allocator is None:
        allocator = getattr(target, "default_allocator", None)
    if not callable(allocator):
        raise EPTypeError("allocator: expected a callable (shape, dtype) -> array for the outputs")
    return allocator


def make_dispatch_request(
    config: BufferConfig,
    target: Any,
    x: Any,
    topk_idx: Any = None,
    topk_weights: Any = None,
    *,
    sm_cache: dict | None = None,
    **kwargs: Any,
) -> DispatchRequest:
    """`validate_dispatch` of the keyword arguments of `EPBuffer.dispatch` (`DispatchArgs`' fields)."""
    return validate_dispatch(config, target, DispatchArgs(x, topk_idx, topk_weights, **kwargs), sm_cache)


def validate_dispatch(
    config: BufferConfig, target: Any, a: DispatchArgs, sm_cache: dict | None = None
) -> DispatchRequest:
    """Validate a dispatch (rules D1-D18 of the module doc) and resolve its defaults."""
    handle, num_experts = a.handle, a.num_experts  # resolved below
    # D1, D2, D3
    if isinstance(a.x, tuple):
        if len(a.x) != 2:
            raise EPTypeError(f"x: an FP8 input is a tuple (data, sf) of two arrays, got {len(a.x)} elements")
        xi = check_array("x[0] (FP8 data)", a.x[0], target, dtypes=_FP8, ndim=2)
        sfi = check_array("x[1] (sf)", a.x[1], target, dtypes=_SF, ndim=2, contiguous=False)
        if sfi.shape[0] != xi.shape[0]:
            raise EPValueError(
                f"x[1] (sf): expected {xi.shape[0]} rows (one per token), got shape {sfi.shape}"
            )
        elem = 1
    elif isinstance(a.x, list):
        raise EPTypeError("x: expected a bf16 array or a tuple (data, sf) for FP8, got a list")
    else:
        xi = check_array("x", a.x, target, dtypes=("bfloat16",), ndim=2)
        sfi = None
        elem = 2
    num_tokens, hidden = xi.shape
    # D5
    if hidden <= 0 or hidden * elem % 32:
        raise EPValueError(
            f"x: hidden * element size must be a positive multiple of 32 bytes, got hidden={hidden} "
            f"({hidden * elem} bytes)"
        )
    for name, flag in (
        ("do_handle_copy", a.do_handle_copy),
        ("do_expand", a.do_expand),
        ("do_zero_padding", a.do_zero_padding),
        ("use_tma_aligned_col_major_sf", a.use_tma_aligned_col_major_sf),
    ):
        _check_flag(name, flag)
    if not isinstance(a.zero_copy, bool):  # D18
        raise EPTypeError(f"zero_copy: expected a bool, got {a.zero_copy!r}")
    if a.zero_copy:
        check_zero_copy_dispatch_args(
            handle is not None, a.do_expand, a.use_tma_aligned_col_major_sf, config.rank
        )
        topo = config.topology
        if topo.num_rdma_ranks > 1:
            raise EPValueError(
                f"zero_copy: direct mode within one NVLink domain only; this buffer's {topo.num_ranks} ranks span "
                f"{topo.num_rdma_ranks} NVLink domains of {topo.num_nvlink_ranks} (rank {config.rank}; dispatch "
                "without zero_copy)"
            )
    _check_events(a.previous_event, a.allocate_on_comm_stream, a.async_with_compute_stream)  # D15

    if handle is not None:  # D11 (cached)
        handle = check_handle(config, target, handle)
        validate_routing(a.topk_idx, True, num_tokens, target)
        if a.do_cpu_sync:
            raise EPValueError("do_cpu_sync: a cached dispatch cannot do a CPU sync; leave it None or False")
        if a.do_expand != handle.do_expand:
            raise EPValueError(
                f"do_expand: {a.do_expand} differs from the cached handle's {handle.do_expand}"
            )
        if a.cumulative_local_expert_recv_stats is not None:
            raise EPValueError("cumulative_local_expert_recv_stats: not allowed with a cached handle")
        for name, given, cached in (
            ("num_experts", num_experts, handle.num_experts),
            ("num_max_tokens_per_rank", a.num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
            ("expert_alignment", a.expert_alignment, handle.expert_alignment),
        ):
            if given is not None and given != cached:
                raise EPValueError(f"{name}: {given} differs from the cached handle's {cached}")
        num_experts, m, alignment = (
            handle.num_experts,
            handle.num_max_tokens_per_rank,
            handle.expert_alignment,
        )
        ti = None
        k = handle.num_topk
        if num_tokens != handle.num_tokens:
            raise EPValueError(
                f"x: {num_tokens} tokens, but the cached handle was made for {handle.num_tokens}"
            )
        cpu_sync = False
    else:
        ti = validate_routing(a.topk_idx, False, num_tokens, target)
        k = ti.shape[1]
        if num_experts is None:  # D9
            num_experts = config.num_experts or None
        if num_experts is None:
            raise EPValueError("num_experts: required unless a cached handle is given")
        if not _is_int(num_experts):
            raise EPTypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
        config.topology.check_num_experts(num_experts)
        m = config.num_max_tokens_per_rank if a.num_max_tokens_per_rank is None else a.num_max_tokens_per_rank
        alignment = 1 if a.expert_alignment is None else a.expert_alignment
        cpu_sync = True if a.do_cpu_sync is None else _check_flag("do_cpu_sync", a.do_cpu_sync)
    # D10, D6
    if not _is_int(alignment) or alignment < 1:
        raise EPValueError(f"expert_alignment: expected an int >= 1, got {alignment!r}")
    if not _is_int(m) or m <= 0:
        raise EPValueError(
            f"num_max_tokens_per_rank: expected an int > 0 (here or at construction), got {m!r}"
        )
    if num_tokens > m:
        raise EPValueError(f"x: num_tokens ({num_tokens}) must be <= num_max_tokens_per_rank ({m})")
    if a.do_zero_padding and not a.do_expand:  # D12
        raise EPValueError("do_zero_padding: only valid together with do_expand=True")
    wi = None
    if a.topk_weights is not None:  # D8
        wi = check_array("topk_weights", a.topk_weights, target, dtypes=("float32",), shape=(num_tokens, k))
    epr = num_experts // config.num_ranks
    stats = None
    if a.cumulative_local_expert_recv_stats is not None:  # D13
        stats = check_array(
            "cumulative_local_expert_recv_stats",
            a.cumulative_local_expert_recv_stats,
            target,
            dtypes=("int32",),
            shape=(epr,),
        )
    # D14
    sms = resolve_num_sms(config, target, a.num_sms, num_experts, k, handle, sm_cache)
    qps = _resolve_num_qps(config, a.num_qps, sms)
    # D16
    packs = sfi.shape[1] if sfi is not None else 0
    _check_capacity(config, "dispatch", _dispatch_bytes(hidden, elem, packs, k, config.topology, m))
    alloc = check_allocator(a.allocator, target)  # D17
    return DispatchRequest(
        x=xi,
        sf=sfi,
        topk_idx=ti,
        topk_weights=wi,
        handle=handle,
        cumulative_local_expert_recv_stats=stats,
        num_tokens=num_tokens,
        hidden=hidden,
        num_topk=k,
        num_sf_packs=packs,
        elem_size=elem,
        num_experts=num_experts,
        num_max_tokens_per_rank=m,
        expert_alignment=alignment,
        num_sms=sms,
        num_qps=qps,
        do_cpu_sync=cpu_sync,
        do_expand=a.do_expand,
        do_zero_padding=a.do_zero_padding,
        do_handle_copy=a.do_handle_copy,
        use_tma_aligned_col_major_sf=a.use_tma_aligned_col_major_sf,
        deterministic=config.deterministic,
        allocator=alloc,
        stream=check_stream(a.stream),
        previous_event=a.previous_event,
        previous_event_before_epilogue=a.previous_event_before_epilogue,
        async_with_compute_stream=a.async_with_compute_stream,
        allocate_on_comm_stream=a.allocate_on_comm_stream,
        zero_copy=a.zero_copy,
    )


def validate_routing(topk_idx: Any, cached: bool, num_tokens: int, target: Any) -> ArrayInfo | None:
    """Rule D7, the one routing check of every dispatch: `validate_dispatch`'s, and the kernel layer's own entry
    points' (`validate_rank_routing`, with `target` None: no device check), so the
    kernels (`RankDriver.launch_dispatch`) repeat none of it. `topk_idx` is forbidden with a cached handle and
    required without one: int64 or int32, [num_tokens, K] with 1 <= K <= MAX_TOPK, contiguous. Returns its
    description (None when cached)."""
    if cached:
        if topk_idx is not None:
            raise EPValueError("topk_idx: must be None for a cached dispatch (the handle holds the routing)")
        return None
    if topk_idx is None:
        raise EPValueError("topk_idx: required unless a cached handle is given")
    ti = check_array("topk_idx", topk_idx, target, dtypes=_INT_IDS, ndim=2)
    k = ti.shape[1]
    if ti.shape[0] != num_tokens:
        raise EPValueError(f"topk_idx: expected {num_tokens} rows (one per token of x), got shape {ti.shape}")
    if not 1 <= k <= MAX_TOPK:
        raise EPValueError(f"topk_idx: num_topk (second dim) must be in [1, {MAX_TOPK}], got {k}")
    return ti


def validate_rank_routing(x: Any, topk_idx: Any, handle: Any) -> None:
    """Rule D7 for the kernel layer's own entry points (`LoopbackDomain.dispatch`, `ProcessRank` and `NcclRank`'s
    `launch_dispatch`) through the validator's `validate_routing` (its wording; the kernels check no routing). The
    rows are x's (its shape where `describe` cannot read its dtype); an `x` that is no 2-D array is left to the kernel
    layer's own check of `x`."""
    cached = handle is not None
    if cached or topk_idx is None:  # forbidden, or required: no rows to compare
        validate_routing(topk_idx, cached, 0, None)
        return
    data = x[0] if isinstance(x, tuple) and x else x
    try:
        shape = describe(data, "x").shape
    except EPTypeError:
        shape = tuple(getattr(data, "shape", None) or ())
    if len(shape) == 2:
        validate_routing(topk_idx, False, int(shape[0]), None)


def check_zero_copy_dispatch_args(
    cached: bool, do_expand: bool, use_tma_aligned_col_major_sf: bool, rank: int
) -> None:
    """Rule D18's limits of a zero-copy dispatch's arguments, for `make_dispatch_request` and the kernel layer
    (`RankDriver.check_zero_copy_dispatch`, which adds the buffer's): the dispatch places each row at its final
    address from this call's counts, in the non-expanded layout with row-major scales."""
    where = f"rank {rank}"
    if cached:
        raise EPValueError(
            f"zero_copy: not with a cached dispatch (handle given, {where}): a zero-copy dispatch places the rows "
            "from this call's counts; dispatch the handle without zero_copy"
        )
    if do_expand:
        raise EPValueError(
            f"zero_copy: the non-expanded layout only (do_expand=False), got do_expand=True ({where}); an "
            "expanded dispatch runs without zero_copy"
        )
    if use_tma_aligned_col_major_sf:
        raise EPValueError(
            f"zero_copy: row-major scales only, got use_tma_aligned_col_major_sf=True ({where}); column-major "
            "scales need the copy epilogue (dispatch without zero_copy)"
        )


def check_zero_copy_args(handle: EPHandle, topk_weights: Any = None, hidden: Any = None) -> None:
    """Rule C7's arguments of a zero-copy combine, for `make_combine_request`, `EPBuffer.combine_buffer` and the
    kernel layer (`RankDriver.combine_buffer`): a non-expanded handle, no weights, and (when given) a positive int
    hidden size."""
    if handle.do_expand:
        raise EPValueError(
            "handle: a zero-copy combine needs the handle of a non-expanded dispatch (do_expand=False); an expanded "
            "layout's rows are per (token, expert) and travel with the ordinary combine"
        )
    if topk_weights is not None:
        raise EPValueError(
            "topk_weights: a zero-copy combine sends nothing back, so it returns no combined weights; pass None "
            "(or combine without zero_copy)"
        )
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0):
        raise EPValueError(f"hidden: expected a positive int, got {hidden!r}")


def make_combine_request(
    config: BufferConfig,
    target: Any,
    x: Any,
    handle: Any,
    topk_weights: Any = None,
    bias: Any = None,
    **kwargs: Any,
) -> CombineRequest:
    """`validate_combine` of the keyword arguments of `EPBuffer.combine` (`CombineArgs`' fields)."""
    return validate_combine(config, target, CombineArgs(x, handle, topk_weights, bias, **kwargs))


def validate_combine(config: BufferConfig, target: Any, a: CombineArgs) -> CombineRequest:
    """Validate a combine (rules C1-C7 of the module doc) and resolve its defaults."""
    if a.handle is None:
        raise EPValueError("handle: required (the handle returned by dispatch)")
    h = check_handle(config, target, a.handle)  # C2
    if not isinstance(a.zero_copy, bool):  # C7
        raise EPTypeError(f"zero_copy: expected a bool, got {a.zero_copy!r}")
    if a.zero_copy:
        check_zero_copy_args(h, a.topk_weights)
    if isinstance(a.x, (tuple, list)):
        raise EPTypeError(f"x: expected one bf16 array, got a {type(a.x).__name__}")
    xi = check_array("x", a.x, target, dtypes=("bfloat16",), ndim=2)  # C1
    rows, hidden = xi.shape
    if hidden <= 0 or hidden * 2 % 32:
        raise EPValueError(f"x: hidden must be a positive multiple of 16 (32-byte bf16 rows), got {hidden}")
    want_rows = h.num_expanded_tokens if h.do_expand else h.num_recv_tokens
    if rows != want_rows:
        what = "num_expanded_tokens" if h.do_expand else "num_recv_tokens"
        raise EPValueError(f"x: expected {want_rows} rows (handle.{what}), got {rows}")
    k = h.num_topk
    amr = config.allow_multiple_reduction
    wi = None
    if a.topk_weights is not None:  # C3
        if h.do_expand and not amr:
            raise EPValueError("topk_weights: not allowed in expand mode with allow_multiple_reduction=False")
        shape = (rows,) if h.do_expand else (rows, k)
        wi = check_array("topk_weights", a.topk_weights, target, dtypes=("float32",), shape=shape)
    num_tokens = h.num_tokens
    # C4
    if a.bias is None:
        biases: tuple = ()
    elif isinstance(a.bias, tuple):
        if len(a.bias) != 2:
            raise EPTypeError(f"bias: a bias tuple must hold exactly two arrays, got {len(a.bias)}")
        biases = a.bias
    elif isinstance(a.bias, list):
        raise EPTypeError("bias: expected None, an array or a tuple of two arrays, got a list")
    else:
        biases = (a.bias,)
    bias_info = tuple(
        check_array(
            f"bias[{i}]" if len(biases) > 1 else "bias",
            b,
            target,
            dtypes=("bfloat16",),
            shape=(num_tokens, hidden),
        )
        for i, b in enumerate(biases)
    )
    m = h.num_max_tokens_per_rank
    if num_tokens > m:  # C5
        raise EPValueError(f"handle: num_tokens ({num_tokens}) must be <= num_max_tokens_per_rank ({m})")
    _check_events(a.previous_event, a.allocate_on_comm_stream, a.async_with_compute_stream)
    sms = resolve_num_sms(config, target, a.num_sms, h.num_experts, k, h)
    qps = _resolve_num_qps(config, a.num_qps, sms)
    _check_capacity(config, "combine", _combine_bytes(hidden, k, config.topology, m, bool(amr)))
    alloc = check_allocator(a.allocator, target)
    return CombineRequest(
        x=xi,
        handle=h,
        topk_weights=wi,
        bias=bias_info,
        num_tokens=num_tokens,
        hidden=hidden,
        num_topk=k,
        num_sms=sms,
        num_qps=qps,
        allow_multiple_reduction=amr,
        allocator=alloc,
        stream=check_stream(a.stream),
        previous_event=a.previous_event,
        previous_event_before_epilogue=a.previous_event_before_epilogue,
        async_with_compute_stream=a.async_with_compute_stream,
        allocate_on_comm_stream=a.allocate_on_comm_stream,
        zero_copy=a.zero_copy,
    )
