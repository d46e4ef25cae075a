"""Analytic planner: buffer size hint, SM count, QP counts, bandwidth detection (SPEC §4-5, behaviour doc §2-3).

SM model (`explain` returns every intermediate):

1. `expected(g) = g * (1 - C(E - E/g, K) / C(E, K))`: expected distinct groups a token touches when the E experts
   are split into g equal groups; `ekt = expected(N)`, `est = expected(S_o)` (0 in direct mode).
2. Traffic per received token copy, starting from `read = 1/ekt`:
   hybrid: `write = 1/ekt + est/(ekt*S_o) + 1`, `rdma = est*(1 - 1/S_o)/ekt`, `read += est/ekt`,
   `nvl = 1 - 1/S_u`; direct: `write = [num_rdma_ranks > 1]/ekt + nvl_ranks/N`,
   `nvl = (nvl_ranks/N)(1 - 1/nvl_ranks)`, `rdma = (N - nvl_ranks)/N` (never the bound in direct mode).
3. Bound link: RDMA if hybrid and `rdma/rdma_gbs > nvl/nvlink_gbs`, else NVLink.
4. `raw = max(B/T * read / sm_read_gbs, B/T * write / sm_write_gbs)` (B, T: bound bandwidth and traffic; the
   dispatch); `PlannerPolicy.V2_5` adds the combine's `B/T * (write - nvl) / sm_read_gbs` and
   `B/T * (read + nvl) / sm_write_gbs` (DeepEP 2.5's `EPBuffer`); device SMs when the bound traffic is 0.
5. `n = align(max(4, ceil(margin * raw)), a)`; at least 64 unless `prefer_overlap_with_compute`; at most the cap.
   `PlannerPolicy.V2`: margin 1.25, a = 2, cap = device SMs, per-SM rates 200 / 50 GB/s (read / write).
   `PlannerPolicy.V2_5`: margin 1.3, a = 4, cap = device SMs rounded down to even, per-SM rates 180 / 45 GB/s
   (DeepEP 2.5's `get_sm_read_gbs` / `get_sm_write_gbs`). A rate of 0 (the default) means the policy's.

Bandwidths (looked up only when the model needs them; a failure is an `EPConfigError` naming the variable): an
explicit argument, then `EPKIT_NVLINK_GBS` / `EPKIT_RDMA_GBS`, then detection: NVLink, the sum of the first GPU's
link speeds (`nvidia-smi nvlink -s`) x 0.9; RDMA, the NIC rate / 8 (sysfs or `ibstat`). Without NVLink the
scale-up path stands in (`detect_scaleup_gbs`): ranks sharing one GPU, the device copy bandwidth (memory clock x
bus width, read plus write, x 0.9); GPUs on PCIe, the link (the generation's per-lane rate x width x 0.9). The
plan's `scaleup_path` says which ("argument", "env", "nvlink", "same_gpu", "pcie"; "" when not needed).
"""

from __future__ import annotations

import enum
import math
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from ep_core._env import knobs
from ep_core.errors import EPConfigError
from ep_core.topology import MAX_TOPK, Topology

__all__ = [
    "DIRECT_NUM_ALLOCATED_QPS",
    "HYBRID_NUM_ALLOCATED_QPS",
    "HYBRID_NUM_ALLOCATED_QPS_FAST_ATOMICS",
    "MemoryPlan",
    "PlannerPolicy",
    "SMPlan",
    "default_num_allocated_qps",
    "detect_fast_rdma_atomics",
    "detect_nvlink_gbs",
    "detect_rdma_gbs",
    "detect_scaleup_gbs",
    "expected_num_groups",
    "explain",
    "explain_memory",
    "get_buffer_size_hint",
    "get_theoretical_num_qps",
    "get_theoretical_num_sms",
    "hybrid_kernel_bytes",
    "parse_ibstat",
    "parse_nvidia_smi_nvlink",
    "parse_nvidia_smi_pcie",
]

DIRECT_NUM_ALLOCATED_QPS = 17
HYBRID_NUM_ALLOCATED_QPS = 129
HYBRID_NUM_ALLOCATED_QPS_FAST_ATOMICS = 65
NVLINK_EFFICIENCY = 0.9
# GB/s per lane and direction after line encoding, by PCIe generation (the fallback path without NVLink).
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
FAST_ATOMICS_CA_TYPE = "MT4131"


