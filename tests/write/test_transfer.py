"""Captured states -> unit buffer: real tokens only, the storage dtype, and every NaN/Inf found."""

from __future__ import annotations

import numpy as np
import torch

from dspark_precompute.write.transfer import UnitTransfer, real_token_index, zero_samples


def states_for(lengths: list[int], width: int, hidden: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(len(lengths), width, hidden, generator=g)
    for r, n in enumerate(lengths):
        t[r, n:] = float("nan")  # padding: never stored, never counted
    return t


def test_only_real_tokens_reach_the_buffer_in_order_and_cast_to_bf16_bits():
    lengths = np.asarray([3, 1, 2])
    layer, last = states_for(list(lengths), 4), states_for(list(lengths), 4, seed=1)
    bufs = {"h": np.zeros((8, 4), np.uint16), "last": np.zeros((8, 4), np.uint16)}
    tr = UnitTransfer([("h", 0, True), ("last", 9, True)], torch.bfloat16, torch.device("cpu"))
    tr.start(bufs)
    tr.add(np.asarray([5, 6, 7]), lengths, 4, {0: layer}, last, offset=2)
    check = tr.finish()
    assert not check.nonfinite and not check.bad_samples  # the NaN padding was not looked at
    want = torch.cat([layer[r, :n] for r, n in enumerate(lengths)]).to(torch.bfloat16).view(torch.int16)
    assert np.array_equal(bufs["h"][2:8].view(np.int16), want.numpy())
    assert not bufs["h"][:2].any()
    want_last = torch.cat([last[r, :n] for r, n in enumerate(lengths)]).to(torch.bfloat16).view(torch.int16)
    assert np.array_equal(bufs["last"][2:8].view(np.int16), want_last.numpy())


def test_non_finite_values_are_counted_per_sample_and_array():
    lengths = np.asarray([2, 3, 1])
    layer, last = states_for(list(lengths), 3), states_for(list(lengths), 3, seed=1)
    layer[1, 2, 0] = float("inf")
    layer[1, 0, 1:3] = float("nan")
    last[2, 0, 3] = float("-inf")
    bufs = {"h": np.zeros((6, 4), np.float32), "last": np.zeros((6, 4), np.float32)}
    tr = UnitTransfer([("h", 0, False), ("last", 9, False)], torch.float32, torch.device("cpu"))
    tr.start(bufs)
    tr.add(np.asarray([10, 11, 12]), lengths, 3, {0: layer}, last, offset=0)
    check = tr.finish()
    assert check.bad_samples == {11: {"h": 3}, 12: {"last": 1}}
    assert check.nonfinite == {"h": 3, "last": 1}


def test_an_fp16_overflow_is_caught_after_the_cast():
    """A finite fp32 state too large for fp16 becomes Inf on the way to the buffer: still found."""
    lengths = np.asarray([2])
    layer = torch.ones(1, 2, 4)
    layer[0, 1, 2] = 1e6  # > fp16 max (65504)
    bufs = {"h": np.zeros((2, 4), np.float16)}
    tr = UnitTransfer([("h", 0, False)], torch.float16, torch.device("cpu"))
    tr.start(bufs)
    tr.add(np.asarray([0]), lengths, 2, {0: layer}, layer, offset=0)
    assert tr.finish().bad_samples == {0: {"h": 1}}


def test_the_real_token_index_skips_padding_and_is_none_without_any():
    assert real_token_index(np.asarray([3, 3]), 3) is None
    assert list(real_token_index(np.asarray([2, 3, 1]), 3)) == [0, 1, 3, 4, 5, 6]


def test_zeroing_dropped_samples_touches_only_their_slots():
    bufs = {"h": np.ones((6, 2), np.float32)}
    zero_samples(bufs, ["h"], [(1, 3), (5, 6)])
    assert bufs["h"][:, 0].tolist() == [1, 0, 0, 1, 1, 0]
