"""`RankRuntime`, the per-rank runtime state of `RankDriver` (`ep_core.kernels.rank_driver`, which makes its fields):
the launch step, the guard's slow path, the error record, the spoilt handles, the reset (a buffer's host steps:
`ep_core.rank_state`).

Failures (the host half of the rule in include/ep_core/timeout.cuh). A wait that times out records the error in the
workspace and raises the abort flag of every rank; the flag stays raised until the domain is reset, and every kernel
that finds it raised at entry, or leaves early, does nothing more than copy the abort kind into a page-locked host
word mapped into the device (`OpArgs::host_error`). The host therefore never needs a stream sync to know:

- before every launch (`guard`, at the top of `launch_dispatch` and `combine`) the rank reads its host words; once
  an abort was published it synchronizes, reads the error record and raises it (`EPTimeoutError`, or
  `EPDeviceError`), and it keeps raising it at every later call, launching nothing, until `reset_state` (every rank
  of the domain, collectively: `LoopbackDomain.reset`, `ProcessRank.reset`, `GpuExecutor.reset`);
- a call with a CPU sync checks the record right after its sync, so that call itself raises.

So the outputs of an operation are valid once a later host call (or `check_errors`) has returned without raising
after that operation ran; a failed operation leaves its outputs undefined and is always followed by an exception
at the next host call. Replays of a captured CUDA graph run no host code: synchronize the replaying stream, then
call `check_errors()` (or `status()`, which needs no sync). Invalid expert ids (not an abort) set the second host
word and are raised once, by the next call whose `guard` sees the word, after that call's kernels were launched on
every rank (`_report_input_error`: no rank skips a collective launch), or right after a CPU sync.

Handles of no-sync dispatches are "unconfirmed" until a stream sync finds no error; when an abort is found they are
marked failed, and a cached dispatch or a combine with such a handle raises `EPStateError` (before and after the
reset: its prefix sums and slots may be garbage, and kernels would write through them into peers' buffers).
"""

from __future__ import annotations

from collections.abc import Callable

import ep_layout
import numpy as np

from ep_core.errors import EPDeviceError, EPStateError, EPTimeoutError
from ep_core.handle import EPHandle
from ep_core.kernels import _cuda
from ep_core.kernels._envelope import describe_envelope, pack_envelope
from ep_core.kernels.plan import SCRATCH_INPUT_ERROR_OFFSET
from ep_core.rank_state import check_owner

__all__ = ["TAG_NAMES", "RankRuntime"]

TAG_NAMES = {
    1: "grid_barrier",
    2: "dispatch.entry_barrier",
    3: "dispatch.counts",
    4: "combine.entry_barrier",
    5: "combine.exit_barrier",
    6: "dispatch.scaleout_signal",
    7: "combine.forward_barrier",
    8: "combine.read_barrier",
}
_EK = ep_layout.ErrorKind
_ERR_OFF = ep_layout.WorkspaceLayout.ERROR_RECORD_OFFSET
_FIELD = {f.name: f for f in ep_layout.ERROR_RECORD_FIELDS}

_RESET_HINT = (
    "every later call on this rank raises this until the domain is reset (reset() on every rank, together)"
)


