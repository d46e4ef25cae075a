"""Direct mode's rank: one `DirectRank` per rank drives the three kernels of ep_core (`GpuExecutor`,
`ep_core.kernels.gpu_executor`, is the executor `EPBuffer` calls; it drives a `DirectRank`).

A dispatch is two phases so that several ranks of one process (the loopback domain) can be driven together:
`launch_dispatch` validates, allocates the handle arrays and launches the dispatch kernel (it returns at once);
`finish_dispatch` waits for the received counts when a CPU sync is asked for (stream poll with the CPU timeout),
sizes and allocates the outputs and launches the copy epilogue. A combine is one launch. A process that holds one
rank (multi-process, or a real multi-GPU job) simply calls both phases in turn.

Arrays are `DeviceArray`s allocated stream-ordered on the rank's stream, or caller arrays taken by pointer
(`as_view`). bf16 is uint16 storage; FP8 data is uint8.

Failures (the host half of the rule in include/ep_core/timeout.cuh). A wait that times out records the error in the
workspace and raises the abort flag of every rank; the flag stays raised until the domain is reset, and every kernel
that finds it raised at entry, or leaves early, does nothing more than copy the abort kind into a page-locked host
word mapped into the device (`OpArgs::host_error`). The host therefore never needs a stream sync to know:

- before every launch (`guard`, at the top of `launch_dispatch` and `combine`) the rank reads its host words; once
  an abort was published it synchronizes, reads the error record and raises it (`EPTimeoutError`, or
  `EPDeviceError`), and it keeps raising it at every later call, launching nothing, until `reset_state` (every rank
  of the domain, collectively: `LoopbackDomain.reset`, `ProcessRank.reset`, `GpuExecutor.reset`);
- a call with a CPU sync checks the record right after its sync, so that call itself raises.

So the outputs of an operation are valid once a later host call (or `check_errors`) has returned without raising
after that operation ran; a failed operation leaves its outputs undefined and is always followed by an exception
at the next host call. Replays of a captured CUDA graph run no host code: synchronize the replaying stream, then
call `check_errors()` (or `status()`, which needs no sync). Invalid expert ids (not an abort) set the second host
word and are raised once, by the next call whose `guard` sees the word, after that call's kernels were launched on
every rank (`_report_input_error`: no rank skips a collective launch), or right after a CPU sync.

Handles of no-sync dispatches are "unconfirmed" until a stream sync finds no error; when an abort is found they are
marked failed, and a cached dispatch or a combine with such a handle raises `EPStateError` (before and after the
reset: its prefix sums and slots may be garbage, and kernels would write through them into peers' buffers).

SM counts and launches. `RankResources.num_ranks_on_device` says how many ranks of the domain drive this rank's
GPU (all N in the loopback domain, processes sharing a GPU, 1 with a GPU per rank). Ranks that share a GPU wait on
each other inside their kernels, so the default SM count splits the device between them and every grid must fit
next to the others; a rank alone on its GPU takes the planner's count and launches its grid-synchronizing kernels
(dispatch, combine) cooperatively, so that all their blocks are resident even while compute kernels of other
streams occupy SMs.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ep_layout
import numpy as np

from ep_core.device_array import DeviceArray as CoreArray
from ep_core.errors import (
    EPConfigError,
    EPDeviceError,
    EPStateError,
    EPTimeoutError,
    EPTypeError,
    EPValueError,
)
from ep_core.handle import EPHandle
from ep_core.kernels import _cuda
from ep_core.kernels._args import FLAGS, OP_ARGS_FIELDS, pack_op_args
from ep_core.kernels._cuda import DeviceArray, DeviceView, PinnedBuffer, Stream, as_view, view_ptr
from ep_core.kernels._envelope import OP_COMBINE, OP_DISPATCH, describe_envelope, pack_envelope
from ep_core.kernels._source import load_kernels
from ep_core.kernels.plan import (
    SCRATCH_BARRIER_EPOCH_OFFSET,
    SCRATCH_INPUT_ERROR_OFFSET,
    KernelConfig,
    LaunchGeometry,
    RegionPlan,
    check_coresident,
    check_epilogue_sms,
    check_occupancy,
    default_num_sms,
    launch_geometry,
    plan_regions,
)
from ep_core.kernels.prepared_launch import PreparedLaunch, PreparedLaunches, PreparedOp
from ep_core.kernels.repeat import RepeatCombine, RepeatDispatch, epilogue_outputs
from ep_core.kernels.zero_copy_rows import ZeroCopyRows
from ep_core.requests import CombineResult, DispatchResult
from ep_core.validation import check_zero_copy_args, check_zero_copy_dispatch_args

# the page-locked words of a CPU-sync dispatch's counts: room for one copy that spans a handle block's prefix sums
# and per-expert counts (`DirectRank._copy_counts`; 256 local experts take 2.3 KiB)
_ONE_COPY_BYTES = 16384

__all__ = [
    "TAG_NAMES",
    "CombineResult",
    "DirectRank",
    "DispatchResult",
    "RankResources",
    "count_ranks_on_device",
]

TAG_NAMES = {
    1: "grid_barrier",
    2: "dispatch.entry_barrier",
    3: "dispatch.counts",
    4: "combine.entry_barrier",
    5: "combine.exit_barrier",
    6: "dispatch.scaleout_signal",
    7: "combine.forward_barrier",
    8: "combine.read_barrier",
}
_EK = ep_layout.ErrorKind
_ERR_OFF = ep_layout.WorkspaceLayout.ERROR_RECORD_OFFSET
_FIELD = {f.name: f for f in ep_layout.ERROR_RECORD_FIELDS}

Allocator = Callable[[tuple, Any, "tuple | None"], Any]

# The copy epilogue as a programmatic dependent launch of the dispatch (its blocks wait in griddepcontrol.wait, the
# dispatch's blocks release them once done sending): on by default where it is safe (`_epilogue_pdl`);
# EPKIT_EPILOGUE_PDL=0 launches it after the dispatch as before.
EPILOGUE_PDL = os.environ.get("EPKIT_EPILOGUE_PDL", "1").strip().lower() not in ("0", "false", "no", "off")

_RESET_HINT = (
    "every later call on this rank raises this until the domain is reset (reset() on every rank, together)"
)


def count_ranks_on_device(identities: list[str], rank: int) -> int:
    """How many ranks drive the same GPU as `rank`, from every rank's `_cuda.device_identity()` (host and UUID),
    as gathered through the bootstrap."""
    return sum(1 for ident in identities if ident == identities[rank])


@dataclass
class RankResources:
    """What a rank's kernels address: its symmetric base, the device table of every rank's base, its stream."""

    rank: int
    num_ranks: int
    base: int
    data_bytes: int
    peer_table: int
    stream: Stream
    nccl_window: int = 0
    nccl_devcomm: int = 0
    """nccl, several nodes: device address of the GIN `ncclDevComm` (`OpArgs::nccl_devcomm`, the gin scale-out)."""
    scratch_buffers: dict = field(default_factory=dict)
    num_ranks_on_device: int = 0
    """Ranks of the domain that drive this rank's GPU (itself included); 0 = unknown: every rank is assumed to
    share it (the conservative choice: small, non-cooperative grids)."""


# the per-call fields of each prepared launch (ep_core.kernels.prepared_launch), in the order DirectRank passes them
_DISPATCH_DYNAMIC = (
    "x",
    "sf",
    "topk_idx",
    "topk_weights",
    "dst_slot",
    "fwd_meta",
    "psum_rank",
    "psum_expert",
    "unaligned_expert",
    "cum_stats",
    "topk_idx_copy",
    "envelope",
)
# a zero-copy dispatch's kernel also writes the handle's metadata (the envelope stays last)
_DISPATCH_ZERO_COPY_DYNAMIC = (*_DISPATCH_DYNAMIC[:-1], "src_metadata", "envelope")
_EPILOGUE_DYNAMIC = (
    "envelope",
    "src_metadata",
    "recv_x",
    "recv_sf",
    "sf_out_stride0",
    "sf_out_stride1",
    "recv_topk_idx",
    "recv_topk_weights",
    "num_out_rows",
)
# the epilogue's launch starts from the dispatch launch's words: the dispatch's per-call fields, then its own
_EPILOGUE_DYNAMIC_ALL = _DISPATCH_DYNAMIC + _EPILOGUE_DYNAMIC
_COMBINE_DYNAMIC = (
    "topk_idx",
    "psum_rank",
    "src_metadata",
    "fwd_meta",
    "comb_x",
    "comb_weights",
    "bias0",
    "bias1",
    "combined_x",
    "combined_weights",
    "envelope",
)
# a zero-copy combine also reads the dispatch's slots (the envelope stays last: it says whether a launch is collective)
_COMBINE_ZERO_COPY_DYNAMIC = (*_COMBINE_DYNAMIC[:-1], "dst_slot", "envelope")


@dataclass
class _PendingDispatch:
    config: KernelConfig
    args: dict | None  # the full argument dict when this call prepared its launch shape (a miss), else None
    geometry: Any
    cached: bool
    do_cpu_sync: bool
    expand: bool
    num_tokens: int
    num_experts: int
    alignment: int
    num_sms: int
    x: DeviceView
    sf: DeviceView | None
    col_major_sf: bool
    has_weights: bool
    zero_padding: bool
    handle: EPHandle | None
    topk_idx: Any
    arrays: dict
    keep: list
    host: PinnedBuffer | None = None
    # this rank's collective launch count after the dispatch kernel: the identity of its handle in envelopes
    launch_number: int = 0
    prepared: PreparedOp | None = None
    dynamic: tuple = ()  # the dispatch launch's per-call words (the epilogue's start with them, then its outputs)
    repeat: dict | None = None  # what a `RepeatDispatch` needs beyond these fields (`record=True`)
    # a lone rank's cached dispatch: no dispatch kernel, the copy epilogue does it all (`DirectRank.epilogue_only`)
    epilogue_only: bool = False
    # the outputs are views of the receive region, written by the dispatch kernel (`zero_copy=True`): no epilogue
    zero_copy: bool = False


def _combine_smem(cfg: KernelConfig) -> int:
    """The combine launch's dynamic shared memory: the direct combine stages rows through it with bulk copies
    (`KernelConfig.combine_dynamic_smem_bytes`, 0 when it does not fit: the register path); hybrid and cross-node
    combines do not use it (helper-latency's request 3, issue 17)."""
    if cfg.is_hybrid or cfg.is_direct_xnode:
        return 0
    return cfg.combine_dynamic_smem_bytes


_INT64, _INT32, _FLOAT32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)
_DTYPE_NAMES: dict[np.dtype, str] = {}  # numpy's `dtype.name` is slow to compute: once per dtype


