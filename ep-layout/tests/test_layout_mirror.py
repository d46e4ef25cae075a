"""The Python mirror equals the C++ headers byte for byte, for thousands of hypothesis-drawn configurations.

All requests go to one C++ process (tests/cpp/layout_dump.cpp, compiled once per session) in batches.
"""

from __future__ import annotations

import ep_layout as el
from hypothesis import example, given, settings
from hypothesis import strategies as st

BATCH = st.lists  # every example is a batch of configurations sent to the C++ process at once
SETTINGS = settings(max_examples=30, deadline=None)

hidden_bytes = st.one_of(
    st.integers(1, 2048).map(lambda n: 32 * n),
    st.sampled_from([2048, 2880, 4096, 5120, 7168, 8192]).flatmap(lambda h: st.sampled_from([h, 2 * h])),
)
token_args = st.tuples(
    hidden_bytes, st.integers(0, 1024).map(lambda n: 4 * n), st.integers(0, 32), st.booleans()
)


@st.composite
def topologies(draw: st.DrawFn) -> tuple[int, int, bool]:
    num_ranks = draw(st.one_of(st.integers(1, 1024), st.sampled_from([1, 2, 4, 8, 16, 32, 64, 72, 128, 256])))
    divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
    return num_ranks, draw(st.sampled_from(divisors)), draw(st.booleans())


def _token(args: tuple[int, int, int, bool]) -> el.TokenLayout:
    return el.TokenLayout(*args)


def _request(*values: object) -> str:
    return " ".join(str(int(v)) if isinstance(v, bool) else str(v) for v in values)


def _ints(answer: str) -> list[int]:
    return [int(x) for x in answer.split()]


@SETTINGS
@given(BATCH(token_args, min_size=50, max_size=300))
@example(
    [(14336, 0, 8, True), (7168, 896, 8, True), (14336, 0, 8, False), (32, 0, 0, False), (32, 4, 32, True)]
)
def test_token_layout_matches_cpp(layout_dump, batch: list[tuple[int, int, int, bool]]) -> None:
    answers = layout_dump.query([_request("token", *args) for args in batch])
    for args, answer in zip(batch, answers, strict=True):
        t = _token(args)
        expected = [
            t.get_num_bytes(),
            t.get_num_bytes(with_mbarrier=True),
            t.get_num_metadata_bytes(),
            t.get_hidden_offset(),
            t.get_sf_offset(),
            t.get_topk_idx_offset(),
            t.get_topk_weights_offset(),
            t.get_src_token_idx_offset(),
            t.get_linked_list_idx_offset(),
            t.get_mbarrier_offset(),
            1,  # is_valid() on the C++ side for every configuration the mirror accepts
        ]
        assert _ints(answer) == expected, args


