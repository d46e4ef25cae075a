"""The operation envelope: every host-side collective step of a buffer is checked against its peers.

Each step (a dispatch's or combine's exchange, a barrier, a reset) sends, with its payload, an envelope: the
step's sequence number, the operation kind and the configuration that must agree across ranks (num_experts, M,
hidden, top-k, dtypes, expand, alignment, the handle's step, whether scales / weights / bias are present). After
the exchange every rank compares all envelopes the same way, so a disagreement makes *every* rank raise the same
`EPMismatchError`, naming the ranks and the fields that differ, instead of pairing different calls.

A rank that rejects its own call before the exchange (a bad argument, a call after `destroy()`, the capture
check) takes part in the step with an *abort note* instead (`Channel.announce`), then raises its own error; its
peers raise `EPPeerError` naming that rank and its message. The ranks stay in step: the buffer stays usable.

Waits are bounded by the bootstrap (`ThreadGroup(timeout_secs=)`, ep_torch's `ProcessGroupBootstrap` with the
buffer's `num_cpu_timeout_secs`), which raise `EPTimeoutError` / `EPPeerError` naming the peer rank.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ep_core.errors import EPMismatchError, EPPeerError, EPStateError

__all__ = ["Channel", "Envelope", "check_envelopes"]


@dataclass(frozen=True)
class Envelope:
    """What one rank says about the collective step it is in."""

    seq: int
    op: str
    config: tuple[tuple[str, Any], ...] = ()
    abort: str | None = None  # the rank's own error message when it rejected its call before the exchange


def _describe(envs: list[Envelope], get: Any) -> str:
    return ", ".join(f"rank {r}: {get(e)!r}" for r, e in enumerate(envs))


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
        "and handles (every rank raises this error; the buffer stays usable)",
        fields=diffs,
    )


class Channel:
    """The enveloped host exchange of one buffer over its bootstrap (one sequence of steps per buffer)."""

    def __init__(self, bootstrap: Any) -> None:
        self.bootstrap = bootstrap
        self.rank = bootstrap.rank
        self.seq = 0

    def exchange(self, op: str, config: dict[str, Any], payload: Any = None) -> list[Any]:
        """Every rank's payload of this step, after checking every rank's envelope (see the module doc)."""
        env = Envelope(self.seq, op, tuple(sorted(config.items())))
        return self._step(env, payload)

    def announce(self, op: str, error: BaseException) -> None:
        """Take part in the peers' pending step with an abort note naming `error` (the caller raises it)."""
        note = f"{op}: {type(error).__name__}: {error}"
        self._step(Envelope(self.seq, op, (), abort=note), None)

    def _step(self, env: Envelope, payload: Any) -> list[Any]:
        self.seq += 1
        raw = self.bootstrap.allgather(pickle.dumps((env, payload)))
        try:
            items = [pickle.loads(b) for b in raw]
        except Exception as exc:  # a peer outside the envelope protocol (another library on the same group)
            raise EPStateError(
                f"{env.op} (step {env.seq}) on rank {self.rank}: a peer sent bytes that are no operation envelope "
                f"({exc}); every rank of the group must use the same buffer for its collective steps"
            ) from exc
        items = [it if isinstance(it, tuple) and len(it) == 2 else (None, None) for it in items]
        envs = [e if isinstance(e, Envelope) else Envelope(-1, "<no envelope>") for e, _ in items]
        check_envelopes(envs, self.rank)
        return [p for _, p in items]