class RankRuntime:
    """The runtime state of one rank's kernels (module doc); a part of `RankDriver`."""

    @property
    def launch_step(self) -> int:
        """Collective launches (or abandoned steps) of this rank so far: the sequence number of the last envelope."""
        return self._num_collective_launches

    def abandon_step(self) -> None:
        """A dispatch or combine this rank rejected before launching (a bad argument, the capture check, a call after
        destroy): consume its sequence number. The peers that did launch that call wait in its entry barrier; this
        rank's next launch then arrives with the next sequence number, so the envelopes differ and every rank raises,
        instead of this rank's next call being paired with the peers' earlier one."""
        self._num_collective_launches += 1

    def _envelope(self, kind: int, fields: tuple[int, ...]) -> int:
        """The envelope of the next collective launch (`ep_core.kernels._envelope`)."""
        return pack_envelope(kind, self._num_collective_launches + 1, fields)

    # ------------------------------------------------------------------ failure state
    def status(self) -> tuple[int, int]:
        """`(abort kind, invalid-input kind)` that this rank's kernels published so far (0 = none); no sync."""
        abort, bad_input = self._status.read()
        return abort, bad_input

    def fail_unconfirmed_handles(self) -> None:
        """Refuse, from now on, every handle of a no-sync dispatch not yet confirmed by a clean sync (a reset
        follows a failure: such handles may hold garbage counts and slots)."""
        self._failed_handles.update(self._unconfirmed)
        self._unconfirmed.clear()

    def _check_handle(self, handle: EPHandle | None) -> None:
        """Where every road (the full path, a plan's run) takes a handle of a combine, cached dispatch or combine buffer:
        its owner (`check_owner`), then whether a failure spoilt it."""
        if handle is None:
            return
        check_owner(handle, self.state, self.rank)
        if handle in self._failed_handles:
            raise EPStateError(
                f"handle: rank {self.rank}: it comes from a no-sync dispatch that was running when a kernel of this "
                "rank failed, so its counts and slots are not valid; dispatch again (without the handle)"
            )

    def guard(self) -> None:
        """Raise, launching nothing, if a kernel of this rank published a failure (module doc, "Failures"): the
        recorded error, sticky until `reset_state`. An invalid-input report is not raised here (that would make this
        rank skip a collective launch its peers make): `_report_input_error` raises it once the call's collective
        kernels are launched."""
        abort, bad_input = self._status.read()
        # reports visible now are raised by this call, after its launch (a report that this call's own kernel
        # publishes meanwhile waits for the next call: which call raises must not depend on timing)
        self._input_pending = bad_input != 0
        if abort == 0:
            return
        self.check_errors(synchronize=True)
        # the record was cleared behind our back: still refuse
        raise EPStateError(
            f"rank {self.rank}: a kernel of this rank failed earlier (error kind {abort}); {_RESET_HINT}"
        )

    def _report_input_error(self) -> None:
        """Raise an invalid-input report that an earlier no-sync dispatch published (once). Called after the
        current call's collective kernels were launched, so every rank stays in step: the call that raises has run
        on every rank; its outputs are not returned, and it must not be repeated."""
        if self._input_pending:
            self._input_pending = False
            self.check_errors(synchronize=True)

    def read_error(self) -> tuple[np.ndarray, np.ndarray]:
        """(error record bytes, input-error words) of this rank (synchronizes the stream)."""
        # read through page-locked memory (a pageable destination makes each copy a staged, blocking one)
        nrec = ep_layout.NUM_ERROR_RECORD_BYTES
        staging = self._error_host.array
        staging[nrec:] = 0
        _cuda.copy_to_host(staging[:nrec], self.res.base + _ERR_OFF, self.stream)
        scratch = self._any_scratch()
        if scratch:
            _cuda.copy_to_host(staging[nrec:], scratch + SCRATCH_INPUT_ERROR_OFFSET, self.stream)
        self.stream.synchronize()
        rec = staging[:nrec].copy()
        inp = staging[nrec:].copy().view(np.int64)
        return rec, inp

    def _any_scratch(self) -> int:
        """The scratch of the last operation (the workspace's reserved region unless it was too small)."""
        last = self._last_scratch
        return self.res.base + ep_layout.WorkspaceLayout.RESERVED_OFFSET if last is None else last

    def drain(self, tag: str, message: str | None = None) -> None:
        """Wait for this rank's stream up to the CPU timeout; past it raise EPTimeoutError (`tag`, `message`)."""
        if not self.stream.synchronize(self.cpu_timeout_secs):
            raise EPTimeoutError(self.rank, tag, "stream", "not drained", message)

    def check_errors(self, synchronize: bool = True) -> None:
        """Raise EPTimeoutError / EPDeviceError if a kernel of this rank recorded an error (an abort stays recorded,
        and raised again, until `reset_state`; an invalid-input report is cleared once raised)."""
        if synchronize:
            self.drain("cpu.synchronize")
        rec, inp = self.read_error()
        published_abort, published_input = self._status.read()

        def get(name: str) -> int:
            f = _FIELD[name]
            dt = np.int32 if f.dtype == "int32" else np.int64
            return int(rec[f.offset : f.offset + np.dtype(dt).itemsize].view(dt)[0])

        kind = get("abort_flag") or published_abort
        if kind != 0:  # handles of no-sync dispatches not yet confirmed by a clean sync may be garbage
            self.fail_unconfirmed_handles()
        elif synchronize:
            self._unconfirmed.clear()
        if kind in (int(_EK.TIMEOUT), int(_EK.PEER_ABORT)):
            tag = TAG_NAMES.get(get("tag"), str(get("tag")))
            if kind == int(_EK.PEER_ABORT):
                raise EPTimeoutError(
                    self.rank,
                    "peer_abort",
                    "abort_flag",
                    kind,
                    f"rank {self.rank}: aborted because a peer rank failed (timed out or met another operation); "
                    f"{_RESET_HINT}",
                )
            raise EPTimeoutError(
                get("rank"),
                tag,
                get("counter"),
                get("value"),
                f"rank {get('rank')} timed out in {tag} (peer {get('peer_rank')}, counter {get('counter')}, last "
                f"value {get('value')}, expected {get('expected')}); a peer rank did not arrive: check that every "
                f"rank calls the same operations; {_RESET_HINT}",
            )
        if kind == int(_EK.ENVELOPE_MISMATCH):
            tag = TAG_NAMES.get(get("tag"), str(get("tag")))
            peer = get("peer_rank")
            raise EPDeviceError(
                f"rank {get('rank')}: in {tag}, rank {peer} entered {describe_envelope(get('value'))} while this rank "
                f"entered {describe_envelope(get('expected'))}: every rank must call the same operations in the same "
                "order, with the same num_experts, hidden size, top-k, dtypes, flags and handle; nothing was paired; "
                f"{_RESET_HINT}",
                code=kind,
                rank=get("rank"),
                detail=peer,
            )
        if kind != 0:
            raise EPDeviceError(
                f"rank {self.rank}: kernel error kind {kind}; {_RESET_HINT}", code=kind, rank=self.rank
            )
        what_of = {
            int(_EK.INVALID_EXPERT): "an expert id >= num_experts",
            int(_EK.DUPLICATE_EXPERT): "a duplicate expert in one token",
        }
        if inp[0] != 0:
            what = what_of.get(int(inp[0]), "bad input")
            self.clear_input_error()
            raise EPDeviceError(
                f"rank {self.rank}: topk_idx holds {what} (token {inp[1]}, lane {inp[2]}, value {inp[3]}); fix the "
                "routing",
                code=int(inp[0]),
                rank=self.rank,
                detail=int(inp[3]),
            )
        if published_input != 0:  # reported into the scratch of an earlier configuration
            self.clear_input_error()
            raise EPDeviceError(
                f"rank {self.rank}: topk_idx of an earlier dispatch held {what_of.get(published_input, 'bad input')}; "
                "fix the routing",
                code=published_input,
                rank=self.rank,
            )

    def clear_input_error(self) -> None:
        """Clear the invalid-input record of every scratch this rank used (a record left in another
        configuration's scratch would block new reports there and be raised again later) and the host word."""
        for scratch in self._scratches | {self._any_scratch()}:
            _cuda.memset(scratch + SCRATCH_INPUT_ERROR_OFFSET, 32, self.stream)
        self._status.array[1] = 0

    def reset_state(self, barrier: Callable[[], None] | None = None) -> None:
        """Return this rank to a clean state after an error: zero its workspace (barrier arrivals, error record and
        abort flag, count words, the reserved scratch) and every separate scratch, and its host-mapped error words.

        Every rank of the domain must reset together. `barrier` is the domain's host barrier (a bootstrap's
        `barrier`); the order is: drain this rank's stream (every kernel ends: all waits are bounded and watch the
        abort flag), barrier (no rank's kernels run or write into a peer any more), zero, drain, barrier (no rank
        launches before every rank is zeroed). Without `barrier` the caller orders the ranks (the loopback domain
        drains every rank before zeroing any). Nothing needs preserving: the barrier epoch (scratch) and the arrival
        count (workspace) are both zeroed on every rank, and `arrivals >= epoch * N` only needs them to agree.
        """
        if self.res.base == 0:
            raise EPStateError("reset_state: the rank has no buffer")
        self.drain(
            "cpu.reset",
            f"rank {self.rank}: reset_state: the stream did not drain within {self.cpu_timeout_secs} s",
        )
        self.fail_unconfirmed_handles()  # a reset follows a failure: in-flight handles may hold garbage
        self.state.new_generation()  # and every handle made before is stale (`check_owner`)
        if barrier is not None:
            barrier()
        self._zero_state()
        self.stream.synchronize()
        self._status.clear()
        if barrier is not None:
            barrier()

    def _zero_state(self) -> None:
        """Stream-ordered memsets of the workspace and of every separate scratch (the caller drains and orders)."""
        # the envelopes' sequence: every rank starts counting again together
        self._num_collective_launches = 0
        _cuda.memset(self.res.base, ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES, self.stream)
        for buf in self.res.scratch_buffers.values():
            _cuda.memset(buf.ptr, buf.nbytes, self.stream)
