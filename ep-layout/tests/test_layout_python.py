"""The Python mirror on its own: SPEC §4 worked examples, workspace invariants, argument validation, CLI."""

from __future__ import annotations

import re
from pathlib import Path

import ep_layout as el
import pytest

MIB = 1 << 20
INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include" / "ep_layout"


# SPEC §4 / behaviour doc §2.2-§2.4 worked examples


def test_token_worked_examples() -> None:
    dispatch = el.make_dispatch_token_layout(7168, 2, 0, 8)
    combine = el.make_combine_token_layout(7168, 8)
    assert dispatch == el.TokenLayout(14336, 0, 8, True)
    assert dispatch.get_num_bytes() == 14_464
    assert dispatch.get_num_bytes(with_mbarrier=True) == 14_496
    assert combine.get_num_bytes() == 14_400
    assert combine.get_num_bytes(with_mbarrier=True) == 14_432


def test_token_field_offsets() -> None:
    t = el.TokenLayout(14336, 0, 8, True)
    assert t.offsets() == {
        "hidden": 0,
        "sf": 14336,
        "topk_idx": 14336,
        "topk_weights": 14336 + 32,
        "src_token_idx": 14336 + 64,
        "linked_list_idx": 14336 + 68,
        "mbarrier": 14464,
    }
    assert t.get_num_metadata_bytes() == 8 * 8 + 9 * 4
    fp8 = el.make_dispatch_token_layout(7168, 1, el.get_num_fp8_sf_packs(7168), 8)
    assert (fp8.get_sf_offset(), fp8.get_metadata_offset(), fp8.get_num_bytes()) == (7168, 7168 + 896, 8192)


def test_size_hint_worked_examples() -> None:
    assert el.size_hint_bytes(8, 4096, 7168, 8) == 452 * MIB
    assert el.size_hint_bytes(8, 4096, 7168, 8, use_fp8=True) == 450 * MIB
    assert el.size_hint_bytes(8, 4096, 7168, 0) == 462 * MIB
    assert el.size_hint_bytes(el.Topology(8, 8, True), 4096, 7168, 8) == 452 * MIB
    # 452 MiB is exactly the direct dispatch receive buffer [8][4096] x 14,464 B.
    d = el.dispatch_buffers(el.get_sizing_dispatch_token(7168, 8), 8, 4096)
    assert isinstance(d, el.DirectDispatchBuffers) and d.get_num_bytes() == 8 * 4096 * 14_464 == 452 * MIB
    assert el.combine_buffer_bytes(el.get_sizing_combine_token(7168, 8), 8, 4096) == 8 * 4096 * 14_400


def test_hybrid_worked_example() -> None:
    # 2 nodes x 8 GPUs, M = 4096, hidden 7168 bf16, K = 8, amr (computed by hand from behaviour doc §2.4).
    topo = el.Topology(16, 8)
    d = el.dispatch_buffers(el.get_sizing_dispatch_token(7168, 8), topo, 4096)
    c = el.combine_buffers(el.get_sizing_combine_token(7168, 8), topo, 4096)
    assert isinstance(d, el.HybridDispatchBuffers) and isinstance(c, el.HybridCombineBuffers)
    assert d.get_num_bytes() == 14_464 * (8 * 2 * 4096 + 4096 + 2 * (4096 + 1280)) == 1_162_674_176
    assert c.get_num_bytes() == 14_400 * (8 * 2 * 4096 + 2 * 4096 + 2 * (4096 + 1280)) == 1_216_512_000
    assert el.size_hint_bytes(topo, 4096, 7168, 8) == 581 * 2 * MIB


def test_direct_compositions_without_nvlink() -> None:
    token = el.get_sizing_dispatch_token(7168, 8)
    topo = el.Topology(8, 8, is_scaleup_nvlink=False)
    d = el.DirectDispatchBuffers(token, topo, 4096)
    assert d.get_send_offset() == 8 * 4096 * 14_464 and d.send.num_ranks == 1
    combine_token = el.get_sizing_combine_token(7168, 8)
    c = el.DirectCombineBuffers(combine_token, topo, 4096, allow_multiple_reduction=False)
    assert (c.recv.num_ranks, c.send.num_ranks, c.send.num_tokens_per_rank) == (8, 8, 8 * 4096)


def test_combine_layout_rule() -> None:
    assert el.combine_uses_rank_layout(8, 8, True) and el.get_combine_num_recv_slots(8, 8, True) == 8
    assert not el.combine_uses_rank_layout(16, 8, True) and el.get_combine_num_recv_slots(16, 8, True) == 8
    assert not el.combine_uses_rank_layout(4, 8, False) and el.get_combine_num_recv_slots(4, 8, False) == 8
    assert el.get_combine_num_recv_slots(4, 8, True) == 4


def test_buffer_views() -> None:
    b = el.BufferLayout(el.TokenLayout(64, 0, 2, False), 4, 10)
    per = el.TokenLayout(64, 0, 2, False).get_num_bytes()
    assert per == 96 and b.get_num_bytes() == 4 * 10 * 96
    assert b.get_token_offset(2, 3) == (2 * 10 + 3) * 96
    assert b.get_channel_offset(3, 2) == 6 * 96
    assert (
        el.BufferLayout(el.TokenLayout(64, 0, 2, False), 4, 10, with_mbarrier=True).get_num_bytes_per_token()
        == 128
    )


# Workspace


