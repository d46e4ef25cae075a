"""Can GIN (NCCL's GPU-initiated networking) be had on this machine? Checked before any communicator exists.

GIN needs four things: not disabled (``EPKIT_DISABLE_GIN``, as DeepEP's ``EP_DISABLE_GIN``), an NCCL library that
loads, library and compiled-in headers new enough (GIN: 2.28.7; the RAIL connection of hybrid mode: 2.29.7), and an
RDMA NIC with an active port (GIN's transport is the network; without one NCCL has nothing to put over). The NIC
check reads sysfs like ``ibv_devices`` would; NCCL itself may still refuse later (e.g. no GPUDirect RDMA), which
``dev_comm`` reports as an NCCL call error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import _env
from ._loader import load
from .errors import GinUnavailableError, NcclGinError
from .version import FEATURES, NcclVersion

__all__ = ["GinSupport", "gin_support", "rdma_devices", "require_gin"]


@dataclass(frozen=True)
class GinSupport:
    """What `gin_support` found. `missing` is empty exactly when GIN is available."""

    missing: tuple[str, ...]
    runtime: NcclVersion | None  # loaded NCCL library (None: none loaded)
    header: NcclVersion | None  # NCCL headers the extension was compiled against
    rdma_devices: tuple[str, ...]  # RDMA devices with an ACTIVE port

    @property
    def available(self) -> bool:
        return not self.missing

    def require(self) -> GinSupport:
        """Raise :class:`GinUnavailableError` naming everything missing; return self when GIN is available."""
        if self.missing:
            raise GinUnavailableError(
                "GIN is not available: " + "; ".join(self.missing), missing=self.missing
            )
        return self


def rdma_devices(sysfs_dir: str | Path | None = None) -> tuple[str, ...]:
    """RDMA devices (``/sys/class/infiniband/<dev>``) with at least one port whose state is ACTIVE."""
    root = Path(sysfs_dir if sysfs_dir is not None else _env.rdma_sysfs_dir())
    found = []
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return ()
    for dev in devices:
        try:
            states = [(p / "state").read_text() for p in (dev / "ports").iterdir()]
        except OSError:
            continue
        if any("ACTIVE" in s.upper() for s in states):
            found.append(dev.name)
    return tuple(found)


def gin_support(*, hybrid: bool = False, sysfs_dir: str | Path | None = None) -> GinSupport:
    """Check every GIN requirement (module doc); never raises for a missing piece (see `GinSupport.require`).
    `hybrid`: also the RAIL connection type of hybrid mode (NCCL >= 2.29.7)."""
    missing: list[str] = []
    if _env.gin_disabled():
        missing.append("GIN is disabled by EPKIT_DISABLE_GIN=1 (unset it to use GIN)")
    runtime = header = None
    try:
        nccl = load()
        runtime, header = nccl.runtime, nccl.header
    except NcclGinError as e:
        missing.append(f"no usable NCCL library ({e})")
    needs = [FEATURES["gin"]] + ([FEATURES["gin_connection_options"]] if hybrid else [])
    for f in needs:
        if runtime is not None and runtime < f.since:
            missing.append(
                f"{f.description} needs NCCL >= {f.since}, the loaded library is {runtime} "
                f"(pip install 'nvidia-nccl-cu13>={f.since}')"
            )
        if header is not None and header < f.since:
            missing.append(
                f"{f.description} needs NCCL headers >= {f.since}, ep_nccl_gin was compiled against {header} "
                "(rebuild ep-nccl-gin against a newer nvidia-nccl wheel)"
            )
    root = sysfs_dir if sysfs_dir is not None else _env.rdma_sysfs_dir()
    nics = rdma_devices(root)
    if not nics:
        missing.append(f"no RDMA NIC with an active port under {root} (GIN puts go over the network)")
    return GinSupport(tuple(missing), runtime, header, nics)


def require_gin(*, hybrid: bool = False, sysfs_dir: str | Path | None = None) -> GinSupport:
    """`gin_support(...).require()`: raises :class:`GinUnavailableError` naming what is missing."""
    return gin_support(hybrid=hybrid, sysfs_dir=sysfs_dir).require()
