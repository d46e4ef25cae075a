"""Every environment knob of ep_symmem, read here only (prefix EPKIT_SYMMEM_)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._errors import SymmemValueError

__all__ = ["KNOBS", "allow_ptrace", "bootstrap_timeout_s", "libcuda_path", "same_process_import"]


@dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: object
    doc: str


KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob(
            "EPKIT_SYMMEM_LIBCUDA",
            str,
            "libcuda.so.1",
            "Library handed to dlopen on the first GPU call (read when ep_symmem is imported).",
        ),
        Knob(
            "EPKIT_SYMMEM_SAME_PROCESS_IMPORT",
            str,
            "retain",
            "How a peer living in this same process is mapped: 'retain' (cuMemRetainAllocationHandle on the live "
            "allocation) or 'posix_fd' (pidfd_getfd on self + cuMemImportFromShareableHandle, like a foreign peer).",
        ),
        Knob(
            "EPKIT_SYMMEM_ALLOW_PTRACE",
            bool,
            False,
            "1: every allocating process calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) so that peers may "
            "pidfd_getfd its fds under Yama ptrace_scope=1. Weakens process isolation; off by default.",
        ),
        Knob(
            "EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT",
            float,
            300.0,
            "Seconds a LocalBootstrap / FileBootstrap collective waits for the other ranks.",
        ),
    )
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def libcuda_path() -> str:
    value = _raw("EPKIT_SYMMEM_LIBCUDA")
    return value or str(KNOBS["EPKIT_SYMMEM_LIBCUDA"].default)


def same_process_import() -> str:
    value = (_raw("EPKIT_SYMMEM_SAME_PROCESS_IMPORT") or "retain").lower()
    if value not in ("retain", "posix_fd"):
        raise SymmemValueError(
            f"EPKIT_SYMMEM_SAME_PROCESS_IMPORT must be 'retain' or 'posix_fd', got {value!r}"
        )
    return value


def allow_ptrace() -> bool:
    value = (_raw("EPKIT_SYMMEM_ALLOW_PTRACE") or "").lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SymmemValueError(f"EPKIT_SYMMEM_ALLOW_PTRACE must be 0 or 1, got {value!r}")


def bootstrap_timeout_s() -> float:
    value = _raw("EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT")
    if not value:
        return float(KNOBS["EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT"].default)  # type: ignore[arg-type]
    try:
        seconds = float(value)
    except ValueError:
        raise SymmemValueError(
            f"EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT must be a number of seconds, got {value!r}"
        ) from None
    if seconds <= 0:
        raise SymmemValueError(f"EPKIT_SYMMEM_BOOTSTRAP_TIMEOUT must be > 0, got {seconds}")
    return seconds
