"""The reference executor: `ep_core.reference` over host arrays, every rank's inputs exchanged through the
bootstrap (CPU tests, and a CPU backend for any bootstrap). `ReferenceTransport` builds its host storage."""

from __future__ import annotations

from typing import Any

import numpy as np

from ep_core import reference
from ep_core.device_array import DeviceArray, describe, host_allocator, host_array, host_copy, to_numpy
from ep_core.envelope import Channel
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import ARRAY_FIELDS, EPHandle
from ep_core.rank_state import check_owner
from ep_core.requests import BufferConfig, CombineRequest, CombineResult, DispatchRequest, DispatchResult

__all__ = ["ReferenceExecutor", "ReferenceTransport"]


class ReferenceTransport:
    """Host storage and a `ReferenceExecutor` (CPU tests; a CPU backend for any bootstrap)."""

    def __init__(
        self,
        num_device_sms: int = 132,
        nvlink_gbs: float = 450.0,
        rdma_gbs: float = 50.0,
        num_nvlink_ranks: int | None = None,
    ) -> None:
        self._num_device_sms = num_device_sms
        self._nvlink_gbs = nvlink_gbs
        self._rdma_gbs = rdma_gbs
        self._num_nvlink_ranks = num_nvlink_ranks

    def num_nvlink_ranks(self, bootstrap: Any) -> int:
        return self._num_nvlink_ranks or bootstrap.size

    def allocate(self, bootstrap: Any, num_bytes: int) -> Any:
        from ep_core.buffer_base import HostStorage

        return HostStorage(num_bytes)

    def create_executor(self, config: BufferConfig, buffer: Any) -> ReferenceExecutor:
        ex = ReferenceExecutor(config, buffer.bootstrap, num_device_sms=self._num_device_sms)
        ex.nvlink_gbs = self._nvlink_gbs
        ex.rdma_gbs = self._rdma_gbs
        return ex


def _handle_key(h: EPHandle) -> tuple:
    """What identifies a handle across ranks: the step of the dispatch that made it, and its layout."""
    return (
        getattr(h, "_ep_step", None),
        h.num_experts,
        h.num_max_tokens_per_rank,
        h.do_expand,
        h.expert_alignment,
    )


def _handle_np(h: EPHandle) -> EPHandle:
    """A copy of a handle whose array fields are numpy arrays (for the exchange between ranks)."""
    import dataclasses

    fields = {}
    for name in ARRAY_FIELDS:
        v = getattr(h, name)
        fields[name] = v if isinstance(v, np.ndarray) else host_copy(v)
    return dataclasses.replace(
        h,
        **fields,
        token_metadata_at_forward=None,
        channel_linked_list=None,
        cached_recv_src_metadata_before_sort=None,
    )


