"""Packaging facts of ep_core: importable without torch, explicit __all__, version, typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ep_core


def test_import_without_torch():
    code = "import sys, ep_core; assert 'torch' not in sys.modules, 'ep_core imported torch'; print(ep_core.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.1.0"


def test_public_names():
    assert ep_core.__version__ == "0.1.0"
    for name in ep_core.__all__:
        assert hasattr(ep_core, name), name
    assert (Path(ep_core.__file__).parent / "py.typed").exists()
