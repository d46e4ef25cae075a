"""Version of the byte layouts (``EP_LAYOUT_VERSION_MAJOR/MINOR`` in ``ep_layout/version.cuh``).

The major is bumped on any change of a byte (field, offset, alignment, region, composition), the minor for
additions that move no existing byte. This is independent of the package version ``ep_layout.__version__``.
"""

from __future__ import annotations

__all__ = ["LAYOUT_VERSION", "LAYOUT_VERSION_MAJOR", "LAYOUT_VERSION_MINOR"]

LAYOUT_VERSION_MAJOR = 1
LAYOUT_VERSION_MINOR = 0
LAYOUT_VERSION = (LAYOUT_VERSION_MAJOR, LAYOUT_VERSION_MINOR)