@st.composite
def buffer_args(draw: st.DrawFn) -> tuple:
    token = draw(token_args)
    with_mbarrier = draw(st.booleans())
    num_ranks = draw(st.integers(0, 1024))
    num_tokens = draw(st.integers(0, 20000))
    rank = draw(st.integers(0, max(num_ranks - 1, 0)))
    tok = draw(st.integers(0, max(num_tokens - 1, 0)))
    tpc = draw(st.integers(0, max(num_tokens, 0)))
    channel = draw(st.integers(0, num_tokens // tpc if tpc else 0))
    return (*token, with_mbarrier, num_ranks, num_tokens, rank, tok, channel, tpc)


@SETTINGS
@given(BATCH(buffer_args(), min_size=50, max_size=300))
def test_buffer_layout_matches_cpp(layout_dump, batch: list[tuple]) -> None:
    answers = layout_dump.query([_request("buffer", *args) for args in batch])
    for args, answer in zip(batch, answers, strict=True):
        h, s, k, wm, mb, ranks, tokens, rank, tok, channel, tpc = args
        b = el.BufferLayout(el.TokenLayout(h, s, k, wm), ranks, tokens, with_mbarrier=mb)
        expected = [
            b.get_num_bytes_per_token(),
            b.get_num_bytes_per_rank(),
            b.get_num_bytes(),
            b.get_rank_offset(rank),
            b.get_token_offset(rank, tok),
            b.get_channel_offset(channel, tpc),
            1,  # the C++ pointer views agree with the offsets
        ]
        assert _ints(answer) == expected, args


@st.composite
def compose_args(draw: st.DrawFn) -> tuple:
    return (*draw(token_args), *draw(topologies()), draw(st.integers(1, 65536)), draw(st.booleans()))


def _expected_compose(args: tuple) -> list[str]:
    h, s, k, wm, n, su, nvl, m, amr = args
    token = el.TokenLayout(h, s, k, wm)
    topo = el.Topology(n, su, nvl)
    d = el.dispatch_buffers(token, topo, m)
    c = el.combine_buffers(token, topo, m, amr)
    assert (
        isinstance(d, el.HybridDispatchBuffers) == topo.is_hybrid() == isinstance(c, el.HybridCombineBuffers)
    )
    out = ["hybrid" if topo.is_hybrid() else "direct"]
    for comp, total in (
        (d, el.dispatch_buffer_bytes(token, topo, m)),
        (c, el.combine_buffer_bytes(token, topo, m, amr)),
    ):
        for name, offset, layout in comp.parts():
            assert comp.get_offset(name) == offset == getattr(comp, f"get_{name}_offset")()
            out += [
                str(offset),
                str(layout.num_ranks),
                str(layout.num_tokens_per_rank),
                str(layout.get_num_bytes()),
            ]
        out += [str(comp.get_num_bytes()), str(total)]
    return out


@SETTINGS
@given(BATCH(compose_args(), min_size=50, max_size=300))
@example([(14336, 0, 8, True, 8, 8, True, 4096, True), (14336, 0, 8, False, 16, 8, False, 4096, False)])
def test_buffer_compositions_match_cpp(layout_dump, batch: list[tuple]) -> None:
    answers = layout_dump.query([_request("compose", *args) for args in batch])
    for args, answer in zip(batch, answers, strict=True):
        assert answer.split() == _expected_compose(args), args


@st.composite
def hint_args(draw: st.DrawFn) -> tuple:
    n, su, nvl = draw(topologies())
    use_fp8 = draw(st.booleans())
    granule = 32 if use_fp8 else 16
    hidden = draw(
        st.one_of(st.integers(1, 1024).map(lambda x: granule * x), st.sampled_from([2048, 4096, 7168]))
    )
    return (
        n,
        su,
        nvl,
        draw(st.integers(1, 16384)),
        hidden,
        draw(st.integers(0, 32)),
        use_fp8,
        draw(st.booleans()),
    )


@SETTINGS
@given(BATCH(hint_args(), min_size=50, max_size=300))
@example([(8, 8, True, 4096, 7168, 8, False, True), (8, 8, True, 4096, 7168, 8, True, True)])
def test_size_hint_matches_cpp(layout_dump, batch: list[tuple]) -> None:
    answers = layout_dump.query([_request("hint", *args) for args in batch])
    for args, answer in zip(batch, answers, strict=True):
        n, su, nvl, m, hidden, k, fp8, amr = args
        expected = el.size_hint_bytes(
            el.Topology(n, su, nvl), m, hidden, k, use_fp8=fp8, allow_multiple_reduction=amr
        )
        assert int(answer) == expected, args
        assert expected % el.NUM_SYMMETRIC_ALIGN_BYTES == 0


def test_workspace_matches_cpp(layout_dump) -> None:
    (answer,) = layout_dump.query(["workspace"])
    values = _ints(answer)
    regions = el.WorkspaceLayout.regions()
    per_region = [values[3 * i : 3 * i + 3] for i in range(len(regions))]
    assert per_region == [[r.offset, r.num_elems, r.elem_bytes] for r in regions]
    rest = values[3 * len(regions) :]
    assert rest[:2] == [el.WorkspaceLayout.get_num_bytes(), el.WorkspaceLayout.get_num_aligned_bytes()]
    named = rest[2 : 2 + 2 * len(regions)]
    assert named == [v for r in regions for v in (r.offset, r.num_elems)]
    assert rest[2 + 2 * len(regions) :] == [f.offset for f in el.ERROR_RECORD_FIELDS]


def test_layout_version_matches_cpp(layout_dump) -> None:
    (answer,) = layout_dump.query(["version"])
    assert tuple(_ints(answer)) == el.LAYOUT_VERSION


def test_unknown_request_is_reported(layout_dump) -> None:
    assert layout_dump.query(["no-such-request 1 2"]) == ["error"]
