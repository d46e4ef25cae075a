"""Every environment knob of ep_core, read here and nowhere else (prefix `EPKIT_`).

Each knob is read at access time (`knobs.nvlink_gbs`), so tests and users can change the environment late. A knob
that had an `EP_CORE_` name (`Knob.old`) still reads it for one release when its `EPKIT_` name is unset, with a
`DeprecationWarning` (the `EP_` namespace is DeepEP's).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["KNOBS", "Knob", "knobs", "read"]

T = TypeVar("T")


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: name, type, default and what it does."""

    name: str
    type: type
    default: T
    doc: str
    old: str = ""  # the deprecated `EP_CORE_` name, read when `name` is unset (one release)

    def text(self) -> tuple[str, str | None]:
        """`(the variable read, its text or None)`: `name`'s, else the deprecated `old` name's (with a warning)."""
        raw = os.environ.get(self.name)
        if raw is None and self.old:
            raw = os.environ.get(self.old)
            if raw is not None:
                warnings.warn(
                    f"{self.old} is deprecated and will stop working in the next release; set {self.name} instead",
                    DeprecationWarning,
                    stacklevel=4,
                )
                return self.old, raw
        return self.name, raw

    def get(self) -> T:
        raw = self.text()[1]
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
            "0: a repeated plain no-sync dispatch walks every layer (no kept plans, ep_core.kernels.op_plan)",
        ),
        Knob(
            "EPKIT_NATIVE_LAUNCH",
            bool,
            True,
            "0: kernel launches, event pairs and count copies through cuda-python instead of ep_launch (read once)",
        ),
        Knob(
            "EPKIT_EPILOGUE_PDL",
            bool,
            True,
            "0: the copy epilogue waits for the dispatch kernel as a plain launch (read at import)",
        ),
        Knob(
            "EPKIT_HANDLE_BLOCK",
            str,
            "offered",
            "which allocators carve a new handle's int32 arrays from one block: offered, auto, 1 or 0 (read at import)",
        ),
        Knob(
            "EPKIT_PHASE_TIMING",
            str,
            "",
            "1: build the kernels with the phase-timing instrument (benchmarks/profile_ops.py --phases)",
            old="EP_CORE_PHASE_TIMING",
        ),
        Knob(
            "EPKIT_COMBINE_REDUCE_PARTS",
            str,
            "",
            "direct combine: column parts per token of the reduce (1..32; empty: the default build)",
            old="EP_CORE_COMBINE_REDUCE_PARTS",
        ),
        Knob(
            "EPKIT_COMBINE_LOCAL_REF",
            str,
            "",
            "direct combine: 0 copies every row into its slot (1 or empty: local rows by reference)",
            old="EP_CORE_COMBINE_LOCAL_REF",
        ),
        Knob(
            "EPKIT_WARP_MAJOR",
            str,
            "",
            "0: tokens / rows handed out block-major (1 or empty: warp-major)",
            old="EP_CORE_WARP_MAJOR",
        ),
    )
}


def read(name: str) -> tuple[str, str]:
    """`(the variable read, its stripped text, "" when unset)` of the knob `name` (its deprecated name too): for
    knobs whose caller validates the text itself and names the variable in its error."""
    used, raw = KNOBS[name].text()
    return used, (raw or "").strip()


def _knob(name: str) -> property:
    """A `_Knobs` attribute: the value of knob `name`, read at each access."""
    return property(lambda _: KNOBS[name].get())


class _Knobs:
    nvlink_gbs = _knob("EPKIT_NVLINK_GBS")
    rdma_gbs = _knob("EPKIT_RDMA_GBS")
    nic_name = _knob("EPKIT_NIC_NAME")
    buffer_debug = _knob("EPKIT_BUFFER_DEBUG")
    scaleup_ranks = _knob("EPKIT_SCALEUP_RANKS")
    express_lane = _knob("EPKIT_EXPRESS_LANE")
    native_launch = _knob("EPKIT_NATIVE_LAUNCH")
    epilogue_pdl = _knob("EPKIT_EPILOGUE_PDL")
    handle_block = _knob("EPKIT_HANDLE_BLOCK")


knobs = _Knobs()
