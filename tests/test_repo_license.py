"""The license: Apache-2.0 at the root (what every pyproject declares), the same text in each package directory,
and, where the built wheels are at hand (`EP_WHEEL_DIR`, as the `build` session sets it), inside every wheel."""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    p.parent for p in sorted(ROOT.glob("*/pyproject.toml")) + sorted(ROOT.glob("packages/*/pyproject.toml"))
]


def test_root_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_every_package_declares_and_ships_it():
    assert len(PACKAGES) == 7, PACKAGES
    for pkg in PACKAGES:
        text = (pkg / "pyproject.toml").read_text()
        declared = re.search(r'^license = (?:\{ text = )?"([^"]+)"', text, flags=re.M)
        assert declared and declared.group(1) == "Apache-2.0", pkg.name
        assert (pkg / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), (
            f"{pkg}/LICENSE differs from the root's"
        )


@pytest.mark.skipif(
    not os.environ.get("EP_WHEEL_DIR"), reason="EP_WHEEL_DIR not set (the build session sets it)"
)
def test_every_wheel_carries_the_license():
    wheels = sorted(Path(os.environ["EP_WHEEL_DIR"]).glob("*.whl"))
    assert len(wheels) == 7, wheels
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            assert names, f"{wheel.name} has no LICENSE"
            assert zf.read(names[0]) == (ROOT / "LICENSE").read_bytes(), wheel.name
