"""ElasticBuffer's methods beyond EP (issue 20): pipeline send/recv, Engram fetch, all-gather / reduce-scatter.

A mixin so that these primitives live apart from dispatch/combine; `ElasticBuffer` inherits it.
"""

from __future__ import annotations

__all__ = ["ElasticOps"]


class ElasticOps:
    """PP, Engram and AGRS methods of `ElasticBuffer` (DeepEP V2's names and semantics)."""
