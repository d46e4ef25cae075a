"""pytest setup of the ep-core GPU tests: makes ep_core_gpu_testing.py (the helpers the test modules share)
importable as `ep_core_gpu_testing`.

The root config imports test modules with --import-mode=importlib, which puts no test folder on sys.path, so a
test module cannot import a sibling module by name. pytest imports this conftest before any test module of this
folder, and it registers the helper module in sys.modules under that unique name, without touching sys.path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# Loopback ranks wait for each other inside their kernels, so their streams (and a captured graph's branches) need
# hardware queues of their own: CUDA reads the count when the context is created, before any test runs
# (`ep_core.kernels._cuda.reserve_connections`)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

_HELPERS = "ep_core_gpu_testing"


def _load_helpers() -> None:
    if _HELPERS in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(_HELPERS, Path(__file__).with_name(f"{_HELPERS}.py"))
    assert spec is not None and spec.loader is not None, f"cannot load {_HELPERS}.py next to {__file__}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[_HELPERS] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_HELPERS]
        raise


_load_helpers()
