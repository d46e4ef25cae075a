"""CPU tests of ep_launch: the module imports without a GPU and patches argument words as documented."""

import struct

import ep_launch
import pytest


def _words(values):
    return struct.pack(f"<{len(values)}q", *values)


def test_patched_words_set_slots_in_order():
    launch = ep_launch.Launch(0, 4, 128, 0, True, _words([1, 2, 3, 4]), [3, 0])
    assert launch.patched((7, 9)) == _words([9, 2, 3, 7])
    assert launch.patched((7,)) == _words([1, 2, 3, 7])  # fewer values than slots: the rest keep their words
    assert launch.words == _words([1, 2, 3, 4])
    assert (launch.grid, launch.block, launch.shared_mem, launch.cooperative, launch.pdl) == (
        4,
        128,
        0,
        True,
        False,
    )


def test_later_slots_win_and_pointers_wrap():
    launch = ep_launch.Launch(0, 1, 32, 0, False, _words([0, 0]), [1, 0, 1])
    top = (1 << 64) - 8  # a value above 2**63 wraps as pack_op_args wraps it
    assert launch.patched((5, top, 6)) == _words([-8, 6])
    with pytest.raises(OverflowError):
        launch.patched((1 << 64, 0, 0))
    with pytest.raises(TypeError):
        launch.patched(("x", 0, 0))


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="slots"):
        ep_launch.Launch(0, 1, 32, 0, False, _words([0]), [1])
    with pytest.raises(ValueError, match="multiple of 8"):
        ep_launch.Launch(0, 1, 32, 0, False, b"abc", [])
    with pytest.raises(ValueError, match="more values"):
        ep_launch.Launch(0, 1, 32, 0, False, _words([0]), [0]).patched((1, 2))


def test_availability_is_reported_not_raised():
    ok = ep_launch.available()
    assert isinstance(ok, bool)
    assert ok or ep_launch.unavailable_reason()
