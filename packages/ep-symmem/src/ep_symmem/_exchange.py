"""exchange(): the collective that turns one SymmetricAllocation per rank into a mapped symmetric group."""

from __future__ import annotations

from collections.abc import Sequence

from ._allocation import SymmetricAllocation
from ._bootstrap import Bootstrap
from ._errors import ExchangeError, SymmemError, SymmemValueError

__all__ = ["exchange", "exchange_local"]


def exchange(allocation: SymmetricAllocation, bootstrap: Bootstrap) -> list[int]:
    """Every rank calls this with its allocation: allgather the descriptors, map every peer, agree that every rank
    succeeded, then close the exported fds. Returns allocation.peer_ptrs.

    If any rank fails to map its peers, every rank raises (ExchangeError on the others, the original error on the
    failing rank) and no rank keeps peer mappings.
    """
    for name in ("rank", "size", "allgather"):
        if not hasattr(bootstrap, name):
            raise SymmemValueError(
                f"bootstrap lacks `{name}`: it needs rank, size, allgather(bytes) -> list[bytes] and barrier()"
            )
    rank, size = bootstrap.rank, bootstrap.size
    descriptors = bootstrap.allgather(allocation.export())
    if len(descriptors) != size:
        raise ExchangeError(f"bootstrap.allgather returned {len(descriptors)} items for size {size}")
    failure: BaseException | None = None
    try:
        allocation.import_peers(descriptors, rank)
    except SymmemError as error:
        failure = error
    status = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
    statuses = bootstrap.allgather(status)
    # Every rank has finished importing: the exported fds are no longer needed.
    allocation.release_exported_fds()
    if failure is not None:
        raise failure
    failed = {r: s.decode(errors="replace") for r, s in enumerate(statuses) if s}
    if failed:
        allocation._drop_peers()
        details = "; ".join(f"rank {r}: {message}" for r, message in sorted(failed.items()))
        raise ExchangeError(f"exchange failed on {len(failed)} of {size} ranks ({details})")
    return allocation.peer_ptrs


def exchange_local(allocations: Sequence[SymmetricAllocation]) -> None:
    """Map a group whose ranks all live in this process and are driven by one thread (the loopback domain):
    allocations[r] is rank r. No bootstrap needed; on failure no allocation keeps peer mappings."""
    if (
        isinstance(allocations, SymmetricAllocation)
        or not isinstance(allocations, Sequence)
        or not allocations
    ):
        raise SymmemValueError("allocations must be a non-empty list of SymmetricAllocation, one per rank")
    descriptors = [allocation.export() for allocation in allocations]
    done: list[SymmetricAllocation] = []
    try:
        for rank, allocation in enumerate(allocations):
            allocation.import_peers(descriptors, rank)
            done.append(allocation)
    except BaseException:
        for allocation in done:
            allocation._drop_peers()
        raise
    finally:
        for allocation in allocations:
            if not allocation.closed:
                allocation.release_exported_fds()