class RegionView(CoreArray):
    """A zero-copy dispatch's output: a view of its rank's receive region (no allocation of its own) that copies
    itself to the host like the rank's allocations do (`numpy()`, on the rank's stream, synchronizing)."""

    __slots__ = ("stream",)

    def __init__(
        self, ptr: int, shape: tuple, dtype: Any, stream: Stream, owner: Any, device_id: int
    ) -> None:
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        super().__init__(ptr, shape, name, device_id=device_id, owner=owner)
        self.stream = stream

    def numpy(self) -> np.ndarray:
        host = np.empty(self.shape, np.dtype(self.dtype))
        if host.nbytes:
            _cuda.copy_to_host(host, self.ptr, self.stream)
            self.stream.synchronize()
        return host


def _check_2d(view: DeviceView, what: str) -> None:
    if len(view.shape) != 2:
        raise EPValueError(f"{what}: expected a 2-D array, got shape {view.shape}")


class DirectRank:
    """One rank of a direct-mode domain (ipc or nccl transport): validates, launches, reads back counts."""

    def __init__(
        self,
        resources: RankResources,
        *,
        num_max_tokens_per_rank: int,
        gpu_timeout_secs: float = 100.0,
        cpu_timeout_secs: float = 300.0,
        allocator: Allocator | None = None,
        num_warps: int | None = None,
        cooperative: bool | None = None,
        num_scaleup_ranks: int | None = None,
        num_nvlink_ranks: int | None = None,
        epilogue_sms: int = 0,
    ) -> None:
        from ep_core.topology import resolve_scaleup_ranks

        self.res = resources
        self.num_ranks = resources.num_ranks
        # ranks per node (S_u < N: the hybrid kernels, ep_core/hybrid.cuh, emulated scale-out over ipc)
        self.num_scaleup_ranks = resolve_scaleup_ranks(self.num_ranks, num_scaleup_ranks)
        # ranks per node in direct mode (S_u = N): fewer than N is direct mode across nodes (ep_core/direct_xnode.cuh)
        self.num_nvlink_ranks = resolve_scaleup_ranks(
            self.num_ranks, num_nvlink_ranks or self.num_scaleup_ranks
        )
        if resources.nccl_window and self.num_nvlink_ranks < self.num_ranks and not resources.nccl_devcomm:
            # over nccl the kernels of several nodes take the gin scale-out put (KernelConfig), which reads the
            # device communicator: without one it would dereference null
            mode = "hybrid mode" if self.num_scaleup_ranks < self.num_ranks else "direct mode across nodes"
            raise EPConfigError(
                f"nccl_devcomm: {mode} over transport 'nccl' ({self.num_ranks // self.num_nvlink_ranks} nodes "
                f"x {self.num_nvlink_ranks} ranks, rank {resources.rank}) needs the GIN device communicator, got none; "
                "create the buffer through NcclTransport (EPBuffer(transport='nccl')), which sets it up"
            )
        self.debug_skip_scaleout_signal = False  # tests: this rank's node "never sends" (hybrid dispatch)
        self.rank = resources.rank
        self.num_max_tokens = int(num_max_tokens_per_rank)
        self.gpu_timeout_secs = float(gpu_timeout_secs)
        self.cpu_timeout_secs = float(cpu_timeout_secs)
        self.device_sms = _cuda.num_device_sms()
        clock_khz = _cuda.device_attribute("CU_DEVICE_ATTRIBUTE_CLOCK_RATE")
        self.timeout_cycles = max(int(self.gpu_timeout_secs * clock_khz * 1000.0), 1)
        self._allocator = allocator
        self._num_warps = num_warps
        # a CPU-sync dispatch's counts: the prefix sums at 0, the per-expert counts at `_counts_at` (`_copy_counts`)
        self._host_bytes = max(4 * (2 * self.num_ranks + 2 * 256) + 64 + 32, _ONE_COPY_BYTES)
        self._host = PinnedBuffer(self._host_bytes)
        self._counts_at = 4 * self.num_ranks
        # the error record and the input-error words, read through page-locked memory (`read_error`)
        self._error_host = PinnedBuffer(ep_layout.NUM_ERROR_RECORD_BYTES + 32)
        self.num_ranks_on_device = int(resources.num_ranks_on_device or resources.num_ranks)
        if not 1 <= self.num_ranks_on_device <= self.num_ranks:
            raise EPConfigError(
                f"num_ranks_on_device: expected 1..{self.num_ranks} (ranks of the domain), got "
                f"{self.num_ranks_on_device}"
            )
        self.epilogue_sms = check_epilogue_sms(epilogue_sms, self.device_sms, self.num_ranks_on_device)
        # Cooperative launches guarantee that all blocks of one grid are resident together, which a grid that waits
        # in grid barriers needs when compute kernels of other streams share the SMs. Ranks sharing a GPU are
        # different: their grids wait for each other across launches, which no launch mode guarantees; today's
        # plain launches there are what runs verified (all grids fit the device together: `check_coresident`).
        if cooperative is None:
            cooperative = self.num_ranks_on_device == 1
        if cooperative and self.num_ranks_on_device > 1:
            raise EPConfigError(
                f"cooperative: {self.num_ranks_on_device} ranks share this GPU; their grids wait for each other, "
                "which a cooperative launch does not cover: use cooperative=None or False"
            )
        self.cooperative = bool(cooperative)
        self._status = _cuda.MappedWords(2)
        self._unconfirmed: weakref.WeakSet = weakref.WeakSet()
        self._failed_handles: weakref.WeakSet = weakref.WeakSet()
        self._scratches: set[int] = set()  # every scratch an op used (input-error records live there)
        self._input_pending = False  # an invalid-input report seen by the current call's guard
        self._blocks_per_sm: dict = {}
        self._planned_sms: dict = {}
        self._configs: dict = {}
        self._launches = (
            PreparedLaunches()
        )  # per launch shape: kernel, geometry, occupancy verdict, packed args
        # collective launches so far (every rank counts the same launches; zeroed by reset_state), and the launch
        # number of the dispatch behind each handle (a combine's envelope names its handle)
        self._num_collective_launches = 0
        self._handle_launch: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # repeated calls (ep_core.kernels.repeat): the last full call's plan when it was asked to record one, and
        # the verdict on each handle's topk_idx
        self.last_repeat: RepeatDispatch | RepeatCombine | None = None
        self._handle_idx: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_scratch: int | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def stream(self) -> Stream:
        return self.res.stream

    def _alloc(self, shape: tuple, dtype: Any, strides: tuple | None = None) -> Any:
        if self._allocator is not None:
            return self._allocator(tuple(shape), np.dtype(dtype), strides)
        return DeviceArray(shape, dtype, self.stream, strides)

    def _alloc_int32(self, shapes: dict) -> dict:
        """A new handle's int32 arrays: one block when the allocator can carve one (`int32_block`), else one
        allocation each."""
        block = getattr(self._allocator, "int32_block", None)
        views = block(list(shapes.values())) if block is not None else None
        if views is None:
            return {name: self._alloc(shape, np.int32) for name, shape in shapes.items()}
        return dict(zip(shapes, views))

    def _config(self, hidden: int, elem: int, packs: int, topk: int) -> KernelConfig:
        transport = "nccl" if self.res.nccl_window else "ipc"
        key = (
            hidden,
            elem,
            packs,
            topk,
            self._num_warps,
            transport,
            self.num_ranks,
            self.num_scaleup_ranks,
            self.num_nvlink_ranks,
        )
        cfg = self._configs.get(key)
        if cfg is None:  # KernelConfig is frozen: one per key (its checks raise before anything is stored)
            kw = {} if self._num_warps is None else {"num_warps": self._num_warps}
            cfg = KernelConfig(
                self.num_ranks,
                topk,
                hidden,
                elem,
                packs,
                transport=transport,
                num_scaleup_ranks=self.num_scaleup_ranks,
                num_nvlink_ranks=self.num_nvlink_ranks,
                **kw,
            )
            self._configs[key] = cfg
        return cfg

    def _regions(
        self, config: KernelConfig, num_experts: int, op: str, amr: bool | None = None
    ) -> tuple[RegionPlan, int]:
        plan = plan_regions(
            config, num_experts, self.num_max_tokens, self.res.data_bytes, op=op, allow_multiple_reduction=amr
        )
        if plan.scratch_offset >= 0:
            scratch = self.res.base + plan.scratch_offset
        else:
            buf = self.res.scratch_buffers.get(plan.scratch_bytes)
            if buf is None:
                buf = _cuda.DeviceBuffer(plan.scratch_bytes)
                self.res.scratch_buffers[plan.scratch_bytes] = buf
            scratch = buf.ptr
        previous = getattr(self, "_last_scratch", None)  # (tests drive _regions on stand-ins)
        if previous is not None and previous != scratch:
            # The barrier epoch lives in the scratch but counts arrivals in the workspace, which every op shares:
            # carry it to the new scratch, or the barrier's `arrivals >= epoch * N` test would pass at once.
            off = SCRATCH_BARRIER_EPOCH_OFFSET
            _cuda.copy_device(scratch + off, previous + off, 8, self.stream)
        self._last_scratch = scratch
        self._scratches.add(scratch)
        return plan, scratch

    def _common(self, plan: RegionPlan, scratch: int, num_experts: int) -> dict:
        return {
            "workspace": self.res.base + plan.workspace_offset,
            "recv_region": self.res.base + plan.recv_offset,
            "scratch": scratch,
            "peer_bases": self.res.peer_table,
            "own_base": self.res.base,
            "nccl_window": self.res.nccl_window,
            "nccl_devcomm": self.res.nccl_devcomm,
            "rank": self.rank,
            "num_max_tokens": self.num_max_tokens,
            "num_experts": num_experts,
            "timeout_cycles": self.timeout_cycles,
            "host_error": self._status.device_ptr,
        }

    def _planner_sms(self, num_experts: int, num_topk: int) -> int:
        """The planner's SM count for a rank alone on its GPU (0 when it cannot run, e.g. no NVLink bandwidth)."""
        key = (num_experts, num_topk)
        if key not in self._planned_sms:
            from ep_core import planner
            from ep_core.topology import Topology

            try:
                sms = planner.get_theoretical_num_sms(
                    Topology(self.num_ranks), num_experts, num_topk, num_device_sms=self.device_sms
                )
            except EPConfigError:
                sms = 0
            self._planned_sms[key] = int(sms)
        return self._planned_sms[key]

    def _num_sms(self, num_sms: int, handle: EPHandle | None, num_experts: int = 0, num_topk: int = 0) -> int:
        if num_sms == 0 and handle is not None and handle.num_sms:
            num_sms = handle.num_sms
        if num_sms == 0:
            planned = 0
            if self.num_ranks_on_device == 1 and num_experts > 0 and num_topk > 0:
                planned = self._planner_sms(num_experts, num_topk)
            num_sms = default_num_sms(self.device_sms, self.num_ranks_on_device, planned)
        num_sms = int(num_sms)
        if self.num_ranks_on_device > 1:
            check_coresident(self.num_ranks_on_device, num_sms, self.device_sms)
        return num_sms

    def _occupancy(self, kernel: Any, block: int, shared_mem: int) -> int:
        """Resident blocks per SM of `kernel` (the driver's occupancy; cached per kernel, block and shared memory)."""
        key = (id(kernel), block, shared_mem)
        per_sm = self._blocks_per_sm.get(key)
        if per_sm is None:
            per_sm = int(kernel.max_active_blocks_per_sm(block, shared_mem))
            self._blocks_per_sm[key] = per_sm
        return per_sm

    def _launch(
        self, kernel: Any, name: str, geo: LaunchGeometry, args: dict, shared_mem: int, cooperative: bool
    ) -> None:
        """Check that the grid fits the device (occupancy), then launch it on the rank's stream."""
        import ep_jit

        self._check_fits(kernel, name, geo.grid, geo.block, shared_mem)
        kernel.launch(
            geo.grid,
            geo.block,
            [ep_jit.struct(pack_op_args(**args))],
            shared_mem=shared_mem,
            stream=self.stream.handle,
            cooperative=cooperative,
        )
        if args.get("envelope"):
            self._num_collective_launches += 1

    def _check_fits(self, kernel: Any, name: str, grid: int, block: int, shared_mem: int) -> None:
        """The occupancy verdict of one launch (`check_occupancy`)."""
        per_sm = self._occupancy(kernel, block, shared_mem)
        check_occupancy(
            name,
            per_sm,
            grid,
            self.device_sms,
            self.num_ranks_on_device,
            threads=block,
            shared_mem=shared_mem,
        )

    def _prepare(
        self,
        kernel: Any,
        name: str,
        geo: LaunchGeometry,
        shared_mem: int,
        cooperative: bool,
        args: dict,
        dynamic,
        pdl: bool = False,
    ) -> PreparedLaunch:
        """A launch shape's first call: the occupancy verdict (raises: nothing is stored), then the full pack."""
        self._check_fits(kernel, name, geo.grid, geo.block, shared_mem)
        return PreparedLaunch.pack(
            kernel, name, geo.grid, geo.block, shared_mem, cooperative, args, dynamic, pdl
        )

    def epilogue_only(self, cached: bool, rows: int, zero_padding: bool) -> bool:
        """Whether a dispatch is its copy epilogue alone: a cached dispatch of a rank with no peer, whose rows the
        handle fixes. The dispatch kernel would only store each row's tail (its routing, weights and scales) into
        the rank's own region for the epilogue to read back (dispatch.cuh, kDirectOwnRowsTailOnly); the epilogue
        builds the tail from the same inputs instead (dispatch_epilogue.cuh), one kernel instead of two. A call
        with nothing to copy keeps the dispatch launch (the epilogue is not launched then)."""
        return cached and self.num_ranks == 1 and (rows > 0 or zero_padding)

    def _epilogue_pdl(self, p: _PendingDispatch) -> bool:
        """Whether this dispatch's copy epilogue is launched as a programmatic dependent of its dispatch kernel: not
        after a CPU sync (the count copy sits between them), and only when its early blocks cannot keep a dispatch
        grid of a rank sharing this GPU from becoming resident: every rank's dispatch and epilogue blocks together
        (the epilogue's grid as `epilogue_geometry` widens it) fit the device at one block per SM, so that any
        placement leaves every pending block an SM. (Per-kernel occupancy is no such guarantee: a dispatch block and
        an epilogue block may not share an SM even where two of either would.) A rank alone on its GPU always: its
        dispatch blocks are all resident before any of them releases the epilogue."""
        if not EPILOGUE_PDL or p.do_cpu_sync or p.epilogue_only:
            return False
        n = self.num_ranks_on_device
        epilogue_grid = max(p.geometry.grid, self.epilogue_sms)  # `epilogue_geometry`
        return n == 1 or n * (p.geometry.grid + epilogue_grid) <= self.device_sms

    def combine_split(self, cfg: KernelConfig, geo: LaunchGeometry, num_tokens: int) -> bool:
        """Whether a direct combine runs as two launches: entry, send and exit on the op's grid, then the reduce on
        `epilogue_geometry`'s wider one (combine.cuh `kFlagCombineSendOnly` / `kFlagCombineReduceOnly`), as DeepEP
        V2 runs its combine's reduce epilogue on every SM. Only where that grid is wider, and not for a lone rank
        whose tokens the op's warps reduce in one round (its operands are its own rows, read in place: the second
        launch would only add its latency, EP1 decode 9.6 -> 11.0 us); hybrid and cross-node combines keep one
        launch."""
        if self.epilogue_sms <= geo.grid or cfg.is_hybrid or cfg.is_direct_xnode:
            return False
        return self.num_ranks > 1 or num_tokens > geo.grid * cfg.num_warps

    def epilogue_geometry(self, geo: LaunchGeometry) -> LaunchGeometry:
        """The copy epilogue's grid: the op's, or `epilogue_sms` blocks where that is more. The epilogue has no
        grid barrier and reads only this rank's memory (its rows are handed out by grid stride), so any grid is
        correct; a wider one copies out of the receive region on more SMs (DeepEP V2 runs it on every SM)."""
        if self.epilogue_sms <= geo.grid:
            return geo
        return LaunchGeometry(self.epilogue_sms, geo.block, geo.shared_mem)

    def _launch_prepared(
        self,
        launch: PreparedLaunch,
        values: tuple,
        fresh: bool,
        collective: bool,
        wait: Any = None,
        signal: Any = None,
    ) -> None:
        """Launch a prepared launch: its kept words as they are (`fresh`: this call packed them), else with the
        per-call `values` patched in (natively when ep_launch is usable). `collective`: it carries an envelope.
        `wait` / `signal`: the stream-order pairs before and after it (`PreparedLaunch.run`; repeats only)."""
        if fresh:
            launch.launch(launch.words, self.stream.handle)
        elif wait is None and signal is None:
            launch.run(values, self.stream.handle)
        else:
            launch.run(values, self.stream.handle, wait, signal)
        if collective:
            self._num_collective_launches += 1

    def _shape_key(self, plan: RegionPlan, scratch: int, num_sms: int) -> tuple:
        """The rank's words of a launch shape (every field of `_common` but the op's num_experts) and its grid."""
        res = self.res
        return (
            res.base + plan.workspace_offset,
            res.base + plan.recv_offset,
            scratch,
            res.peer_table,
            res.base,
            res.nccl_window,
            res.nccl_devcomm,
            self.rank,
            self.num_max_tokens,
            self.timeout_cycles,
            self._status.device_ptr,
            num_sms,
            self.device_sms,
            self.num_ranks_on_device,
            self.cooperative,
        )

    @property
    def launch_step(self) -> int:
        """Collective launches (or abandoned steps) of this rank so far: the sequence number of the last envelope."""
        return self._num_collective_launches

    def abandon_step(self) -> None:
        """A dispatch or combine this rank rejected before launching (a bad argument, the capture check, a call after
        destroy): consume its sequence number. The peers that did launch that call wait in its entry barrier; this
        rank's next launch then arrives with the next sequence number, so the envelopes differ and every rank raises,
        instead of this rank's next call being paired with the peers' earlier one."""
        self._num_collective_launches += 1

    def _envelope(self, kind: int, fields: tuple[int, ...]) -> int:
        """The envelope of the next collective launch (`ep_core.kernels._envelope`)."""
        return pack_envelope(kind, self._num_collective_launches + 1, fields)

    # ------------------------------------------------------------------ failure state
    def status(self) -> tuple[int, int]:
        """`(abort kind, invalid-input kind)` that this rank's kernels published so far (0 = none); no sync."""
        abort, bad_input = self._status.read()
        return abort, bad_input

    def fail_unconfirmed_handles(self) -> None:
        """Refuse, from now on, every handle of a no-sync dispatch not yet confirmed by a clean sync (a reset
        follows a failure: such handles may hold garbage counts and slots)."""
        self._failed_handles.update(self._unconfirmed)
        self._unconfirmed.clear()

    def _check_handle(self, handle: EPHandle | None) -> None:
        if handle is not None and handle in self._failed_handles:
            raise EPStateError(
                f"handle: rank {self.rank}: it comes from a no-sync dispatch that was running when a kernel of this "
                "rank failed, so its counts and slots are not valid; dispatch again (without the handle)"
            )

    def guard(self) -> None:
        """Raise, launching nothing, if a kernel of this rank published a failure (module doc, "Failures"): the
        recorded error, sticky until `reset_state`. An invalid-input report is not raised here (that would make this
        rank skip a collective launch its peers make): `_report_input_error` raises it once the call's collective
        kernels are launched."""
        abort, bad_input = self._status.read()
        # reports visible now are raised by this call, after its launch (a report that this call's own kernel
        # publishes meanwhile waits for the next call: which call raises must not depend on timing)
        self._input_pending = bad_input != 0
        if abort == 0:
            return
        self.check_errors(synchronize=True)
        # the record was cleared behind our back: still refuse
        raise EPStateError(
            f"rank {self.rank}: a kernel of this rank failed earlier (error kind {abort}); {_RESET_HINT}"
        )

    def _report_input_error(self) -> None:
        """Raise an invalid-input report that an earlier no-sync dispatch published (once). Called after the
        current call's collective kernels were launched, so every rank stays in step: the call that raises has run
        on every rank; its outputs are not returned, and it must not be repeated."""
        if self._input_pending:
            self._input_pending = False
            self.check_errors(synchronize=True)

    # ------------------------------------------------------------------ dispatch
    def launch_dispatch(
        self,
        x: Any,
        topk_idx: Any = None,
        topk_weights: Any = None,
        *,
        sf: Any = None,
        num_experts: int | None = None,
        expert_alignment: int | None = None,
        do_expand: bool | None = None,
        do_cpu_sync: bool | None = None,
        deterministic: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        handle: EPHandle | None = None,
        num_sms: int = 0,
        cumulative_local_expert_recv_stats: Any = None,
        record: bool = False,
        topk_idx_copy: Any = None,
        zero_copy: bool = False,
    ) -> _PendingDispatch:
        """Validate and launch the dispatch kernel; `finish_dispatch` completes the call. `record`: leave the
        call's `RepeatDispatch` in `last_repeat` (a dispatch without CPU sync; ep_core.kernels.repeat).
        `topk_idx_copy`: a contiguous array of topk_idx's shape and dtype that the kernel fills with the routing
        as it reads it (the new handle's copy, `do_handle_copy`; not with a handle). `zero_copy`: the kernel
        stores the outputs in their final form in this rank's receive region and `recv_x`, its scales, ids and
        weights are views of it (no copy epilogue; rows in deterministic order; `zero_copy_rows`); every rank of
        the call passes it alike (the envelope checks)."""
        self.last_repeat = None
        self.guard()
        self._check_handle(handle)
        keep: list = []
        if isinstance(x, tuple):
            if len(x) != 2:
                raise EPTypeError(f"x: expected an array or an FP8 tuple (data, sf), got a tuple of {len(x)}")
            x, sf = x
        xv = as_view(x, "x")
        _check_2d(xv, "x")
        num_tokens, hidden = xv.shape
        elem = xv.dtype.itemsize
        if elem not in (1, 2):
            raise EPTypeError(f"x: expected bf16 (2-byte) or FP8 (1-byte) elements, got dtype {xv.dtype}")
        if num_tokens > 0 and xv.element_strides[1] != 1:  # an empty x may carry any strides (torch: (0, 0))
            raise EPValueError(f"x: expected rows with unit element stride, got strides {xv.element_strides}")
        if num_tokens > self.num_max_tokens:
            raise EPValueError(
                f"x: expected at most num_max_tokens_per_rank={self.num_max_tokens} rows, got {num_tokens}"
            )
        sfv = None
        packs = 0
        if elem == 1:
            if sf is None:
                raise EPValueError("x: FP8 data needs its scale packs: pass x=(data, sf)")
            sfv = as_view(sf, "sf")
            _check_2d(sfv, "sf")
            if sfv.dtype.itemsize != 4 or sfv.shape[0] != num_tokens:
                raise EPValueError(
                    f"sf: expected [{num_tokens}, P] 4-byte packs, got {sfv.shape} {sfv.dtype}"
                )
            packs = sfv.shape[1]
        elif sf is not None:
            raise EPValueError("sf: scale packs are only valid with FP8 data (1-byte elements)")

        cached = handle is not None
        if cached:
            if topk_idx is not None:
                raise EPValueError(
                    "topk_idx: must be None for a cached dispatch (the handle's routing is reused)"
                )
            if do_cpu_sync:
                raise EPValueError("do_cpu_sync: cannot do a CPU sync with a cached handle")
            if cumulative_local_expert_recv_stats is not None:
                raise EPValueError("cumulative_local_expert_recv_stats: not allowed in a cached dispatch")
            topk_idx = handle.topk_idx
            num_experts = handle.num_experts
            expert_alignment = handle.expert_alignment
            do_expand = handle.do_expand
            do_cpu_sync = False
            if handle.num_tokens != num_tokens:
                raise EPValueError(f"x: the handle was made for {handle.num_tokens} tokens, got {num_tokens}")
        else:
            if topk_idx is None:
                raise EPValueError("topk_idx: required without a handle")
            if num_experts is None:
                raise EPValueError("num_experts: required without a handle")
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        expert_alignment = 1 if expert_alignment is None else int(expert_alignment)
        do_expand = bool(do_expand)
        if expert_alignment < 1:
            raise EPValueError(f"expert_alignment: expected >= 1, got {expert_alignment}")
        if do_zero_padding and not do_expand:
            raise EPValueError("do_zero_padding: only valid together with do_expand=True")
        num_experts = int(num_experts)
        if num_experts % self.num_ranks:
            raise EPValueError(
                f"num_experts: expected a multiple of num_ranks={self.num_ranks}, got {num_experts}"
            )
        iv = as_view(topk_idx, "topk_idx")
        _check_2d(iv, "topk_idx")
        if iv.shape[0] != num_tokens or not iv.is_contiguous:
            raise EPValueError(f"topk_idx: expected a contiguous [{num_tokens}, K] array, got {iv.shape}")
        if iv.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
            raise EPTypeError(f"topk_idx: expected int64 (or int32), got {iv.dtype}")
        topk = iv.shape[1]
        copy_ptr = 0
        if topk_idx_copy is not None:
            if cached:
                raise EPValueError(
                    "topk_idx_copy: a cached dispatch makes no new handle to copy the routing into"
                )
            cv = as_view(topk_idx_copy, "topk_idx_copy")
            if cv.shape != iv.shape or cv.dtype != iv.dtype or not cv.is_contiguous:
                raise EPValueError(
                    f"topk_idx_copy: expected a contiguous {iv.dtype} {iv.shape} array, got {cv.shape} {cv.dtype}"
                )
            copy_ptr = cv.ptr
        wv = None
        if topk_weights is not None:
            wv = as_view(topk_weights, "topk_weights")
            if wv.shape != (num_tokens, topk) or wv.dtype != np.float32 or not wv.is_contiguous:
                raise EPValueError(
                    f"topk_weights: expected a contiguous float32 [{num_tokens}, {topk}], got {wv.shape} {wv.dtype}"
                )
        cfg = self._config(hidden, elem, packs, topk)
        zero_copy = bool(zero_copy)
        if zero_copy:
            self.check_zero_copy_dispatch(cfg, cached, do_expand, bool(use_tma_aligned_col_major_sf))
        plan, scratch = self._regions(cfg, num_experts, "dispatch")
        num_sms = self._num_sms(num_sms, handle, num_experts, topk)
        flags = 0
        if zero_copy:
            flags |= FLAGS["dispatch_zero_copy"] | FLAGS["deterministic"]
        if do_expand:
            flags |= FLAGS["expand"]
        if cached:
            flags |= FLAGS["cached"]
        if deterministic:
            flags |= FLAGS["deterministic"]
        if do_zero_padding:
            flags |= FLAGS["zero_padding"]
        if use_tma_aligned_col_major_sf:
            flags |= FLAGS["sf_col_major"]
        if iv.dtype == np.int32:
            flags |= FLAGS["topk_idx32"]
        if self.debug_skip_scaleout_signal:
            flags |= FLAGS["skip_scaleout_signal"]
        x_stride = xv.element_strides[0] * elem
        sf_strides = (sfv.element_strides[0], sfv.element_strides[1]) if sfv is not None else (0, 0)
        # everything that shapes the launch (ep_core.kernels.prepared_launch); the pointers are patched per call
        key = (
            "dispatch",
            cfg,
            num_experts,
            num_tokens,
            expert_alignment,
            flags,
            x_stride,
            sf_strides,
            self._shape_key(plan, scratch, num_sms),
        )
        prepared = self._launches.get(key)
        if prepared is None:
            geo = launch_geometry(cfg, num_sms, self.device_sms)
            kernels = load_kernels(cfg)
        else:
            geo, kernels = prepared.geometry, prepared.kernels
        epr = num_experts // self.num_ranks

        arrays: dict[str, Any] = {}
        if cached:
            arrays["dst_slot"] = handle.dst_buffer_slot_idx
            arrays["psum_rank"] = handle.psum_num_recv_tokens_per_scaleup_rank
            arrays["psum_expert"] = handle.psum_num_recv_tokens_per_expert
            arrays["unaligned"] = handle.num_unaligned_recv_tokens_per_expert
            arrays["src_metadata"] = handle.recv_src_metadata
            arrays["fwd"] = handle.token_metadata_at_forward
        else:
            shapes = {"dst_slot": (num_tokens, topk), "psum_rank": (self.num_scaleup_ranks,)}
            # hybrid: per source node [count, ...] then per forwarded message (source id, K expert ids)
            if cfg.is_hybrid:
                shapes["fwd"] = (cfg.num_nodes, self.num_max_tokens + 1, topk + 1)
            shapes["psum_expert"] = (epr,)
            shapes["unaligned"] = (epr,)
            # its rows are known now (one per slot): in the same block. A zero-copy dispatch's kernel writes it: at
            # its largest (a CPU sync's handle keeps the first rows)
            if not do_cpu_sync or zero_copy:
                shapes["src_metadata"] = (self.num_ranks * self.num_max_tokens, topk + 2)
            arrays.update(self._alloc_int32(shapes))
            arrays.setdefault("fwd", None)
        stats_ptr = 0
        if cumulative_local_expert_recv_stats is not None:
            sv = as_view(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
            if sv.shape != (epr,) or sv.dtype != np.int32:
                raise EPValueError(
                    f"cumulative_local_expert_recv_stats: expected int32 [{epr}], got {sv.shape} {sv.dtype}"
                )
            stats_ptr = sv.ptr
        if cfg.is_hybrid and arrays["fwd"] is None:
            raise EPValueError("handle: not made by a hybrid dispatch (no token_metadata_at_forward)")
        psum_rank_ptr = view_ptr(arrays["psum_rank"], "psum_rank")
        unaligned_ptr = view_ptr(arrays["unaligned"], "unaligned")
        env_fields = (
            hidden * elem,
            cfg.num_sf_packs,
            cfg.num_topk,
            num_experts,
            self.num_max_tokens,
            expert_alignment,
            flags
            & (FLAGS["expand"] | FLAGS["cached"] | FLAGS["deterministic"] | FLAGS["dispatch_zero_copy"]),
        )
        dynamic = (
            xv.ptr,
            sfv.ptr if sfv is not None else 0,
            iv.ptr,
            wv.ptr if wv is not None else 0,
            view_ptr(arrays["dst_slot"], "dst_slot"),
            view_ptr(arrays["fwd"], "token_metadata_at_forward") if cfg.is_hybrid else 0,
            psum_rank_ptr,
            view_ptr(arrays["psum_expert"], "psum_expert"),
            unaligned_ptr,
            stats_ptr,
            copy_ptr,
            self._envelope(OP_DISPATCH, (*env_fields, self._handle_launch.get(handle, -1) if cached else -1)),
        )
        fields = _DISPATCH_DYNAMIC
        if zero_copy:
            fields = _DISPATCH_ZERO_COPY_DYNAMIC
            dynamic = (*dynamic[:-1], view_ptr(arrays["src_metadata"], "src_metadata"), dynamic[-1])
        args = None
        if prepared is None:  # a new launch shape: every field packed afresh (pack_op_args), then kept
            args = self._common(plan, scratch, num_experts)
            args.update(
                num_tokens=num_tokens,
                expert_alignment=expert_alignment,
                flags=flags,
                x_stride=x_stride,
                sf_stride0=sf_strides[0],
                sf_stride1=sf_strides[1],
            )
            args.update(zip(fields, dynamic))
            main = self._prepare(
                kernels.dispatch_zero_copy if zero_copy else kernels.dispatch,
                "ep_dispatch_zero_copy_impl" if zero_copy else "ep_dispatch_impl",
                geo,
                geo.shared_mem,
                self.cooperative,
                args,
                fields,
            )
            # the combine of this configuration may come first inside a CUDA graph capture: query its occupancy now
            self._occupancy(kernels.combine, geo.block, _combine_smem(cfg))
            prepared = self._launches.put(key, PreparedOp(geo, kernels, main))
        rows = (handle.num_expanded_tokens if do_expand else handle.num_recv_tokens) if cached else 0
        epilogue_only = self.epilogue_only(cached, rows, bool(do_zero_padding))
        if epilogue_only:  # prepared (its words start the epilogue's) but not launched; counted as launched
            self._num_collective_launches += bool(dynamic[-1])
        else:
            self._launch_prepared(prepared.main, dynamic, args is not None, bool(dynamic[-1]))
        keep.extend([x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, topk_idx_copy])
        pending = _PendingDispatch(
            cfg,
            args,
            geo,
            cached,
            do_cpu_sync,
            do_expand,
            num_tokens,
            num_experts,
            expert_alignment,
            num_sms,
            xv,
            sfv,
            bool(use_tma_aligned_col_major_sf),
            wv is not None,
            bool(do_zero_padding),
            handle,
            topk_idx,
            arrays,
            keep,
            launch_number=self._num_collective_launches,
            prepared=prepared,
            dynamic=dynamic,
            epilogue_only=epilogue_only,
            zero_copy=zero_copy,
        )
        if record:
            pending.repeat = {
                "scratch": scratch,
                "skip_signal": self.debug_skip_scaleout_signal,
                "hybrid": cfg.is_hybrid,
                "idx32": bool(flags & FLAGS["topk_idx32"]),
                "topk": topk,
                "int32_shapes": None if cached else shapes,
                "env_fields": env_fields,
            }
        if do_cpu_sync:
            self._copy_counts(psum_rank_ptr, unaligned_ptr, epr)
            pending.host = self._host
        return pending

    def _copy_counts(self, psum_rank_ptr: int, unaligned_ptr: int, epr: int, one_block: bool = False) -> None:
        """Queue the copies of a CPU-sync dispatch's counts into the page-locked host words (`_sync_counts`).
        `one_block`: both arrays are parts of one allocation (`kernels.array_block`: the prefix sums first), so
        one copy spanning them (and what lies between, the same allocation's) replaces two driver calls."""
        n, su = self.num_ranks, self.num_scaleup_ranks
        gap = unaligned_ptr - psum_rank_ptr
        span = gap + 4 * epr
        one = one_block and gap >= 4 * su and span <= self._host_bytes
        self._counts_at = gap if one else 4 * n
        base = getattr(self._host, "_ptr", None)
        native = _cuda.native_launch() if type(base) is int else None
        if native is not None:  # C++ copies; on a failure they are queued again below
            stream = self.stream.handle
            if one:
                if not native.copy_to_host(base, psum_rank_ptr, span, stream):
                    return
            elif not native.copy_to_host(base, psum_rank_ptr, 4 * su, stream) and not native.copy_to_host(
                base + 4 * n, unaligned_ptr, 4 * epr, stream
            ):
                return
        host = self._host.array
        if one:
            _cuda.copy_to_host(host[:span], psum_rank_ptr, self.stream)
            return
        _cuda.copy_to_host(host[: 4 * su], psum_rank_ptr, self.stream)
        _cuda.copy_to_host(host[4 * n : 4 * n + 4 * epr], unaligned_ptr, self.stream)

    def _sync_counts(self, epr: int, a: int) -> tuple[int, int, list]:
        """Wait for a CPU-sync dispatch (CPU timeout), raise what its kernels reported, and read its counts:
        `(num_recv, num_expanded, aligned per-expert counts)`."""
        if not self.stream.synchronize(self.cpu_timeout_secs):
            raise EPTimeoutError(
                self.rank,
                "cpu.dispatch_wait",
                "stream",
                "not drained",
                f"rank {self.rank}: the dispatch did not finish within the CPU timeout "
                f"({self.cpu_timeout_secs} s)",
            )
        # drained: a kernel of this stream that failed (or found the abort flag raised) published its abort kind,
        # an invalid input its kind, into the mapped words; the record is read (two copies and a sync) only then.
        # (A peer's abort raised after this rank's kernels completed is raised by the next call, whose kernels find
        # it at entry.)
        if any(self._status.read()):
            self.check_errors(synchronize=False)
        self._unconfirmed.clear()  # drained and clean: earlier no-sync handles are valid
        host = self._host.array
        n = self.num_scaleup_ranks
        num_recv = int(host[4 * (n - 1) : 4 * n].view(np.int32)[0])  # the last inclusive prefix sum
        at = self._counts_at
        counts = host[at : at + 4 * epr].view(np.int32)
        # Python ints, read before the next dispatch's copy lands (tolist copies); one numpy op when aligning
        aligned = counts.tolist() if a == 1 else ((counts.astype(np.int64) + (a - 1)) // a * a).tolist()
        return num_recv, sum(aligned), aligned

    def finish_dispatch(self, p: _PendingDispatch) -> DispatchResult:
        """Wait for the counts (CPU sync), allocate the outputs and launch the copy epilogue."""
        n, k, m = self.num_ranks, p.config.num_topk, self.num_max_tokens
        epr = p.num_experts // n
        a = p.alignment
        if p.do_cpu_sync:
            num_recv, num_expanded, expert_list = self._sync_counts(epr, a)
        elif p.cached:
            num_recv = p.handle.num_recv_tokens
            num_expanded = p.handle.num_expanded_tokens
            expert_list = list(p.handle.num_recv_tokens_per_expert_list)
        else:
            num_recv = n * m
            num_expanded = ep_layout.align(n * m * min(k, epr) + (a - 1) * epr, a)
            expert_list = []
        rows = num_expanded if p.expand else num_recv
        hidden = p.x.shape[1]
        if p.zero_copy:
            recv_x, recv_sf, recv_idx, recv_w, meta = self._zero_copy_outputs(p, num_recv)
            pdl = False
        else:
            recv_x, recv_sf, recv_idx, recv_w, meta, pdl = self._copy_epilogue(p, rows, num_recv)
        if p.cached:
            handle = p.handle
        else:
            handle = EPHandle(
                p.expand,
                p.num_experts,
                a,
                m,
                p.num_sms,
                p.topk_idx,
                num_recv,
                num_expanded,
                expert_list,
                p.arrays["psum_rank"],
                p.arrays["psum_expert"],
                p.arrays["unaligned"],
                meta,
                p.arrays["dst_slot"],
                token_metadata_at_forward=p.arrays["fwd"],
                num_ranks=n,
                rank=self.rank,
            )
        if not p.cached:
            self._handle_launch[handle] = p.launch_number
        if not p.cached and not p.do_cpu_sync:
            self._unconfirmed.add(handle)
        kept = p.prepared.epilogue_pdl if pdl else p.prepared.epilogue
        # a CPU-sync repeat learns its rows after launching: it needs the epilogue kept already. A zero-copy
        # dispatch has no epilogue; its repeat serves the no-sync call (a CPU sync's handle keeps a slice of the
        # metadata, which the repeat's handle block does not make)
        if p.zero_copy:
            repeatable = not p.do_cpu_sync
        else:
            repeatable = kept is not None or not (rows > 0 or p.zero_padding or p.do_cpu_sync)
        if p.repeat is not None and repeatable:
            self.last_repeat = RepeatDispatch(
                rank=self,
                prepared=p.prepared,
                cached=p.cached,
                expand=p.expand,
                num_tokens=p.num_tokens,
                hidden=hidden,
                x_dtype=p.x.dtype,
                sf_dtype=None if p.sf is None else p.sf.dtype,
                packs=0 if p.sf is None else p.sf.shape[1],
                col_major_sf=p.col_major_sf,
                has_weights=p.has_weights,
                zero_padding=p.zero_padding,
                num_experts=p.num_experts,
                alignment=a,
                num_sms=p.num_sms,
                num_recv=num_recv,
                num_expanded=num_expanded,
                epilogue_pdl=pdl,
                cpu_sync=p.do_cpu_sync,
                zero_copy=p.zero_copy,
                config=p.config,
                **p.repeat,
            )
        self._report_input_error()
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)

    def _copy_epilogue(self, p: _PendingDispatch, rows: int, num_recv: int) -> tuple:
        """`finish_dispatch`'s outputs, allocated, and the copy epilogue that fills them: `(recv_x, recv_sf,
        recv_topk_idx, recv_topk_weights, recv_src_metadata, whether the epilogue was a programmatic dependent)`."""
        hidden, k = p.x.shape[1], p.config.num_topk
        recv_x = self._alloc((rows, hidden), p.x.dtype)
        recv_sf = None
        sf_strides = (0, 0)
        if p.sf is not None:
            packs = p.sf.shape[1]
            if p.col_major_sf:
                ld = ep_layout.align(max(rows, 1), 4)
                sf_strides = (1, ld)
                recv_sf = self._alloc((rows, packs), p.sf.dtype, sf_strides)
            else:
                sf_strides = (packs, 1)
                recv_sf = self._alloc((rows, packs), p.sf.dtype)
        recv_idx = None if p.expand else self._alloc((rows, k), np.int64)
        recv_w = None
        if p.has_weights:
            recv_w = self._alloc((rows,) if p.expand else (rows, k), np.float32)
        # the handle's (cached), or allocated with the slots (no CPU sync)
        meta = p.arrays.get("src_metadata")
        if meta is None:
            meta = self._alloc((num_recv, k + 2), np.int32)
        outputs = epilogue_outputs(
            view_ptr, view_ptr(meta, "recv_src_metadata"), recv_x, recv_sf, sf_strides, recv_idx, recv_w, rows
        )
        pdl = self._epilogue_pdl(p)
        if rows > 0 or p.zero_padding:
            # no grid barrier in the epilogue: a plain launch (or a programmatic dependent one)
            epilogue = p.prepared.epilogue_pdl if pdl else p.prepared.epilogue
            fresh = epilogue is None or p.args is not None  # its first use, or a new shape: a fresh pack
            if fresh:
                if p.args is not None:
                    args = dict(p.args)
                else:
                    args = dict(zip(OP_ARGS_FIELDS, p.prepared.main.patch(p.dynamic)))
                args.update(zip(_EPILOGUE_DYNAMIC, outputs))
                epilogue = self._prepare(
                    p.prepared.kernels.epilogue,
                    "ep_dispatch_copy_epilogue_impl",
                    self.epilogue_geometry(p.geometry),
                    p.geometry.shared_mem,
                    False,
                    args,
                    _EPILOGUE_DYNAMIC_ALL,
                    pdl,
                )
                if pdl:
                    p.prepared.epilogue_pdl = epilogue
                else:
                    p.prepared.epilogue = epilogue
            # its words are the dispatch's (this call's pointers) with the epilogue's outputs, envelope 0
            self._launch_prepared(epilogue, p.dynamic + outputs, fresh, False)
        return recv_x, recv_sf, recv_idx, recv_w, meta, pdl

    def _zero_copy_outputs(self, p: _PendingDispatch, num_recv: int) -> tuple:
        """`finish_dispatch`'s outputs of a zero-copy dispatch: views of this rank's receive region, where the kernel
        stored them (`ZeroCopyRows`), `num_recv` rows each (exact after a CPU sync, N * M without, as the ordinary
        dispatch's); the handle's metadata is the first `num_recv` rows of the array the kernel filled."""
        k = p.config.num_topk
        sf_dtype, packs = (None, 0) if p.sf is None else (p.sf.dtype, p.sf.shape[1])
        recv_x, recv_sf, recv_idx, recv_w = self.zero_copy_views(
            p.config, p.num_experts, num_recv, p.x.dtype, sf_dtype, packs, p.has_weights
        )
        dev, stream = self.device_id, self.stream
        meta = p.arrays["src_metadata"]
        # a CPU sync's rows: the first of the kernel's array, of the allocator's type
        if meta.shape[0] != num_recv:
            if hasattr(meta, "__getitem__"):  # torch, numpy-like
                meta = meta[:num_recv]
            else:
                ptr = view_ptr(meta, "recv_src_metadata")
                meta = RegionView(ptr, (num_recv, k + 2), _INT32, stream, meta, dev)
        return recv_x, recv_sf, recv_idx, recv_w, meta

    def zero_copy_views(
        self,
        cfg: KernelConfig,
        num_experts: int,
        rows: int,
        x_dtype: Any,
        sf_dtype: Any,
        packs: int,
        has_weights: bool,
    ) -> tuple:
        """A zero-copy dispatch's `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`: `RegionView`s of `rows`
        rows where the kernel stored them (`finish_dispatch`, and its repeat `RepeatDispatch.run`)."""
        base, sf_at, idx_at, w_at = self._zero_copy_places(cfg, num_experts)
        dev, stream, k = self.device_id, self.stream, cfg.num_topk
        recv_x = RegionView(base, (rows, cfg.hidden), x_dtype, stream, self, dev)
        recv_sf = None if sf_dtype is None else RegionView(sf_at, (rows, packs), sf_dtype, stream, self, dev)
        recv_idx = RegionView(idx_at, (rows, k), _INT64, stream, self, dev)
        recv_w = RegionView(w_at, (rows, k), _FLOAT32, stream, self, dev) if has_weights else None
        return recv_x, recv_sf, recv_idx, recv_w

    @property
    def device_id(self) -> int:
        """The CUDA device of this rank's memory (the current one when first asked; kept: no driver call per view)."""
        dev = getattr(self, "_device_id", None)
        if dev is None:
            dev = self._device_id = _cuda.current_device()
        return dev

    def _zero_copy_places(self, cfg: KernelConfig, num_experts: int) -> tuple[int, int, int, int]:
        """The addresses of a zero-copy dispatch's `recv_x`, scales, ids and weights in this rank's receive region
        (`ZeroCopyRows`), kept per configuration: a call computes no offsets."""
        places = self.__dict__.setdefault("_zc_places", {})
        key = (cfg, num_experts)
        at = places.get(key)
        if at is None:
            z = self.zero_copy_rows(cfg)
            plan = plan_regions(cfg, num_experts, self.num_max_tokens, self.res.data_bytes, op="dispatch")
            base = self.res.base + plan.recv_offset
            at = places[key] = (base, base + z.sf_offset, base + z.topk_idx_offset, base + z.weights_offset)
        return at

    def zero_copy_rows(self, cfg: KernelConfig) -> ZeroCopyRows:
        """Where a zero-copy dispatch of `cfg` leaves its outputs in the receive region (zero_copy_rows.cuh)."""
        return ZeroCopyRows(
            self.num_ranks * self.num_max_tokens, cfg.hidden * cfg.elem_size, cfg.num_sf_packs, cfg.num_topk
        )

    def check_zero_copy_dispatch(
        self, cfg: KernelConfig, cached: bool, expand: bool, col_major_sf: bool
    ) -> None:
        """What `dispatch(..., zero_copy=True)` asks of its call and of this buffer; raises before any launch (the
        same on every rank of a call: nothing here depends on the rank's own tokens): the arguments as validation
        rule D18 says, then this buffer's mode and room."""
        check_zero_copy_dispatch_args(cached, expand, col_major_sf, self.rank)
        self._check_one_domain(cfg, "dispatch")
        where = f"rank {self.rank}"
        need = self.zero_copy_rows(cfg).num_bytes
        if need > self.res.data_bytes:
            raise EPValueError(
                f"zero_copy: the outputs of {self.num_ranks} x {self.num_max_tokens} rows need {need} bytes, {where}'s "
                f"receive region has {self.res.data_bytes}; allocate the buffer with get_buffer_size_hint()"
            )

    def _check_one_domain(self, cfg: KernelConfig, op: str) -> None:
        """The zero-copy ops' mode: direct, within one NVLink domain (their kernels store and load peers' regions)."""
        if cfg.is_hybrid or cfg.is_direct_xnode:
            raise EPValueError(
                f"zero_copy: direct mode within one NVLink domain only; this buffer's {self.num_ranks} ranks span "
                f"nodes of {self.num_nvlink_ranks} (rank {self.rank}; {op} without zero_copy)"
            )

    def dispatch(self, *args: Any, **kwargs: Any) -> DispatchResult:
        """Both phases (one rank per process)."""
        return self.finish_dispatch(self.launch_dispatch(*args, **kwargs))

    # ------------------------------------------------------------------ combine
    def check_zero_copy(self, x: Any, handle: EPHandle, topk_weights: Any = None) -> None:
        """What `combine(x, handle, topk_weights=..., zero_copy=True)` checks of its arguments, without launching
        (the loopback domain checks every rank before the first launches)."""
        check_zero_copy_args(handle, topk_weights)
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 2:
            raise EPValueError(f"x: expected rank {self.rank}'s 2-D combine buffer, got shape {shape}")
        ptr, rows = self._combine_buffer_place(handle, int(shape[1]))
        if shape == (rows, shape[1]) and rows == 0:
            return  # no rows: nothing is read, any address will do
        try:
            where = f"{as_view(x, 'x').ptr:#x}"
        except TypeError:  # host memory, or no array at all
            where = f"a {type(x).__name__}"
        if where != f"{ptr:#x}" or shape[0] != rows:
            raise EPValueError(
                f"x: a zero-copy combine reads rank {self.rank}'s combine buffer in place; pass "
                f"combine_buffer(handle, hidden) ({(rows, shape[1])} at {ptr:#x}) with the expert outputs written "
                f"into it, got {shape} at {where}"
            )

    def combine_buffer(self, handle: EPHandle, hidden: int) -> CoreArray:
        """Where a zero-copy combine (`combine(..., zero_copy=True)`) reads this rank's rows: bf16 [received rows,
        hidden] at the start of the receive region, one row per row of the dispatch's `recv_x`, in its order. The
        caller writes its expert outputs there instead of into an array of its own. Valid from the end of the
        dispatch's copy epilogue (the region held the received tokens until then) until the next dispatch or combine
        on this buffer, which writes the region; direct mode within one NVLink domain, non-expanded handles."""
        ptr, rows = self._combine_buffer_place(handle, hidden)
        return CoreArray(ptr, (rows, hidden), "bfloat16", device_id=self.device_id, owner=self)

    def _combine_buffer_place(self, handle: EPHandle, hidden: int) -> tuple[int, int]:
        """(address, rows) of the combine buffer, after the checks of `combine_buffer`."""
        self._check_handle(handle)
        check_zero_copy_args(handle, hidden=hidden)
        cfg = self._config(hidden, 2, 0, handle.num_topk)
        self._check_one_domain(cfg, "combine")
        rows = int(handle.recv_src_metadata.shape[0])
        if rows * hidden * 2 > self.res.data_bytes:
            raise EPValueError(
                f"zero_copy: {rows} rows of {hidden} bf16 need {rows * hidden * 2} bytes, rank {self.rank}'s receive "
                f"region has {self.res.data_bytes}; allocate the buffer with get_buffer_size_hint()"
            )
        # the receive region's start, where a zero-copy dispatch's recv_x lies too (the rows need only the bytes
        # checked above, not the ordinary combine's receive slots of both layouts)
        return self._zero_copy_places(cfg, handle.num_experts)[0], rows

    def combine(
        self,
        x: Any,
        handle: EPHandle,
        *,
        topk_weights: Any = None,
        bias: Any = None,
        allow_multiple_reduction: bool = True,
        num_sms: int = 0,
        report_input_error: bool = True,
        record: bool = False,
        zero_copy: bool = False,
    ) -> CombineResult:
        """Launch the combine kernel. `report_input_error=False` leaves `_report_input_error` to a caller that
        launches several ranks (the loopback domain reports once every rank has launched). `record`: leave the
        call's `RepeatCombine` in `last_repeat` (ep_core.kernels.repeat). `zero_copy`: `x` is this rank's
        `combine_buffer(handle, hidden)`, which every rank's kernel reads in place (module doc of combine.cuh);
        every rank of the call passes it alike (the envelope checks)."""
        self.last_repeat = None
        self.guard()
        if handle is None:
            raise EPValueError("handle: combine needs the handle of a dispatch")
        self._check_handle(handle)
        xv = as_view(x, "x")
        _check_2d(xv, "x")
        if xv.dtype.itemsize != 2 or not xv.is_contiguous:
            raise EPTypeError(
                f"x: expected contiguous bf16 rows (2-byte elements), got {xv.dtype} {xv.shape}"
            )
        hidden = xv.shape[1]
        k = handle.num_topk
        t = handle.num_tokens
        amr = bool(allow_multiple_reduction)
        if not handle.do_expand and xv.shape[0] != handle.recv_src_metadata.shape[0]:
            raise EPValueError(
                f"x: expected {handle.recv_src_metadata.shape[0]} rows (one per received token), got {xv.shape[0]}"
            )
        zero_copy = bool(zero_copy)
        if zero_copy:
            self.check_zero_copy(xv, handle, topk_weights)
        wv = None
        if topk_weights is not None:
            if handle.do_expand and not amr:
                raise EPValueError(
                    "topk_weights: not allowed for an expand-layout combine with allow_multiple_reduction=False"
                )
            wv = as_view(topk_weights, "topk_weights")
            want = (xv.shape[0],) if handle.do_expand else (xv.shape[0], k)
            if wv.shape != want or wv.dtype != np.float32 or not wv.is_contiguous:
                raise EPValueError(
                    f"topk_weights: expected contiguous float32 {want}, got {wv.shape} {wv.dtype}"
                )
        if bias is None:
            biases: tuple = ()
        elif isinstance(bias, tuple):
            if len(bias) != 2:
                raise EPValueError(f"bias: expected a tuple of exactly two arrays, got {len(bias)}")
            biases = tuple(b for b in bias if b is not None)
        elif isinstance(bias, list):
            raise EPTypeError("bias: expected an array or a tuple of two arrays, got a list")
        else:
            biases = (bias,)
        bias_views = []
        for i, b in enumerate(biases):
            bv = as_view(b, f"bias[{i}]")
            if bv.shape != (t, hidden) or bv.dtype.itemsize != 2 or not bv.is_contiguous:
                raise EPValueError(
                    f"bias[{i}]: expected contiguous bf16 [{t}, {hidden}], got {bv.shape} {bv.dtype}"
                )
            bias_views.append(bv)
        iv = as_view(handle.topk_idx, "handle.topk_idx")
        cfg = self._config(hidden, 2, 0, k)
        if cfg.is_hybrid and handle.token_metadata_at_forward is None:
            raise EPValueError("handle: not made by a hybrid dispatch (no token_metadata_at_forward)")
        plan, scratch = self._regions(cfg, handle.num_experts, "combine", amr)
        num_sms = self._num_sms(num_sms, handle, handle.num_experts, k)
        flags = 0
        if handle.do_expand:
            flags |= FLAGS["expand"]
        if amr:
            flags |= FLAGS["multiple_reduction"]
        if wv is not None:
            flags |= FLAGS["combine_weights"]
        if ep_layout.combine_uses_rank_layout(self.num_ranks, k, amr):
            flags |= FLAGS["rank_layout"]
        if iv.dtype == np.int32:
            flags |= FLAGS["topk_idx32"]
        if zero_copy:
            flags |= FLAGS["combine_zero_copy"]
        key = ("combine", cfg, handle.num_experts, t, flags, self._shape_key(plan, scratch, num_sms))
        prepared = self._launches.get(key)
        if prepared is None:
            geo = launch_geometry(cfg, num_sms, self.device_sms)
            kernels = load_kernels(cfg)
        combined = self._alloc((t, hidden), np.uint16)
        combined_w = self._alloc((t, k), np.float32) if wv is not None else None
        # ranks that differ in zero_copy would read buffers nobody filled, or fill slots nobody reads
        env_mask = (
            FLAGS["expand"] | FLAGS["multiple_reduction"] | FLAGS["rank_layout"] | FLAGS["combine_zero_copy"]
        )
        env_fields = (hidden, k, handle.num_experts, self.num_max_tokens, flags & env_mask)
        dynamic = (
            iv.ptr,
            view_ptr(handle.psum_num_recv_tokens_per_scaleup_rank, "psum"),
            view_ptr(handle.recv_src_metadata, "recv_src_metadata"),
            view_ptr(handle.token_metadata_at_forward, "token_metadata_at_forward") if cfg.is_hybrid else 0,
            xv.ptr,
            wv.ptr if wv is not None else 0,
            bias_views[0].ptr if len(bias_views) > 0 else 0,
            bias_views[1].ptr if len(bias_views) > 1 else 0,
            view_ptr(combined, "combined_x"),
            view_ptr(combined_w, "combined_w") if combined_w is not None else 0,
            self._envelope(OP_COMBINE, (*env_fields, self._handle_launch.get(handle, -1))),
        )
        names = _COMBINE_DYNAMIC
        if zero_copy:  # the dispatch's slots, before the envelope
            names = _COMBINE_ZERO_COPY_DYNAMIC
            dynamic = (
                *dynamic[:-1],
                view_ptr(handle.dst_buffer_slot_idx, "dst_buffer_slot_idx"),
                dynamic[-1],
            )
        if prepared is None:  # a new launch shape: every field packed afresh (pack_op_args), then kept
            args = self._common(plan, scratch, handle.num_experts)
            # zero-copy: one launch (nothing is sent, the reduce is the whole kernel)
            split = not zero_copy and self.combine_split(cfg, geo, t)
            args.update(num_tokens=t, flags=flags | (FLAGS["combine_send_only"] if split else 0))
            args.update(zip(names, dynamic))
            main = self._prepare(
                kernels.combine_zero_copy if zero_copy else kernels.combine,
                "ep_combine_zero_copy_impl" if zero_copy else "ep_combine_impl",
                geo,
                _combine_smem(cfg),
                self.cooperative,
                args,
                names,
            )
            reduce = None
            if split:  # the reduce on the wider grid: the same words, its flag, no envelope (not collective)
                args.update(flags=flags | FLAGS["combine_reduce_only"], envelope=0)
                reduce = self._prepare(
                    kernels.combine,
                    "ep_combine_impl",
                    self.epilogue_geometry(geo),
                    _combine_smem(cfg),
                    False,
                    args,
                    names,
                )
            prepared = PreparedOp(geo, kernels, main)
            prepared.epilogue = reduce
            prepared = self._launches.put(key, prepared)
            fresh = True
        else:
            fresh = False
        self._launch_prepared(prepared.main, dynamic, fresh, bool(dynamic[-1]))
        if prepared.epilogue is not None:
            self._launch_prepared(prepared.epilogue, (*dynamic[:-1], 0), fresh, False)
        if record:
            self.last_repeat = RepeatCombine(
                rank=self,
                prepared=prepared,
                scratch=scratch,
                hybrid=cfg.is_hybrid,
                idx32=bool(flags & FLAGS["topk_idx32"]),
                num_tokens=t,
                hidden=hidden,
                topk=k,
                has_weights=wv is not None,
                env_fields=env_fields,
                zero_copy=zero_copy,
                buffer_ptr=xv.ptr if zero_copy else 0,
            )
        if report_input_error:
            self._report_input_error()
        return CombineResult(combined, combined_w)

    # ------------------------------------------------------------------ errors
    def read_error(self) -> tuple[np.ndarray, np.ndarray]:
        """(error record bytes, input-error words) of this rank (synchronizes the stream)."""
        # read through page-locked memory (a pageable destination makes each copy a staged, blocking one)
        nrec = ep_layout.NUM_ERROR_RECORD_BYTES
        staging = self._error_host.array
        staging[nrec:] = 0
        _cuda.copy_to_host(staging[:nrec], self.res.base + _ERR_OFF, self.stream)
        scratch = self._any_scratch()
        if scratch:
            _cuda.copy_to_host(staging[nrec:], scratch + SCRATCH_INPUT_ERROR_OFFSET, self.stream)
        self.stream.synchronize()
        rec = staging[:nrec].copy()
        inp = staging[nrec:].copy().view(np.int64)
        return rec, inp

    def _any_scratch(self) -> int:
        """The scratch of the last operation (the workspace's reserved region unless it was too small)."""
        last = self._last_scratch
        return self.res.base + ep_layout.WorkspaceLayout.RESERVED_OFFSET if last is None else last

    def check_errors(self, synchronize: bool = True) -> None:
        """Raise EPTimeoutError / EPDeviceError if a kernel of this rank recorded an error (an abort stays recorded,
        and raised again, until `reset_state`; an invalid-input report is cleared once raised)."""
        if synchronize and not self.stream.synchronize(self.cpu_timeout_secs):
            raise EPTimeoutError(self.rank, "cpu.synchronize", "stream", "not drained")
        rec, inp = self.read_error()
        published_abort, published_input = self._status.read()

        def get(name: str) -> int:
            f = _FIELD[name]
            dt = np.int32 if f.dtype == "int32" else np.int64
            return int(rec[f.offset : f.offset + np.dtype(dt).itemsize].view(dt)[0])

        kind = get("abort_flag") or published_abort
        if kind != 0:  # handles of no-sync dispatches not yet confirmed by a clean sync may be garbage
            self.fail_unconfirmed_handles()
        elif synchronize:
            self._unconfirmed.clear()
        if kind in (int(_EK.TIMEOUT), int(_EK.PEER_ABORT)):
            tag = TAG_NAMES.get(get("tag"), str(get("tag")))
            if kind == int(_EK.PEER_ABORT):
                raise EPTimeoutError(
                    self.rank,
                    "peer_abort",
                    "abort_flag",
                    kind,
                    f"rank {self.rank}: aborted because a peer rank failed (timed out or met another operation); "
                    f"{_RESET_HINT}",
                )
            raise EPTimeoutError(
                get("rank"),
                tag,
                get("counter"),
                get("value"),
                f"rank {get('rank')} timed out in {tag} (peer {get('peer_rank')}, counter {get('counter')}, last "
                f"value {get('value')}, expected {get('expected')}); a peer rank did not arrive: check that every "
                f"rank calls the same operations; {_RESET_HINT}",
            )
        if kind == int(_EK.ENVELOPE_MISMATCH):
            tag = TAG_NAMES.get(get("tag"), str(get("tag")))
            peer = get("peer_rank")
            raise EPDeviceError(
                f"rank {get('rank')}: in {tag}, rank {peer} entered {describe_envelope(get('value'))} while this rank "
                f"entered {describe_envelope(get('expected'))}: every rank must call the same operations in the same "
                "order, with the same num_experts, hidden size, top-k, dtypes, flags and handle; nothing was paired; "
                f"{_RESET_HINT}",
                code=kind,
                rank=get("rank"),
                detail=peer,
            )
        if kind != 0:
            raise EPDeviceError(
                f"rank {self.rank}: kernel error kind {kind}; {_RESET_HINT}", code=kind, rank=self.rank
            )
        what_of = {
            int(_EK.INVALID_EXPERT): "an expert id >= num_experts",
            int(_EK.DUPLICATE_EXPERT): "a duplicate expert in one token",
        }
        if inp[0] != 0:
            what = what_of.get(int(inp[0]), "bad input")
            self.clear_input_error()
            raise EPDeviceError(
                f"rank {self.rank}: topk_idx holds {what} (token {inp[1]}, lane {inp[2]}, value {inp[3]}); fix the "
                "routing",
                code=int(inp[0]),
                rank=self.rank,
                detail=int(inp[3]),
            )
        if published_input != 0:  # reported into the scratch of an earlier configuration
            self.clear_input_error()
            raise EPDeviceError(
                f"rank {self.rank}: topk_idx of an earlier dispatch held {what_of.get(published_input, 'bad input')}; "
                "fix the routing",
                code=published_input,
                rank=self.rank,
            )

    def clear_input_error(self) -> None:
        """Clear the invalid-input record of every scratch this rank used (a record left in another
        configuration's scratch would block new reports there and be raised again later) and the host word."""
        for scratch in self._scratches | {self._any_scratch()}:
            _cuda.memset(scratch + SCRATCH_INPUT_ERROR_OFFSET, 32, self.stream)
        self._status.array[1] = 0

    def reset_state(self, barrier: Callable[[], None] | None = None) -> None:
        """Return this rank to a clean state after an error: zero its workspace (barrier arrivals, error record and
        abort flag, count words, the reserved scratch) and every separate scratch, and its host-mapped error words.

        Every rank of the domain must reset together. `barrier` is the domain's host barrier (a bootstrap's
        `barrier`); the order is: drain this rank's stream (every kernel ends: all waits are bounded and watch the
        abort flag), barrier (no rank's kernels run or write into a peer any more), zero, drain, barrier (no rank
        launches before every rank is zeroed). Without `barrier` the caller orders the ranks (the loopback domain
        drains every rank before zeroing any). Nothing needs preserving: the barrier epoch (scratch) and the arrival
        count (workspace) are both zeroed on every rank, and `arrivals >= epoch * N` only needs them to agree.
        """
        if self.res.base == 0:
            raise EPStateError("reset_state: the rank has no buffer")
        if not self.stream.synchronize(self.cpu_timeout_secs):
            raise EPTimeoutError(
                self.rank,
                "cpu.reset",
                "stream",
                "not drained",
                f"rank {self.rank}: reset_state: the stream did not drain within {self.cpu_timeout_secs} s",
            )
        self.fail_unconfirmed_handles()  # a reset follows a failure: in-flight handles may hold garbage
        if barrier is not None:
            barrier()
        self._zero_state()
        self.stream.synchronize()
        self._status.clear()
        if barrier is not None:
            barrier()

    def _zero_state(self) -> None:
        """Stream-ordered memsets of the workspace and of every separate scratch (the caller drains and orders)."""
        self._num_collective_launches = (
            0  # the envelopes' sequence: every rank starts counting again together
        )
        _cuda.memset(self.res.base, ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES, self.stream)
        for buf in self.res.scratch_buffers.values():
            _cuda.memset(buf.ptr, buf.nbytes, self.stream)
