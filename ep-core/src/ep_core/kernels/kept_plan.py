"""A plan (`ep_core.kernels.op_plan`) kept for a framework's repeats (`EPBuffer.keep_lane`): the checks that it can
serve them, and its allocations by one call of a trusted allocator's `batch` (ep_torch's host extension: one C call
for a call's outputs, the routing copy and the new handle's int32 block), set up once per plan and allocator (at
`keep`, or at a plan's first `serve` with that allocator). The per-call side (`_alloc()`, `_made`, `_kept_outputs`)
is the plan's own."""

from __future__ import annotations

from typing import Any

from ep_core.kernels.array_block import Int32Block
from ep_core.validation import handle_fingerprint, is_trusted_allocator

__all__ = ["batched", "keep", "output_specs"]


def keep(plan: Any, buffer: Any, ex: Any, x_dtype: str, allocator: Any, match: Any, handle: Any) -> Any:
    """`plan` set up to serve `buffer`'s framework (`match(x, ...)`: a later call's pointers or None; `handle`: whose
    key part a cached dispatch or a combine keeps), or None: another rank's plan, an untrusted allocator or one
    without `batch`, a handle unlike the plan's kind, a cached dispatch with CPU sync or FP8 scales, what `batched`
    refuses."""
    keyed = plan.op == "combine" or plan.cached  # (a plan keyed by its handle's layout)
    if (handle is None) is keyed or (
        keyed and plan.op == "dispatch" and (plan.cpu_sync or plan.sf_dtype is not None)
    ):
        return None
    batch = getattr(allocator, "batch", None)
    if batch is None or plan.rank is not getattr(ex, "rank", None) or not is_trusted_allocator(allocator):
        return None
    if handle is not None:
        try:  # the handle's part of the entry's key (`PreparedOps`: its scalar fields, `topk_idx`'s shape)
            fp = handle_fingerprint(buffer.config, ex, handle)
        except Exception:
            return None
        plan._handle_key = (fp[0][1], fp[0][2][0])
        if plan._handle_key[1] is None:
            return None
    plan.buffer, plan._executor, plan.match = buffer, ex, match
    plan._comm, plan._events = ex.stream.handle, ex.stream_events()
    return plan if batched(plan, allocator, x_dtype, batch) else None


def batched(plan: Any, allocator: Any, x_dtype: str, batch: Any) -> bool:
    """Whether `plan`'s calls with a trusted `allocator` allocate by one call of its `batch`, set up here (other
    allocators: one by one). A combine: its outputs. A dispatch: not for a cached one with CPU sync or FP8 scales,
    an empty routing, a CPU-sync zero-copy dispatch, or a call `run` declines."""
    if plan.op == "combine":
        t, k = plan.num_tokens, plan.topk
        specs = (((t, plan.hidden), "bfloat16"),) + ((((t, k), "float32"),) if plan.has_weights else ())
        plan._alloc, plan.batching = batch(specs), (allocator, True)
        return True
    plan.batching = (allocator, False)
    if plan.cached and (plan.cpu_sync or plan.sf_dtype is not None):
        return False
    if not plan.cached:
        if not plan.int32_shapes or plan.num_tokens == 0 or plan.topk == 0:
            return False
        # a CPU-sync dispatch's metadata is allocated once its rows are known (`run`), else it is in the block
        if ("src_metadata" in plan.int32_shapes) is plan.cpu_sync:
            return False
        rows = plan.num_expanded if plan.expand else plan.num_recv
        epilogue = plan.prepared.epilogue_pdl if plan.epilogue_pdl else plan.prepared.epilogue
        if plan.zero_copy and plan.cpu_sync:  # (one launch, no epilogue) a CPU-sync one is never recorded
            return False
        if not plan.zero_copy and epilogue is None and (rows > 0 or plan.zero_padding or plan.cpu_sync):
            return False  # what `run` declines
        # the outputs (CPU sync: none, they follow the counts), the routing copy (`handle_copy`), the block
        specs = [] if plan.cpu_sync else output_specs(plan, rows, x_dtype)
        specs += [((plan.num_tokens, plan.topk), "int32" if plan.idx32 else "int64")] * plan.handle_copy
        specs.append(((max(Int32Block.layout(plan._int32_key)[2], 1),), "int32"))
        plan._alloc = batch(tuple(specs))
        plan._by_value = None  # the handles' fingerprint by value, read from the first
    sf = plan._sf_name is not None
    has_idx = not plan.expand
    # the outputs' places in a batch (0: absent; recv_x is first): scales, recv_topk_idx, recv_topk_weights
    plan._at = (1 if sf else 0, 1 + sf if has_idx else 0, 1 + sf + has_idx if plan.has_weights else 0)
    plan._made = None  # this call's batch (no-sync: outputs, routing copy, block)
    plan._by_rows = {}
    plan._batch = batch
    plan._x_name = x_dtype
    plan.batching = (allocator, True)
    return True


def output_specs(plan: Any, rows: int, x_name: str) -> list:
    """What a dispatch plan's `run` allocates for `rows` rows, in its order: recv_x, the scales (column-major: the
    storage `[packs, align(rows, 4)]`), recv_topk_idx (not expanded), recv_topk_weights; none when zero-copy."""
    if plan.zero_copy:
        return []
    k = plan.topk
    specs: list = [((rows, plan.hidden), x_name)]
    if plan._sf_name is not None:
        specs.append((plan.sf_layout(rows)[0], plan._sf_name))
    if not plan.expand:
        specs.append(((rows, k), "int64"))
    if plan.has_weights:
        specs.append(((rows,) if plan.expand else (rows, k), "float32"))
    return specs
