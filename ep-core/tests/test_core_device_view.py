"""DeviceView's contiguity rule: what the kernels accept from frameworks' arrays (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
from ep_core.kernels._cuda import DeviceView


@pytest.mark.parametrize(
    ("shape", "strides", "contiguous"),
    [
        ((4, 8), None, True),
        ((4, 8), (8, 1), True),
        ((4, 8), (16, 1), False),  # row padding
        ((4, 8), (1, 4), False),  # transposed
        ((0, 8), (0, 0), True),  # torch's DLPack strides of an empty tensor
        ((0, 4), (1, 1), True),
        ((1, 8), (999, 1), True),  # a size-1 dimension's stride is never used
        ((4, 1), (1, 7), True),
        ((3, 1, 8), (8, 0, 1), True),
        ((3, 2, 8), (16, 0, 1), False),  # broadcast (stride 0) over a real dimension
    ],
)
def test_is_contiguous_follows_torch(shape, strides, contiguous) -> None:
    assert DeviceView(0x1000, shape, np.dtype(np.uint16), strides).is_contiguous is contiguous
