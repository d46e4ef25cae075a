"""Which road V1 low-latency mode takes on CUDA (issue 44): ``Buffer(ll_native=None)`` means ep's own kernels
("auto": where the transport maps the peers) unless ``EPKIT_LL_NATIVE=0`` or an adapter-only option is set;
an explicit True/False is kept."""

from __future__ import annotations

import pytest
from ep_torch import _env

NONE = (0, 0, False, False, False)  # lanes, combine SMs, non-deterministic, use_kernels set, zero_copy set


@pytest.mark.parametrize(
    "choice,options,env,want",
    [
        (None, NONE, None, "auto"),
        (None, NONE, "0", None),
        (True, NONE, "0", True),
        (False, NONE, None, False),
        (None, (2, 0, False, False, False), None, None),
        (None, (0, 16, False, False, False), None, None),
        (None, (0, 0, True, False, False), None, None),
        (None, (0, 0, False, True, False), None, None),
        (None, (0, 0, False, False, True), None, None),
    ],
)
def test_ll_native_choice(choice, options, env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("EPKIT_LL_NATIVE", raising=False)
    else:
        monkeypatch.setenv("EPKIT_LL_NATIVE", env)
    assert _env.ll_native_choice(choice, options) == want
