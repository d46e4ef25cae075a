"""Host-side planning of the direct-mode kernels: compile keys, buffer regions, scratch size, launch geometry.

Everything here is pure arithmetic (no GPU), unit tested on the CPU. Byte math of tokens and receive regions comes
from ep_layout (`make_dispatch_token_layout`, `DirectDispatchBuffers`, `DirectCombineBuffers`, `WorkspaceLayout`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import ep_layout

from ep_core.errors import EPConfigError, EPValueError

__all__ = [
    "DEFAULT_NUM_WARPS",
    "SCALEOUTS",
    "HybridRegions",
    "KernelConfig",
    "LaunchGeometry",
    "RegionPlan",
    "check_coresident",
    "check_epilogue_sms",
    "check_occupancy",
    "combine_smem",
    "default_num_sms",
    "default_num_warps",
    "epilogue_share",
    "launch_geometry",
    "plan_regions",
    "rank_sm_share",
    "scratch_bytes",
]

DEFAULT_NUM_WARPS = 16
"""Most warps per block of every kernel (512 threads); every block is one persistent CTA on one SM."""

SMEM_PER_BLOCK_BYTES = 232448
"""Opt-in shared memory per block of sm_90 (227 KiB). Dispatch and epilogue stage one token per warp there."""

STATIC_SMEM_RESERVE_BYTES = 12288
"""Static shared memory of the kernels (counters, mbarriers, pointers), kept free of token slots."""

SCRATCH_HEADER_BYTES = 64
# Offsets in the scratch header (args.cuh `Scratch`): the barrier epoch (uint64) and the input-error report.
SCRATCH_BARRIER_EPOCH_OFFSET = 8
SCRATCH_INPUT_ERROR_OFFSET = 16
"""Rank-private scratch: grid barrier words, barrier epoch, input-error report (args.cuh `Scratch`)."""


SCALEOUTS = ("emulated", "gin")
"""Implementations of the hybrid scale-out put (include/ep_core/scaleout.cuh), picked at JIT time."""


@dataclass(frozen=True)
class KernelConfig:
    """The template constants of one JIT instance (all three kernels share them).

    `elem_size`: 2 (bf16) or 1 (FP8 data); `num_sf_packs`: 4-byte scale packs per token (0 for bf16).
    `num_scaleup_ranks` (S_u, 0 = num_ranks): ranks per node; S_u < num_ranks builds the hybrid kernels
    (include/ep_core/hybrid.cuh) with the scale-out put `scaleout` ("emulated": load/store, every rank reachable;
    "gin": NCCL GIN, nccl transport only; default: "gin" over nccl, else "emulated"). Direct configurations keep
    `num_scaleup_ranks == num_ranks` and `scaleout == ""`. `num_nvlink_ranks` (0 = num_scaleup_ranks): the ranks of
    one node (physical); `num_nvlink_ranks < num_scaleup_ranks == num_ranks` is direct mode across nodes
    (include/ep_core/direct_xnode.cuh: the direct kernels with the scale-out put to every rank of another node).
    """

    num_ranks: int
    num_topk: int
    hidden: int
    elem_size: int = 2
    num_sf_packs: int = 0
    num_warps: int = 0
    transport: str = "ipc"
    num_scaleup_ranks: int = 0
    scaleout: str = ""
    num_nvlink_ranks: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_ranks <= ep_layout.NUM_MAX_RANKS:
            raise EPConfigError(f"num_ranks: expected 1..{ep_layout.NUM_MAX_RANKS}, got {self.num_ranks}")
        if not 1 <= self.num_topk <= 32:
            raise EPConfigError(f"num_topk: expected 1..32, got {self.num_topk}")
        if self.elem_size not in (1, 2):
            raise EPConfigError(f"elem_size: expected 2 (bf16) or 1 (FP8), got {self.elem_size}")
        if (self.hidden * self.elem_size) % 32 or (self.hidden * 2) % 32:
            raise EPConfigError(
                f"hidden: expected hidden * element size to be a multiple of 32 bytes, got hidden={self.hidden} "
                f"with {self.elem_size}-byte elements; pad hidden to a multiple of 32"
            )
        if self.num_sf_packs < 0 or (self.elem_size == 2 and self.num_sf_packs):
            raise EPConfigError(
                f"num_sf_packs: expected 0 for bf16 and >= 0 for FP8, got {self.num_sf_packs}"
            )
        if self.transport not in ("ipc", "nccl"):
            raise EPConfigError(f"transport: expected 'ipc' or 'nccl', got {self.transport!r}")
        su = self.num_scaleup_ranks or self.num_ranks
        if isinstance(su, bool) or not isinstance(su, int) or su < 1 or self.num_ranks % su:
            raise EPConfigError(
                f"num_scaleup_ranks: expected a divisor of num_ranks={self.num_ranks} (the ranks of one node), "
                f"got {self.num_scaleup_ranks!r}"
            )
        object.__setattr__(self, "num_scaleup_ranks", su)
        nvl = self.num_nvlink_ranks or su
        if isinstance(nvl, bool) or not isinstance(nvl, int) or nvl < 1 or self.num_ranks % nvl:
            raise EPConfigError(
                f"num_nvlink_ranks: expected a divisor of num_ranks={self.num_ranks} (the ranks of one node), "
                f"got {self.num_nvlink_ranks!r}"
            )
        if su < self.num_ranks and nvl != su:
            raise EPConfigError(
                f"num_nvlink_ranks: hybrid mode forwards within a node of num_scaleup_ranks={su} ranks, got "
                f"num_nvlink_ranks={nvl}"
            )
        object.__setattr__(self, "num_nvlink_ranks", nvl)
        if nvl == self.num_ranks:
            if self.scaleout:
                raise EPConfigError(
                    f"scaleout: only hybrid configurations or direct mode across nodes (num_nvlink_ranks < "
                    f"num_ranks) have a scale-out put, got {self.scaleout!r} with one node"
                )
        else:
            so = self.scaleout or ("gin" if self.transport == "nccl" else "emulated")
            if so not in SCALEOUTS:
                raise EPConfigError(f"scaleout: expected one of {SCALEOUTS}, got {so!r}")
            if so == "gin" and self.transport != "nccl":
                raise EPConfigError("scaleout: 'gin' needs transport='nccl' (the GIN device communicator)")
            object.__setattr__(self, "scaleout", so)
        if self.num_warps == 0:
            object.__setattr__(self, "num_warps", default_num_warps(self.smem_slot_bytes))
        if not 1 <= self.num_warps <= 32:
            raise EPConfigError(f"num_warps: expected 1..32, got {self.num_warps}")
        if self.dynamic_smem_bytes + STATIC_SMEM_RESERVE_BYTES > SMEM_PER_BLOCK_BYTES:
            raise EPConfigError(
                f"num_warps: {self.num_warps} token slots of {self.smem_slot_bytes} bytes exceed shared memory; "
                f"use at most {default_num_warps(self.smem_slot_bytes)}"
            )

    # The derived values below are pure functions of the (frozen) fields: computed once per instance
    # (`cached_property` stores into the instance dict, which a frozen dataclass allows; eq/hash use the fields).
    @functools.cached_property
    def dispatch_token(self) -> ep_layout.TokenLayout:
        return ep_layout.make_dispatch_token_layout(
            self.hidden, self.elem_size, self.num_sf_packs, self.num_topk
        )

    @functools.cached_property
    def combine_token(self) -> ep_layout.TokenLayout:
        return ep_layout.make_combine_token_layout(self.hidden, self.num_topk)

    @property
    def is_hybrid(self) -> bool:
        return self.num_scaleup_ranks < self.num_ranks

    @property
    def is_direct_xnode(self) -> bool:
        """Direct mode across nodes: one logical domain of every rank, nodes of num_nvlink_ranks ranks."""
        return self.num_nvlink_ranks < self.num_ranks and not self.is_hybrid

    @property
    def num_nodes(self) -> int:
        """Nodes of num_nvlink_ranks ranks (S_o in hybrid mode)."""
        return self.num_ranks // self.num_nvlink_ranks

    @property
    def message_bytes(self) -> int:
        """A hybrid scale-out message: the dispatch token and K int32 destination slots (hybrid.cuh)."""
        return self.dispatch_token.get_num_bytes() + ep_layout.align(4 * self.num_topk, 32)

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @functools.cached_property
    def smem_slot_bytes(self) -> int:
        """One warp's shared-memory token slot (token.cuh `kSmemSlotBytes`): the dispatch token, 128-aligned; in
        hybrid mode the scale-out message (token + K slots, hybrid.cuh `kSlotBytes`)."""
        if self.is_hybrid:
            return ep_layout.align(self.message_bytes, 128)
        return ep_layout.align(self.dispatch_token.get_num_bytes(), 128)

    @property
    def dynamic_smem_bytes(self) -> int:
        """Dynamic shared memory of the dispatch and epilogue kernels (one token slot per warp)."""
        return self.num_warps * self.smem_slot_bytes

    @property
    def combine_dynamic_smem_bytes(self) -> int:
        """Dynamic shared memory that lets the direct combine stage rows with bulk (TMA) copies: one bf16 row per
        warp (combine.cuh `kCombineSlotBytes`), or 0 when that does not fit next to the static reserve (the
        kernel then keeps its register path; it checks the launch's dynamic size itself, so 0 is always valid).
        Hybrid and cross-node combines ignore it."""
        need = self.num_warps * ep_layout.align(self.hidden * 2, 128)
        return need if need + STATIC_SMEM_RESERVE_BYTES <= SMEM_PER_BLOCK_BYTES else 0

    def defines(self) -> dict[str, object]:
        """The -D constants of the generated source."""
        transport = "ep_core::IpcTransport" if self.transport == "ipc" else "ep_core::NcclTransport"
        out: dict[str, object] = {}
        if self.is_hybrid or self.is_direct_xnode:  # several nodes: the ranks of one node, the scale-out
            if self.is_hybrid:
                node = out["EP_CORE_NUM_SCALEUP_RANKS"] = self.num_scaleup_ranks
            else:
                node = out["EP_CORE_NUM_NODE_RANKS"] = self.num_nvlink_ranks
            if self.scaleout == "gin":
                out["EP_CORE_SCALEOUT"] = "ep_core::GinScaleout"
                # NCCL's LSA team is one node: its load/store peers are indexed by the local rank
                transport = f"ep_core::NodeLsaTransport<{node}>"
            else:
                out["EP_CORE_SCALEOUT"] = "ep_core::EmulatedScaleout"
        return out | {
            "EP_CORE_NUM_RANKS": self.num_ranks,
            "EP_CORE_NUM_TOPK": self.num_topk,
            "EP_CORE_HIDDEN_BYTES": self.hidden * self.elem_size,
            "EP_CORE_COMBINE_HIDDEN_BYTES": self.hidden * 2,
            "EP_CORE_NUM_SF_PACKS": self.num_sf_packs,
            "EP_CORE_NUM_WARPS": self.num_warps,
            "EP_CORE_TRANSPORT": transport,
        }


def default_num_warps(slot_bytes: int, smem_per_block: int = SMEM_PER_BLOCK_BYTES) -> int:
    """As many warps as token slots fit in shared memory, at most DEFAULT_NUM_WARPS."""
    fit = (smem_per_block - STATIC_SMEM_RESERVE_BYTES) // slot_bytes
    if fit < 1:
        raise EPConfigError(
            f"hidden: one token slot of {slot_bytes} bytes does not fit in shared memory ({smem_per_block} bytes "
            "per block); use a smaller hidden size"
        )
    return int(min(DEFAULT_NUM_WARPS, fit))


def scratch_bytes(num_ranks: int, num_experts: int, num_max_tokens: int, num_scaleup_ranks: int = 0) -> int:
    """Bytes of the rank-private scratch (mirror of args.cuh `Scratch`); hybrid mode adds the per-source prefix
    and the node-slot counters (hybrid.cuh `hybrid_psum_src`, 8 * N bytes)."""
    epr = num_experts // num_ranks
    words = (num_max_tokens + 31) // 32
    counters = 4 * (2 * num_ranks + num_experts + 2 * epr + num_experts)
    bitmaps = 2 * 4 * (num_ranks + num_experts) * words
    hybrid = 8 * num_ranks if 0 < num_scaleup_ranks < num_ranks else 0
    return SCRATCH_HEADER_BYTES + counters + bitmaps + hybrid


@dataclass(frozen=True)
class HybridRegions:
    """Bytes of the hybrid receive area (mirror of hybrid.cuh `HybridRegions`), for one configuration.

    Dispatch: `[tokens N x M | messages S_o x M | count blocks S_o | gin: send stage S_o x M, count stage S_o]`
    (the tokens land exactly as in direct mode). Combine: `[stage K x S_o x M | final K x M | gin: send stage
    S_o x K x M]` of combine tokens. DeepEP's sizes (behaviour doc section 2.4) are per channel; these are per
    (node, token), the bound when every token goes to every node.
    """

    tokens: int
    messages: int
    count_blocks: int
    send_stage: int
    combine_stage: int
    combine_final: int
    combine_send_stage: int

    @property
    def dispatch_bytes(self) -> int:
        return self.tokens + self.messages + self.count_blocks + self.send_stage

    @property
    def combine_bytes(self) -> int:
        return self.combine_stage + self.combine_final + self.combine_send_stage

    @classmethod
    def of(cls, config: KernelConfig, num_experts: int, num_max_tokens: int) -> HybridRegions:
        n, su, so, k, m = (
            config.num_ranks,
            config.num_scaleup_ranks,
            config.num_nodes,
            config.num_topk,
            num_max_tokens,
        )
        epr = num_experts // n
        tok = config.dispatch_token.get_num_bytes()
        comb = config.combine_token.get_num_bytes()
        cnt = ep_layout.align(4 * (su + su * epr), 32)
        gin = config.scaleout == "gin"
        return cls(
            tokens=n * m * tok,
            messages=so * m * config.message_bytes,
            count_blocks=so * cnt,
            send_stage=(so * m * config.message_bytes + so * cnt) if gin else 0,
            combine_stage=k * so * m * comb,
            combine_final=k * m * comb,
            combine_send_stage=so * k * m * comb if gin else 0,
        )


@dataclass(frozen=True)
class RegionPlan:
    """Byte offsets inside one rank's symmetric allocation `[workspace | data]`.

    The dispatch receive region `[N][M]` of dispatch tokens and the combine receive region `[slots][M]` of
    combine tokens both start at `recv_offset` (combine reuses the bytes: every combine begins with a barrier that
    waits for every rank's copy epilogue). `scratch_offset` is the workspace's reserved region when the scratch
    fits there, else -1 (the executor allocates it separately).
    """

    workspace_offset: int
    recv_offset: int
    dispatch_bytes: int
    combine_bytes: int
    scratch_offset: int
    scratch_bytes: int
    total_bytes: int


def plan_regions(
    config: KernelConfig,
    num_experts: int,
    num_max_tokens: int,
    data_bytes: int | None = None,
    *,
    op: str | None = None,
    allow_multiple_reduction: bool | None = None,
) -> RegionPlan:
    """Regions for `config`; `data_bytes` is the GPU buffer after the workspace (default: exactly what is needed).
    `op` ("dispatch", "combine" or None = both) and `allow_multiple_reduction` (None = both combine layouts) say
    which receive regions must fit in `data_bytes`.

    A pure function of its arguments: memoized per (config, num_experts, num_max_tokens, data_bytes, op,
    allow_multiple_reduction) when they are plain ints (the plan is immutable; errors are never cached)."""
    amr = None if allow_multiple_reduction is None else bool(allow_multiple_reduction)
    if (
        type(config) is KernelConfig
        and type(num_experts) is int
        and type(num_max_tokens) is int
        and (data_bytes is None or type(data_bytes) is int)
        and (op is None or type(op) is str)
    ):
        return _plan_regions_cached(config, num_experts, num_max_tokens, data_bytes, op, amr)
    return _plan_regions(config, num_experts, num_max_tokens, data_bytes, op, amr)


@functools.lru_cache(maxsize=1024)
def _plan_regions_cached(
    config: KernelConfig,
    num_experts: int,
    num_max_tokens: int,
    data_bytes: int | None,
    op: str | None,
    amr: bool | None,
) -> RegionPlan:
    return _plan_regions(config, num_experts, num_max_tokens, data_bytes, op, amr)


def _plan_regions(
    config: KernelConfig,
    num_experts: int,
    num_max_tokens: int,
    data_bytes: int | None,
    op: str | None,
    allow_multiple_reduction: bool | None,
) -> RegionPlan:
    if num_experts % config.num_ranks:
        raise EPConfigError(
            f"num_experts: expected a multiple of num_ranks={config.num_ranks}, got {num_experts}"
        )
    if num_experts > ep_layout.NUM_MAX_EXPERTS or num_experts // config.num_ranks > 256:
        raise EPConfigError(
            f"num_experts: expected <= {ep_layout.NUM_MAX_EXPERTS} and <= 256 per rank, got {num_experts}"
        )
    if config.is_hybrid:
        hybrid = HybridRegions.of(config, num_experts, num_max_tokens)
        dispatch, combine = hybrid.dispatch_bytes, hybrid.combine_bytes
    else:
        # direct mode across nodes over gin adds DeepEP's send buffers (direct_xnode.cuh stages its puts there)
        staged = config.is_direct_xnode and config.scaleout == "gin"
        topo = ep_layout.Topology(config.num_ranks, is_scaleup_nvlink=not staged)
        dispatch = ep_layout.DirectDispatchBuffers(
            config.dispatch_token, topo, num_max_tokens
        ).get_num_bytes()
        amrs = (True, False) if allow_multiple_reduction is None else (bool(allow_multiple_reduction),)
        combine = max(
            ep_layout.DirectCombineBuffers(config.combine_token, topo, num_max_tokens, amr).get_num_bytes()
            for amr in amrs
        )
    need = {"dispatch": dispatch, "combine": combine, None: max(dispatch, combine)}[op]
    data = need if data_bytes is None else int(data_bytes)
    if data < need:
        raise EPConfigError(
            f"buffer: the GPU buffer holds {data} bytes but this configuration needs {need} "
            f"(dispatch {dispatch}, combine {combine}); allocate with get_buffer_size_hint()"
        )
    ws = ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
    sb = scratch_bytes(config.num_ranks, num_experts, num_max_tokens, config.num_scaleup_ranks)
    reserved = ep_layout.WorkspaceLayout.RESERVED_OFFSET
    scratch_offset = reserved if sb <= ep_layout.NUM_RESERVED_BYTES else -1
    return RegionPlan(0, ws, dispatch, combine, scratch_offset, sb, ws + data)


@dataclass(frozen=True)
class LaunchGeometry:
    grid: int
    block: int
    shared_mem: int  # dispatch and copy epilogue; the combine kernel uses none


def launch_geometry(config: KernelConfig, num_sms: int, device_sms: int) -> LaunchGeometry:
    """One block of `config.num_warps` warps per SM; `num_sms` blocks for every kernel of the op."""
    if type(num_sms) is int and type(device_sms) is int and type(config) is KernelConfig:
        return _launch_geometry_cached(config, num_sms, device_sms)
    return _launch_geometry(config, num_sms, device_sms)


@functools.lru_cache(maxsize=1024)
def _launch_geometry_cached(config: KernelConfig, num_sms: int, device_sms: int) -> LaunchGeometry:
    return _launch_geometry(config, num_sms, device_sms)


def _launch_geometry(config: KernelConfig, num_sms: int, device_sms: int) -> LaunchGeometry:
    if not 1 <= num_sms <= device_sms:
        raise EPValueError(f"num_sms: expected 1..{device_sms} (device SMs), got {num_sms}")
    return LaunchGeometry(num_sms, config.num_threads, config.dynamic_smem_bytes)


def rank_sm_share(device_sms: int, num_ranks_on_device: int = 1) -> int:
    """The SMs one rank may use: its device's, split between the ranks that share it (at least 1)."""
    return max(1, device_sms // max(1, num_ranks_on_device))


def check_epilogue_sms(epilogue_sms: int, device_sms: int, num_ranks_on_device: int = 1) -> int:
    """The copy epilogue's SM count of a rank (`RankDriver.epilogue_geometry`): 0 runs it on the op's `num_sms`;
    n > 0 on at least n SMs, at most this rank's share of the device (`rank_sm_share`)."""
    share = rank_sm_share(device_sms, num_ranks_on_device)
    if type(epilogue_sms) is not int or not 0 <= epilogue_sms <= share:
        raise EPValueError(
            f"epilogue_sms: expected an int in 0..{share} (0: the op's num_sms; at most this rank's share of the "
            f"{device_sms} device SMs, {num_ranks_on_device} rank(s) on it), got {epilogue_sms!r}"
        )
    return epilogue_sms


def epilogue_share(prefer_overlap_with_compute: bool, device_sms: int, num_ranks_on_device: int = 1) -> int:
    """`epilogue_sms` for a buffer's `prefer_overlap_with_compute`: True keeps the copy epilogue on the op's SMs (the
    rest stay free for compute the whole time); False runs it on the rank's share of the device, as DeepEP V2 runs
    its epilogues on every SM."""
    if prefer_overlap_with_compute:
        return 0
    return rank_sm_share(device_sms, num_ranks_on_device)


def check_coresident(num_ranks_on_device: int, num_sms: int, device_sms: int) -> None:
    """Ranks sharing one GPU wait on each other inside their kernels, so every block of every rank must be
    resident at once: `ranks * num_sms <= device SMs` (one persistent block per SM)."""
    total = num_ranks_on_device * num_sms
    if total > device_sms:
        raise EPConfigError(
            f"num_sms: {num_ranks_on_device} ranks on one GPU x {num_sms} SMs = {total} SMs, but the device has "
            f"{device_sms}; kernels of all ranks must be co-resident (they wait on each other): use num_sms <= "
            f"{device_sms // num_ranks_on_device}"
        )


DEFAULT_SHARED_NUM_SMS = 16
"""SMs per rank by default when ranks share a device (or when the planner cannot run): the V2.5 planner's EP8
figure, and small enough that eight ranks fit one 132-SM GPU together."""


def default_num_sms(device_sms: int, num_ranks_on_device: int, planner_sms: int = 0) -> int:
    """SMs of one rank's kernels when the caller passes none.

    Ranks that share a device split it: `min(16, device_sms // num_ranks_on_device)` (at least 1), so that every
    block of every rank is resident at once. A rank alone on its device uses the planner's count (`planner_sms`,
    the device's SMs alone decide the cap), or 16 (capped by the device) when the planner could not run.
    """
    if num_ranks_on_device < 1:
        raise EPConfigError(f"num_ranks_on_device: expected >= 1, got {num_ranks_on_device}")
    if num_ranks_on_device > 1:
        return min(DEFAULT_SHARED_NUM_SMS, rank_sm_share(device_sms, num_ranks_on_device))
    if planner_sms > 0:
        return max(1, min(int(planner_sms), device_sms))
    return max(1, min(DEFAULT_SHARED_NUM_SMS, device_sms))


def check_occupancy(
    kernel: str,
    blocks_per_sm: int,
    num_sms: int,
    device_sms: int,
    num_ranks_on_device: int,
    *,
    threads: int,
    shared_mem: int,
) -> None:
    """The grid of `num_sms` blocks must be resident at once (its blocks wait for each other in grid barriers):
    `blocks_per_sm` (the driver's occupancy for this block size and shared memory) must be >= 1 and the device must
    hold the grids of every rank on it, `num_ranks_on_device * num_sms <= blocks_per_sm * device_sms`."""
    if blocks_per_sm < 1:
        raise EPConfigError(
            f"{kernel}: a block of {threads} threads with {shared_mem} bytes of dynamic shared memory does not fit "
            "on one SM (registers or shared memory exceed the SM); use fewer warps (num_warps) or a smaller hidden"
        )
    capacity = blocks_per_sm * device_sms
    need = num_ranks_on_device * num_sms
    if need > capacity:
        per_rank = capacity // num_ranks_on_device
        raise EPConfigError(
            f"num_sms: {kernel} needs {need} co-resident blocks ({num_ranks_on_device} rank(s) on this device x "
            f"{num_sms}), but the device holds {capacity} ({blocks_per_sm} per SM x {device_sms} SMs) of "
            f"{threads} threads and {shared_mem} bytes of shared memory; use num_sms <= {per_rank}"
        )


def combine_smem(cfg: KernelConfig) -> int:
    """The combine launch's dynamic shared memory: the direct combine stages rows through it with bulk copies
    (`KernelConfig.combine_dynamic_smem_bytes`, 0 when it does not fit: the register path); hybrid and cross-node
    combines do not use it (helper-latency's request 3, issue 17)."""
    if cfg.is_hybrid or cfg.is_direct_xnode:
        return 0
    return cfg.combine_dynamic_smem_bytes
