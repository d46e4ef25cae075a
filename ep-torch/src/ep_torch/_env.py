"""Every environment knob of ep_torch, read here only (prefix ``EPKIT_``).

| variable | type | default | meaning |
|---|---|---|---|
| ``EPKIT_AVOID_RECORD_STREAM`` | bool | ``0`` | keep async operands alive in the returned ``EventOverlap`` instead of calling ``record_stream`` (needed inside CUDA graphs) |
| ``EPKIT_TORCH_TRANSPORT`` | str | ``""`` | force the backend of new buffers: ``reference`` (CPU, torch.distributed collectives), ``ipc`` or ``nccl``; empty = automatic |
| ``EPKIT_TORCH_NCCL_COMM`` | str | ``auto`` | nccl transport's communicator: ``group`` (borrow the ProcessGroupNCCL's), ``own`` (create one per buffer group) or ``auto`` (borrow when allowed, see ``ep_torch.transport_choice``) |
| ``EPKIT_TORCH_REFERENCE_NUM_SMS`` | int | ``132`` | device SM count the planner assumes on the CPU reference backend (an H200 by default) |
| ``EPKIT_TORCH_REFERENCE_NVLINK_GBS`` | float | ``430.3`` | NVLink bandwidth (GB/s) the planner assumes on the CPU reference backend |
| ``EPKIT_SCALEUP_RANKS`` | int | ``0`` | ranks per (emulated) node, S_u: a divisor of N below N runs hybrid mode with ranks ``r // S_u`` forming a node, on the reference backend and over ``ipc`` (emulated nodes on one host: processes sharing a GPU or one per GPU); across hosts it overrides NCCL's LSA team size; 0 = the transport's own NVLink domain. Shared with ep-core |
| ``EPKIT_TORCH_REFERENCE_NVLINK_RANKS`` | int | ``0`` | the old name of ``EPKIT_SCALEUP_RANKS``, read on the CPU reference backend only |
| ``EPKIT_TORCH_HOST_EXTENSION`` | str | ``auto`` | the host extension (``ep_torch.host_extension``: ``torch.empty`` and describe through torch's C++ API): ``auto`` builds it at first CUDA use and warns once and keeps the Python calls if it cannot, ``0`` off, ``1`` required (an error if it cannot be built) |
| ``EPKIT_CPU_TIMEOUT_SECS`` | float | ``300`` | bound (seconds) of every host-side wait on peers of buffers that take no ``num_cpu_timeout_secs`` keyword: V1's ``Buffer`` (its host exchanges and its low-latency wait) and the host exchanges before a buffer's own timeout applies (the construction); a peer that does not arrive raises ``EPTimeoutError`` naming it |
| ``EPKIT_LL_NATIVE`` | bool | ``1`` | V1 low-latency mode on CUDA: ``Buffer(ll_native=None)`` (the default) runs ep's own low-latency kernels where they can (a transport that maps the peers' memory, no adapter-only ``ll_*`` option); ``0`` keeps the adapter on V2's kernels unless ``ll_native=True`` |
| ``EPKIT_LL_LOCAL_DIRECT`` | bool | ``1`` | V1 low-latency mode's own kernels (``ll_native=True``): without a hook, a rank's own experts read their rows where they lie (one pass); ``0`` sends them through the buffer like a peer's |
| ``EPKIT_ELASTIC_WAIT`` | str | ``kernel`` | how PP/AGRS/BucketBuffer streams wait for a peer's signal on the GPU: ``kernel`` (a bounded one-thread wait kernel) or ``stream`` (``cuStreamWaitValue64`` bounded by a host watchdog, nothing spinning on the GPU); read when a buffer's elastic backend is made |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "Knob",
    "avoid_record_stream",
    "cpu_timeout_secs",
    "elastic_wait",
    "host_extension",
    "knobs",
    "ll_local_direct",
    "ll_native",
    "ll_native_choice",
    "reference_num_sms",
    "reference_nvlink_gbs",
    "scaleup_ranks",
    "transport",
]


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    doc: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)


knobs: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "EPKIT_AVOID_RECORD_STREAM",
            "0",
            "keep async operands alive in the EventOverlap, not record_stream",
        ),
        Knob("EPKIT_TORCH_TRANSPORT", "", "force the backend: reference, ipc or nccl (empty: automatic)"),
        Knob(
            "EPKIT_TORCH_NCCL_COMM",
            "auto",
            "nccl transport: borrow the group's communicator (group), create one (own) or decide (auto)",
        ),
        Knob(
            "EPKIT_TORCH_REFERENCE_NUM_SMS",
            "132",
            "device SMs assumed by the planner on the CPU reference backend",
        ),
        Knob(
            "EPKIT_TORCH_REFERENCE_NVLINK_GBS",
            "430.3",
            "NVLink GB/s assumed by the planner on the CPU backend",
        ),
        Knob(
            "EPKIT_SCALEUP_RANKS",
            "0",
            "ranks per (emulated) node; a divisor of N below N runs hybrid mode (0 = one node)",
        ),
        Knob(
            "EPKIT_TORCH_REFERENCE_NVLINK_RANKS",
            "0",
            "old name of EPKIT_SCALEUP_RANKS, on the CPU reference backend only",
        ),
        Knob(
            "EPKIT_TORCH_HOST_EXTENSION",
            "auto",
            "host extension (torch.empty and describe in C++): auto (fall back with a warning), 0 off, 1 required",
        ),
        Knob(
            "EPKIT_CPU_TIMEOUT_SECS",
            "300",
            "bound (s) of host waits on peers where no num_cpu_timeout_secs applies (V1 Buffer, construction)",
        ),
        Knob(
            "EPKIT_LL_NATIVE",
            "1",
            "V1 low-latency mode on CUDA: ll_native=None runs ep's own kernels where it can; 0 keeps the adapter",
        ),
        Knob(
            "EPKIT_LL_LOCAL_DIRECT",
            "1",
            "V1 low-latency native kernels: 0 sends a rank's own experts' rows through the buffer like a peer's",
        ),
        Knob(
            "EPKIT_ELASTIC_WAIT",
            "kernel",
            "GPU waits of PP/AGRS/BucketBuffer: kernel (bounded wait kernel) or stream (stream wait + host watchdog)",
        ),
    )
}


def _flag(name: str) -> bool:
    value = knobs[name].raw().strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r}: expected 0/1 (or true/false)")


def _number(name: str, kind: type) -> float:
    value = knobs[name].raw()
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a {kind.__name__}") from None


def cpu_timeout_secs() -> float:
    """``EPKIT_CPU_TIMEOUT_SECS``: a positive number of seconds."""
    value = _number("EPKIT_CPU_TIMEOUT_SECS", float)
    if not value > 0:
        raise ValueError(f"EPKIT_CPU_TIMEOUT_SECS={value!r}: expected a positive number of seconds")
    return value


def ll_native() -> bool:
    """``EPKIT_LL_NATIVE`` (default on): what ``Buffer(ll_native=None)`` means on CUDA."""
    return _flag("EPKIT_LL_NATIVE")


def ll_native_choice(choice: object, adapter_options: tuple) -> object:
    """``Buffer(ll_native=...)`` resolved: an explicit True/False as a bool; None (the default) as ``"auto"`` (the
    native kernels where the transport maps the peers) unless ``EPKIT_LL_NATIVE=0`` or an adapter-only option
    (``adapter_options``: any value other than None, 0 or False) asks for the adapter (then None)."""
    if choice is not None:
        return bool(choice)
    asked = any(v is not None and v is not False and v != 0 for v in adapter_options)
    return None if asked or not ll_native() else "auto"


def ll_local_direct() -> bool:
    """``EPKIT_LL_LOCAL_DIRECT`` (default on)."""
    return _flag("EPKIT_LL_LOCAL_DIRECT")


def avoid_record_stream() -> bool:
    """``EPKIT_AVOID_RECORD_STREAM``."""
    return _flag("EPKIT_AVOID_RECORD_STREAM")


def transport() -> str:
    """``EPKIT_TORCH_TRANSPORT`` (lower case; empty = automatic)."""
    value = knobs["EPKIT_TORCH_TRANSPORT"].raw().strip().lower()
    if value not in ("", "reference", "ipc", "nccl"):
        raise ValueError(f"EPKIT_TORCH_TRANSPORT={value!r}: expected one of reference, ipc, nccl (or unset)")
    return value


def nccl_comm() -> str:
    """``EPKIT_TORCH_NCCL_COMM`` (lower case): ``auto``, ``group`` or ``own``."""
    value = knobs["EPKIT_TORCH_NCCL_COMM"].raw().strip().lower() or "auto"
    if value not in ("auto", "group", "own"):
        raise ValueError(f"EPKIT_TORCH_NCCL_COMM={value!r}: expected one of auto, group, own")
    return value


def reference_num_sms() -> int:
    """``EPKIT_TORCH_REFERENCE_NUM_SMS``."""
    return int(_number("EPKIT_TORCH_REFERENCE_NUM_SMS", int))


def reference_nvlink_gbs() -> float:
    """``EPKIT_TORCH_REFERENCE_NVLINK_GBS``."""
    return float(_number("EPKIT_TORCH_REFERENCE_NVLINK_GBS", float))


def scaleup_ranks(*, reference: bool) -> tuple[str, int]:
    """(the variable that set it, S_u) from ``EPKIT_SCALEUP_RANKS``; on the reference backend its old name
    ``EPKIT_TORCH_REFERENCE_NVLINK_RANKS`` counts too (both set must agree). S_u = 0: not set. Divisibility by the
    group size is the caller's check (it knows the rank)."""
    found = []
    for name in ("EPKIT_SCALEUP_RANKS", "EPKIT_TORCH_REFERENCE_NVLINK_RANKS")[: 2 if reference else 1]:
        value = int(_number(name, int))
        if value < 0:
            raise ValueError(f"{name}={value}: expected >= 0 (0 = not set)")
        if value:
            found.append((name, value))
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise ValueError(
            f"EPKIT_SCALEUP_RANKS={found[0][1]} and its old name EPKIT_TORCH_REFERENCE_NVLINK_RANKS={found[1][1]} "
            "disagree; set only EPKIT_SCALEUP_RANKS"
        )
    return found[0] if found else ("EPKIT_SCALEUP_RANKS", 0)


def elastic_wait() -> str:
    """``EPKIT_ELASTIC_WAIT`` (lower case): ``kernel`` or ``stream``."""
    value = knobs["EPKIT_ELASTIC_WAIT"].raw().strip().lower() or "kernel"
    if value not in ("kernel", "stream"):
        raise ValueError(
            f"EPKIT_ELASTIC_WAIT={value!r}: expected kernel (the bounded wait kernel) or stream (cuStreamWaitValue64 "
            "bounded by a host watchdog)"
        )
    return value


def host_extension() -> str:
    """``EPKIT_TORCH_HOST_EXTENSION``: ``auto``, ``0`` or ``1``."""
    value = knobs["EPKIT_TORCH_HOST_EXTENSION"].raw().strip().lower() or "auto"
    value = {"false": "0", "no": "0", "off": "0", "true": "1", "yes": "1", "on": "1"}.get(value, value)
    if value not in ("auto", "0", "1"):
        raise ValueError(
            f"EPKIT_TORCH_HOST_EXTENSION={value!r}: expected auto (build it, warn and use torch's Python API if it "
            "cannot), 0 (off) or 1 (required)"
        )
    return value
