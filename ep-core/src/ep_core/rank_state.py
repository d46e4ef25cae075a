"""The per-rank runtime state of a buffer's collective steps: the one place for it.

A buffer's host steps (`ep_core.envelope.Channel`) and the guards of surfaces with steps of their own (V1's
`Buffer`, PP, AGRS) share one `RankState`:

- `seq`: the step counter every rank compares in the envelope (one per buffer: V1's inner buffers and its own
  exchange share it). A step a rank aborted counts on no rank (every rank takes its counter back), so an abort note
  pairs with whatever step its peers are in; `taken` counts the steps a rank took part in, aborted ones included;
- `failure`: the error that put the ranks out of step (`EPMismatchError`, `EPTimeoutError`, a dead peer). Once set,
  every operation is refused at once (`refuse`: `EPStateError` naming the cause) until `reset()`, a collective
  (`Channel.reset`). An *announced* error (`EPPeerError.announced`) leaves the ranks in step: no failure;
- `generation`: the resets this state went through; handles record `owner` = `(ident, generation)`, and
  `check_owner` refuses, by name, a handle from before a reset or from another buffer.
"""

from __future__ import annotations

import itertools
from typing import Any

from ep_core.errors import EPMismatchError, EPPeerError, EPStateError, EPTimeoutError, EPValueError

__all__ = ["Guard", "RankState", "breaks_step", "check_owner"]

_IDS = itertools.count(1)


def breaks_step(exc: BaseException) -> bool:
    """Whether `exc` leaves the ranks out of step (they disagree, a wait expired, a peer died): then nothing may
    pair until `reset()`. A peer's announced rejection keeps them in step."""
    if isinstance(exc, (EPMismatchError, EPTimeoutError)):
        return True
    return isinstance(exc, EPPeerError) and not getattr(exc, "announced", False)


class RankState:
    """One rank's state of one buffer's collective steps (see the module doc)."""

    __slots__ = ("failed_op", "failure", "generation", "ident", "name", "owner", "rank", "seq", "taken")

    def __init__(self, rank: int, name: str = "buffer") -> None:
        self.rank = rank
        self.name = name
        self.seq = 0
        self.taken = 0  # steps this rank took part in (its own or a peer's abort included): `Guard`'s test
        self.failure: BaseException | None = None
        self.failed_op = ""
        self.generation = 0
        self.ident = next(_IDS)  # this process's id of the buffer (handles carry it)
        # what a new handle records (`_ep_owner`): one tuple per generation, so that `check_owner` compares a
        # handle of this generation by identity
        self.owner = (self.ident, 0)

    def refuse(self, op: str) -> None:
        """Raise the refusal of `op` on an out-of-step buffer (call only when `failure` is set)."""
        exc = self.failure
        raise EPStateError(
            f"{op} on rank {self.rank}: refused: this {self.name} is out of step with its peers since {self.failed_op} "
            f"failed ({type(exc).__name__}: {str(exc)[:300]}); every operation is refused until reset() is called on "
            "every rank (reset() resynchronises the ranks; then the buffer works as new)"
        ) from exc

    def record(self, op: str, exc: BaseException) -> None:
        """Keep `exc` as the failure when it breaks the step (`breaks_step`); the first one stays."""
        if self.failure is None and breaks_step(exc):
            self.failure = exc
            self.failed_op = op

    def cleared(self, seq: int) -> None:
        """After a successful `reset()`: in step again at `seq`, a new generation."""
        self.seq = seq
        self.failure = None
        self.failed_op = ""
        self.new_generation()

    def new_generation(self) -> None:
        """Advance the generation: every handle made before is stale (`check_owner`)."""
        self.generation += 1
        self.owner = (self.ident, self.generation)

    def guard(self, op: str, announce: Any = None) -> Guard:
        """`with state.guard(op, announce):` refuses `op` on an out-of-step buffer, records a step-breaking error
        leaving the block, and for any other error raised before this rank took part in a step (`seq` unchanged)
        calls `announce(op, error)` (best effort: its own failure never hides the error)."""
        return Guard(self, op, announce)


def check_owner(handle: Any, state: RankState, rank: int) -> None:
    """Refuse, by name, a handle that another buffer's dispatch made (`EPValueError`) or one from before this
    buffer's last `reset()` (`EPStateError`): its arrays index another layout. A handle built by hand (tests,
    replays: no `_ep_owner`) passes; its layout is checked as any handle's. Once per call where a road takes the
    handle: a handle of this generation costs a getattr and one identity compare."""
    owner = getattr(handle, "_ep_owner", None)
    if owner is None or owner is state.owner:
        return
    if owner[0] != state.ident:
        raise EPValueError(
            f"handle: comes from another buffer (rank {rank}); a handle works only with the buffer whose dispatch "
            "made it"
        )
    if owner[1] != state.generation:
        raise EPStateError(
            f"handle: stale (rank {rank}): this buffer was reset() since the dispatch that made it; dispatch again"
        )


class Guard:
    """`RankState.guard`'s context (a plain class: cheap per call)."""

    __slots__ = ("announce", "op", "state", "step")

    def __init__(self, state: RankState, op: str, announce: Any) -> None:
        self.state = state
        self.op = op
        self.announce = announce

    def __enter__(self) -> None:
        st = self.state
        if st.failure is not None:
            st.refuse(self.op)
        self.step = st.taken

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not isinstance(exc, Exception):
            return False
        st = self.state
        if breaks_step(exc):
            st.record(self.op, exc)
        elif st.taken == self.step and self.announce is not None and st.failure is None:
            try:
                self.announce(self.op, exc)
            except Exception as inner:  # the caller raises the original error
                st.record(self.op, inner)
                exc.__context__ = inner
        return False
