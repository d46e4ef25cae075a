"""DeepEP 2.5's ``topk_idx`` version check (issue 42): a handle that keeps the caller's ``topk_idx``
(``do_handle_copy=False``, 2.5's ``EPBuffer`` default) must not see it changed in place while the handle is in use.

DeepEP's ``EPHandle`` records ``topk_idx._version`` (none for an inference-mode tensor, which has no version counter)
and asserts it unchanged whenever ``handle.topk_idx`` is read: by a cached dispatch, by combine, by the caller. ep's
handle is ep-core's (framework-free, a plain field), so ep_torch checks where it hands a handle to ep-core: a cached
``dispatch(handle=...)`` and every ``combine`` (the FP32 and deferred roads too: they go through ``combine``), before
any launch, as ``EPValueError`` naming ``topk_idx``. What a version counter misses is missed here too (writes through
``.data`` or raw pointers). A handle whose ``topk_idx`` is ep's own copy (``do_handle_copy=True``) is not recorded:
no caller holds that tensor.

A direct read of ``handle.topk_idx`` is not checked (DeepEP's property asserts there too), by choice: the field is
ep-core's plain attribute, which ep-core reads on every call that takes the handle (``num_topk``, ``num_tokens``,
the validation's fingerprint, the kept plans' match), and ep-core's fast paths test the handle's exact type
(``type(handle) is EPHandle``); a checking property on ``EPHandle`` would add a version read to each of those reads
(ep-core keeps a field read at a plain attribute's cost: ``ep_core.handle._InBlock``), and a checking subclass would
leave the fast paths. What the check guards against, a handle used with a routing it was not made from, is caught at
the use, before any launch. The read itself returns the caller's own tensor (``handle.topk_idx is topk_idx``), so it
can only show the caller what the caller wrote; ``check(handle, op)`` checks explicitly where a caller wants it.

The records are keyed by the handle's id and dropped with the handle (a weak reference's callback); a lookup of a
handle never recorded is one dict miss.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from ep_core.errors import EPValueError

__all__ = ["KEPT", "check", "check_announced", "keep"]

# id(handle) -> (weak reference to the handle, the caller's topk_idx, its version at the dispatch)
KEPT: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}


def keep(handle: Any, topk_idx: Any) -> None:
    """Record ``topk_idx``'s version for ``handle`` (a new handle that keeps the caller's tensor)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.is_inference():
        return  # DeepEP: an inference tensor has no version counter and cannot be checked
    key = id(handle)
    KEPT[key] = (weakref.ref(handle, lambda ref, k=key: _drop(k, ref)), topk_idx, topk_idx._version)


def _drop(key: int, ref: weakref.ref) -> None:
    entry = KEPT.get(key)
    if entry is not None and entry[0] is ref:  # not a newer handle's record at a reused id
        del KEPT[key]


def check(handle: Any, op: str) -> None:
    """Raise ``EPValueError`` if the ``topk_idx`` that ``handle`` keeps changed in place since its dispatch."""
    entry = KEPT.get(id(handle))
    if entry is None or entry[0]() is not handle:
        return
    now = entry[1]._version
    if now != entry[2]:
        raise EPValueError(
            f"{op}: topk_idx was modified in place after the dispatch that made this handle (its version went from "
            f"{entry[2]} to {now}); the handle keeps the caller's topk_idx (do_handle_copy=False) and it must not be "
            "modified while the handle is in use (DeepEP 2.5's rule): change a clone, or dispatch again"
        )


def check_announced(buf: Any, handle: Any, op: str) -> None:
    """``check`` inside ``buf``'s call: a refusal is announced to the peers (ep-core's block, as ``_refuse_capture``)
    so that they raise naming this rank instead of waiting for its launch."""
    try:
        check(handle, op)
    except EPValueError:
        with buf._core.announcing(op):
            raise
