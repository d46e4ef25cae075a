"""ep_core's exception hierarchy.

Every message says what was expected, what was got, and what to do. Each error is also the builtin DeepEP raises
for the same check, so code that catches the builtins keeps working: DeepEP checks arguments with Python `assert`
(`AssertionError`), and its C++ runtime's `EP_HOST_ASSERT`, state checks and timeouts throw `RuntimeError`.

    EPError
    ├── EPValueError (ValueError, AssertionError)   bad argument value or shape; the message names the argument
    │   ├── EPConfigError                  bad configuration: topology, sizes, planner inputs, undetectable bandwidth
    │   │   └── EPPlanMismatchError        ranks of one domain planned different symmetric tensors
    │   └── EPMismatchError                ranks of one collective step disagree (operation envelope)
    ├── EPTypeError (TypeError, AssertionError)     bad argument type or dtype
    ├── EPStateError (RuntimeError)        call on a destroyed buffer, or out of order (C++ `EP_HOST_ASSERT`)
    │   └── EPPeerError                    a peer rank raised (named) or died in this collective step
    ├── EPDeviceError (RuntimeError)       an error word set by a kernel (bad expert id, duplicate expert, ...)
    └── EPTimeoutError (TimeoutError, RuntimeError)  a wait on peers expired (GPU record or CPU-side wait)
"""

from __future__ import annotations

__all__ = [
    "EPConfigError",
    "EPDeviceError",
    "EPError",
    "EPMismatchError",
    "EPPeerError",
    "EPPlanMismatchError",
    "EPStateError",
    "EPTimeoutError",
    "EPTypeError",
    "EPValueError",
]


class EPError(Exception):
    """Base class of every ep_core error."""


class EPValueError(EPError, ValueError, AssertionError):
    """An argument has a bad value or shape; the message names the argument and the rule."""


class EPTypeError(EPError, TypeError, AssertionError):
    """An argument has a bad type or dtype; the message names the argument."""


class EPConfigError(EPValueError):
    """A configuration cannot work: topology, buffer sizes, planner inputs, undetectable bandwidths."""


class EPPlanMismatchError(EPConfigError):
    """Ranks of one domain planned different symmetric tensors (peers address tensors by offset)."""


class EPStateError(EPError, RuntimeError):
    """The object is in the wrong state for the call (e.g. used after `destroy()`)."""


class EPDeviceError(EPError, RuntimeError):
    """A kernel reported an error through the workspace error word."""

    def __init__(self, message: str, *, code: int = 0, rank: int = -1, detail: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.rank = rank
        self.detail = detail


class EPTimeoutError(EPError, TimeoutError, RuntimeError):
    """A wait on peers timed out.

    `rank`: the rank that waited; `tag`: what it waited for (a kernel tag such as "dispatch.notify", or
    "cpu.dispatch_wait"); `counter`: which counter / peer it waited on; `value`: the last value it saw (or the
    counts seen, for the CPU-side wait).
    """

    def __init__(
        self, rank: int, tag: str, counter: int | str, value: object, message: str | None = None
    ) -> None:
        self.rank = rank
        self.tag = tag
        self.counter = counter
        self.value = value
        text = message or (
            f"rank {rank} timed out waiting on {tag} (counter {counter}, last value {value}); a peer rank did not "
            "arrive: check that every rank calls the same operations, or raise num_gpu_timeout_secs / "
            "num_cpu_timeout_secs"
        )
        super().__init__(text)

    def __reduce__(self):  # keep picklable across processes
        return (type(self), (self.rank, self.tag, self.counter, self.value, str(self)))


class EPPeerError(EPStateError):
    """Another rank of the group failed the collective step this rank is in: it raised its own error (named in
    the message with its rank), or it died. Every other rank raises this instead of waiting or pairing calls."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), announced: bool = False) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        # True: the peer rejected its own call and said so (the ranks stay in step); False: it died or vanished
        self.announced = bool(announced)

    def __reduce__(self):  # keep picklable across processes
        return (_rebuild_peer_error, (type(self), str(self), self.ranks, self.announced))


class EPMismatchError(EPValueError):
    """The ranks of one collective step disagree on the operation or on configuration that must agree (the
    operation envelope); every rank raises it. `fields` maps each differing field to its value per rank."""

    def __init__(self, message: str, *, fields: dict | None = None) -> None:
        super().__init__(message)
        self.fields = dict(fields or {})

    def __reduce__(self):
        return (_rebuild_mismatch_error, (str(self), self.fields))


def _rebuild_peer_error(
    cls: type, message: str, ranks: tuple[int, ...], announced: bool = False
) -> EPPeerError:
    return cls(message, ranks=ranks, announced=announced)


def _rebuild_mismatch_error(message: str, fields: dict) -> EPMismatchError:
    return EPMismatchError(message, fields=fields)
