"""ep_torch: the PyTorch front end of ep, DeepEP-compatible.

``from ep_torch import ElasticBuffer`` replaces ``from deep_ep import ElasticBuffer``: same constructor keywords,
methods, ``dispatch``/``combine`` keywords and return tuples. ``EPBuffer`` is the newer surface (planner policy
V2.5). CPU tensors on a gloo group run on the reference backend (bit-identical to ``ep_core.reference``); CUDA
tensors on an nccl group run on the GPU kernels. ``ep_torch.functional`` has the autograd functions (also usable
inside ``torch.compile``), ``ep_torch.nn.MoEDispatcher`` the intended use in a model, ``ep-demo`` the end-to-end demo.
"""

from __future__ import annotations

from ep_core.handle import EPHandle

from . import comm
from .bucket_buffer import BucketBuffer, BucketSession
from .buffer import ElasticBuffer, EPBuffer, topk_idx_t
from .buffer_base import (
    BufferAllocator,
    BufferBase,
    BufferContext,
    get_num_allocation_alignment,
    get_num_rdma_alignment,
    get_num_tma_alignment,
    register_buffers,
)
from .comm import destroy_all_managed_nccl_comm, get_logical_domain_size, get_physical_domain_size
from .engram_buffer import EngramBuffer
from .event import EventHandle, EventOverlap
from .legacy import Buffer, Config
from .pp_buffer import PPBuffer
from .recv_view import DispatchRecvView

register_buffers()  # isinstance(buffer, BufferBase) for every buffer class, as DeepEP's subclasses

__version__ = "0.1.0"

__all__ = [
    "BucketBuffer",
    "BucketSession",
    "Buffer",
    "BufferAllocator",
    "BufferBase",
    "BufferContext",
    "Config",
    "DispatchRecvView",
    "EPBuffer",
    "EPHandle",
    "ElasticBuffer",
    "EngramBuffer",
    "EventHandle",
    "EventOverlap",
    "PPBuffer",
    "__version__",
    "comm",
    "destroy_all_managed_nccl_comm",
    "get_logical_domain_size",
    "get_num_allocation_alignment",
    "get_num_rdma_alignment",
    "get_num_tma_alignment",
    "get_physical_domain_size",
    "topk_idx_t",
]
