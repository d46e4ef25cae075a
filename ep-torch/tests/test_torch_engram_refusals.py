"""Issue 41: an EngramBuffer refusal is announced to the peers on the GPU as on the CPU reference backend where the
peers wait on the host: ``set_config`` and ``write`` begin with the host agreement on every backend
(``engram_buffer._HOST_FIRST``); a ``barrier``'s peers wait on the device (no note reaches them there). The GPU test
runs collective_safety_survey.py's Engram cases on 2 processes sharing GPU 0 (ipc transport)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from ep_core.rank_state import RankState

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _engram(transport: str):
    from ep_torch import EngramBuffer

    buf = object.__new__(EngramBuffer)
    notes = []
    inner = SimpleNamespace(
        transport=transport,
        bootstrap=SimpleNamespace(rank_state=RankState(0), _via_store=None),
        _announce_refusal=lambda op, exc: notes.append(op),
    )
    buf._buffer, buf.rank_idx = inner, 0
    return buf, notes


@pytest.mark.parametrize("transport", ["reference", "ipc", "nccl"])
def test_refusals_of_host_first_operations_are_announced_on_every_backend(transport):
    buf, notes = _engram(transport)
    for op in ("set_config", "write"):
        with pytest.raises(ValueError), buf._guard(op):
            raise ValueError("a bad argument on this rank")
    assert notes == ["EngramBuffer.set_config", "EngramBuffer.write"]
    with pytest.raises(ValueError), buf._guard("barrier"):
        raise ValueError("refused")
    # the barrier's peers wait on the host only on the reference backend
    assert len(notes) == (3 if transport == "reference" else 2)
    with pytest.raises(ValueError), buf._guard("fetch", collective=False):
        raise ValueError("one-sided: nothing to announce")
    assert len(notes) == (3 if transport == "reference" else 2)


@pytest.mark.gpu
@gpu
def test_engram_one_rank_errors_on_the_gpu(tmp_path):
    from ep_torch_testing import survey_chain  # loaded by conftest.py

    cases = ["engram.write_wrong_shape", "engram.set_config_mismatch", "engram.construct_bad_size"]
    env = {**os.environ, "EP_SURVEY_DEVICE": "cuda"}
    bad = survey_chain(cases, tmp_path, 300, env, what="engram gpu: ")
    assert not bad, "\n".join(bad)
