"""The torch API on 4 gloo processes (CPU reference backend) against ep_core.reference: every SPEC §9 mode that
exists on CPU, the SPEC §6 bad-input table, autograd and MoEDispatcher against dense computations, torch.compile.

One spawn runs every scenario (process start-up dominates on two cores); each test asserts one scenario group.
"""

from __future__ import annotations

import os

import pytest
from ep_torch.testing.conformance import run_spawned


@pytest.fixture(scope="module")
def four_ranks() -> list[list[tuple[str, bool, str]]]:
    return run_spawned(4, {"backend": "cpu"})


@pytest.fixture(scope="module")
def one_rank() -> list[list[tuple[str, bool, str]]]:
    return run_spawned(1, {"backend": "cpu", "scenarios": ["modes", "autograd"]})


@pytest.fixture(scope="module")
def four_ranks_hybrid() -> list[list[tuple[str, bool, str]]]:
    """2 emulated NVLink domains of 2 ranks: hybrid mode (S_o = 2, S_u = 2) on the reference backend."""
    old = os.environ.get("EPKIT_TORCH_REFERENCE_NVLINK_RANKS")
    os.environ["EPKIT_TORCH_REFERENCE_NVLINK_RANKS"] = "2"
    try:
        return run_spawned(4, {"backend": "cpu", "scenarios": ["modes", "autograd", "planner"]})
    finally:
        if old is None:
            del os.environ["EPKIT_TORCH_REFERENCE_NVLINK_RANKS"]
        else:
            os.environ["EPKIT_TORCH_REFERENCE_NVLINK_RANKS"] = old


def _assert_group(per_rank: list[list[tuple[str, bool, str]]], prefix: str, minimum: int) -> None:
    names = [n for n, _, _ in per_rank[0] if n.startswith(prefix)]
    assert len(names) >= minimum, f"only {len(names)} '{prefix}' checks ran, expected at least {minimum}"
    failures = []
    for rank, results in enumerate(per_rank):
        assert [n for n, _, _ in results] == [n for n, _, _ in per_rank[0]], "ranks ran different checks"
        failures += [f"rank {rank}: {n}\n{d}" for n, ok, d in results if n.startswith(prefix) and not ok]
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:10])


def test_modes_match_reference(four_ranks):
    # 3 routings x {bf16, fp8} x {rank, expand} x {A=1, 128} x {sync, no sync} x 2 buffers: dispatch + cached,
    # and 3 bias variants of combine for bf16
    _assert_group(four_ranks, "modes/", 3 * 2 * 2 * 2 * 2 * 2 * 2 + 3 * 2 * 2 * 2 * 2 * 3)


def test_transport_choice(four_ranks):
    # the automatic choice on a gloo group, and a collectively destroyed buffer through every mode
    _assert_group(four_ranks, "transport/", 4)
    assert ("transport/chosen reference", True) in [(n, ok) for n, ok, _ in four_ranks[0]]
    _assert_group(four_ranks, "modes/", 3 * 2 * 2 * 2 * 2 * 2 * 3 + 3 * 2 * 2 * 2 * 2 * 3 * 3 // 2)


def test_bad_inputs_raise(four_ranks):
    _assert_group(four_ranks, "errors/", 50)


def test_autograd_exact_against_dense(four_ranks):
    _assert_group(four_ranks, "autograd/", 3)


def test_torch_compile_fullgraph(four_ranks):
    _assert_group(four_ranks, "compile/", 2)


def test_moe_dispatcher_module(four_ranks):
    _assert_group(four_ranks, "module/", 2)


def test_one_rank(one_rank):
    _assert_group(one_rank, "modes/", 96)
    _assert_group(one_rank, "autograd/", 3)


def test_planner_and_domains(four_ranks):
    _assert_group(four_ranks, "planner/", 1)


def test_hybrid_mode_on_cpu(four_ranks_hybrid):
    # regions grouped by scale-up index, three reduction levels, through the torch API
    _assert_group(four_ranks_hybrid, "modes/", 300)
    _assert_group(four_ranks_hybrid, "autograd/", 3)
    _assert_group(four_ranks_hybrid, "planner/", 1)
