"""ep_core: the framework-agnostic expert-parallel MoE runtime (planner, EPBuffer, numpy reference).

Importing ep_core needs only numpy; the GPU pieces load their dependencies lazily.
"""

from __future__ import annotations

from ep_core import bf16, planner, reference, routing
from ep_core.errors import (
    EPConfigError,
    EPDeviceError,
    EPError,
    EPPlanMismatchError,
    EPStateError,
    EPTimeoutError,
    EPTypeError,
    EPValueError,
)
from ep_core.handle import EPHandle
from ep_core.planner import (
    PlannerPolicy,
    default_num_allocated_qps,
    get_buffer_size_hint,
    get_theoretical_num_qps,
    get_theoretical_num_sms,
)
from ep_core.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "EPConfigError",
    "EPDeviceError",
    "EPError",
    "EPHandle",
    "EPPlanMismatchError",
    "EPStateError",
    "EPTimeoutError",
    "EPTypeError",
    "EPValueError",
    "PlannerPolicy",
    "Topology",
    "__version__",
    "bf16",
    "default_num_allocated_qps",
    "get_buffer_size_hint",
    "get_theoretical_num_qps",
    "get_theoretical_num_sms",
    "planner",
    "reference",
    "routing",
]
