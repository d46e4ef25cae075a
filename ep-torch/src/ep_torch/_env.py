"""Every environment knob of ep_torch, read here only (prefix ``EPKIT_``): ``knobs`` below (name, default, meaning;
ep-torch's README, "Environment variables", says the same at length).
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
    "ll_own_by_token",
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


knobs: dict[str, Knob] = {  # (name, default, meaning; ep-torch's README says each at length)
    k.name: k
    for k in (
        Knob("EPKIT_AVOID_RECORD_STREAM", "0", "keep async operands in the EventOverlap, not record_stream"),
        Knob("EPKIT_TORCH_TRANSPORT", "", "force the backend: reference, ipc or nccl (empty: automatic)"),
        Knob("EPKIT_TORCH_NCCL_COMM", "auto", "nccl's communicator: group (borrow), own, or auto"),
        Knob("EPKIT_TORCH_REFERENCE_NUM_SMS", "132", "device SMs the planner assumes on the CPU backend"),
        Knob("EPKIT_TORCH_REFERENCE_NVLINK_GBS", "430.3", "NVLink GB/s assumed on the CPU backend"),
        Knob("EPKIT_SCALEUP_RANKS", "0", "ranks per (emulated) node; below N: hybrid mode (0 = one node)"),
        Knob("EPKIT_TORCH_REFERENCE_NVLINK_RANKS", "0", "old name of EPKIT_SCALEUP_RANKS (CPU backend only)"),
        Knob("EPKIT_TORCH_HOST_EXTENSION", "auto", "C++ host extension: auto, 0 off, 1 required"),
        Knob("EPKIT_CPU_TIMEOUT_SECS", "300", "host waits' bound (s) without num_cpu_timeout_secs"),
        Knob("EPKIT_LL_NATIVE", "1", "V1 low-latency: ep's own kernels where they can; 0: adapter"),
        Knob("EPKIT_LL_LOCAL_DIRECT", "1", "V1 native kernels: 0 sends own experts' rows via the buffer"),
        Knob("EPKIT_LL_OWN_BY_TOKEN", "0", "V1 native dispatch: 1 own rows token-major (FP8 cast once)"),
        Knob("EPKIT_ELASTIC_WAIT", "kernel", "GPU waits of PP/AGRS/BucketBuffer: kernel or stream"),
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


def ll_own_by_token() -> bool:
    """``EPKIT_LL_OWN_BY_TOKEN`` (default off; an A/B knob of issue 44)."""
    return _flag("EPKIT_LL_OWN_BY_TOKEN")


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
