"""CPU: every ep_core error is also the builtin DeepEP raises for the same check (Python `assert` ->
AssertionError, C++ runtime -> RuntimeError), keeps ep's own hierarchy and its ValueError/TypeError/TimeoutError
bases, and stays picklable."""

from __future__ import annotations

import pickle

import pytest
from ep_core import errors as E
from ep_core.transports.nccl import NcclTransport

DEEPEP_BUILTIN = {
    E.EPValueError: AssertionError,
    E.EPConfigError: AssertionError,
    E.EPPlanMismatchError: AssertionError,
    E.EPMismatchError: AssertionError,
    E.EPTypeError: AssertionError,
    E.EPStateError: RuntimeError,
    E.EPPeerError: RuntimeError,
    E.EPDeviceError: RuntimeError,
    E.EPTimeoutError: RuntimeError,
}
OWN_BUILTIN = {
    E.EPValueError: ValueError,
    E.EPConfigError: ValueError,
    E.EPTypeError: TypeError,
    E.EPStateError: RuntimeError,
    E.EPTimeoutError: TimeoutError,
}


def _make(cls):
    if cls is E.EPTimeoutError:
        return cls(1, "dispatch.notify", 2, 3)
    return cls("argument x: rule (rank 0)")


@pytest.mark.parametrize("cls", list(DEEPEP_BUILTIN), ids=lambda c: c.__name__)
def test_each_error_is_deepeps_builtin_and_ep_error(cls):
    exc = _make(cls)
    assert isinstance(exc, E.EPError) and isinstance(exc, DEEPEP_BUILTIN[cls])
    if cls in OWN_BUILTIN:
        assert isinstance(exc, OWN_BUILTIN[cls])
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc)


def test_argument_errors_are_not_runtime_errors_and_runtime_errors_not_assertions():
    assert not issubclass(E.EPValueError, RuntimeError) and not issubclass(E.EPTypeError, RuntimeError)
    for cls in (E.EPStateError, E.EPDeviceError, E.EPTimeoutError):
        assert not issubclass(cls, AssertionError)
    assert issubclass(E.EPPlanMismatchError, E.EPConfigError) and issubclass(E.EPConfigError, E.EPValueError)


def test_a_real_check_is_caught_by_deepep_and_by_older_callers():
    for catch in (AssertionError, ValueError, E.EPConfigError):
        with pytest.raises(catch, match="comm_ptr"):
            NcclTransport(comm_ptr=-3)
    try:
        NcclTransport(comm_ptr=-3)
    except ValueError as exc:  # an existing `except ValueError` still sees it first
        assert isinstance(exc, AssertionError)