class PlannerPolicy(enum.Enum):
    """Margin and rounding of the SM count: the two designs of the seeds."""

    # (margin, SM alignment, cap rounded down to even, per-SM read / write GB/s, the combine's terms counted)
    V2 = (1.25, 2, False, 200.0, 50.0, False)  # DeepEP V2 (ElasticBuffer)
    V2_5 = (1.3, 4, True, 180.0, 45.0, True)  # DeepEP 2.5 (EPBuffer)

    @property
    def margin(self) -> float:
        return self.value[0]

    @property
    def sm_alignment(self) -> int:
        return self.value[1]

    def cap(self, num_device_sms: int) -> int:
        return num_device_sms // 2 * 2 if self.value[2] else num_device_sms

    @property
    def sm_gbs(self) -> tuple[float, float]:
        """The default per-SM HBM (read, write) GB/s."""
        return self.value[3], self.value[4]

    @property
    def counts_combine(self) -> bool:
        """Whether the SM count also covers the combine's traffic (step 4)."""
        return self.value[5]


@dataclass(frozen=True)
class SMPlan:
    """Every intermediate of the SM model (see the module doc)."""

    policy: str
    num_experts: int
    num_topk: int
    num_scaleout_ranks: int
    num_scaleup_ranks: int
    num_rdma_ranks: int
    num_nvlink_ranks: int
    expected_scaleout_groups: float  # est
    expected_rank_groups: float  # ekt
    read_traffic: float
    write_traffic: float
    nvlink_traffic: float
    rdma_traffic: float
    nvlink_gbs: float
    rdma_gbs: float
    bound: str  # "nvlink", "rdma" or "none" (no inter-rank traffic)
    bound_traffic: float
    bound_gbs: float
    raw_num_sms: float
    num_device_sms: int
    num_sms: int
    # Where nvlink_gbs came from: "argument", "env", "nvlink", "same_gpu" (device copy), "pcie", "" (not needed).
    scaleup_path: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def expected_num_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups among K distinct experts drawn from E split into `num_groups` groups."""
    if num_groups < 1 or num_experts % num_groups:
        raise EPConfigError(f"num_experts: expected a multiple of {num_groups} groups, got {num_experts}")
    if not 0 < num_topk <= num_experts:
        raise EPConfigError(f"num_topk: expected 1 <= num_topk <= num_experts={num_experts}, got {num_topk}")
    miss = math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk)
    return num_groups * (1 - miss)


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EPConfigError(f"{name}: expected a positive int, got {value!r}")
    return value


def explain(
    topology: Topology,
    num_experts: int,
    num_topk: int,
    *,
    num_device_sms: int,
    nvlink_gbs: float | None = None,
    rdma_gbs: float | None = None,
    sm_read_gbs: float = 0,
    sm_write_gbs: float = 0,
    prefer_overlap_with_compute: bool = True,
    num_scaleout_topk: int = 0,
    policy: PlannerPolicy = PlannerPolicy.V2_5,
) -> SMPlan:
    """Run the SM model and return all intermediates; `get_theoretical_num_sms` returns `.num_sms`."""
    if num_scaleout_topk != 0:
        raise EPConfigError(f"num_scaleout_topk: only 0 is supported, got {num_scaleout_topk}")
    if not isinstance(policy, PlannerPolicy):
        raise EPConfigError(f"policy: expected a PlannerPolicy (V2 or V2_5), got {policy!r}")
    _check_positive_int("num_device_sms", num_device_sms)
    _check_positive_int("num_topk", num_topk)
    if num_topk > MAX_TOPK:
        raise EPConfigError(f"num_topk: expected at most {MAX_TOPK}, got {num_topk}")
    topology.check_num_experts(num_experts)
    if sm_read_gbs < 0 or sm_write_gbs < 0:
        raise EPConfigError(
            f"sm_read_gbs/sm_write_gbs: expected > 0 (0 = the policy's), got {sm_read_gbs}/{sm_write_gbs}"
        )
    sm_read_gbs = sm_read_gbs or policy.sm_gbs[0]
    sm_write_gbs = sm_write_gbs or policy.sm_gbs[1]
    n = topology.num_ranks
    so, su = topology.logical_domain_size
    rdma_ranks, nvl_ranks = topology.physical_domain_size
    est = expected_num_groups(num_experts, num_topk, so) if so > 1 else 0.0
    ekt = expected_num_groups(num_experts, num_topk, n)
    read, write, rdma, nvl = 1 / ekt, 0.0, 0.0, 0.0
    if so > 1:
        write += 1 / ekt
        write += (1 / ekt) * (est / so)
        rdma += (1 / ekt) * est * (1 - 1 / so)
        read += est / ekt
        write += 1
        nvl += 1 - 1 / su
    else:
        if rdma_ranks > 1:
            write += 1 / ekt
        write += nvl_ranks / n
        nvl += (nvl_ranks / n) * (1 - 1 / nvl_ranks)
        rdma += (n - nvl_ranks) / n

    nvl_bw = rdma_bw = 0.0
    if so > 1:
        nvl_bw, path = _scaleup_bandwidth(nvlink_gbs, n) if nvl > 0 else (_bandwidth_or_zero(nvlink_gbs), "")
        rdma_bw = _bandwidth(rdma_gbs, detect_rdma_gbs)
        nvl_time = nvl / nvl_bw if nvl > 0 else 0.0
        if rdma / rdma_bw > nvl_time:
            bound, traffic, bw = "rdma", rdma, rdma_bw
        else:
            bound, traffic, bw = "nvlink", nvl, nvl_bw
    else:
        bound, traffic = "nvlink", nvl
        nvl_bw, path = _scaleup_bandwidth(nvlink_gbs, n) if nvl > 0 else (_bandwidth_or_zero(nvlink_gbs), "")
        rdma_bw = _bandwidth_or_zero(rdma_gbs)
        bw = nvl_bw
    if traffic > 0:
        raw = max(bw / traffic * read / sm_read_gbs, bw / traffic * write / sm_write_gbs)
        if policy.counts_combine:
            raw = max(
                raw, bw / traffic * (write - nvl) / sm_read_gbs, bw / traffic * (read + nvl) / sm_write_gbs
            )
    else:
        bound, raw = "none", float(num_device_sms)
    a = policy.sm_alignment
    sms = max(4, math.ceil(raw * policy.margin))
    sms = (sms + a - 1) // a * a
    if not prefer_overlap_with_compute:
        sms = max(sms, 64)
    sms = min(sms, policy.cap(num_device_sms))
    plan = SMPlan(
        policy=policy.name,
        num_experts=num_experts,
        num_topk=num_topk,
        num_scaleout_ranks=so,
        num_scaleup_ranks=su,
        num_rdma_ranks=rdma_ranks,
        num_nvlink_ranks=nvl_ranks,
        expected_scaleout_groups=est,
        expected_rank_groups=ekt,
        read_traffic=read,
        write_traffic=write,
        nvlink_traffic=nvl,
        rdma_traffic=rdma,
        nvlink_gbs=nvl_bw,
        rdma_gbs=rdma_bw,
        bound=bound,
        bound_traffic=traffic,
        bound_gbs=bw,
        raw_num_sms=raw,
        num_device_sms=num_device_sms,
        num_sms=sms,
        scaleup_path=path,
    )
    if knobs.buffer_debug:
        print(f"[ep_core.planner] {plan}")
    return plan


def get_theoretical_num_sms(
    topology: Topology,
    num_experts: int,
    num_topk: int,
    *,
    num_device_sms: int,
    nvlink_gbs: float | None = None,
    rdma_gbs: float | None = None,
    sm_read_gbs: float = 0,
    sm_write_gbs: float = 0,
    prefer_overlap_with_compute: bool = True,
    num_scaleout_topk: int = 0,
    policy: PlannerPolicy = PlannerPolicy.V2_5,
) -> int:
    """SMs a dispatch/combine should use so that the bound link, not the SMs, limits it (module doc).

    `nvlink_gbs` / `rdma_gbs`: None or 0 = environment override, else detection (only when needed).
    """
    return explain(
        topology,
        num_experts,
        num_topk,
        num_device_sms=num_device_sms,
        nvlink_gbs=nvlink_gbs,
        rdma_gbs=rdma_gbs,
        sm_read_gbs=sm_read_gbs,
        sm_write_gbs=sm_write_gbs,
        prefer_overlap_with_compute=prefer_overlap_with_compute,
        num_scaleout_topk=num_scaleout_topk,
        policy=policy,
    ).num_sms


def default_num_allocated_qps(topology: Topology, fast_rdma_atomics: bool | None = None) -> int:
    """QPs allocated when the user passes 0: 17 without the hybrid flag; with it 65 on NICs with fast RDMA
    atomics (CA type MT4131), else 129. `fast_rdma_atomics=None` detects it (False when undetectable)."""
    if not topology.allow_hybrid_mode:
        return DIRECT_NUM_ALLOCATED_QPS
    fast = detect_fast_rdma_atomics() if fast_rdma_atomics is None else fast_rdma_atomics
    return HYBRID_NUM_ALLOCATED_QPS_FAST_ATOMICS if fast else HYBRID_NUM_ALLOCATED_QPS


def get_theoretical_num_qps(topology: Topology, num_sms: int, num_allocated_qps: int = 0) -> int:
    """`min(num_sms, 9)`, or `16*num_sms + 1` when the hybrid flag is set (one extra QP for the notify warps),
    capped by the allocated QPs (`0` = `default_num_allocated_qps`)."""
    _check_positive_int("num_sms", num_sms)
    if not isinstance(num_allocated_qps, int) or num_allocated_qps < 0:
        raise EPConfigError(
            f"num_allocated_qps: expected an int >= 0 (0 = default), got {num_allocated_qps!r}"
        )
    allocated = num_allocated_qps or default_num_allocated_qps(topology)
    qps = num_sms * 16 + 1 if topology.allow_hybrid_mode else min(num_sms, 9)
    return min(qps, allocated)


def get_buffer_size_hint(
    topology: Topology,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
    allow_multiple_reduction: bool = True,
) -> int:
    """GPU buffer bytes: `align(max(dispatch_bytes, combine_bytes), 2 MiB)` from ep_layout's byte math
    (`K = 0` sized as 32; FP8 scales as `ceil(hidden/32)` packs). The workspace comes on top."""
    import ep_layout

    _check_positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    _check_positive_int("hidden", hidden)
    if not isinstance(num_topk, int) or not 0 <= num_topk <= MAX_TOPK:
        raise EPConfigError(
            f"num_topk: expected an int in [0, {MAX_TOPK}] (0 = size for {MAX_TOPK}), got {num_topk!r}"
        )
    try:
        hint = ep_layout.size_hint_bytes(
            topology.to_layout(),
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            bool(use_fp8_dispatch),
            bool(allow_multiple_reduction),
        )
    except ValueError as exc:
        raise EPConfigError(str(exc)) from exc
    if topology.is_hybrid:
        hint = max(hint, hybrid_kernel_bytes(topology, num_max_tokens_per_rank, hidden, num_topk or MAX_TOPK))
    return hint


def hybrid_kernel_bytes(topology: Topology, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
    """GPU buffer bytes the hybrid kernels need (`ep_core.kernels.plan.HybridRegions`: per (node, token) regions,
    the count blocks sized for the most experts per rank), aligned to 2 MiB. Their combine stage holds one row per
    (lane, source node, token), more than DeepEP's channel buffers (behaviour doc section 2.4) for few nodes, so the
    size hint of a hybrid topology is the larger of the two."""
    import ep_layout

    from ep_core.kernels.plan import KernelConfig, plan_regions

    n = topology.num_ranks
    cfg = KernelConfig(n, num_topk, hidden, num_scaleup_ranks=topology.num_scaleup_ranks)
    most = min(ep_layout.NUM_MAX_EXPERTS, 256 * n) // n * n
    plan = plan_regions(cfg, most, num_max_tokens_per_rank)
    return ep_layout.align(max(plan.dispatch_bytes, plan.combine_bytes), ep_layout.NUM_SYMMETRIC_ALIGN_BYTES)


# ------------------------------------------------------------------------------------------------------------
# bandwidth detection


def _bandwidth_or_zero(given: float | None) -> float:
    return float(given) if given else 0.0


def _bandwidth(given: float | None, detect) -> float:
    if given is not None and given < 0:
        raise EPConfigError(f"bandwidth: expected GB/s >= 0 (0 = detect), got {given}")
    return float(given) if given else detect()


def _scaleup_bandwidth(given: float | None, num_ranks: int) -> tuple[float, str]:
    if given is not None and given < 0:
        raise EPConfigError(f"nvlink_gbs: expected GB/s >= 0 (0 = detect), got {given}")
    return (float(given), "argument") if given else detect_scaleup_gbs(num_ranks)


def parse_nvidia_smi_pcie(text: str) -> float:
    """GB/s of the first GPU's PCIe link from `nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max
    --format=csv,noheader,nounits` output ("5, 16"): per-lane rate x width, no efficiency (0.0 when unreadable)."""
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s*,\s*(\d+)\s*$", line)
        if m:
            gen, width = int(m.group(1)), int(m.group(2))
            return PCIE_LANE_GBS.get(gen, 0.0) * width
    return 0.0


def _num_gpus() -> int:
    return sum(1 for line in _run(["nvidia-smi", "-L"]).splitlines() if line.startswith("GPU "))


def _device_copy_gbs() -> float:
    """Device-to-device copy GB/s of the current GPU: peak memory bandwidth (2 x memory clock x bus width, DDR)
    halved (a copy reads and writes) x 0.9. 0.0 when the driver cannot say."""
    try:
        from ep_core.kernels import _cuda

        khz = _cuda.device_attribute("CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE")
        bits = _cuda.device_attribute("CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH")
    except Exception:  # no driver, no device, or an attribute this driver dropped
        return 0.0
    return 2 * khz * 1e3 * bits / 8 / 1e9 / 2 * NVLINK_EFFICIENCY


def detect_scaleup_gbs(num_ranks: int = 2) -> tuple[float, str]:
    """`(GB/s, path)` of the scale-up peers' path: `EPKIT_NVLINK_GBS` ("env"), else NVLink ("nvlink"), else, with
    one GPU on the machine and several ranks, the device copy bandwidth ("same_gpu"), else the PCIe link ("pcie")."""
    env = knobs.nvlink_gbs
    if env > 0:
        return env, "env"
    total = parse_nvidia_smi_nvlink(_run(["nvidia-smi", "nvlink", "-s"]))
    if total > 0:
        return total * NVLINK_EFFICIENCY, "nvlink"
    if num_ranks > 1 and _num_gpus() == 1:
        copy = _device_copy_gbs()
        if copy > 0:
            return copy, "same_gpu"
    query = [
        "nvidia-smi",
        "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
        "--format=csv,noheader,nounits",
    ]
    pcie = parse_nvidia_smi_pcie(_run(query))
    if pcie > 0:
        return pcie * NVLINK_EFFICIENCY, "pcie"
    raise EPConfigError(
        "nvlink_gbs: could not detect the scale-up bandwidth (nvidia-smi reported no NVLink links, the device "
        "copy bandwidth of a shared GPU and the PCIe link are unknown); pass nvlink_gbs= or set "
        "EPKIT_NVLINK_GBS=<GB/s per GPU>"
    )


def parse_nvidia_smi_nvlink(text: str) -> float:
    """Sum of the `Link k: X GB/s` speeds of the first GPU block of `nvidia-smi nvlink -s` output (no 0.9)."""
    total = 0.0
    seen_gpu = False
    for line in text.splitlines():
        if line.startswith("GPU "):
            if seen_gpu:
                break
            seen_gpu = True
            continue
        m = re.search(r"Link\s+\d+:\s*([0-9.]+)\s*GB/s", line)
        if m:
            total += float(m.group(1))
    return total


def parse_ibstat(text: str, nic_name: str) -> tuple[float, str]:
    """`(rate in Gb/s, CA type)` of CA `nic_name` in `ibstat` output (0.0 / "" when absent)."""
    rate, ca_type, inside = 0.0, "", False
    for line in text.splitlines():
        m = re.match(r"\s*CA '([^']+)'", line)
        if m:
            if inside:
                break
            inside = m.group(1) == nic_name
            continue
        if not inside:
            continue
        t = re.match(r"\s*CA type:\s*(\S+)", line)
        if t and not ca_type:
            ca_type = t.group(1)
        r = re.match(r"\s*Rate:\s*([0-9.]+)", line)
        if r and not rate:
            rate = float(r.group(1))
    return rate, ca_type


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def detect_nvlink_gbs() -> float:
    """NVLink GB/s: `EPKIT_NVLINK_GBS` if set, else the first GPU's link speeds x 0.9 (nvidia-smi)."""
    env = knobs.nvlink_gbs
    if env > 0:
        return env
    total = parse_nvidia_smi_nvlink(_run(["nvidia-smi", "nvlink", "-s"]))
    if total <= 0:
        raise EPConfigError(
            "nvlink_gbs: could not detect the NVLink bandwidth (nvidia-smi nvlink -s reported no links); "
            "pass nvlink_gbs= or set EPKIT_NVLINK_GBS=<GB/s per GPU>"
        )
    return total * NVLINK_EFFICIENCY


def detect_rdma_gbs() -> float:
    """RDMA GB/s: `EPKIT_RDMA_GBS` if set, else the rate of NIC `EPKIT_NIC_NAME` / 8 (sysfs, then ibstat)."""
    env = knobs.rdma_gbs
    if env > 0:
        return env
    nic = knobs.nic_name
    rate = 0.0
    try:
        text = (Path("/sys/class/infiniband") / nic / "ports" / "1" / "rate").read_text()
        m = re.match(r"\s*([0-9.]+)", text)
        rate = float(m.group(1)) if m else 0.0
    except OSError:
        pass
    if rate <= 0:
        rate = parse_ibstat(_run(["ibstat"]), nic)[0]
    if rate <= 0:
        raise EPConfigError(
            f"rdma_gbs: could not detect the RDMA bandwidth of NIC {nic!r} (no sysfs rate, no ibstat); "
            "pass rdma_gbs= or set EPKIT_RDMA_GBS=<GB/s per GPU> (or EPKIT_NIC_NAME)"
        )
    return rate / 8


def detect_fast_rdma_atomics() -> bool:
    """True when NIC `EPKIT_NIC_NAME` reports CA type MT4131 in ibstat; False otherwise or when undetectable."""
    return parse_ibstat(_run(["ibstat"]), knobs.nic_name)[1] == FAST_ATOMICS_CA_TYPE


# ------------------------------------------------------------------------------------------------------------
# elastic memory: receive regions past the GPU part (issue 20; ep_core.elastic_memory)

HOST_LINK_EFFICIENCY = 0.9


@dataclass(frozen=True)
class MemoryPlan:
    """Where a buffer's receive regions live: `[GPU part | host part]` of the data region (`num_bytes`, of which
    the last `num_cpu_bytes` are host NUMA memory when `host_memory`), and what the host part costs.

    `*_host_bytes`: bytes of the region past the GPU part (worst case: every row filled). The dispatch region of
    direct mode is `[N sources][M rows]` filled from the front of each source's rows, so under uniformly random
    routing it expects `M * ekt / N` rows per source (`expected_dispatch_host_bytes`; worst case when
    `num_experts` is not given). Each byte in host memory is written once over the host link and read once by the
    epilogue: `*_host_us` = `2 * bytes / host_gbs`, against `2 * bytes / hbm_gbs` had it fit in HBM. With the
    rank given (one NVLink domain), its own source block counts only the rows' tails: the direct dispatch stores a
    row a rank keeps without its hidden part (the copy epilogue reads that from `x`), so at EP1 almost nothing of the dispatch
    crosses the link. The combine's slots are indexed by source token: under uniform routing the fraction of them
    used is a token's chance to visit a rank (`expected_combine_host_bytes`; worst case without `num_experts`).
    """

    num_bytes: int
    num_cpu_bytes: int
    num_gpu_bytes: int
    host_memory: bool  # False: the transport kept the "host" part in GPU memory (no cost)
    dispatch_bytes: int
    combine_bytes: int
    dispatch_host_bytes: int
    combine_host_bytes: int
    expected_dispatch_host_bytes: float
    expected_combine_host_bytes: float
    hbm_gbs: float
    host_gbs: float
    host_path: str  # "argument", "pcie", "" (no host bytes or no host memory)
    dispatch_host_us: float
    dispatch_hbm_us: float
    expected_dispatch_host_us: float
    combine_host_us: float
    fits_gpu: bool  # both regions fit the GPU part (no spill)

    def as_dict(self) -> dict:
        return asdict(self)


def explain_memory(
    topology: Topology,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    num_bytes: int,
    num_cpu_bytes: int,
    *,
    num_experts: int = 0,
    use_fp8_dispatch: bool = False,
    allow_multiple_reduction: bool = True,
    host_memory: bool = True,
    hbm_gbs: float | None = None,
    host_gbs: float | None = None,
    rank: int | None = None,
) -> MemoryPlan:
    """The receive regions' placement in `[GPU num_bytes - num_cpu_bytes | host num_cpu_bytes]` (`MemoryPlan`).
    `hbm_gbs` / `host_gbs`: None = detect (device copy bandwidth; the PCIe link x 0.9), only when needed.
    `rank`: whose regions (its own rows are stored as tails only); None counts every block whole.
    A region larger than `num_bytes` raises (EPConfigError), as the dispatch would."""
    import ep_layout

    m = _check_positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    h = _check_positive_int("hidden", hidden)
    if not isinstance(num_topk, int) or not 1 <= num_topk <= MAX_TOPK:
        raise EPConfigError(f"num_topk: expected an int in [1, {MAX_TOPK}], got {num_topk!r}")
    nb = _check_positive_int("num_bytes", num_bytes)
    if not isinstance(num_cpu_bytes, int) or not 0 <= num_cpu_bytes <= nb:
        raise EPConfigError(f"num_cpu_bytes: expected an int in [0, num_bytes={nb}], got {num_cpu_bytes!r}")
    layout = topology.to_layout()
    dtok = ep_layout.get_sizing_dispatch_token(h, num_topk, bool(use_fp8_dispatch))
    ctok = ep_layout.get_sizing_combine_token(h, num_topk)
    dispatch = ep_layout.dispatch_buffer_bytes(dtok, layout, m)
    combine = ep_layout.combine_buffer_bytes(ctok, layout, m, bool(allow_multiple_reduction))
    if max(dispatch, combine) > nb:
        raise EPConfigError(
            f"num_bytes: the dispatch needs {dispatch} bytes and the combine {combine}, more than the buffer's "
            f"{nb} (GPU and host parts together); allocate with get_buffer_size_hint()"
        )
    gpu = nb - num_cpu_bytes
    d_host, c_host = max(0, dispatch - gpu), max(0, combine - gpu)
    # expected fill of the direct dispatch rows: each source's rows are used from the front
    n, tok = topology.num_ranks, dtok.get_num_bytes()
    p = 1.0
    if num_experts and not topology.is_hybrid:
        topology.check_num_experts(num_experts)
        p = expected_num_groups(num_experts, num_topk, n) / n
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n):
        raise EPConfigError(f"rank: expected an int in [0, {n}), got {rank!r}")
    if topology.is_hybrid:
        expected = float(d_host)  # the hybrid regions fill by node: worst case
        expected_c = float(c_host)
    else:
        rows = m * p * tok
        # of a kept row only [sf | metadata] is stored (one NVLink domain: direct mode across nodes stores whole rows)
        tail = (tok - dtok.num_hidden_bytes) / tok if topology.num_nvlink_ranks == n else 1.0

        def block(r: int) -> float:
            spilled = max(0.0, min(r * m * tok + rows, dispatch) - max(r * m * tok, gpu))
            return spilled * tail if r == rank else spilled

        expected = float(sum(block(r) for r in range(n)))
        expected_c = float(c_host) * p
    spill = host_memory and (d_host or c_host)
    hbm = host = 0.0
    path = ""
    if spill:
        hbm = float(hbm_gbs) if hbm_gbs else _device_copy_gbs()
        if host_gbs:
            host, path = float(host_gbs), "argument"
        else:
            query = [
                "nvidia-smi",
                "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
                "--format=csv,noheader,nounits",
            ]
            host, path = parse_nvidia_smi_pcie(_run(query)) * HOST_LINK_EFFICIENCY, "pcie"
        if host <= 0 or hbm <= 0:
            raise EPConfigError(
                "host_gbs/hbm_gbs: could not detect the host link or the HBM bandwidth (nvidia-smi, the driver); "
                "pass host_gbs= and hbm_gbs="
            )

    def us(nbytes: float, gbs: float) -> float:
        return 2 * nbytes / gbs / 1e3 if gbs > 0 else 0.0

    plan = MemoryPlan(
        num_bytes=nb,
        num_cpu_bytes=num_cpu_bytes,
        num_gpu_bytes=gpu,
        host_memory=bool(host_memory),
        dispatch_bytes=dispatch,
        combine_bytes=combine,
        dispatch_host_bytes=d_host,
        combine_host_bytes=c_host,
        expected_dispatch_host_bytes=expected,
        expected_combine_host_bytes=expected_c,
        hbm_gbs=hbm,
        host_gbs=host,
        host_path=path,
        dispatch_host_us=us(d_host, host) if spill else 0.0,
        dispatch_hbm_us=us(d_host, hbm) if spill else 0.0,
        expected_dispatch_host_us=us(expected, host) if spill else 0.0,
        combine_host_us=us(c_host, host) if spill else 0.0,
        fits_gpu=not (d_host or c_host),
    )
    if knobs.buffer_debug:
        print(f"[ep_core.planner] {plan}")
    return plan
