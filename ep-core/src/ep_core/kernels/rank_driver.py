"""The rank driver: one `RankDriver` per rank drives ep_core's kernels in every mode (direct, hybrid, cross-node;
`GpuExecutor`, the executor `EPBuffer` calls, drives one).

A dispatch is two phases so that several ranks of one process (the loopback domain) can be driven together:
`launch_dispatch` validates, allocates the handle arrays and launches the dispatch kernel; `finish_dispatch` waits
for the received counts when a CPU sync is asked for, allocates the outputs and launches the copy epilogue. A
combine is one launch. Arrays are `DeviceArray`s allocated on the rank's stream, or caller arrays by pointer
(`as_view`); bf16 is uint16 storage, FP8 uint8. Failures: `ep_core.kernels.rank_runtime`.

SM counts: `RankResources.num_ranks_on_device` ranks drive this rank's GPU (all N in the loopback domain, 1 with a
GPU per rank). Ranks that share a GPU wait on each other inside their kernels, so the default SM count splits the
device and every grid must fit next to the others; a rank alone on its GPU takes the planner's count and launches
its grid-synchronizing kernels cooperatively (all blocks resident while other streams' kernels occupy SMs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ep_layout
import numpy as np

from ep_core._env import knobs
from ep_core.errors import EPConfigError, EPTimeoutError
from ep_core.handle import EPHandle
from ep_core.kernels import _cuda
from ep_core.kernels._args import pack_op_args
from ep_core.kernels._cuda import DeviceArray, PinnedBuffer, Stream
from ep_core.kernels._source import load_kernels
from ep_core.kernels.combine_launch import CombineLaunch
from ep_core.kernels.dispatch_launch import DispatchLaunch, _PendingDispatch
from ep_core.kernels.op_plan import CombinePlan, DispatchPlan, run_launch
from ep_core.kernels.plan import (
    SCRATCH_BARRIER_EPOCH_OFFSET,
    KernelConfig,
    LaunchGeometry,
    RegionPlan,
    check_coresident,
    check_epilogue_sms,
    check_occupancy,
    default_num_sms,
    plan_regions,
)
from ep_core.kernels.plan import combine_smem as _combine_smem
from ep_core.kernels.prepared_launch import PlanCache, PreparedLaunch
from ep_core.kernels.rank_runtime import TAG_NAMES, RankRuntime
from ep_core.rank_state import RankState
from ep_core.requests import CombineResult, DispatchResult

# the page-locked words of a CPU-sync dispatch's counts: room for one copy that spans a handle block's prefix sums
# and per-expert counts (`RankDriver._copy_counts`; 256 local experts take 2.3 KiB)
_ONE_COPY_BYTES = 16384

__all__ = [
    "TAG_NAMES",
    "CombineResult",
    "DispatchResult",
    "RankDriver",
    "RankResources",
    "count_ranks_on_device",
]


Allocator = Callable[[tuple, Any, "tuple | None"], Any]

# The copy epilogue as a programmatic dependent launch of the dispatch (its blocks wait in griddepcontrol.wait, the
# dispatch's blocks release them once done sending): on by default where it is safe (`_epilogue_pdl`);
# EPKIT_EPILOGUE_PDL=0 launches it after the dispatch as before.
EPILOGUE_PDL = knobs.epilogue_pdl


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


class RankDriver(DispatchLaunch, CombineLaunch, RankRuntime):
    """One rank's driver (direct, hybrid or cross-node mode; ipc or nccl transport): validates, launches, reads back
    counts; its dispatch side `DispatchLaunch`, its combine side `CombineLaunch`, its runtime state `RankRuntime`."""

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
        # the identity and generation its handles carry (`_ep_owner`, ep_core.rank_state.check_owner: a handle of
        # another buffer or from before a reset is refused by name); the kernels meet their peers on the device,
        # so this state counts no host steps
        self.state = RankState(self.rank)
        self._scratches: set[int] = set()  # every scratch an op used (input-error records live there)
        self._input_pending = False  # an invalid-input report seen by the current call's guard
        self._blocks_per_sm: dict = {}
        self._configs: dict = {}
        # the rank's one plan cache (kernels.prepared_launch.PlanCache): per launch shape its kernel, geometry,
        # occupancy verdict and packed args; per call signature (a prepared entry's token) its plan; the planner's
        # SM counts
        self.plans = PlanCache()
        # collective launches so far (every rank counts the same launches; zeroed by reset_state), and the launch
        # number of the dispatch behind each handle (a combine's envelope names its handle)
        self._num_collective_launches = 0
        self._handle_launch: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # repeated calls (ep_core.kernels.op_plan): the last full call's plan when it was asked to record one, and
        # the verdict on each handle's topk_idx
        self.last_repeat: DispatchPlan | CombinePlan | None = None
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

    def plan_int32(self, names: tuple, key: tuple, shapes: dict, allocate: Any) -> dict:
        """A plan's new handle's int32 arrays, viewed, for an allocator that carves no `handle_block`
        (`op_plan.DispatchPlan.run`): one block by the shapes' `key` where the rank's allocator makes one, else the
        request's `allocate` by name (as GpuExecutor's wrapper calls it), else the rank's allocator."""
        block = getattr(self._allocator, "int32_block", None)
        views = None if block is None else block(key)
        if views is not None:
            return dict(zip(names, views))
        if allocate is not None:
            return {name: allocate(shape, "int32") for name, shape in shapes.items()}
        return self._alloc_int32(shapes)

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
        return self.plans.sms(num_experts, num_topk, lambda: self._theoretical_sms(num_experts, num_topk))

    def _theoretical_sms(self, num_experts: int, num_topk: int) -> int:
        from ep_core import planner
        from ep_core.topology import Topology

        try:
            return planner.get_theoretical_num_sms(
                Topology(self.num_ranks), num_experts, num_topk, num_device_sms=self.device_sms
            )
        except EPConfigError:
            return 0

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

    # through this module's names, which tests and benchmarks replace (the CPU benchmark's mocked kernels,
    # profile_ops.py's register-path combine)
    def _kernels(self, cfg: KernelConfig) -> Any:
        """The compiled kernels of `cfg` (`load_kernels`)."""
        return load_kernels(cfg)

    def _combine_smem(self, cfg: KernelConfig) -> int:
        """The combine launch's dynamic shared memory (`plan.combine_smem`)."""
        return _combine_smem(cfg)

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

    def _launch_prepared(self, launch: PreparedLaunch, values: tuple, fresh: bool, collective: bool) -> None:
        """The full path's launch of a prepared launch: its kept words as they are (`fresh`: this call packed
        them), else with the per-call `values` patched in as a plan's run launches them (`op_plan._launch`,
        natively when ep_launch is usable). `collective`: it carries an envelope."""
        if not fresh:
            return run_launch(self, launch, values, collective, None, None)
        launch.launch(launch.words, self.stream.handle)
        if collective:
            self._num_collective_launches += 1

    # ------------------------------------------------------------------ a CPU sync's count round trip
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

    def count_round_trip(
        self, psum_rank_ptr: int, unaligned_ptr: int, epr: int, one_block: bool, a: int
    ) -> tuple[int, int, list]:
        """A CPU-sync plan's counts (`op_plan.DispatchPlan.run`): `_copy_counts`, then `_sync_counts`."""
        self._copy_counts(psum_rank_ptr, unaligned_ptr, epr, one_block)
        return self._sync_counts(epr, a)

    def _sync_counts(self, epr: int, a: int) -> tuple[int, int, list]:
        """Wait for a CPU-sync dispatch (CPU timeout), raise what its kernels reported, and read its counts:
        `(num_recv, num_expanded, aligned per-expert counts)`."""
        # inline, not RankRuntime.drain: a kept plan's CPU-sync call enters no further module (its guard test)
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

    def _shape_key(self, plan: RegionPlan, scratch: int, num_sms: int) -> tuple:
        """The rank's words of a launch shape (every field of `_common`, the op's num_experts left 0: the key holds
        it apart) and its grid. The full path's (a plan's run keeps its key)."""
        words = self._common(plan, scratch, 0).values()
        return (*words, num_sms, self.device_sms, self.num_ranks_on_device, self.cooperative)

    @property
    def device_id(self) -> int:
        """The CUDA device of this rank's memory (the current one when first asked; kept: no driver call per view)."""
        dev = getattr(self, "_device_id", None)
        if dev is None:
            dev = self._device_id = _cuda.current_device()
        return dev
