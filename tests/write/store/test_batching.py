"""Batching: every sample in exactly one batch, rows x longest row within the token budget, padding on the right."""

from __future__ import annotations

import numpy as np
import torch

from dspark_precompute.write.store.batching import batch_inputs, make_batches


def test_batches_cover_each_sample_once_in_order_and_keep_rows_times_longest_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=57)
    order = np.argsort(-lengths, kind="stable")  # longest first, as the layout orders a unit
    for max_tokens, max_samples in [(512, None), (1024, 4), (299, None), (10_000, 1)]:
        batches = make_batches(order, lengths, max_tokens, max_samples)
        assert np.array_equal(np.concatenate(batches), order)
        for b in batches:
            assert len(b) == 1 or len(b) * int(lengths[b].max()) <= max_tokens
            assert max_samples is None or len(b) <= max_samples
        # greedy: the next sample would not have fitted in the batch before it
        for b, nxt in zip(batches, batches[1:], strict=False):
            fits = (len(b) + 1) * int(lengths[b[0]]) <= max_tokens and (max_samples is None or len(b) < max_samples)
            assert not fits, (b, nxt)


def test_a_sample_longer_than_the_budget_still_gets_a_batch_of_its_own():
    lengths = np.asarray([900, 10, 10])
    assert [b.tolist() for b in make_batches(np.arange(3), lengths, 256, None)] == [[0], [1, 2]]


def test_inputs_are_right_padded_with_the_pad_id_and_the_mask_marks_the_real_tokens():
    ids_of = {0: np.asarray([5, 6, 7]), 1: np.asarray([8])}
    ids, mask = batch_inputs(ids_of, np.asarray([0, 1]), np.asarray([3, 1]), pad_id=99, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [8, 99, 99]]
    assert mask is not None and mask.tolist() == [[True, True, True], [True, False, False]]
    assert ids[mask].tolist() == [5, 6, 7, 8]
    same, none = batch_inputs(ids_of, np.asarray([0]), np.asarray([3, 1]), pad_id=99, device=torch.device("cpu"))
    assert same.tolist() == [[5, 6, 7]] and none is None
