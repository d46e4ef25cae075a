"""Rank masking: which peers a rank has given up on, and the exchange that skips them (DeepEP V1's ``enable_shrink``).

A *masked* rank is neither sent to nor waited for: tokens routed to its experts are dropped (a dispatch receives
nothing from it and sends nothing to it; in a combine its lanes count as expert id -1). Reasons: ``user``
(``RankMask.update(peer, True)``, V1's ``low_latency_update_mask_buffer``); ``timeout`` (the peer's message of a
step did not arrive in time: masked with a ``RankMaskedWarning``, the step finishes without it); ``peer`` (the peer
gave up waiting on this rank). The state is per rank and local, as DeepEP's mask buffer: ranks may disagree for a
while. ``clean()`` and ``update(peer, False)`` resume traffic; call them on every rank between the same two
operations.

``MaskedExchange`` is the host transport of one masked step over a key-value store (``set``, ``get``,
``compare_set``, ``wait(keys, timedelta)``, ``delete_key``, as torch's ``TCPStore``): per ordered pair one mailbox
of numbered messages, each slot settled once by both sides (read and deleted by its receiver, or claimed at the
deadline, which a late sender learns: it masks the receiver, reason ``peer``), so the counters stay equal and a
late message is never read at a later step; messages carry their operation and configuration (``EPMismatchError``
when ranks come back in different operations).

``RankMask`` knows nothing of V1: GPU kernels take ``flags`` (int32 per rank, 1 = masked) in a device array, skip
masked ranks' puts and waits, set the flag on a wait's timeout, and the host merges them back with
``merge(flags, "timeout")`` (V1's native kernels: ``include/ep_core/ll_native.cuh``,
``ep_torch.legacy.ll_shrink.NativeShrink``; records stamped with a generation, so one from before a clean is not
merged after it).
"""

from __future__ import annotations

import pickle
import time
import warnings
from datetime import timedelta
from typing import Any

import numpy as np

from ep_core.errors import EPMismatchError, EPPeerError, EPValueError

__all__ = ["MaskedExchange", "RankMask", "RankMaskedWarning"]

REASONS = ("user", "timeout", "peer")


class RankMaskedWarning(UserWarning):
    """A rank masked a peer that did not arrive within the wait's bound (``enable_shrink``); the message names it."""


