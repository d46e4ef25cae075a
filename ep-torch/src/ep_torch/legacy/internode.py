"""DeepEP V1's internode handle for ``legacy.Buffer`` when the ranks span several nodes (physical domain
``(num_rdma_ranks > 1, S_u)``; ``EPKIT_SCALEUP_RANKS`` emulates nodes on one host; ep-torch's README says what is
filled).

V1 returns a 10-tuple handle and orders rows by global source rank, then source token; ep's hybrid rows are grouped
by scale-up region first, so the V1 layer permutes them to V1's order (and back before combine). The fields follow
V1's two-level route (RDMA to the rank of node r with the sender's local index, then NVLink). ep has no channels:
every channel matrix is one channel (``[X, 1]``, the counts), the heads slot positions in it. ep's kernels read none
of these tensors (combine and cached dispatch use ep's own handle).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPConfigError

from ..bootstrap import ProcessGroupBootstrap
from ..transport_choice import data_device, ranks_per_host, scaleup_ranks
from .guard import _dispatch_target, _normal_target

__all__ = [
    "internode_combine",
    "internode_dispatch",
    "internode_handle_tensors",
    "predicted_nvl_ranks",
    "tokens_per_rdma_rank",
    "v1_row_order",
]


def _spans_nodes(buffer: Any, op: str, target: Any, args: tuple) -> None:
    """DeepEP's ``internode_*`` run its internode kernels, for groups over several NVLink domains only. The answer
    is the same on every rank, but a peer may have called the intranode method: the refusal is announced where
    that call's first step waits (``target``: the V1 method's guard target, issue 41)."""
    if buffer._domain()[0] <= 1:
        inner, host = target(buffer, args, {})
        with buffer._guard(op, inner, host):
            raise EPConfigError(
                f"{op} (rank {buffer.rank}): the group is one NVLink domain ({buffer.group_size} ranks); call "
                f"{op.removeprefix('internode_')}(), which runs the intranode path"
            )


def internode_dispatch(
    self: Any,
    x: Any,
    handle: Any = None,
    num_tokens_per_rank: torch.Tensor | None = None,
    num_tokens_per_rdma_rank: torch.Tensor | None = None,
    is_token_in_rank: torch.Tensor | None = None,
    num_tokens_per_expert: torch.Tensor | None = None,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    expert_alignment: int = 1,
    config: Any = None,
    previous_event: Any = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:
    """V1's ``Buffer.internode_dispatch`` (DeepEP's parameters: ``dispatch``'s without ``num_worst_tokens``):
    ``dispatch`` on a group that spans nodes; ``config=None`` takes ``get_dispatch_config``'s (DeepEP requires
    one)."""
    _spans_nodes(self, "internode_dispatch", _dispatch_target, (x, handle))
    # by name: every parameter is dispatch's (num_worst_tokens keeps its default, 0)
    return self.dispatch(**{k: v for k, v in locals().items() if k != "self"})


def internode_combine(
    self: Any,
    x: torch.Tensor,
    handle: Any,
    topk_weights: torch.Tensor | None = None,
    bias: Any = None,
    config: Any = None,
    previous_event: Any = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:
    """V1's ``Buffer.internode_combine`` (DeepEP's parameters, ``combine``'s): ``combine`` on a group that spans
    nodes."""
    _spans_nodes(self, "internode_combine", _normal_target, (x, handle))
    return self.combine(**{k: v for k, v in locals().items() if k != "self"})  # by name: combine's parameters


def predicted_nvl_ranks(group: dist.ProcessGroup, transport: str | None) -> int:
    """S_u the inner buffer will get (same rule as ``ElasticBuffer.get_buffer_size_hint``), known before it exists so
    ``get_dispatch_layout`` can fill ``num_tokens_per_rdma_rank``. A collective only on a CUDA group without
    ``EPKIT_SCALEUP_RANKS`` (host names)."""
    boot = ProcessGroupBootstrap(group)
    name, _ = data_device(transport, boot.device)
    nvl = scaleup_ranks(name or "auto", boot.size, boot.rank)
    if nvl is None:
        nvl = boot.size if name == "reference" else ranks_per_host(boot)
    return int(nvl)


def tokens_per_rdma_rank(is_token_in_rank: torch.Tensor, nvl: int) -> torch.Tensor:
    """``[num_rdma_ranks]`` int32: tokens sent to each node (a token counts once per node)."""
    t, n = is_token_in_rank.shape
    return is_token_in_rank.reshape(t, n // nvl, nvl).any(2).sum(0, dtype=torch.int32)


def v1_row_order(recv_src_metadata: Any, rows: int, device: torch.device) -> torch.Tensor:
    """Permutation putting ep's rows in V1 order: ``v1_rows = ep_rows[perm]`` (source rank, then source token;
    column 0 of ``recv_src_metadata`` is ``src_rank*M + src_token``, unique per row)."""
    meta = torch.as_tensor(recv_src_metadata)[:rows, 0].to(torch.int64)
    return torch.argsort(meta, stable=True).to(device)


def _node_bits(is_token_in_rank: torch.Tensor, nvl: int) -> torch.Tensor:
    """``[T, num_rdma_ranks]`` int32: bit i set when the token goes to local rank i of that node."""
    t, n = is_token_in_rank.shape
    weights = (1 << torch.arange(nvl, dtype=torch.int32, device=is_token_in_rank.device)).view(1, 1, nvl)
    return (is_token_in_rank.reshape(t, n // nvl, nvl).to(torch.int32) * weights).sum(2, dtype=torch.int32)


def _position(mask: torch.Tensor) -> torch.Tensor:
    """Slot of each set entry among the set entries of its column (row order), -1 elsewhere."""
    pos = mask.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return torch.where(mask, pos, torch.full_like(pos, -1))


def internode_handle_tensors(
    group: dist.ProcessGroup,
    rank: int,
    nvl: int,
    max_tokens: int,
    is_token_in_rank: torch.Tensor,
    rank_prefix_matrix: torch.Tensor,
    src_global: torch.Tensor,
    gather: Any = None,
) -> tuple:
    """V1's internode 10-tuple for this rank (module docstring). ``rank_prefix_matrix`` [N, N] (column j: inclusive
    prefix over source ranks of tokens sent to j), ``src_global`` [R] int64: ``src_rank*M + src_token`` of each row
    in V1 order. One all-gather of every rank's per-node bits ([M, num_rdma_ranks] int32), collective: through
    ``gather`` (``bits -> every rank's bits``; ``legacy.Buffer`` passes an enveloped, bounded step of its
    ``Channel``) when given, else the group's ``all_gather``."""
    dev = is_token_in_rank.device
    n = is_token_in_rank.shape[1]
    nodes, node, local = n // nvl, rank // nvl, rank % nvl
    sent = is_token_in_rank.sum(0, dtype=torch.int32)
    bits = _node_bits(is_token_in_rank, nvl)
    in_node = bits != 0
    per_node = in_node.sum(0, dtype=torch.int32)
    padded = torch.zeros(max_tokens, nodes, dtype=torch.int32, device=dev)
    padded[: bits.shape[0]] = bits
    if gather is not None:
        gathered = list(gather(padded))
    else:
        if dist.get_backend(group) != "nccl":
            padded = padded.cpu()  # a gloo group gathers host tensors
        gathered = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(gathered, padded, group=group)
    all_bits = torch.stack(gathered).to(dev)  # [N, M, nodes]: source rank, source token, destination node
    # what this rank forwards: tokens of (node r, my local index) bound for my node, node r ascending, token order
    fwd_bits = all_bits[torch.arange(nodes, device=dev) * nvl + local, :, node]  # [nodes, M]
    recv_rdma = (fwd_bits != 0).sum(1, dtype=torch.int32)
    fwd = fwd_bits.flatten()
    fwd = fwd[fwd != 0]
    peer = (fwd.view(-1, 1) >> torch.arange(nvl, dtype=torch.int32, device=dev).view(1, nvl)) & 1
    send_nvl_head = _position(peer.bool())
    recv_from = torch.diff(rank_prefix_matrix[:, rank], prepend=rank_prefix_matrix.new_zeros(1))
    src, tok = src_global // max_tokens, src_global % max_tokens
    recv_src_meta = torch.stack([(src // nvl).to(torch.int32), all_bits[src, tok, node]], 1)
    return (
        is_token_in_rank,
        per_node.view(nodes, 1),  # rdma_channel_prefix_matrix: one channel
        sent.view(n, 1),  # gbl_channel_prefix_matrix: one channel
        recv_rdma.view(nodes, 1),  # recv_rdma_channel_prefix_matrix: one channel
        recv_rdma.cumsum(0, dtype=torch.int32),  # recv_rdma_rank_prefix_sum
        recv_from.to(torch.int32).view(n, 1),  # recv_gbl_channel_prefix_matrix: one channel
        rank_prefix_matrix[:, rank].contiguous(),  # recv_gbl_rank_prefix_sum
        recv_src_meta.contiguous().view(
            torch.uint8
        ),  # [R, 8] bytes: (src_rdma_rank, is_token_in_nvl_rank_bits)
        _position(in_node),  # send_rdma_head [T, nodes]
        send_nvl_head,  # [num_rdma_recv_tokens, S_u]
    )
