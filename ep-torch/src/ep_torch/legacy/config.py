"""V1's ``deep_ep.Config`` and its recommended chunk-size tables (``Buffer.get_dispatch_config`` /
``get_combine_config``)."""

from __future__ import annotations

from ep_core.buffer_base import align
from ep_core.errors import EPValueError

__all__ = ["Config", "default_combine_config", "default_dispatch_config"]


class Config:
    """V1's ``deep_ep.Config``: SM count and chunk sizes. ep's kernels plan their own chunks; the values are kept for
    callers that read them, and ``num_sms`` is passed on to ep's dispatch/combine."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        if num_sms <= 0 or num_sms % 2:
            raise AssertionError(f"Config: num_sms must be a positive even number, got {num_sms}")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """V1's formula shape: channels x ranks x recv tokens x token bytes, 128-byte aligned."""
        channels = self.num_sms // 2
        return align(channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 256), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # ep has no separate RDMA buffer (no NVSHMEM)

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
            f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
            f"{self.num_max_rdma_chunked_recv_tokens}))"
        )


# V1's recommended (nvl send, nvl recv, rdma send, rdma recv) chunk sizes per rank count
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


def _table(table: dict, num_ranks: int) -> tuple:
    if num_ranks == 1:
        return table[2]  # one rank: any entry (ep runs EP1 too)
    if num_ranks not in table:
        raise EPValueError(
            f"num_ranks: unsupported number of EP ranks {num_ranks} (V1's table: {sorted(table)})"
        )
    return table[num_ranks]


def default_dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """V1's ``Buffer.get_dispatch_config``: its recommended chunk sizes for ``num_ranks``."""
    return Config(num_sms, *_table(_DISPATCH_CONFIGS, num_ranks))


def default_combine_config(num_sms: int, num_ranks: int) -> Config:
    """V1's ``Buffer.get_combine_config``: its recommended chunk sizes for ``num_ranks``."""
    return Config(num_sms, *_table(_COMBINE_CONFIGS, num_ranks))
