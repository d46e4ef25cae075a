"""pytest setup of the ep-torch tests: makes ep_torch_testing.py (the helpers the test modules share) importable
as `ep_torch_testing`, and the conformance harness (the package ep_torch_conformance/) as `ep_torch_conformance`.

The root config imports test modules with --import-mode=importlib, which puts no test folder on sys.path, so a
test module cannot import a sibling module by name. pytest imports this conftest before any test module of this
folder, and it registers both in sys.modules under their unique names, without touching sys.path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# The GPU loopback tests run N ranks' streams in this process; CUDA reads its hardware queue count when the context is
# created (before any test runs): enough queues for 8 ranks (ep_torch.loopback refuses too few)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

_HELPERS = "ep_torch_testing"
_CONFORMANCE = "ep_torch_conformance"  # the conformance harness, a package of this folder (not in the wheel)


def _load(name: str, path: Path, package: bool = False) -> None:
    if name in sys.modules:
        return
    where = [str(path.parent)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=where)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


_load(_HELPERS, Path(__file__).with_name(f"{_HELPERS}.py"))
_load(_CONFORMANCE, Path(__file__).with_name(_CONFORMANCE) / "__init__.py", package=True)
