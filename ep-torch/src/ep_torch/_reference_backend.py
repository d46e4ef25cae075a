"""The CPU reference backend: DeepEP semantics over ``torch.distributed`` collectives, bit-identical to ep-core.

Every operation is one all-gather of the ranks' inputs (as raw bits) followed by ``ep_core.reference`` over all
ranks' inputs; each rank keeps its own result. The reference is deterministic, so every rank computes the same
global layout and keeps every rank's handle: a cached dispatch or a combine needs only the new data. It is
honest and exact, not fast: it is the embedded default that runs the API, the autograd functions and the demo on
machines without a GPU, and the oracle the kernels are tested against.

Errors: a rank whose local validation fails still joins the exchange (with an error note) so that the other ranks
raise too instead of waiting forever; the failing rank raises its own error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ep_core import reference
from ep_core.handle import EPHandle as CoreHandle

from ._exchange import Bootstrap, allgather_arrays


class PeerError(RuntimeError):
    """Another rank failed the same collective operation (its own error is raised there)."""


def _note(message: str) -> np.ndarray:
    return np.frombuffer(message.encode(), dtype=np.uint8).copy()


class ReferenceBackend:
    """Exchange + ``ep_core.reference`` for one buffer (``num_scaleup_ranks`` = ranks of one scale-up domain)."""

    def __init__(self, bootstrap: Bootstrap, num_scaleup_ranks: int) -> None:
        self.bootstrap = bootstrap
        self.rank = bootstrap.rank
        self.size = bootstrap.size
        self.num_scaleup_ranks = num_scaleup_ranks

    # ----------------------------------------------------------------------------------------------------------------

    def fail(self, op: str, error: BaseException) -> None:
        """Join the exchange of ``op`` with an error note (the other ranks raise PeerError); the caller re-raises."""
        allgather_arrays(self.bootstrap, {"error": _note(f"{type(error).__name__}: {error}")})

    def _gather(self, op: str, arrays: dict[str, np.ndarray | None]) -> list[dict]:
        """All-gather ``arrays``; raise PeerError if another rank reported an error instead."""
        parts = allgather_arrays(self.bootstrap, {"error": None, **arrays})
        for r, p in enumerate(parts):
            if p.get("error") is not None:
                msg = bytes(p["error"]).decode(errors="replace")
                raise PeerError(
                    f"{op}: rank {r} rejected its inputs ({msg}); this rank's call is abandoned too"
                )
        return parts

    def dispatch(
        self,
        x: np.ndarray,
        sf: np.ndarray | None,
        topk_idx: np.ndarray,
        topk_weights: np.ndarray | None,
        **kwargs: Any,
    ) -> tuple[reference.DispatchOutput, list[CoreHandle]]:
        """Non-cached dispatch; ``kwargs`` go to ``ep_core.reference.dispatch``. Returns (own output, all handles)."""
        parts = self._gather("dispatch", {"x": x, "sf": sf, "idx": topk_idx, "w": topk_weights})
        outs = reference.dispatch(
            [p["x"] for p in parts],
            [p["idx"] for p in parts],
            self._all_or_none("topk_weights", [p["w"] for p in parts]),
            sf=self._all_or_none("x (scale factors)", [p["sf"] for p in parts]),
            num_scaleup_ranks=self.num_scaleup_ranks,
            **kwargs,
        )
        return outs[self.rank], [o.handle for o in outs]

    def cached_dispatch(
        self,
        x: np.ndarray,
        sf: np.ndarray | None,
        topk_weights: np.ndarray | None,
        handles: list[CoreHandle],
        **kwargs: Any,
    ) -> reference.DispatchOutput:
        """Dispatch through every rank's handle (same rows, same order as the original)."""
        parts = self._gather("dispatch", {"x": x, "sf": sf, "w": topk_weights})
        outs = reference.dispatch(
            [p["x"] for p in parts],
            None,
            self._all_or_none("topk_weights", [p["w"] for p in parts]),
            sf=self._all_or_none("x (scale factors)", [p["sf"] for p in parts]),
            handles=handles,
            **kwargs,
        )
        return outs[self.rank]

    def combine(
        self,
        x: np.ndarray,
        topk_weights: np.ndarray | None,
        bias: tuple[np.ndarray | None, np.ndarray | None],
        handles: list[CoreHandle],
        *,
        allow_multiple_reduction: bool,
    ) -> reference.CombineOutput:
        """Combine of every rank's ``x`` through the handles; returns this rank's output."""
        parts = self._gather("combine", {"x": x, "w": topk_weights, "bias0": bias[0], "bias1": bias[1]})
        biases: list[Any] = []
        for p in parts:
            b0, b1 = p["bias0"], p["bias1"]
            biases.append(None if b0 is None else (b0 if b1 is None else (b0, b1)))
        outs = reference.combine(
            [p["x"] for p in parts],
            handles,
            topk_weights=self._all_or_none("topk_weights", [p["w"] for p in parts]),
            bias=None if all(b is None for b in biases) else biases,
            allow_multiple_reduction=allow_multiple_reduction,
            num_scaleup_ranks=self.num_scaleup_ranks,
        )
        return outs[self.rank]

    def barrier(self) -> None:
        self.bootstrap.barrier()

    @staticmethod
    def _all_or_none(name: str, values: list[Any]) -> list[Any] | None:
        given = [v is not None for v in values]
        if all(given):
            return values
        if not any(given):
            return None
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(
            f"{name}: given on some ranks but not on ranks {missing}; every rank must pass it or none"
        )
