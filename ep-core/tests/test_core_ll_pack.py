"""ep_core.ll_pack (host side of include/ep_core/ll_pack.cuh, V1 low-latency mode's kernels): the parameter table
the launches are typed by equals the header's extern "C" signatures, and bad arguments are refused before the
driver sees them. (The kernels' results are tested by ep-torch's test_torch_legacy_ll_kernels.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ep_core import ll_pack
from ep_core.errors import EPValueError


def _header_signatures() -> dict[str, str]:
    from ep_core.kernels._source import get_include

    text = (Path(get_include()) / "ep_core" / "ll_pack.cuh").read_text()
    found = {}
    for m in re.finditer(
        r'extern "C" __global__ void(?: __launch_bounds__\(\d+\))?\s+(\w+)\(([^)]*)\)', text
    ):
        found[m.group(1)] = "".join("p" if "*" in p else "i" for p in m.group(2).split(","))
    return found


def test_signatures_match_the_header():
    assert _header_signatures() == ll_pack.SIGNATURES


def test_bad_arguments_are_refused():
    pytest.importorskip("ep_jit")
    with pytest.raises(EPValueError, match="expected one of"):
        ll_pack._args("ep_ll_nope", [])
    with pytest.raises(EPValueError, match="expected 5 arguments"):
        ll_pack._args("ep_ll_order", [0, 1, 0])
    with pytest.raises(EPValueError, match="argument 1 must be an int32"):
        ll_pack._args("ep_ll_order", [0, 1 << 40, 0, 4, 0])  # an address where an int goes
    args = ll_pack._args("ep_ll_order", [0x1000, 3, None, 4, 0x2000])
    assert [type(a).__name__ for a in args] == ["pointer", "int32", "pointer", "int32", "pointer"]
