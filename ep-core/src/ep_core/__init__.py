"""ep_core: the framework-agnostic expert-parallel MoE runtime (planner, EPBuffer, numpy reference).

Importing ep_core needs only numpy; the GPU pieces load their dependencies lazily.
"""

from __future__ import annotations

from ep_core import agrs, bf16, engram, planner, pp, reference, routing, validation
from ep_core.bootstrap import Bootstrap, LocalBootstrap, ThreadGroup
from ep_core.buffer import EPBuffer, resolve_transport
from ep_core.buffer_base import BufferAllocator, BufferBase, HostStorage, SymmetricStorage, TensorSpec
from ep_core.device_array import ArrayInfo, DeviceArray, describe, host_allocator, host_array, to_numpy
from ep_core.errors import (
    EPConfigError,
    EPDeviceError,
    EPError,
    EPMismatchError,
    EPPeerError,
    EPPlanMismatchError,
    EPStateError,
    EPTimeoutError,
    EPTypeError,
    EPValueError,
)
from ep_core.executor import (
    BufferConfig,
    CombineRequest,
    CombineResult,
    DispatchRequest,
    DispatchResult,
    Executor,
    ReferenceExecutor,
    ReferenceTransport,
    Transport,
)
from ep_core.handle import EPHandle
from ep_core.loopback import LoopbackDomain, ProcessRank
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
    "ArrayInfo",
    "Bootstrap",
    "BufferAllocator",
    "BufferBase",
    "BufferConfig",
    "CombineRequest",
    "CombineResult",
    "DeviceArray",
    "DispatchRequest",
    "DispatchResult",
    "EPBuffer",
    "EPConfigError",
    "EPDeviceError",
    "EPError",
    "EPHandle",
    "EPMismatchError",
    "EPPeerError",
    "EPPlanMismatchError",
    "EPStateError",
    "EPTimeoutError",
    "EPTypeError",
    "EPValueError",
    "Executor",
    "HostStorage",
    "LocalBootstrap",
    "LoopbackDomain",
    "PlannerPolicy",
    "ProcessRank",
    "ReferenceExecutor",
    "ReferenceTransport",
    "SymmetricStorage",
    "TensorSpec",
    "ThreadGroup",
    "Topology",
    "Transport",
    "__version__",
    "agrs",
    "bf16",
    "default_num_allocated_qps",
    "describe",
    "engram",
    "get_buffer_size_hint",
    "get_theoretical_num_qps",
    "get_theoretical_num_sms",
    "host_allocator",
    "host_array",
    "planner",
    "pp",
    "reference",
    "resolve_transport",
    "routing",
    "to_numpy",
    "validation",
]
