"""The former name of `ep_core.kernels.rank_driver` (`DirectRank` is `RankDriver`): the same module object under
both names, so that code importing or patching `direct_rank` (`ep_core.loopback`, `ep_core.transports.nccl`,
`benchmarks/profile_ops.py`) keeps working."""

import sys

from ep_core.kernels import rank_driver

sys.modules[__name__] = rank_driver
