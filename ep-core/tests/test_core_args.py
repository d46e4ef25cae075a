"""One argument record per operation (issue 45): `DispatchArgs` / `CombineArgs` are `EPBuffer.dispatch` /
`combine`'s parameters, and `EPBuffer` builds each once and hands it on whole (no positional lists to keep in
order: the record is read by field name, and the prepared-operation cache's keys name the fields they read)."""

from __future__ import annotations

import inspect

import pytest
from ep_core.buffer import EPBuffer
from ep_core.requests import CombineArgs, DispatchArgs


class _Stop(Exception):
    pass


# the framework layer's fields of a record, after the public signature's (ep_torch runs their roads)
_FRAMEWORK = {"dispatch": (), "combine": ("out_dtype", "defer_epilogue")}


@pytest.mark.parametrize(("op", "record"), [("dispatch", DispatchArgs), ("combine", CombineArgs)])
def test_the_record_is_the_public_signature(op, record):
    params = inspect.signature(getattr(EPBuffer, op)).parameters
    assert list(record._fields) == list(params)[1:] + list(_FRAMEWORK[op])
    for name, p in list(params.items())[1:]:
        if p.default is not inspect.Parameter.empty:
            assert record._field_defaults[name] is p.default or record._field_defaults[name] == p.default, (
                name
            )


@pytest.mark.parametrize(("op", "record"), [("dispatch", DispatchArgs), ("combine", CombineArgs)])
def test_each_argument_lands_in_its_own_field(op, record):
    got: list = []

    def run(args):
        got.append(args)
        raise _Stop

    fake = type("Fake", (), {f"run_{op}": staticmethod(run)})()
    sentinels = {name: object() for name in record._fields if name not in _FRAMEWORK[op]}
    with pytest.raises(_Stop):
        getattr(EPBuffer, op)(fake, **sentinels)
    (args,) = got
    assert type(args) is record
    assert all(getattr(args, name) is value for name, value in sentinels.items())


def test_ep_cores_combine_refuses_the_framework_fields():
    """`out_dtype` / `defer_epilogue` are ep_torch's roads: a record that sets them is refused, not run as a bf16
    combine (no silent fallback)."""
    from ep_core.errors import EPValueError

    buf = EPBuffer.__new__(EPBuffer)
    buf._destroyed = False
    for extra in ({"out_dtype": "float32"}, {"defer_epilogue": True}):
        with pytest.raises(EPValueError, match="out_dtype / defer_epilogue"):
            buf._combine(CombineArgs(None, None, **extra))


def test_the_prepared_keys_name_their_fields():
    from ep_core import prepared

    args = DispatchArgs(*(f"v{i}" for i in range(len(DispatchArgs._fields))))
    keyed = prepared._dispatch_scalars(args)
    names = [DispatchArgs._fields[int(v[1:])] for v in keyed]
    assert "x" not in names and "handle" not in names and "allocator" not in names and "stream" not in names
    assert {"num_sms", "num_qps", "do_cpu_sync", "do_expand", "zero_copy"} <= set(names)
    cargs = CombineArgs(*(f"v{i}" for i in range(len(CombineArgs._fields))))
    cnames = [CombineArgs._fields[int(v[1:])] for v in prepared._combine_scalars(cargs)]
    assert cnames == [
        "num_sms",
        "num_qps",
        "async_with_compute_stream",
        "allocate_on_comm_stream",
        "zero_copy",
    ]


def test_the_launch_words_are_built_in_their_named_order():
    """The kernels' per-call words are built in one place each (`ep_core.kernels.op_plan`), for the full path and
    the plans' runs alike, in the order their slots' names (`ep_core.kernels.prepared_launch`) say."""
    from ep_core.kernels import op_plan as lw
    from ep_core.kernels import prepared_launch as names_of

    assert lw.dispatch_words(*names_of._DISPATCH_DYNAMIC) == names_of._DISPATCH_DYNAMIC
    zero_copy = lw.dispatch_words(*names_of._DISPATCH_DYNAMIC, src_metadata="src_metadata")
    assert zero_copy == names_of._DISPATCH_ZERO_COPY_DYNAMIC
    assert lw.combine_words(*names_of._COMBINE_DYNAMIC) == names_of._COMBINE_DYNAMIC
    assert (
        lw.combine_words(*names_of._COMBINE_DYNAMIC, dst_slot="dst_slot")
        == names_of._COMBINE_ZERO_COPY_DYNAMIC
    )
    names = names_of._EPILOGUE_DYNAMIC
    words = lw.epilogue_outputs(lambda a, _what: a, names[1], names[2], names[3], names[4:6], *names[6:])
    assert words == (0, *names[1:])  # the envelope is 0: the epilogue meets no peer
