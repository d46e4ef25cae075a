"""Where the installed headers and CMake files are (private; re-exported by ``ep_layout``)."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import EPLayoutError

_PKG_DIR = Path(__file__).resolve().parent
_UMBRELLA = Path("ep_layout") / "ep_layout.cuh"


def get_include() -> str:
    """Directory to add with ``-I`` so that ``#include <ep_layout/ep_layout.cuh>`` works.

    ``<package>/include`` in an installed wheel; the source tree's ``ep-layout/include`` when running from a
    checkout (``PYTHONPATH=ep-layout/src`` or an editable install).
    """
    for candidate in (_PKG_DIR / "include", _PKG_DIR.parent.parent / "include"):
        if (candidate / _UMBRELLA).is_file():
            return str(candidate)
    raise EPLayoutError(
        f"ep_layout headers not found: expected {_PKG_DIR / 'include' / _UMBRELLA} (installed wheel) or "
        f"{_PKG_DIR.parent.parent / 'include' / _UMBRELLA} (source tree); reinstall ep-layout"
    )


def get_cmake_dir() -> str:
    """Directory holding ``ep_layoutConfig.cmake``: pass it as ``-Dep_layout_DIR=...`` to CMake.

    The file is generated when the wheel is built: it is in the installed package, or (editable installs, whose
    Python files stay in the source tree) in the ``ep_layout`` directory that the install put on ``sys.path``.
    """
    cmake_dir = _PKG_DIR / "share" / "cmake" / "ep_layout"
    candidates = [cmake_dir] + [
        Path(p) / "ep_layout" / "share" / "cmake" / "ep_layout" for p in sys.path if p
    ]
    for candidate in candidates:
        if (candidate / "ep_layoutConfig.cmake").is_file():
            return str(candidate)
    raise EPLayoutError(
        f"ep_layout CMake files not found: expected {cmake_dir / 'ep_layoutConfig.cmake'}; they exist only in an "
        "installed ep-layout (pip install ep-layout), not in a bare source checkout"
    )
