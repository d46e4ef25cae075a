"""Every environment knob of ep_core, read here and nowhere else (prefix `EPKIT_`).

Each knob is read at access time (`knobs.nvlink_gbs`), so tests and users can change the environment late.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["KNOBS", "Knob", "knobs"]

T = TypeVar("T")


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: name, type, default and what it does."""

    name: str
    type: type
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.type is bool:
            return raw.strip().lower() not in ("0", "false", "no", "off")  # type: ignore[return-value]
        try:
            return self.type(raw)
        except ValueError as exc:
            from ep_core.errors import EPConfigError

            raise EPConfigError(
                f"{self.name}: expected a {self.type.__name__}, got {raw!r}; fix or unset the variable"
            ) from exc


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "EPKIT_NVLINK_GBS", float, 0.0, "NVLink bandwidth per GPU in GB/s for the SM planner; 0 = detect"
        ),
        Knob("EPKIT_RDMA_GBS", float, 0.0, "RDMA bandwidth per GPU in GB/s for the SM planner; 0 = detect"),
        Knob("EPKIT_NIC_NAME", str, "mlx5_0", "RDMA NIC whose rate and CA type are detected"),
        Knob("EPKIT_BUFFER_DEBUG", bool, False, "print buffer sizes and planner intermediates"),
        Knob(
            "EPKIT_SCALEUP_RANKS",
            int,
            0,
            "ranks per node (S_u, a divisor of the group size) overriding the detected NVLink domain; ranks r // S_u "
            "form a node; 0 = not set",
        ),
        Knob(
            "EPKIT_EXPRESS_LANE",
            bool,
            True,
            "0: a repeated plain no-sync dispatch walks every layer (ep_core.kernels.express is not used)",
        ),
    )
}


class _Knobs:
    @property
    def nvlink_gbs(self) -> float:
        return KNOBS["EPKIT_NVLINK_GBS"].get()

    @property
    def rdma_gbs(self) -> float:
        return KNOBS["EPKIT_RDMA_GBS"].get()

    @property
    def nic_name(self) -> str:
        return KNOBS["EPKIT_NIC_NAME"].get()

    @property
    def buffer_debug(self) -> bool:
        return KNOBS["EPKIT_BUFFER_DEBUG"].get()

    @property
    def scaleup_ranks(self) -> int:
        return KNOBS["EPKIT_SCALEUP_RANKS"].get()

    @property
    def express_lane(self) -> bool:
        return KNOBS["EPKIT_EXPRESS_LANE"].get()


knobs = _Knobs()