class RankMask:
    """One rank's mask of its group: ``flags[r]`` is 1 when rank ``r`` is masked, ``reasons[r]`` why (see the module
    docstring). Local state: no collective."""

    __slots__ = ("flags", "num_ranks", "rank", "reasons")

    def __init__(self, rank: int, num_ranks: int) -> None:
        if not (0 <= rank < num_ranks):
            raise EPValueError(f"RankMask: rank={rank} must be in [0, num_ranks={num_ranks})")
        self.rank = int(rank)
        self.num_ranks = int(num_ranks)
        self.flags = np.zeros(num_ranks, np.int32)
        self.reasons: list[str | None] = [None] * num_ranks

    def _check_rank(self, what: str, r: Any) -> int:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not (0 <= int(r) < self.num_ranks):
            raise EPValueError(f"{what}: expected a rank in [0, {self.num_ranks}), got {r!r}")
        return int(r)

    def update(self, rank_to_mask: int, mask: bool, reason: str = "user") -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask`` (V1's ``low_latency_update_mask_buffer``)."""
        r = self._check_rank("rank_to_mask", rank_to_mask)
        if reason not in REASONS:
            raise EPValueError(f"reason: expected one of {REASONS}, got {reason!r}")
        self.flags[r] = 1 if mask else 0
        self.reasons[r] = reason if mask else None

    def mask_lost(self, peer: int, op: str, waited_s: float) -> None:
        """Mask ``peer`` after a wait on it expired in ``op``, with a warning naming it."""
        self.update(peer, True, "timeout")
        warnings.warn(
            f"rank {self.rank}: rank {peer} did not arrive within {waited_s:g} s in {op}: masked it (enable_shrink); "
            f"its experts' tokens are dropped from now on (low_latency_query_mask_buffer reports it, "
            "low_latency_clean_mask_buffer unmasks every rank)",
            RankMaskedWarning,
            stacklevel=3,
        )

    def mask_gave_up(self, peer: int, op: str) -> None:
        """Mask ``peer``, which gave up waiting on this rank's message in ``op`` (it masked this rank), with a
        warning naming it."""
        self.update(peer, True, "peer")
        warnings.warn(
            f"rank {self.rank}: rank {peer} gave up waiting on this rank's message in {op} (it masked this rank after "
            "its timeout): masked it in turn (enable_shrink)",
            RankMaskedWarning,
            stacklevel=3,
        )

    def merge(self, flags: Any, reason: str = "timeout") -> list[int]:
        """Take the masks set elsewhere (a device copy of ``flags`` written by kernels): ranks newly masked there
        are masked here with ``reason``; returns them."""
        new = [r for r, f in enumerate(np.asarray(flags).reshape(-1)) if f and not self.flags[r]]
        for r in new:
            self.update(r, True, reason)
        return new

    def clean(self) -> None:
        """Unmask every rank (V1's ``low_latency_clean_mask_buffer``)."""
        self.flags[:] = 0
        self.reasons = [None] * self.num_ranks

    def is_masked(self, r: int) -> bool:
        return bool(self.flags[r])

    def any(self) -> bool:
        return bool(self.flags.any())

    def unmasked_peers(self) -> list[int]:
        """The other ranks this rank still sends to and waits for, ascending."""
        return [r for r in range(self.num_ranks) if r != self.rank and not self.flags[r]]

    def masked_ranks(self) -> dict[int, str]:
        """``{rank: reason}`` of every masked rank."""
        return {r: str(self.reasons[r]) for r in range(self.num_ranks) if self.flags[r]}

    def drop_lanes(self, topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
        """``topk_idx`` with -1 on every lane whose expert lives on a masked rank (experts ``r * E/N ...``): the
        routing that a masked step follows (zero contribution from those lanes)."""
        idx = np.asarray(topk_idx).astype(np.int64)
        epr = num_experts // self.num_ranks
        owner = np.where(idx >= 0, idx // max(epr, 1), 0)
        return np.where((idx >= 0) & (self.flags[owner] != 0), -1, idx)

    def __repr__(self) -> str:
        return f"RankMask(rank={self.rank}, masked={self.masked_ranks()})"


_ABORT = "abort"


class MaskedExchange:
    """One rank's masked host steps over a key-value ``store`` (see the module docstring): ``exchange`` sends one
    payload to each unmasked peer and returns the payloads of the unmasked peers that arrived within
    ``timeout_s``; a peer that did not is masked (``RankMask.mask_lost``). ``prefix`` names the buffer's mailboxes
    (every rank passes the same); ``state``: the buffer's ``ep_core.rank_state.RankState``, whose ``taken`` counts
    the steps this rank took part in (optional)."""

    def __init__(self, store: Any, mask: RankMask, prefix: str, timeout_s: float, state: Any = None) -> None:
        if not (timeout_s > 0):
            raise EPValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.store = store
        self.mask = mask
        self.prefix = prefix
        self.timeout_s = float(timeout_s)
        self.state = state
        n = mask.num_ranks
        self.sent = [0] * n  # messages this rank posted to each peer
        self.received = [0] * n  # messages this rank read from each peer

    def _key(self, src: int, dst: int, seq: int) -> str:
        return f"{self.prefix}/{src}-{dst}/{seq}"

    def exchange(self, op: str, config: dict[str, Any], payloads: dict[int, Any]) -> dict[int, Any]:
        """Post ``payloads[p]`` to every unmasked peer ``p`` (``None`` where absent), then read every unmasked peer's
        message of this step. Returns ``{peer: payload}`` of the peers that arrived (this rank not included).
        Raises ``EPMismatchError`` when an arrived peer is in another operation or configuration (after reading every
        peer, so every counter stays in step), ``EPPeerError`` (announced) when a peer rejected its call."""
        return self._step(op, tuple(sorted(config.items())), payloads, abort=None)

    def announce(self, op: str, error: BaseException) -> None:
        """Take part in the peers' pending step with an abort note naming ``error`` (the caller raises it): each
        unmasked peer raises ``EPPeerError`` naming this rank; the counters stay in step."""
        self._step(op, (), {}, abort=f"{op}: {type(error).__name__}: {error}")

    def _step(self, op: str, config: tuple, payloads: dict[int, Any], abort: str | None) -> dict[int, Any]:
        me = self.mask.rank
        peers = self.mask.unmasked_peers()
        if self.state is not None:
            self.state.taken += 1
        for p in peers:
            msg = (op, config, abort, None if abort is not None else payloads.get(p))
            key = self._key(me, p, self.sent[p])
            self.sent[p] += 1
            self._call("set", key, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            if self._call("compare_set", key + "/c", "", _SENT) != _SENT:  # p gave up on this message
                self._call("delete_key", key)
                self._call("delete_key", key + "/c")
                self.mask.mask_gave_up(p, op)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        diffs: list[str] = []
        aborted: list[tuple[int, str]] = []
        for p in peers:  # every peer of the step start: each slot is read (or given up) once on both sides
            key = self._key(p, me, self.received[p])
            self.received[p] += 1
            if not self._arrived(key, deadline):
                self.mask.mask_lost(p, op, self.timeout_s)
                continue
            raw = self._call("get", key)
            self._call("delete_key", key)
            self._call("delete_key", key + "/c")
            p_op, p_config, p_abort, payload = pickle.loads(bytes(raw))
            if p_abort is not None:
                aborted.append((p, p_abort))
            elif abort is None and (p_op != op or p_config != config):
                diffs.append(f"rank {p}: {p_op} {dict(p_config)!r}")
            elif not self.mask.is_masked(p):  # a peer masked during the step contributes nothing to it
                got[p] = payload
        if aborted and abort is None:
            raise EPPeerError(
                f"{op} on rank {me}: "
                + "; ".join(
                    f"rank {r} abandoned the operation (it rejected its call and raised {m})"
                    for r, m in aborted
                )
                + "; every rank leaves this step, the buffer stays usable",
                ranks=tuple(r for r, _ in aborted),
                announced=True,
            )
        if diffs:
            raise EPMismatchError(
                f"{op} on rank {me} ({dict(config)!r}): the ranks disagree: "
                + "; ".join(diffs)
                + "; every rank "
                "must call the same low-latency operations in the same order with the same sizes, and mask or unmask a "
                "rank on every rank between the same two operations",
                fields={"operation": op},
            )
        return got

    def _arrived(self, key: str, deadline: float) -> bool:
        """Whether the message ``key`` came by ``deadline`` (the step's bound, shared by its peers). A sender claims
        its message (``key/c``) after writing it; at the deadline the receiver claims it instead, unless the sender
        did first: so a late message is never read at a later step, and its sender learns it was given up."""
        remaining = deadline - time.monotonic()
        try:
            if remaining > 0:
                self.store.wait([key + "/c"], timedelta(seconds=remaining))
                return True
        except Exception:  # the store's own timeout error: claim the slot (the sender may have just now)
            pass
        return self._call("compare_set", key + "/c", "", _GAVE_UP) != _GAVE_UP

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.store, name)(*args)
        except Exception as exc:
            raise EPPeerError(
                f"rank {self.mask.rank}: the group's store is unreachable ({str(exc).splitlines()[0][:200]}): the rank "
                "that hosts it (rank 0 under torch.distributed's default TCPStore) has left; masking cannot continue "
                "without it (rebuild the group)",
                ranks=(0,),
            ) from exc


_SENT, _GAVE_UP = b"S", b"R"  # who claimed a message slot: its sender (written) or its receiver (gave up)
