"""ElasticBuffer's methods beyond EP (issue 20): pipeline send/recv, Engram fetch, all-gather sessions.

A mixin of `ElasticBuffer`. Names, arguments and semantics are DeepEP V2's (`deep_ep/buffers/elastic.py`); the
protocol, sizes and checks ep-core's (`ep_core.pp`, `ep_core.engram`, `ep_core.agrs`); the bytes move on
:mod:`ep_torch.elastic_reference` (CPU tensors on gloo) or :mod:`ep_torch.elastic_copy_engine` (CUDA). User
documentation: ``ep-torch/docs/elastic-ops.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from ep_core import agrs, engram, pp
from ep_core.errors import (
    EPConfigError,
    EPMismatchError,
    EPPeerError,
    EPStateError,
    EPTypeError,
    EPValueError,
)
from ep_core.rank_state import breaks_step

__all__ = ["ElasticOps"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _guarded(op: str, host_step: bool = True) -> Callable[[Any], Any]:
    """The method inside the buffer's ``ep_core.rank_state`` guard (its bootstrap's state, shared with dispatch and
    combine): refused at once after a disagreement, timeout or lost peer until ``reset()``; on the CPU backend, where
    the peers' call begins with a host exchange (``host_step``), a refusal of this rank's call is announced to them
    (issue 41)."""

    def deco(fn: Any) -> Any:
        def call(self: ElasticOps, *args: Any, **kwargs: Any) -> Any:
            state = getattr(self.bootstrap, "rank_state", None)
            if state is None:
                return fn(self, *args, **kwargs)
            announce = self._announce_refusal if host_step and self.transport == "reference" else None
            with state.guard(op, announce):
                if getattr(self.bootstrap, "_via_store", None) is not None and self.transport == "reference":
                    raise EPStateError(
                        f"{op} (rank {self.rank_idx}): after the timeout this buffer was reset from, the process "
                        "group's own collectives are out of step (a wait given up leaves its collective pending); "
                        "dispatch and combine work again, PP and AGRS on the CPU backend need a new process group "
                        "and buffer"
                    )
                return fn(self, *args, **kwargs)

        call.__name__, call.__doc__, call.__qualname__ = fn.__name__, fn.__doc__, fn.__qualname__
        return call

    return deco


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(dist.group.WORLD if group is None else group)


class _State:
    """Per-buffer state of the primitives (created on first use)."""

    def __init__(self, rank: int) -> None:
        self.pp: pp.PPConfig | None = None
        self.engram: engram.EngramTable | None = None
        self.session = agrs.AGRSSession(rank)
        self.backend: Any = None


class ElasticOps:
    """PP, Engram and AGRS methods of `ElasticBuffer` (DeepEP V2's names and semantics)."""

    # provided by ElasticBuffer
    group: dist.ProcessGroup
    rank_idx: int
    num_ranks: int
    device: torch.device
    transport: str
    num_bytes: int
    num_cpu_bytes: int
    num_allocated_qps: int
    bootstrap: Any
    _rt: Callable[[], Any]

    # ---------------------------------------------------------------------------------------------------------
    # size hints (static, no buffer needed)

    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[int, int]:
        """(Experimental) ``(num_gpu_bytes, num_cpu_bytes)`` for Engram: the fetch area for
        ``num_max_tokens_per_rank`` rows and the storage of ``num_entries`` entries of ``hidden`` elements, each
        entry aligned to 32 bytes; both 2 MiB aligned."""
        return engram.get_engram_storage_size_hint(
            num_entries, hidden, num_max_tokens_per_rank, dtype.itemsize
        )

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """(Experimental) Buffer bytes for PP send/recv: ``align(align(bytes, 32) * inflight * 4, 2 MiB)``."""
        return pp.get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)

    @staticmethod
    def get_agrs_num_max_session_bytes(
        group: dist.ProcessGroup | None, shapes: Any, dtype: torch.dtype
    ) -> int:
        """(Experimental) Session bytes for all-gathers of ``shapes`` (one shape or a sequence of shapes, the local
        shapes before gathering): ``sum(align(group_size * prod(shape) * itemsize, 32))``."""
        return agrs.get_agrs_num_max_session_bytes(_group_size(group), shapes, dtype.itemsize)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup | None, num_max_session_bytes: int) -> int:
        """(Experimental) Buffer bytes for AGRS sessions: ``align(num_max_session_bytes, 2 MiB)``."""
        return agrs.get_agrs_buffer_size_hint(num_max_session_bytes)

    # ---------------------------------------------------------------------------------------------------------
    # elastic memory

    def explain_memory(
        self,
        num_experts: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        *,
        hbm_gbs: float | None = None,
        host_gbs: float | None = None,
    ) -> Any:
        """(Ours) Where dispatch/combine receive regions live in ``[GPU | host num_cpu_bytes]`` and what the host
        part costs (``ep_core.planner.MemoryPlan``): bytes past the GPU part (worst case; expected under uniform
        routing with ``num_experts``; this rank's own rows count as the tails the dispatch stores of them), and their
        time at the host link's bandwidth against HBM's. Sizes default to
        the buffer's (``num_max_tokens_per_rank``, ``hidden``, ``num_topk``: 0 = the buffer's; ``num_topk`` 0 on
        both = 8). A region that needs the host part spills there instead of being refused."""
        from ep_core import elastic_memory, planner

        rt = self._rt()
        c = rt.config
        return planner.explain_memory(
            rt.topology,
            int(num_max_tokens_per_rank or c.num_max_tokens_per_rank),
            int(hidden or c.hidden),
            int(num_topk or c.num_topk or 8),
            int(c.num_bytes),
            int(c.num_cpu_bytes),
            num_experts=int(num_experts or c.num_experts),
            use_fp8_dispatch=bool(c.use_fp8_dispatch),
            allow_multiple_reduction=bool(c.allow_multiple_reduction),
            host_memory=elastic_memory.host_bytes(rt.storage) > 0,
            hbm_gbs=hbm_gbs,
            host_gbs=host_gbs,
            rank=self.rank_idx,  # its own rows are stored as tails only
        )

    # ---------------------------------------------------------------------------------------------------------
    # plumbing

    def _elastic(self, collective: bool = False) -> _State:
        """The primitives' state; ``collective``: the caller is a collective (every rank is here), which may create
        the backend (the GPU one exchanges its signal memory). Non-collective calls need a configured primitive,
        hence a backend made by the collective that configured it."""
        self._rt()  # raises after destroy()
        st = self.__dict__.get("_elastic_state")
        if st is None:
            st = _State(self.rank_idx)
            self.__dict__["_elastic_state"] = st
        if collective and st.backend is None:
            st.backend = self._make_elastic_backend()
        return st

    def _make_elastic_backend(self) -> Any:
        if self.transport == "reference":
            from .elastic_reference import ReferenceBackend

            return ReferenceBackend(self)
        # nccl: the peers through NCCL's LSA pointers, one node only (elastic_copy_engine._peer_bases)
        if self.transport in ("ipc", "nccl"):
            from .elastic_copy_engine import CopyEngineBackend

            return CopyEngineBackend.from_buffer(self)
        raise EPConfigError(
            f"transport: PP, Engram and AGRS run on the 'reference' (CPU), 'ipc' and 'nccl' (GPU, one node) "
            f"transports; this buffer uses {self.transport!r} (rank {self.rank_idx})"
        )

    @property
    def _num_gpu_buffer_bytes(self) -> int:
        """The GPU part of the data region (the front); the host part (``num_cpu_bytes``) follows it."""
        return self.num_bytes - self.num_cpu_bytes

    def _check_tensor(self, name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise EPTypeError(
                f"{name}: expected a torch.Tensor, got {type(t).__name__} (rank {self.rank_idx})"
            )
        want = self.device.type
        if t.device.type != want or (
            want == "cuda" and self.device.index is not None and t.device.index != self.device.index
        ):
            raise EPValueError(
                f"{name}: expected a tensor on {self.device} for the {self.transport} backend, got one on {t.device} (rank "
                f"{self.rank_idx})"
            )
        if not t.is_contiguous():
            raise EPValueError(f"{name}: expected a contiguous tensor (rank {self.rank_idx})")
        return t

    def _announce_refusal(self, op: str, exc: BaseException) -> None:
        """Tell the peers waiting in this operation's host exchange that this rank refused its call."""
        self.bootstrap.abort(f"{op}: {type(exc).__name__}: {exc}")

    def _collective(
        self, op: str, validate: Callable[[], Any], fields: Callable[[Any], dict[str, Any]]
    ) -> Any:
        """``validate()`` then the agreement check: a rank whose arguments are refused tells its peers (they raise
        ``EPPeerError`` naming it instead of waiting for it)."""
        try:
            out = validate()
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.bootstrap.abort(f"{op}: {exc}")
            raise
        self._agree(op, fields(out))
        return out

    def _agree(self, op: str, fields: dict[str, Any]) -> None:
        """Every rank's ``fields`` for a collective must be equal; otherwise every rank raises the same error."""
        mine = repr(sorted(fields.items())).encode()
        every = self.bootstrap.allgather(mine)
        if any(b != every[0] for b in every):
            ranks = [r for r, b in enumerate(every) if b != every[0]]
            raise EPMismatchError(
                f"{op}: ranks disagree (rank 0: {every[0].decode()}; differing ranks {ranks}: "
                f"{every[ranks[0]].decode()}); every rank must make the same call",
                fields=fields,
            )

    # ---------------------------------------------------------------------------------------------------------
    # PP

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """(Experimental) Configure PP send/recv (a collective with a barrier that flushes earlier operations).

        Every rank then exchanges tensors of at most ``num_max_tensor_bytes`` with its ring neighbours, at most
        ``num_max_inflight_tensors`` unreceived tensors per direction."""
        st = self._elastic(collective=True)
        cfg = self._collective(
            "pp_set_config",
            lambda: pp.make_pp_config(
                self.rank_idx,
                self.num_ranks,
                self._num_gpu_buffer_bytes,
                num_max_tensor_bytes,
                num_max_inflight_tensors,
            ),
            lambda c: {"bytes": c.num_max_tensor_bytes, "inflight": c.num_max_inflight_tensors},
        )
        st.backend.pp_configure(cfg, st.pp)
        st.pp = cfg

    def _pp_args(
        self, op: str, t: Any, peer_name: str, peer: Any, num_sms: Any
    ) -> tuple[pp.PPConfig, Any, int]:
        st = self._elastic()
        cfg = pp.require_config(st.pp, op, self.rank_idx)
        t = self._check_tensor("t", t)
        cfg.check_nbytes("t", t.nbytes)
        p = cfg.check_peer(peer_name, peer)
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise EPValueError(f"num_sms: expected an int >= 0, got {num_sms!r} (rank {self.rank_idx})")
        return cfg, t, p

    @_guarded("pp_send", host_step=False)
    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """(Experimental) Send ``t`` to ``dst_rank_idx`` (this rank's prev or next ring neighbour).

        Returns once the tensor is on its way (``t`` may be reused); waits only while
        ``num_max_inflight_tensors`` earlier tensors to that rank are still unreceived. ``num_sms`` is accepted
        for compatibility: the copy engine moves the bytes."""
        try:
            cfg, t, dst = self._pp_args("pp_send", t, "dst_rank_idx", dst_rank_idx, num_sms)
        except Exception as exc:  # the receiver waits for this tensor: it raises naming this rank instead
            abort = getattr(getattr(self.__dict__.get("_elastic_state"), "backend", None), "pp_abort", None)
            if abort is not None and isinstance(dst_rank_idx, int) and 0 <= dst_rank_idx < self.num_ranks:
                with contextlib.suppress(Exception):
                    abort(dst_rank_idx, f"pp_send: {type(exc).__name__}: {exc}")
            raise
        self._elastic().backend.pp_send(cfg, t, dst)

    @_guarded("pp_recv", host_step=False)
    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """(Experimental) Receive the next tensor from ``src_rank_idx`` (prev or next) into ``t``, which must have
        the sent tensor's size (ours: a different size raises instead of copying garbage)."""
        cfg, t, src = self._pp_args("pp_recv", t, "src_rank_idx", src_rank_idx, num_sms)
        self._elastic().backend.pp_recv(cfg, t, src)

    # ---------------------------------------------------------------------------------------------------------
    # Engram

    @_guarded("engram_write")
    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """(Experimental) Write this rank's Engram entries (a collective, with a barrier before and after).

        ``storage``: ``[num_entries, hidden]`` bf16 or ``float8_e4m3fn``, the same shape on every rank; entry
        ``g`` of the global table is row ``g % num_entries`` of rank ``g // num_entries``. ``sf``:
        ``[num_ranks * num_entries, num_sf_packs]`` 4-byte packs (float32 or int32), replicated, iff FP8."""
        st = self._elastic(collective=True)

        def validate() -> engram.EngramTable:
            self._check_tensor("storage", storage)
            sf_shape = None
            if sf is not None:
                self._check_tensor("sf", sf)
                if sf.dtype not in (torch.float32, torch.int32):
                    raise EPTypeError(f"sf: expected torch.float32 or torch.int32 packs, got {sf.dtype}")
                sf_shape = tuple(sf.shape)
            return engram.make_engram_table(
                self.rank_idx,
                self.num_ranks,
                tuple(storage.shape),
                _dtype_name(storage.dtype),
                self.num_cpu_bytes,
                sf_shape,
            )

        table = self._collective("engram_write", validate, lambda t: {"table": t.key()})
        st.backend.engram_write(table, storage, sf)
        st.engram = table

    @_guarded("engram_fetch", host_step=False)
    def engram_fetch(
        self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """(Experimental) Start fetching the entries ``indices [num_tokens, k]`` (int32 global entry ids) into the
        front of this rank's buffer; returns a hook that waits and returns ``(data [num_tokens, k * hidden], sf)``
        (DeepEP 2.0's shape: token t's k entries side by side; ``sf``: ``[num_tokens, k * num_sf_packs]`` in FP8
        mode, else None). ``data`` is a view of the buffer: valid until the next fetch or other use of the buffer's
        front. One-sided: peers take no part."""
        st = self._elastic()
        table = engram.require_table(st.engram, self.rank_idx)
        indices = self._check_tensor("indices", indices)
        if (
            isinstance(num_qps, bool)
            or not isinstance(num_qps, int)
            or not 0 <= num_qps <= self.num_allocated_qps
        ):
            raise EPValueError(
                f"num_qps: expected an int in [0, {self.num_allocated_qps}] (0 = all allocated), got {num_qps!r}"
            )
        host = indices.numpy() if indices.device.type == "cpu" else None
        engram.check_fetch_indices(
            table, tuple(indices.shape), _dtype_name(indices.dtype), self._num_gpu_buffer_bytes, host
        )
        hook = st.backend.engram_fetch(table, indices, bool(use_tma_aligned_col_major_sf))
        t, k = (int(v) for v in indices.shape)

        def fetched() -> tuple[torch.Tensor, torch.Tensor | None]:
            data, sf = hook()
            return data.view(t, k * int(data.shape[-1])), sf  # the same bytes as [T * k, hidden]

        return fetched

    # ---------------------------------------------------------------------------------------------------------
    # AGRS

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """(Experimental) Configure all-gather sessions (a collective with a barrier): at most
        ``num_max_session_bytes`` of gathered data and ``num_max_all_gathers_per_session`` (<= 32) all-gathers
        per session. Needs at least 2 ranks, all in one NVLink domain."""
        st = self._elastic(collective=True)

        def validate() -> agrs.AGRSConfig:
            cfg = agrs.make_agrs_config(
                self.rank_idx,
                self.num_ranks,
                self._rt().get_physical_domain_size()[1],
                self._num_gpu_buffer_bytes,
                num_max_session_bytes,
                num_max_all_gathers_per_session,
            )
            st.session.configure(cfg)
            return cfg

        self._collective(
            "agrs_set_config",
            validate,
            lambda c: {"bytes": c.num_max_session_bytes, "count": c.num_max_all_gathers_per_session},
        )
        st.backend.barrier()

    def create_agrs_session(self) -> None:
        """(Experimental) Begin an AGRS session (local; pair it with :meth:`destroy_agrs_session`)."""
        st = self._elastic()
        st.session.create()

    def destroy_agrs_session(self) -> None:
        """(Experimental) End the session: after the work queued so far, tell every peer and wait until every peer
        ended it too, so that the next session may overwrite the space (the results of this one become invalid)."""
        st = self._elastic()
        idx = st.session.destroy()
        st.backend.agrs_end_session(idx)

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True) -> Iterator[None]:
        """(Experimental) ``with buffer.agrs_new_session():`` wraps create/destroy; a no-op with ``enabled=False``."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        except BaseException as exc:  # the body's error is the cause: a failing session end is its context
            if (
                isinstance(exc, EPPeerError) and exc.announced and agrs.NOT_IN_SESSION in str(exc)
            ):  # a peer refused its call from outside any session: it will not end one; neither does this rank
                with contextlib.suppress(Exception):
                    self._elastic().session.abandon()
                raise
            if breaks_step(
                exc
            ):  # the ranks are out of step: end it here only (no wait for peers that will not come)
                with contextlib.suppress(Exception):
                    self._elastic().session.destroy()
                raise
            try:
                self.destroy_agrs_session()
            except Exception as end:
                exc.__context__ = end
            raise
        self.destroy_agrs_session()

    def agrs_get_inplace_tensor(
        self, shapes: Any, dtype: torch.dtype
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """(Experimental) This rank's part of the next all-gather(s), as tensor(s) of ``shapes`` inside the session
        region: write the data there and pass them to :meth:`all_gather` to skip the local copy."""
        st = self._elastic()
        lst, batched = agrs.normalize_shapes(shapes)
        if not isinstance(dtype, torch.dtype):
            raise EPTypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        sizes = [math.prod(s) * dtype.itemsize for s in lst]
        offsets = st.session.inplace_offsets(sizes)
        region = st.backend.region()
        out = tuple(
            region[o : o + b].view(dtype).view(s) for o, b, s in zip(offsets, sizes, lst, strict=True)
        )
        return out if batched else out[0]

    @_guarded("all_gather")
    def all_gather(self, t: torch.Tensor | Sequence[torch.Tensor]) -> Any:
        """(Experimental) All-gather inside the current session: every rank's tensor(s), stacked on a new leading
        dimension of ``num_ranks``. Returns ``(gathered, handle)`` for one tensor, ``(*gathered, handle)`` for a
        sequence; ``handle()`` makes the current stream wait for the data. Results are views of the session
        region, valid until the session ends."""
        st = self._elastic()
        single = isinstance(t, torch.Tensor)
        tensors = [t] if single else list(t)
        tensors = [self._check_tensor(f"t[{i}]" if not single else "t", x) for i, x in enumerate(tensors)]
        if st.session.config is None or not st.session.in_session:
            st.session.plan_all_gather([], [])  # raises the state error
        base, cap = st.backend.region().data_ptr(), st.session.config.num_max_session_bytes
        inplace = [x.data_ptr() - base if 0 <= x.data_ptr() - base < cap else None for x in tensors]
        offsets, slot = st.session.plan_all_gather([x.nbytes for x in tensors], inplace)
        session_idx = st.session.session_idx
        outs = st.backend.all_gather(tensors, offsets, inplace, slot, session_idx)
        session = st.session

        def handle() -> None:
            if not session.in_session or session.session_idx != session_idx:
                raise EPValueError(
                    f"all_gather handle: its session ({session_idx}) already ended on rank {self.rank_idx}; wait "
                    "on the handle before destroy_agrs_session()"
                )
            st.backend.agrs_wait(slot, session_idx)

        return (outs[0], handle) if single else (*outs, handle)

    @_guarded("reduce_scatter")
    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """(Experimental, ours: DeepEP V2's ElasticBuffer has no reduce-scatter) Inside the current session: ``t``
        ``[N * m, ...]`` (float32, bfloat16 or float16) is cut into N chunks along dim 0; returns ``[m, ...]``, the sum
        over ranks of every rank's chunk ``rank``, accumulated in float32 in rank order (deterministic) and cast back
        (as ``torch.distributed.reduce_scatter_tensor``). The chunks travel like an all-gather's parts (copy engine,
        one session slot and ``align(N * chunk_bytes, 32)`` session bytes); the sum is one reduction on the current
        stream, queued after the arrivals (the host does not wait)."""
        st = self._elastic()
        if st.session.config is None or not st.session.in_session:
            st.session.plan_all_gather([], [])  # raises the state error
        t = self._check_tensor("t", t)
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise EPTypeError(
                f"t: expected float32, bfloat16 or float16, got {t.dtype} (rank {self.rank_idx})"
            )
        n = self.num_ranks
        if t.dim() < 1 or t.shape[0] % n:
            raise EPValueError(
                f"t: expected a first dimension divisible by the {n} ranks, got shape {tuple(t.shape)} (rank "
                f"{self.rank_idx})"
            )
        chunk = (t.shape[0] // n, *t.shape[1:])
        cb = t.nbytes // n
        offsets, slot = st.session.plan_all_gather([cb], [None])
        session_idx = st.session.session_idx
        parts = st.backend.reduce_scatter(t, offsets[0], cb, slot, session_idx)
        st.backend.agrs_wait(slot, session_idx)
        acc = parts[0].to(torch.float32, copy=True)  # float32 parts: .float() would alias the session region
        for r in range(1, n):
            acc += parts[r].float()
        return acc.to(t.dtype).view(chunk)