def test_workspace_size_and_regions() -> None:
    ws = el.WorkspaceLayout
    assert ws.get_num_bytes() == el.NUM_WORKSPACE_BYTES == 14 * MIB
    assert ws.get_num_aligned_bytes() == 14 * MIB
    regions = ws.regions()
    assert regions[0].name == "barrier_signals" and regions[-1].name == "reserved"
    end = 0
    for r in regions:
        assert r.offset >= end and r.offset % el.NUM_WORKSPACE_REGION_ALIGN_BYTES == 0, r
        assert r.offset % r.elem_bytes == 0 or r.dtype == "error_record"
        end = r.offset + r.num_bytes
    assert end == ws.get_num_bytes()
    assert ws.region("reserved").num_bytes == el.NUM_RESERVED_BYTES == 1_933_184
    assert ws.RESERVED_OFFSET == 12_746_880
    assert ws.region("channel_tails").num_elems == el.NUM_MAX_CHANNELS * el.NUM_MAX_RANKS
    assert ws.region("expert_count_recv").num_elems >= el.NUM_MAX_EXPERTS  # N * epr = E <= 2048
    assert ws.get_barrier_signal_offset(1, 3) == ws.BARRIER_SIGNALS_OFFSET + 4 * (1024 + 3)
    assert ws.get_channel_tail_offset(2, 5, 8) == ws.CHANNEL_TAILS_OFFSET + 4 * 21
    assert ws.get_error_record_field_offset("counter") == ws.ERROR_RECORD_OFFSET + 16


def test_workspace_class_constants_match_regions() -> None:
    for r in el.WORKSPACE_REGIONS:
        assert getattr(el.WorkspaceLayout, f"{r.name.upper()}_OFFSET") == r.offset
        assert getattr(el.WorkspaceLayout, f"{r.name.upper()}_NUM_ELEMS") == r.num_elems
        assert el.WorkspaceLayout.get_offset(r.name) == r.offset
        assert el.WorkspaceLayout.get_num_elems(r.name) == r.num_elems


def test_workspace_regions_documented_in_header() -> None:
    """Every region is documented in the header comment table and has a C++ enum entry and pointer getter."""
    text = (INCLUDE_DIR / "workspace_layout.cuh").read_text()
    for r in el.WORKSPACE_REGIONS:
        camel = "".join(part.capitalize() for part in r.name.split("_"))
        assert re.search(rf"^///\s+{r.name}\s", text, re.MULTILINE), r.name
        assert f"WorkspaceRegion::k{camel})" in text and f"k{camel}Offset" in text, r.name
        assert f"k{camel}NumElems" in text, r.name
        assert f"get_{r.name}_ptr()" in text, r.name


def test_error_record_fields() -> None:
    fields = el.ERROR_RECORD_FIELDS
    assert [f.name for f in fields][:4] == ["abort_flag", "rank", "peer_rank", "tag"]
    for f in fields:
        size = 4 if f.dtype == "int32" else 8
        assert f.offset % size == 0 and f.offset + size <= el.NUM_ERROR_RECORD_BYTES
    assert int(el.ErrorKind.TIMEOUT) == 1 and int(el.ErrorKind.NONE) == 0


def test_layout_version_matches_header() -> None:
    text = (INCLUDE_DIR / "version.cuh").read_text()
    major = int(re.search(r"#define EP_LAYOUT_VERSION_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define EP_LAYOUT_VERSION_MINOR (\d+)", text).group(1))
    assert (major, minor) == el.LAYOUT_VERSION


# Validation


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((100, 0, 8, True), "num_hidden_bytes"),
        ((0, 0, 8, True), "num_hidden_bytes"),
        ((64, 6, 8, True), "num_sf_bytes"),
        ((64, -4, 8, True), "num_sf_bytes"),
        ((64, 0, 33, True), "num_topk"),
        ((64, 0, -1, True), "num_topk"),
        ((64.0, 0, 8, True), "num_hidden_bytes"),
        ((True, 0, 8, True), "num_hidden_bytes"),
    ],
)
def test_token_layout_rejects(args: tuple, name: str) -> None:
    with pytest.raises(el.LayoutValueError, match=name):
        el.TokenLayout(*args)


def test_layout_value_error_is_value_error() -> None:
    assert issubclass(el.LayoutValueError, ValueError) and issubclass(el.LayoutValueError, el.EPLayoutError)


def test_topology_rejects() -> None:
    with pytest.raises(ValueError, match="num_scaleup_ranks"):
        el.Topology(8, 3)
    with pytest.raises(ValueError, match="num_ranks"):
        el.Topology(2048)
    with pytest.raises(ValueError, match="num_ranks"):
        el.Topology(0)
    assert el.Topology(16, 8).get_num_scaleout_ranks() == 2 and el.Topology(16).is_hybrid() is False


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"hidden": 7000}, "hidden"),
        ({"hidden": 7168 + 16, "use_fp8": True}, "hidden"),
        ({"hidden": 0}, "hidden"),
        ({"num_max_tokens_per_rank": 0}, "num_max_tokens_per_rank"),
        ({"num_topk": 33}, "num_topk"),
    ],
)
def test_size_hint_rejects(kwargs: dict, name: str) -> None:
    args = {"topology": 8, "num_max_tokens_per_rank": 4096, "hidden": 7168, "num_topk": 8} | kwargs
    with pytest.raises(ValueError, match=name):
        el.size_hint_bytes(**args)


def test_unknown_names_are_reported() -> None:
    with pytest.raises(ValueError, match="barrier_signals"):
        el.WorkspaceLayout.region("nope")
    with pytest.raises(ValueError, match="recv"):
        el.DirectDispatchBuffers(el.TokenLayout(64, 0, 1, True), el.Topology(2), 8).get_offset("nope")


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from ep_layout.__main__ import main

    assert main(["--includes", "--version", "--workspace"]) == 0
    out = capsys.readouterr().out
    assert f"-I{el.get_include()}" in out and "layout 1.0" in out and "reserved" in out
    assert main([]) == 0
