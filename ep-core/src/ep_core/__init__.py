"""ep_core: the framework-agnostic expert-parallel MoE runtime (planner, EPBuffer, numpy reference).

Importing ep_core needs only numpy; the GPU pieces load their dependencies lazily.
"""

from __future__ import annotations

from ep_core import bf16, reference, routing
from ep_core.handle import EPHandle

__version__ = "0.1.0"

__all__ = [
    "EPHandle",
    "__version__",
    "bf16",
    "reference",
    "routing",
]
