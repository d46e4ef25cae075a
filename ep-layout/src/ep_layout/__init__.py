"""ep-layout: the byte layouts of ep's symmetric buffer, as header-only C++/CUDA and an exact Python mirror.

C++ headers: ``get_include()`` (``#include <ep_layout/ep_layout.cuh>``); CMake: ``get_cmake_dir()`` or
``find_package(ep_layout CONFIG)`` with target ``ep_layout::ep_layout``.
"""

from __future__ import annotations

from ._locations import get_cmake_dir, get_include
from ._math import NUM_SYMMETRIC_ALIGN_BYTES, align, ceil_div
from .buffer_composition import (
    NUM_MAX_HYBRID_CHANNELS,
    DirectCombineBuffers,
    DirectDispatchBuffers,
    HybridCombineBuffers,
    HybridDispatchBuffers,
    Topology,
    combine_buffer_bytes,
    combine_buffers,
    combine_uses_rank_layout,
    dispatch_buffer_bytes,
    dispatch_buffers,
    get_combine_num_recv_slots,
    get_num_fp8_sf_packs,
    get_sizing_combine_token,
    get_sizing_dispatch_token,
    get_sizing_num_topk,
    size_hint_bytes,
)
from .buffer_layout import BufferLayout
from .errors import EPLayoutError, LayoutValueError
from .token_layout import (
    NUM_MAX_TOPK,
    NUM_MBARRIER_BYTES,
    NUM_TMA_ALIGN_BYTES,
    TokenLayout,
    make_combine_token_layout,
    make_dispatch_token_layout,
)
from .version import LAYOUT_VERSION, LAYOUT_VERSION_MAJOR, LAYOUT_VERSION_MINOR
from .workspace_layout import (
    COUNT_VALID_FLAG,
    ERROR_RECORD_FIELDS,
    NUM_BARRIER_PHASES,
    NUM_ERROR_RECORD_BYTES,
    NUM_MAX_CHANNELS,
    NUM_MAX_EXPERTS,
    NUM_MAX_EXPERTS_PER_RANK,
    NUM_MAX_RANKS,
    NUM_RESERVED_BYTES,
    NUM_WORKSPACE_BYTES,
    NUM_WORKSPACE_REGION_ALIGN_BYTES,
    WORKSPACE_REGIONS,
    ErrorKind,
    ErrorRecordField,
    WorkspaceLayout,
    WorkspaceRegion,
)

__version__ = "0.1.0"

__all__ = [
    "COUNT_VALID_FLAG",
    "ERROR_RECORD_FIELDS",
    "LAYOUT_VERSION",
    "LAYOUT_VERSION_MAJOR",
    "LAYOUT_VERSION_MINOR",
    "NUM_BARRIER_PHASES",
    "NUM_ERROR_RECORD_BYTES",
    "NUM_MAX_CHANNELS",
    "NUM_MAX_EXPERTS",
    "NUM_MAX_EXPERTS_PER_RANK",
    "NUM_MAX_HYBRID_CHANNELS",
    "NUM_MAX_RANKS",
    "NUM_MAX_TOPK",
    "NUM_MBARRIER_BYTES",
    "NUM_RESERVED_BYTES",
    "NUM_SYMMETRIC_ALIGN_BYTES",
    "NUM_TMA_ALIGN_BYTES",
    "NUM_WORKSPACE_BYTES",
    "NUM_WORKSPACE_REGION_ALIGN_BYTES",
    "WORKSPACE_REGIONS",
    "BufferLayout",
    "DirectCombineBuffers",
    "DirectDispatchBuffers",
    "EPLayoutError",
    "ErrorKind",
    "ErrorRecordField",
    "HybridCombineBuffers",
    "HybridDispatchBuffers",
    "LayoutValueError",
    "TokenLayout",
    "Topology",
    "WorkspaceLayout",
    "WorkspaceRegion",
    "__version__",
    "align",
    "ceil_div",
    "combine_buffer_bytes",
    "combine_buffers",
    "combine_uses_rank_layout",
    "dispatch_buffer_bytes",
    "dispatch_buffers",
    "get_cmake_dir",
    "get_combine_num_recv_slots",
    "get_include",
    "get_num_fp8_sf_packs",
    "get_sizing_combine_token",
    "get_sizing_dispatch_token",
    "get_sizing_num_topk",
    "make_combine_token_layout",
    "make_dispatch_token_layout",
    "size_hint_bytes",
]
