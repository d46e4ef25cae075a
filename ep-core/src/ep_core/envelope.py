"""The operation envelope: every host-side collective step of a buffer is checked against its peers.

Each step (a dispatch's or combine's exchange, a barrier, a reset) sends with its payload an envelope: the step's
sequence number, the operation kind and the configuration that must agree across ranks. Every rank compares all
envelopes the same way, so a disagreement makes *every* rank raise the same `EPMismatchError` (naming the ranks and
fields) instead of pairing different calls. A rank that rejects its own call before the exchange takes part in the
step with an *abort note* (`Channel.announce`) and raises its own error; its peers raise `EPPeerError` naming it,
and the buffer stays usable. A failure that leaves the ranks out of step (a disagreement, an expired wait, a dead
peer) makes the channel's `RankState` (`ep_core.rank_state`) refuse every later step until `reset()`, the one
collective that resynchronises the ranks (through the bootstrap's `resync` when it has one). Waits are bounded by
the bootstrap (`EPTimeoutError` / `EPPeerError` naming the peer).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ep_core.errors import EPMismatchError, EPPeerError, EPStateError, EPTimeoutError
from ep_core.rank_state import RankState

__all__ = ["Channel", "Envelope", "check_envelopes"]


@dataclass(frozen=True)
class Envelope:
    """What one rank says about the collective step it is in."""

    seq: int
    op: str
    config: tuple[tuple[str, Any], ...] = ()
    abort: str | None = None  # the rank's own error message when it rejected its call before the exchange


def check_envelopes(envs: list[Envelope], rank: int) -> None:
    """Raise on every rank alike when a peer aborted or the envelopes disagree (a rank's own abort is not
    raised here: that rank raises its own error)."""
    aborted = [r for r, e in enumerate(envs) if e.abort is not None]
    if aborted:
        if envs[rank].abort is not None:
            return
        first = aborted[0]
        raise EPPeerError(
            f"{envs[rank].op} (step {envs[rank].seq}) on rank {rank}: "
            + "; ".join(
                f"rank {r} abandoned the operation (it rejected its call and raised {envs[r].abort})"
                for r in aborted
            )
            + f"; every rank leaves this step, the buffer stays usable (rank {first}'s error is the cause)",
            ranks=tuple(aborted),
            announced=True,
        )
    diffs: dict[str, list[Any]] = {}
    if len({e.op for e in envs}) > 1:
        diffs["operation"] = [e.op for e in envs]
    if len({e.seq for e in envs}) > 1:
        diffs["step"] = [e.seq for e in envs]
    if "operation" not in diffs:
        keys = sorted({k for e in envs for k, _ in e.config})
        for k in keys:
            values = [dict(e.config).get(k, "<absent>") for e in envs]
            if any(v != values[0] for v in values[1:]):
                diffs[k] = values
    if not diffs:
        return
    text = "; ".join(
        f"{k} differs ({', '.join(f'rank {r}: {v!r}' for r, v in enumerate(vs))})" for k, vs in diffs.items()
    )
    raise EPMismatchError(
        f"{envs[rank].op} (step {envs[rank].seq}): the ranks disagree: {text}; every rank must call the same "
        "operations in the same order with the same num_experts, num_max_tokens_per_rank, hidden, top-k, dtypes "
        "and handles (every rank raises this error; the buffer then refuses every operation until reset() is called "
        "on every rank)",
        fields=diffs,
    )


class Channel:
    """The enveloped host exchange of one buffer over its bootstrap (one sequence of steps per buffer; `state`: the
    buffer's `RankState`, shared by every channel of one buffer)."""

    def __init__(self, bootstrap: Any, state: RankState | None = None) -> None:
        self.bootstrap = bootstrap
        self.rank = bootstrap.rank
        if state is None:  # a bootstrap may carry its buffer's state: every channel over it shares the steps
            state = getattr(bootstrap, "rank_state", None)
        self.state = state if state is not None else RankState(bootstrap.rank)
        self.tags: dict[str, Any] = {}

    @contextlib.contextmanager
    def tagged(self, **fields: Any) -> Iterator[None]:
        """Every step taken inside the block carries `fields` in its envelope's configuration: an option of the
        caller that the steps themselves do not see (V1's ``use_logfmt``), so ranks that differ in it meet envelopes
        that differ and all raise `EPMismatchError` instead of combining rows of another format."""
        old = self.tags
        self.tags = {**old, **fields}
        try:
            yield
        finally:
            self.tags = old

    @property
    def taken(self) -> int:
        """Steps this rank took part in (aborted ones too): a call whose count did not move took part in none."""
        return self.state.taken

    @property
    def seq(self) -> int:
        return self.state.seq

    @seq.setter
    def seq(self, value: int) -> None:
        self.state.seq = value

    def exchange(self, op: str, config: dict[str, Any], payload: Any = None) -> list[Any]:
        """Every rank's payload of this step, after checking every rank's envelope (see the module doc)."""
        if self.tags:
            config = {**config, **self.tags}
        env = Envelope(self.state.seq, op, tuple(sorted(config.items())))
        return self._step(env, payload)

    def announce(self, op: str, error: BaseException) -> None:
        """Take part in the peers' pending step with an abort note naming `error` (the caller raises it)."""
        note = f"{op}: {type(error).__name__}: {error}"
        self._step(Envelope(self.state.seq, op, (), abort=note), None)

    def _gather(self, env: Envelope, payload: Any) -> list[tuple[Any, Any]]:
        self.state.taken += 1
        try:
            raw = self.bootstrap.allgather(pickle.dumps((env, payload)))
        except (EPTimeoutError, EPPeerError) as exc:
            self.state.record(env.op, exc)
            raise
        try:
            items = [pickle.loads(b) for b in raw]
        except Exception as exc:  # a peer outside the envelope protocol (another library on the same group)
            err = EPStateError(
                f"{env.op} (step {env.seq}) on rank {self.rank}: a peer sent bytes that are no operation envelope "
                f"({exc}); every rank of the group must use the same buffer for its collective steps"
            )
            self.state.record(env.op, EPMismatchError(str(err)))
            raise err from exc
        return [it if isinstance(it, tuple) and len(it) == 2 else (None, None) for it in items]

    def _step(self, env: Envelope, payload: Any) -> list[Any]:
        st = self.state
        if st.failure is not None:
            st.refuse(env.op)
        st.seq += 1
        try:
            items = self._gather(env, payload)
        except EPPeerError as exc:
            if (
                exc.announced
            ):  # a peer's raw abort note (ep_torch's bootstrap.abort): the step counts on no rank
                st.seq -= 1
            raise
        envs = [e if isinstance(e, Envelope) else Envelope(-1, "<no envelope>") for e, _ in items]
        if any(e.abort is not None for e in envs):
            st.seq -= 1  # an aborted step counts on no rank (see ep_core.rank_state)
        try:
            check_envelopes(envs, self.rank)
        except EPMismatchError as exc:
            st.record(env.op, exc)
            raise
        return [p for _, p in items]

    def reset(self) -> bool:
        """The collective that resynchronises the ranks after a failure (every rank calls it, whatever step it is
        at, failed or not): the bootstrap's `resync` first where it has one (ranks meet outside the possibly
        desynchronised collectives), then a `reset` exchange that puts every rank at the same step; the failure is
        cleared and the generation advances. Raises `EPMismatchError` when a peer is in another operation (it did
        not call `reset()`): the buffer stays refused then, call `reset()` again on every rank. Returns whether any
        rank had recorded a failure (every rank returns the same)."""
        st = self.state
        resync = getattr(self.bootstrap, "resync", None)
        if resync is not None:
            try:
                resync()
            except (EPTimeoutError, EPPeerError) as exc:
                st.record("reset", exc)
                raise
        env = Envelope(st.seq, "reset")
        items = self._gather(env, (st.seq, st.failure is not None))
        envs = [e if isinstance(e, Envelope) else Envelope(-1, "<no envelope>") for e, _ in items]
        ops = [e.op for e in envs]
        if any(op != "reset" for op in ops):
            exc = EPMismatchError(
                f"reset on rank {self.rank}: the ranks are in different operations ("
                + ", ".join(f"rank {r}: {op!r}" for r, op in enumerate(ops))
                + "); reset() is a collective: call it on every rank, then the buffer works again",
                fields={"operation": ops},
            )
            st.record("reset", exc)
            raise exc
        pays = [p if isinstance(p, tuple) and len(p) == 2 else (0, True) for _, p in items]
        st.cleared(max(int(q) for q, _ in pays) + 1)
        return any(bool(f) for _, f in pays)
