"""DeepEP V1's surface: ``Buffer`` (normal and low-latency modes) and ``Config``.

``buffer`` holds the V1 ``Buffer``; ``low_latency`` and ``ll_kernels`` its low-latency mode; ``internode`` the V1
internode handle and row order; ``fp8`` V1's per-token FP8 cast; ``reference`` the numpy definition of V1's numerics.
"""

from .buffer import Buffer, Config, LowLatencyHandle, V1Handle, V1InternodeHandle, per_token_cast_to_fp8

__all__ = ["Buffer", "Config", "LowLatencyHandle", "V1Handle", "V1InternodeHandle", "per_token_cast_to_fp8"]
