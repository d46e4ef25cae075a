"""V2.5's ``ep_torch.EngramBuffer`` (issue 20): several layers of sharded entries, ``write`` then ``fetch`` of every
layer by global index, against a numpy gather; FP8 storage with replicated scaling factors; bad inputs.

CPU: 2-3 gloo processes on the reference backend. GPU (marker gpu): 2 processes sharing GPU 0 over the ipc
transport, the storage in host NUMA memory (``use_cpu_rdma_storage=True``: the CPU reads it back) and in GPU
memory. Each case runs in a process group started by this file as a script under a wall-clock limit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

LAYERS, HIDDEN, TOKENS, K = [48, 37], 256, 16, 3


def _run(mode: str, n: int, tmp_path: Path, limit: float = 240.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ)
    env.pop("EPKIT_TORCH_TRANSPORT", None)
    code, out = run_script(__file__, [mode, str(n), str(tmp_path)], limit, env=env, what=f"{mode}: ")
    seen = [
        json.loads(p.read_text()) if p.exists() else {} for p in (tmp_path / f"{r}.json" for r in range(n))
    ]
    errors = [f"rank {r}: {s['error']}" for r, s in enumerate(seen) if s.get("error")]
    assert not errors, "\n".join(errors) + "\n" + out[-2000:]
    assert code == 0, out[-3000:]
    return seen


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _case(rank: int, n: int, mode: str, seen: dict) -> None:
    import torch
    from ep_torch import EngramBuffer

    gpu = mode.startswith("gpu")
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    for fp8 in (False, True):
        tag = "fp8" if fp8 else "bf16"
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        packs = HIDDEN // 128 if fp8 else 0
        gpu_bytes, storage_bytes = EngramBuffer.get_storage_size_hint(
            None, LAYERS, HIDDEN, TOKENS, K, dtype, packs
        )
        qps, depth, restrict = EngramBuffer.get_theoretical_config(None, len(LAYERS), TOKENS, K)
        buf = EngramBuffer(
            None,
            gpu_bytes,
            storage_bytes,
            use_cpu_rdma_storage=mode != "gpu_gpu_storage",
            num_allocated_qps=qps,
            qp_depth=depth,
            restrict_rd_atomic=restrict,
            explicitly_destroy=True,
            transport="ipc" if gpu else "reference",
        )
        seen[f"{tag}.before_config"] = _raises(lambda buf=buf: buf.write([]))
        buf.set_config(LAYERS, HIDDEN, TOKENS, K, dtype, packs)
        # every rank's shards, reproducible anywhere: raw bits (uint16 bf16, uint8 FP8)
        bits = np.uint8 if fp8 else np.uint16
        top = 0x7F if fp8 else 1 << 15

        def shard(r: int, layer: int, nl: int, top: int = top, bits: type = bits) -> np.ndarray:
            return np.random.default_rng(100 * r + layer).integers(0, top, (nl, HIDDEN)).astype(bits)

        tables = [np.concatenate([shard(r, i, nl) for r in range(n)]) for i, nl in enumerate(LAYERS)]
        sf_tables = [
            np.random.default_rng(7 + i).standard_normal((n * nl, packs)).astype(np.float32)
            for i, nl in enumerate(LAYERS)
        ]
        storages = [torch.from_numpy(shard(rank, i, nl)).view(dtype).to(dev) for i, nl in enumerate(LAYERS)]
        sfs = [torch.from_numpy(s).to(dev) for s in sf_tables] if fp8 else None
        seen[f"{tag}.wrong_layers"] = _raises(lambda buf=buf, s=storages, f=sfs: buf.write(s[:1], f))
        buf.write(storages, sfs)
        idx = np.stack(
            [
                np.random.default_rng(50 + rank + i).integers(0, n * nl, (TOKENS, K))
                for i, nl in enumerate(LAYERS)
            ]
        ).astype(np.int32)
        hooks = buf.fetch(torch.from_numpy(idx).to(dev))
        ok_data, ok_sf = True, True
        for i in reversed(range(len(LAYERS))):  # any order
            out = hooks[i]()
            data, sf = out if fp8 else (out, None)
            if gpu:
                torch.cuda.synchronize()
            got = data.cpu().view(torch.uint8 if fp8 else torch.int16).numpy().view(bits)
            want = tables[i][idx[i].reshape(-1)].reshape(TOKENS, K * HIDDEN)
            ok_data = ok_data and got.shape == want.shape and np.array_equal(got, want)
            if fp8:
                want_sf = sf_tables[i][idx[i].reshape(-1)].reshape(TOKENS, K * packs)
                ok_sf = ok_sf and np.array_equal(sf.cpu().numpy(), want_sf)
        seen[f"{tag}.data"] = ok_data
        seen[f"{tag}.sf"] = ok_sf
        seen[f"{tag}.too_many_tokens"] = _raises(
            lambda buf=buf: buf.fetch(
                torch.zeros((len(LAYERS), TOKENS + 1, K), dtype=torch.int32, device=dev)
            )
        )
        seen[f"{tag}.wrong_k"] = _raises(
            lambda buf=buf: buf.fetch(
                torch.zeros((len(LAYERS), TOKENS, K + 1), dtype=torch.int32, device=dev)
            )
        )
        seen[f"{tag}.num_qps"] = _raises(
            lambda buf=buf, idx=idx: buf.fetch(
                torch.from_numpy(idx).to(dev), num_qps=buf.num_allocated_qps + 1
            )
        )
        if not gpu:
            bad = idx.copy()
            bad[1, 0, 0] = n * LAYERS[1]
            seen[f"{tag}.out_of_range"] = _raises(lambda buf=buf, b=bad: buf.fetch(torch.from_numpy(b)))
        if gpu:
            backend = buf._buf()._elastic().backend
            seen[f"{tag}.storage"] = backend.engram_storage
            if backend.engram_storage == "host":
                try:  # the CPU reads the host part (where the system lets it map it)
                    host = np.frombuffer(backend.host_view(), dtype=bits, count=LAYERS[0] * HIDDEN)
                    seen[f"{tag}.host_holds_layer0"] = bool(
                        np.array_equal(host, shard(rank, 0, LAYERS[0]).ravel())
                    )
                except Exception as exc:
                    seen[f"{tag}.host_holds_layer0"] = f"{type(exc).__name__}: {exc}"
        buf.destroy()
        seen[f"{tag}.after_destroy"] = _raises(
            lambda buf=buf, idx=idx: buf.fetch(torch.from_numpy(idx).to(dev))
        )
    seen["bad_config"] = _raises(lambda: EngramBuffer(None, 2 << 20, 2 << 20, False, 0, 1))
    seen["unaligned"] = _raises(lambda: EngramBuffer(None, 3 << 20, 2 << 20, False, 1, 1))


def _worker(rank: int, world: int, mode: str, out: str) -> None:
    import traceback

    seen: dict = {}
    try:
        _case(rank, world, mode, seen)
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(seen))
    if "error" in seen:
        os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# the tests


def _check(seen: list[dict]) -> None:
    for r, s in enumerate(seen):
        for tag in ("bf16", "fp8"):
            assert s[f"{tag}.data"] and s[f"{tag}.sf"], (r, tag, s)
            assert "set_config() first" in s[f"{tag}.before_config"], s
            assert "one per layer" in s[f"{tag}.wrong_layers"], s
            assert "exceed num_max_tokens" in s[f"{tag}.too_many_tokens"], s
            assert "num_entries_per_token" in s[f"{tag}.wrong_k"], s
            assert "not enough" in s[f"{tag}.num_qps"], s
            assert s[f"{tag}.after_destroy"].startswith("EPStateError"), s
        assert "num_allocated_qps" in s["bad_config"], s
        assert "multiples of 2 MiB" in s["unaligned"], s


@pytest.mark.parametrize("n", [2, 3])
def test_engram_buffer_layers_on_the_reference_backend(n: int, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    seen = _run("cpu", n, tmp_path)
    _check(seen)
    for s in seen:
        assert "outside" in s["bf16.out_of_range"] and f"rank {seen.index(s)}" in s["bf16.out_of_range"], s


def test_engram_buffer_size_hint_and_config() -> None:
    torch = pytest.importorskip("torch")
    from ep_torch import EngramBuffer

    gpu, storage = EngramBuffer.get_storage_size_hint(None, [1000, 24], 7168, 512, 24)
    assert gpu == -(-2 * (-(-512 * 24 * 7168 * 2 // 256) * 256) // (2 << 20)) * (2 << 20)
    layer0 = -(-1000 * 7168 * 2 // 256) * 256
    assert storage == -(-(layer0 + 24 * 7168 * 2) // (2 << 20)) * (2 << 20)
    assert EngramBuffer.get_theoretical_config(None, 2, 512, 24) == (17, 16, False)
    with pytest.raises(ValueError, match="num_entries_per_layer"):
        EngramBuffer.get_storage_size_hint(None, [], 7168, 512, 24)
    with pytest.raises(TypeError, match="dtype"):
        EngramBuffer.get_storage_size_hint(None, [4], 7168, 512, 24, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gpu", "gpu_gpu_storage"])
def test_engram_buffer_on_shared_gpu(mode: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    pytest.importorskip("ep_symmem")
    seen = _run(mode, 2, tmp_path)
    _check(seen)
    for s in seen:
        assert s["bf16.storage"] == ("gpu" if mode == "gpu_gpu_storage" else "host"), s
        if mode == "gpu":
            assert s["bf16.host_holds_layer0"] is True and s["fp8.host_holds_layer0"] is True, s


if __name__ == "__main__":
    from ep_torch import launch
    from ep_torch_testing import spawn_cpu

    # the GPU modes' ranks start afresh (a forked process cannot use CUDA)
    (launch.spawn if sys.argv[1].startswith("gpu") else spawn_cpu)(
        _worker, int(sys.argv[2]), sys.argv[1], sys.argv[3]
    )
