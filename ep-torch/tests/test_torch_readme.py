"""The README's DeepEP-style example runs as written: 4 CPU ranks on the reference backend, or one rank per GPU
over nccl where there are GPUs (the GPU kernels)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def example_source() -> str:
    text = README.read_text()
    section = text.split("## Example", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 4, "the README's example section lost its code blocks"
    return "\n\n".join(blocks)


def test_readme_uses_ep_torch_import():
    src = example_source()
    assert "from ep_torch import ElasticBuffer, EPHandle, EventOverlap" in src
    assert "deep_ep" not in src


def _run_example(tmp_path) -> str:
    script = tmp_path / "readme_example.py"
    script.write_text(example_source())
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(str(script), [], 300, what="the README example: ")
    assert code == 0, out[-8000:]
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the example runs on it: see the gpu test")
def test_readme_example_runs(tmp_path):
    out = _run_example(tmp_path)
    assert out.count("received") == 4 and out.count("(reference)") == 4, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_readme_example_runs_on_gpu(tmp_path):
    out = _run_example(tmp_path)
    n = torch.cuda.device_count()
    assert out.count("received") == n and out.count("(nccl)") == n, out
