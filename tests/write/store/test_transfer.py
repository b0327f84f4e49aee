"""Captured states -> unit buffer: real tokens only, the storage dtype (fp8: quantized), and every NaN/Inf found."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_precompute.write.store.transfer import (
    StateArray,
    UnitTransfer,
    quantize_e4m3,
    real_token_index,
    zero_samples,
)


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


def dequant_torch(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The independent oracle: torch's own float8 decode times the scale of each channel's group."""
    return bits.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(bits.shape[1] // scale.shape[1], dim=1)


@pytest.mark.parametrize("group", [64, 16])
def test_fp8_quantization_keeps_every_value_within_half_an_e4m3_step_of_its_scale(group):
    g = torch.Generator().manual_seed(group)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-3, 3, 256).unsqueeze(1)
    x[:, 5] *= 50  # an outlier channel
    bits, scale = quantize_e4m3(x, group)
    assert bits.dtype == torch.uint8 and scale.dtype == torch.float32 and scale.shape == (256, 64 // group)
    amax = x.abs().reshape(256, -1, group).amax(-1)
    assert torch.equal(scale, amax / 448)  # the documented scale, exactly
    want = (x / scale.repeat_interleave(group, dim=1)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(bits, want)  # torch's own cast of x / scale (round to nearest even)
    err = (dequant_torch(bits, scale) - x).abs()
    bound = torch.maximum(x.abs() * 2 ** -4, scale.repeat_interleave(group, dim=1) * 2 ** -10) * (1 + 2 ** -20)
    assert bool((err <= bound).all())
    y = torch.randn(256, 64, generator=g)  # gaussian rows: about 2.5% relative RMS, what random targets show
    rel_rms = float((dequant_torch(*quantize_e4m3(y, group)) - y).norm() / y.norm())
    assert 0.01 < rel_rms <= 0.05


def test_zero_rows_get_scale_one_and_tiny_rows_the_smallest_normal_scale():
    x = torch.zeros(3, 8)
    x[1, 2] = 1e-40  # subnormal: amax / 448 would underflow
    x[2, :] = torch.linspace(-3, 3, 8)
    bits, scale = quantize_e4m3(x, 8)
    assert scale[0, 0] == 1.0 and not bits[0].any()
    assert scale[1, 0] == 2.0 ** -126 and bool((dequant_torch(bits, scale)[0] == 0).all())
    assert bool((dequant_torch(bits, scale)[2] - x[2]).abs().le(x[2].abs() * 2 ** -4).all())
    assert bits.view(torch.float8_e4m3fn).float().abs().max() <= 448


def test_an_fp8_array_reports_inf_and_nan_before_they_are_quantized():
    lengths = np.asarray([2, 2])
    layer = torch.randn(2, 2, 8)
    layer[1, 1, 3] = float("inf")
    layer[0, 0, 0] = float("nan")
    bufs = {"h": np.zeros((4, 8), np.uint8), "h.s": np.ones((4, 2), np.float32), "last": np.zeros((4, 8), np.uint16)}
    tr = UnitTransfer([StateArray("h", 0, None, scale="h.s", group=4), StateArray("last", 9, torch.bfloat16, True)],
                      device=torch.device("cpu"))
    tr.start(bufs)
    tr.add(np.asarray([3, 4]), lengths, 2, {0: layer}, torch.ones(2, 2, 8), offset=0)
    check = tr.finish()
    assert check.bad_samples == {3: {"h": 1}, 4: {"h": 1}}
    good = dequant_torch(torch.from_numpy(bufs["h"][1:3]), torch.from_numpy(bufs["h.s"][1:3]))
    assert torch.allclose(good, layer.reshape(4, 8)[1:3], rtol=2 ** -4, atol=0)
    zero_samples(bufs, ["h", "h.s"], [(0, 2)], {"h.s": 1.0})
    assert not bufs["h"][:2].any() and (bufs["h.s"][:2] == 1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False])
def test_on_cuda_the_async_copies_give_the_cpu_path_bytes_and_the_same_check(pinned):
    """Gather, cast and check on the device, copies on a side stream into (page-locked or plain) shared
    buffers, several batches in flight before the unit's one sync: the bytes the CPU path writes."""
    from dspark_precompute.write.store.writer import ArraySpec, _pin, _Slot, _unpin

    lengths = np.asarray([5, 2, 4])
    layer, last = states_for(list(lengths), 5, hidden=64), states_for(list(lengths), 5, hidden=64, seed=1)
    layer[2, 3, 7] = float("inf")
    specs = [ArraySpec("h", "uint16", 64), ArraySpec("last", "uint16", 64)]
    slots = [_Slot(specs, 40)]
    assert _pin(slots) if pinned else True
    try:
        want = {"h": np.zeros((40, 64), np.uint16), "last": np.zeros((40, 64), np.uint16)}
        checks = []
        for device, bufs in ((torch.device("cpu"), want), (torch.device("cuda"), slots[0].arrays)):
            tr = UnitTransfer([("h", 0, True), ("last", 9, True)], torch.bfloat16, device)
            tr.start(bufs)
            for rep in range(3):
                tr.add(np.arange(3 * rep, 3 * rep + 3), lengths, 5, {0: layer.to(device)}, last.to(device),
                       offset=11 * rep)
            checks.append(tr.finish())
        assert checks[0].bad_samples == checks[1].bad_samples == {2: {"h": 1}, 5: {"h": 1}, 8: {"h": 1}}
        for name in ("h", "last"):
            assert np.array_equal(want[name], slots[0].arrays[name]), name
    finally:
        if pinned:
            _unpin(slots)
        slots[0].close()
