"""The positional road keeps `EPBuffer.dispatch` / `combine`'s argument order (issue 18).

`EPBuffer.dispatch_positional` and `PreparedOps.dispatch_positional` take the ~20 arguments of `EPBuffer.dispatch`
by position (keywords cost microseconds per layer), and `EPBuffer.dispatch` and `PreparedOps.dispatch_request` pass
them on by position. The order is the contract: a swap of two arguments of one type (num_sms / num_qps, two flags)
would pass every other test. Here the public signature is the reference: every positional list is compared with it
by name, and every forwarding call is driven with one distinct sentinel per argument and must deliver each at its
own position. (ep_torch's `ElasticBuffer.dispatch` / `combine`, the other caller: ep-torch/tests.)
"""

from __future__ import annotations

import inspect

import pytest
from ep_core.buffer import EPBuffer
from ep_core.prepared import PreparedOps


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# x .. stream; `zero_copy` (last, keyword-only) takes its own road (`EPBuffer.dispatch_zero_copy_positional` /
# `combine_zero_copy_positional`), not this one
DISPATCH = [n for n in _params(EPBuffer.dispatch)[1:] if n != "zero_copy"]
COMBINE = [n for n in _params(EPBuffer.combine)[1:] if n != "zero_copy"]


class _Stop(Exception):
    pass


class _Recorder:
    """Stands in for the callee: records its positional arguments and stops the call there."""

    def __init__(self) -> None:
        self.args: tuple = ()

    def __call__(self, *args):
        self.args = args
        raise _Stop


def _forwarded(fn, owner_attr: str, names: list[str], *lead) -> tuple[tuple, dict]:
    rec = _Recorder()
    fake = type("Fake", (), {owner_attr: staticmethod(rec)})()
    sentinels = {name: object() for name in names}
    with pytest.raises(_Stop):
        fn(fake, *lead, **sentinels)
    return rec.args, sentinels


def test_the_reference_lists_are_the_documented_ones():
    assert _params(EPBuffer.dispatch)[-1] == "zero_copy" and _params(EPBuffer.combine)[-1] == "zero_copy"
    assert DISPATCH[:3] == ["x", "topk_idx", "topk_weights"] and DISPATCH[-2:] == ["allocator", "stream"]
    assert len(DISPATCH) == 21 and len(set(DISPATCH)) == 21
    assert COMBINE[:2] == ["x", "handle"] and COMBINE[-2:] == ["allocator", "stream"] and len(COMBINE) == 12


def test_positional_signatures_name_the_public_order():
    # the zero-copy road passes its flag after the SM cache (`EPBuffer.dispatch_zero_copy_positional`)
    assert _params(PreparedOps.dispatch_positional) == ["self", "target", *DISPATCH, "sm_cache", "zero_copy"]
    assert _params(PreparedOps.dispatch_request) == ["self", "target", *DISPATCH, "sm_cache"]
    assert _params(PreparedOps.combine_positional) == ["self", "target", *COMBINE, "zero_copy"]
    assert _params(PreparedOps.combine_request) == ["self", "target", *COMBINE]


def test_epbuffer_forwards_each_dispatch_argument_to_its_position():
    args, sent = _forwarded(EPBuffer.dispatch, "dispatch_positional", DISPATCH)
    assert args == tuple(sent[n] for n in DISPATCH)


def test_epbuffer_forwards_each_zero_copy_dispatch_argument_to_its_position():
    args, sent = _forwarded(EPBuffer.dispatch, "dispatch_zero_copy_positional", [*DISPATCH, "zero_copy"])
    assert args == tuple(sent[n] for n in [*DISPATCH, "zero_copy"])


def test_epbuffer_forwards_each_zero_copy_combine_argument_to_its_position():
    args, sent = _forwarded(EPBuffer.combine, "combine_zero_copy_positional", [*COMBINE, "zero_copy"])
    assert args == tuple(sent[n] for n in [*COMBINE, "zero_copy"])


def test_epbuffer_forwards_each_combine_argument_to_its_position():
    args, sent = _forwarded(EPBuffer.combine, "combine_positional", COMBINE)
    assert args == tuple(sent[n] for n in COMBINE)


def test_prepared_ops_requests_forward_each_argument_to_its_position():
    target = object()
    args, sent = _forwarded(
        PreparedOps.dispatch_request, "dispatch_positional", [*DISPATCH, "sm_cache"], target
    )
    assert args == (target, *(sent[n] for n in [*DISPATCH, "sm_cache"]))
    args, sent = _forwarded(PreparedOps.combine_request, "combine_positional", COMBINE, target)
    assert args == (target, *(sent[n] for n in COMBINE))
