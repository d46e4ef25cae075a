"""The torch API on 4 gloo processes (CPU reference backend) against ep_core.reference: every SPEC §9 mode that
exists on CPU, the SPEC §6 bad-input table, autograd and MoEDispatcher against dense computations, torch.compile.

One spawn runs every scenario (process start-up dominates on two cores), its ranks forked from this file run as a
script; each test asserts one scenario group.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from ep_torch_conformance.conformance import run_spawned


def _spawned(
    ranks: int, cfg: dict, folder: Path, env: dict | None = None
) -> list[list[tuple[str, bool, str]]]:
    """ep_torch_conformance.conformance.run_spawned(ranks, cfg), its ranks forked from this file run as a script under
    a wall-clock limit (a hang fails the test): a fresh interpreter per rank would import torch again."""
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [str(ranks), json.dumps(cfg), str(folder)], 600.0, env=env)
    assert code == 0, out[-3000:]
    return [[tuple(x) for x in json.loads((folder / f"rank{r}.json").read_text())] for r in range(ranks)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[list[tuple[str, bool, str]]]:
    return _spawned(4, {"backend": "cpu"}, tmp_path_factory.mktemp("four"))


@pytest.fixture(scope="module")
def one_rank() -> list[list[tuple[str, bool, str]]]:
    # run_spawned itself (one rank: one fresh interpreter either way)
    return run_spawned(1, {"backend": "cpu", "scenarios": ["modes", "autograd"]})


@pytest.fixture(scope="module")
def four_ranks_hybrid(tmp_path_factory) -> list[list[tuple[str, bool, str]]]:
    """2 emulated NVLink domains of 2 ranks: hybrid mode (S_o = 2, S_u = 2) on the reference backend."""
    env = {**os.environ, "EPKIT_TORCH_REFERENCE_NVLINK_RANKS": "2"}
    cfg = {"backend": "cpu", "scenarios": ["modes", "autograd", "planner"]}
    return _spawned(4, cfg, tmp_path_factory.mktemp("hybrid"), env)


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


if __name__ == "__main__":
    import importlib

    from ep_torch_conformance import conformance
    from ep_torch_testing import spawn_cpu

    # What every rank's autograd, compile and module scenarios import (torch.compile's stack, sympy with it),
    # imported here once before the fork: about 2 CPU-s a rank otherwise
    for name in ("torch._dynamo", "functorch.compile", "torch._inductor.lowering"):
        importlib.import_module(name)
    # run_spawned's ranks (conformance._worker writes out_dir/rank{r}.json), forked: CPU only
    spawn_cpu(conformance._worker, int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