class ReferenceExecutor:
    """Runs `ep_core.reference` for host arrays. Every rank gathers all ranks' inputs through the bootstrap,
    computes the whole reference and keeps its own part, so it works across threads or processes."""

    array_device = "cpu"
    device_id = 0
    # honours `DispatchRequest.zero_copy`: the outputs are views of `_region` (EPBuffer asks for this mark)
    zero_copy_dispatch = True

    def __init__(self, config: BufferConfig, bootstrap: Any, *, num_device_sms: int = 132) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.num_device_sms = num_device_sms
        self.nvlink_gbs: float | None = None
        self.rdma_gbs: float | None = None
        self.num_dispatches = 0
        self.num_combines = 0
        set_timeout = getattr(bootstrap, "set_timeout", None)
        if set_timeout is not None:  # bound every host wait by the buffer's num_cpu_timeout_secs
            set_timeout(config.num_cpu_timeout_secs)
        self.channel = Channel(bootstrap)

    def _dispatch_envelope(self, req: DispatchRequest) -> dict[str, Any]:
        """The configuration of a dispatch that every rank must agree on."""
        h = req.handle
        return {
            "num_experts": req.num_experts,
            "num_max_tokens_per_rank": req.num_max_tokens_per_rank,
            "hidden": req.hidden,
            "num_topk": req.num_topk,
            "x.dtype": req.x.dtype,
            "sf": None if req.sf is None else (req.sf.dtype, req.num_sf_packs),
            "topk_weights": req.topk_weights is not None,
            "do_expand": req.do_expand,
            "expert_alignment": req.expert_alignment,
            "do_cpu_sync": req.do_cpu_sync,
            "handle": None if h is None else _handle_key(h),
            "zero_copy": req.zero_copy,
        }

    def _check_routing(self, req: DispatchRequest, idx: np.ndarray | None) -> None:
        """This rank's expert ids, checked before the exchange so that the error is this rank's own (announced to
        the peers, which raise `EPPeerError` naming this rank, the token and the lane)."""
        if idx is None or idx.size == 0:
            return
        rank, e = self.config.rank, req.num_experts
        bad = np.argwhere((idx < -1) | (idx >= e))
        if bad.size:
            t, k = (int(v) for v in bad[0])
            raise EPValueError(
                f"topk_idx[{t}, {k}] = {int(idx[t, k])} on rank {rank} (token {t}, lane {k}) is out of range: expected an expert id "
                f"in [0, {e}) or -1 (no expert); other negative ids are rejected"
            )
        s = np.sort(idx, axis=1)
        dup = np.argwhere((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0))
        if dup.size:
            t = int(dup[0][0])
            v = int(s[t, dup[0][1]])
            lanes = [int(k) for k in np.flatnonzero(idx[t] == v)]
            raise EPValueError(
                f"topk_idx[{t}] on rank {rank} (token {t}, lanes {lanes}): expert {v} appears twice (or more); each "
                "expert may be chosen once per token"
            )

    @staticmethod
    def _out(allocator: Any, a: np.ndarray | None, dtype: str) -> Any:
        if a is None:
            return None
        arr = allocator(tuple(a.shape), dtype)
        info = describe(arr, "allocator result")
        if info.device != "cpu" or info.shape != tuple(a.shape) or info.dtype != dtype:
            raise EPTypeError(
                f"allocator: expected a host array {tuple(a.shape)} {dtype} for the reference executor, got "
                f"{info.device} {info.shape} {info.dtype}"
            )
        view = to_numpy(arr)
        view[...] = a.view(view.dtype) if a.dtype.itemsize == view.dtype.itemsize else a
        return arr

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        if req.handle is not None:
            self._check_owner(req.handle)
        self.num_dispatches += 1
        cfg = self.config
        mine = {
            "x": host_copy(req.x.obj),
            "sf": host_copy(req.sf.obj) if req.sf is not None else None,
            "topk_idx": host_copy(req.topk_idx.obj) if req.topk_idx is not None else None,
            "topk_weights": host_copy(req.topk_weights.obj) if req.topk_weights is not None else None,
            "handle": _handle_np(req.handle) if req.handle is not None else None,
        }
        if req.handle is None:
            self._check_routing(req, mine["topk_idx"])
        everyone = self.channel.exchange("dispatch", self._dispatch_envelope(req), mine)
        xs = [(e["x"], e["sf"]) if e["sf"] is not None else e["x"] for e in everyone]
        weights = [e["topk_weights"] for e in everyone]
        weights_arg = None if weights[0] is None else weights
        try:
            if req.handle is None:
                outs = reference.dispatch(
                    xs,
                    [e["topk_idx"] for e in everyone],
                    weights_arg,
                    num_experts=req.num_experts,
                    num_max_tokens_per_rank=req.num_max_tokens_per_rank,
                    expert_alignment=req.expert_alignment,
                    do_expand=req.do_expand,
                    do_cpu_sync=req.do_cpu_sync,
                    use_tma_aligned_col_major_sf=False,
                    num_scaleup_ranks=cfg.topology.num_scaleup_ranks,
                    num_sms=req.num_sms,
                    deterministic=req.deterministic,
                )
            else:
                outs = reference.dispatch(xs, None, weights_arg, handles=[e["handle"] for e in everyone])
        except ValueError as exc:  # raised alike on every rank (every rank computes the whole reference)
            raise EPValueError(f"dispatch (reference, every rank): {exc}") from exc
        out = outs[cfg.rank]
        alloc = req.allocator
        # zero-copy: the reference's order is the deterministic one, so the same rows, placed in this rank's region
        if req.zero_copy:
            recv_x, recv_sf, recv_idx, recv_w = self._zero_copy_outputs(req, out)
        else:
            recv_x, recv_sf, recv_idx, recv_w = self._outputs(req, out)
        if req.handle is not None:
            handle = req.handle
        else:
            h = out.handle
            topk_idx = (
                self._out(
                    alloc,
                    h.topk_idx.astype(np.int64 if req.topk_idx.dtype == "int64" else np.int32),
                    req.topk_idx.dtype,
                )
                if req.do_handle_copy
                else req.topk_idx.obj
            )
            handle = EPHandle(
                h.do_expand,
                h.num_experts,
                h.expert_alignment,
                h.num_max_tokens_per_rank,
                req.num_sms,
                topk_idx,
                h.num_recv_tokens,
                h.num_expanded_tokens,
                list(h.num_recv_tokens_per_expert_list),
                self._out(alloc, h.psum_num_recv_tokens_per_scaleup_rank, "int32"),
                self._out(alloc, h.psum_num_recv_tokens_per_expert, "int32"),
                self._out(alloc, h.num_unaligned_recv_tokens_per_expert, "int32"),
                self._out(alloc, h.recv_src_metadata, "int32"),
                self._out(alloc, h.dst_buffer_slot_idx, "int32"),
                num_ranks=cfg.num_ranks,
                rank=cfg.rank,
            )
            handle._ep_step = self.channel.seq - 1  # which collective step made it: handle identity for peers
            # and which buffer and generation (ep_core.rank_state.check_owner: combine and cached dispatch)
            handle._ep_owner = self.channel.state.owner
            if req.cumulative_local_expert_recv_stats is not None:
                stats = to_numpy(req.cumulative_local_expert_recv_stats.obj)
                stats += h.num_unaligned_recv_tokens_per_expert.astype(stats.dtype)
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)

    def _outputs(self, req: DispatchRequest, out: Any) -> tuple:
        """An ordinary dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: from the allocator."""
        alloc = req.allocator
        recv_x = self._out(alloc, out.recv_x, req.x.dtype)
        recv_sf = None
        if out.recv_sf is not None:
            sf = np.ascontiguousarray(out.recv_sf)
            if req.use_tma_aligned_col_major_sf:
                rows = sf.shape[0]
                storage = np.zeros((sf.shape[1], reference.align(rows, 4)), dtype=sf.dtype)
                storage[:, :rows] = sf.T
                sf = storage
            recv_sf = self._out(alloc, sf, req.sf.dtype)
        recv_idx = self._out(alloc, out.recv_topk_idx, "int64")
        recv_w = self._out(alloc, out.recv_topk_weights, "float32")
        return recv_x, recv_sf, recv_idx, recv_w

    def _region(self, num_bytes: int) -> np.ndarray:
        """This executor's stand-in for the GPU's receive region: one host allocation (bytes) of at least
        `num_bytes`, where zero-copy dispatches leave their outputs and `combine_buffer` lies, both at its start
        as on the GPU (so bf16 `recv_x` and the combine buffer are the same memory). A larger need takes a new
        allocation; the views of the old one keep it alive."""
        region = getattr(self, "_region_bytes", None)
        if region is None or region.size < num_bytes:
            region = self._region_bytes = np.zeros(max(num_bytes, 1), np.uint8)
        return region

    def _zero_copy_outputs(self, req: DispatchRequest, out: Any) -> tuple:
        """A zero-copy dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: the reference's rows
        written into `_region` where the GPU's kernel stores them (`ZeroCopyRows`: recv_x at the start, then
        scales, ids and weights, each laid out for N * M rows), returned as host views of it. Limits: validation
        rule D18."""
        from ep_core.kernels.zero_copy_rows import ZeroCopyRows  # no GPU needed: the byte layout only

        cfg = self.config
        hidden_bytes = req.hidden * req.elem_size
        z = ZeroCopyRows(
            cfg.num_ranks * req.num_max_tokens_per_rank, hidden_bytes, req.num_sf_packs, req.num_topk
        )
        region = self._region(z.num_bytes)

        def place(a: np.ndarray | None, offset: int, dtype: str) -> DeviceArray | None:
            if a is None:
                return None
            a = np.ascontiguousarray(a)
            view = region[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            return host_array(view, dtype)

        return (
            place(out.recv_x, 0, req.x.dtype),
            place(out.recv_sf, z.sf_offset, req.sf.dtype) if req.sf is not None else None,
            place(out.recv_topk_idx, z.topk_idx_offset, "int64"),
            place(out.recv_topk_weights, z.weights_offset, "float32"),
        )

    def combine_buffer(self, handle: Any, hidden: int) -> DeviceArray:
        """The zero-copy combine buffer (`EPBuffer.combine_buffer`): a bf16 host `DeviceArray` `[received rows,
        hidden]` at the start of one host allocation kept by this executor, as the GPU's sits at the start of the
        receive region (the same memory for every handle: the next call's buffer overwrites this one's rows). The
        handle and hidden size come validated (`EPBuffer.combine_buffer`)."""
        rows = int(np.asarray(handle.recv_src_metadata).shape[0])
        need = rows * hidden * 2
        return host_array(self._region(need)[:need].view(np.uint16).reshape(rows, hidden), "bfloat16")

    def _check_zero_copy(self, req: CombineRequest) -> None:
        if req.x.shape[0] == 0:  # no rows: nothing is read (an empty view may carry no address)
            return
        region = getattr(self, "_region_bytes", None)
        if region is None or req.x.ptr != region.ctypes.data:
            raise EPValueError(
                f"x: a zero-copy combine reads rank {self.config.rank}'s combine buffer in place; pass "
                "combine_buffer(handle) with the expert outputs written into it"
            )

    def _check_owner(self, h: EPHandle) -> None:
        """A handle of another buffer, or from before a reset(), indexes another layout: refused by name."""
        check_owner(h, self.channel.state, self.config.rank)

    def combine(self, req: CombineRequest, fp32_output: bool = False) -> CombineResult:
        """The combine step. ``fp32_output`` (ep_torch's ``combine(out_dtype=torch.float32)``): the home rank's final
        float32 sum itself, not rounded to bf16; it rides in the envelope (``out_dtype``), so ranks that mix it with an
        ordinary combine all raise ``EPMismatchError``."""
        self._check_owner(req.handle)
        self.num_combines += 1
        if req.zero_copy:  # the same sum: the rows are read where the caller wrote them
            self._check_zero_copy(req)
        mine = {
            "x": host_copy(req.x.obj),
            "handle": _handle_np(req.handle),
            "topk_weights": host_copy(req.topk_weights.obj) if req.topk_weights is not None else None,
            "bias": tuple(host_copy(b.obj) for b in req.bias),
        }
        config = {
            "hidden": req.hidden,
            "num_topk": req.num_topk,
            "handle": _handle_key(req.handle),
            "topk_weights": req.topk_weights is not None,
            "bias": len(req.bias),
            "allow_multiple_reduction": req.allow_multiple_reduction,
            "zero_copy": req.zero_copy,
        }
        if fp32_output:
            config["out_dtype"] = "float32"
        everyone = self.channel.exchange("combine", config, mine)
        weights = [e["topk_weights"] for e in everyone]
        biases = [
            None if not e["bias"] else e["bias"][0] if len(e["bias"]) == 1 else e["bias"] for e in everyone
        ]
        outs = reference.combine(
            [e["x"] for e in everyone],
            [e["handle"] for e in everyone],
            topk_weights=None if weights[0] is None else weights,
            bias=biases,
            allow_multiple_reduction=req.allow_multiple_reduction,
            num_scaleup_ranks=self.config.topology.num_scaleup_ranks,
            fp32_output=fp32_output,
        )
        out = outs[self.config.rank]
        return CombineResult(
            self._out(req.allocator, out.combined_x, "float32" if fp32_output else "bfloat16"),
            self._out(req.allocator, out.combined_topk_weights, "float32"),
        )

    def barrier(self) -> None:
        self.channel.exchange("barrier", {})

    def reset(self) -> None:
        """Nothing to clear on the host; a collective like the GPU executor's."""
        self.channel.exchange("reset", {})

    def destroy(self) -> None:
        return None

    @staticmethod
    def default_allocator(shape: tuple[int, ...], dtype: str) -> DeviceArray:
        return host_allocator(shape, dtype)

    default_allocator.__func__.ep_core_trusted = True  # exact shapes and dtypes (`validation.trust_handle`)
