"""CPU: `EPHandle.deterministic_sort` (DeepEP's method) puts shuffled dispatch outputs back into the reference's
deterministic order, non-expand and expand, for numpy arrays and torch tensors, and leaves cached expand alone."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPTypeError, EPValueError


def _outputs(do_expand, seed=3):
    inp = routing.make_inputs(2, 9, 16, 8, 3, seed=seed, masked_ratio=0.2)
    return reference.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=8,
        num_max_tokens_per_rank=9,
        do_expand=do_expand,
        expert_alignment=4,
    )


def _shuffle_non_expand(out, rng):
    """Shuffle rows inside each source region (what a non-deterministic kernel may do)."""
    h = copy.deepcopy(out.handle)
    b = np.concatenate([[0], np.asarray(h.psum_num_recv_tokens_per_scaleup_rank)])
    perm = np.arange(out.recv_x.shape[0])
    for lo, hi in itertools.pairwise(b):
        perm[lo:hi] = lo + rng.permutation(hi - lo)
    h.recv_src_metadata = h.recv_src_metadata[perm].copy()
    return [a[perm].copy() for a in (out.recv_x, out.recv_topk_idx, out.recv_topk_weights)], h


@pytest.mark.parametrize("seed", [0, 1])
def test_non_expand_sorted_back_to_reference(seed):
    out = _outputs(False)[seed % 2]
    (x, idx, w), h = _shuffle_non_expand(out, np.random.default_rng(seed))
    assert not np.array_equal(x, out.recv_x)
    h.deterministic_sort(True, False, x, None, idx, w)
    np.testing.assert_array_equal(x, out.recv_x)
    np.testing.assert_array_equal(idx, out.recv_topk_idx)
    np.testing.assert_array_equal(w, out.recv_topk_weights)
    np.testing.assert_array_equal(h.recv_src_metadata, out.handle.recv_src_metadata)
    # a cached dispatch re-sorts its fresh outputs with the keys kept from the first sort
    (x2, idx2, w2), _ = _shuffle_non_expand(out, np.random.default_rng(seed))
    h.deterministic_sort(True, True, x2, None, idx2, w2)
    np.testing.assert_array_equal(x2, out.recv_x)
    np.testing.assert_array_equal(h.recv_src_metadata, out.handle.recv_src_metadata)


def test_rows_past_the_true_count_stay_at_the_end_without_cpu_sync():
    out = _outputs(False)[0]
    (x, idx, w), h = _shuffle_non_expand(out, np.random.default_rng(5))
    n = x.shape[0]
    pad = lambda a: np.concatenate([a, np.full((3, *a.shape[1:]), 7, a.dtype)])  # noqa: E731
    x, idx, w = pad(x), pad(idx), pad(w)
    h.recv_src_metadata = np.concatenate(
        [h.recv_src_metadata, np.full((3, h.recv_src_metadata.shape[1]), 99, np.int32)]
    )
    h.deterministic_sort(False, False, x, None, idx, w)
    np.testing.assert_array_equal(x[:n], out.recv_x)
    assert (x[n:] == 7).all() and (h.recv_src_metadata[n:] == 99).all()


def test_expand_sorted_inside_each_expert():
    out = _outputs(True)[1]
    h = copy.deepcopy(out.handle)
    rows = out.recv_x.shape[0]
    valid = reference.valid_expanded_rows(h, rows)
    counts = np.asarray(h.num_unaligned_recv_tokens_per_expert)
    starts = np.asarray(h.psum_num_recv_tokens_per_expert) - counts
    rng = np.random.default_rng(2)
    perm = np.arange(rows)  # new row j holds old row perm[j]
    for s, c in zip(starts, counts):
        perm[s : s + c] = s + rng.permutation(c)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(rows)
    x, w = out.recv_x[perm].copy(), out.recv_topk_weights[perm].copy()
    lanes = h.recv_src_metadata[:, 2:]
    lanes[lanes >= 0] = inv[lanes[lanes >= 0]]
    assert not np.array_equal(x[valid], out.recv_x[valid])
    h.deterministic_sort(True, False, x, None, None, w)
    np.testing.assert_array_equal(x[valid], out.recv_x[valid])
    np.testing.assert_array_equal(w[valid], out.recv_topk_weights[valid])
    np.testing.assert_array_equal(h.recv_src_metadata, out.handle.recv_src_metadata)
    before = x.copy()
    h.deterministic_sort(False, True, x, None, None, w)  # cached expand: placement already final
    np.testing.assert_array_equal(x, before)


def test_torch_tensors_sorted_in_place():
    torch = pytest.importorskip("torch")
    out = _outputs(False)[0]
    (x, idx, w), h = _shuffle_non_expand(out, np.random.default_rng(9))
    tx, tidx, tw = (torch.from_numpy(a.astype(np.int32) if a.dtype == np.uint16 else a) for a in (x, idx, w))
    h.recv_src_metadata = torch.from_numpy(h.recv_src_metadata)
    h.deterministic_sort(True, False, tx, None, tidx, tw)
    np.testing.assert_array_equal(tx.numpy(), out.recv_x.astype(np.int32))
    np.testing.assert_array_equal(tidx.numpy(), out.recv_topk_idx)
    np.testing.assert_array_equal(h.recv_src_metadata.numpy(), out.handle.recv_src_metadata)


def test_errors_name_the_argument():
    out = _outputs(False)[0]
    h = copy.deepcopy(out.handle)
    with pytest.raises(EPValueError, match="is_cached_dispatch"):
        h.deterministic_sort(True, True, out.recv_x.copy(), None, None, None)
    with pytest.raises(EPTypeError, match="recv_x"):
        h.deterministic_sort(True, False, out.recv_x.tolist(), None, None, None)
