"""Captured states -> a unit buffer: gather the real tokens, cast, copy, and check they are finite.

On CUDA everything before the copy happens on the device (the gather of real tokens with
an index built on the host, so no device-to-host sync; the cast to the storage dtype;
the NaN/Inf count), and the copy into the unit buffer (page-locked by the writer) runs
asynchronously on a side stream while the next batch's forward runs; the only sync is
one event per unit, before the unit goes to the writers. On CPU the same steps run
in place.

A sample with any non-finite value in any stored array is reported per array, so the
run can drop it (``data.on_nonfinite=reject``) or stop (``error``): a cache never holds
an Inf silently.

An fp8 array (``storage.dtype=fp8_e4m3``) is quantized here, on the device, by
:func:`quantize_e4m3` (the rule is ``contract/fp8.py``'s); its values are checked for NaN/Inf
before they are quantized (the e4m3 bits of an Inf would be NaN, a scale of one Inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from dspark_precompute.contract.fp8 import E4M3_MAX, MIN_SCALE, ZERO_ROW_SCALE


def quantize_e4m3(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, hidden]`` states -> e4m3 bits ``uint8 [rows, hidden]`` and float32 scales ``[rows, hidden / group]``.

    Per row and group of ``group`` channels: ``scale = max(amax / 448, 2^-126)`` (1 for an
    all-zero group), ``bits = e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even, all
    in float32 (``contract/fp8.py`` documents the rule and decodes it).
    """
    rows, hidden = x.shape
    xf = x.float().reshape(rows, hidden // group, group)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(MIN_SCALE), torch.full_like(amax, ZERO_ROW_SCALE))
    q = (xf / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(rows, hidden), scale


@dataclass(frozen=True)
class StateArray:
    """One hidden-state array of a unit: where it goes, from which layer, and how it is stored."""

    name: str
    layer_id: int
    dtype: torch.dtype | None  # the cast target; None for fp8 (quantized instead)
    bits: bool = False  # bf16, copied as its int16 bit pattern
    scale: str | None = None  # fp8: the scale array's name
    group: int = 0  # fp8: channels per scale


@dataclass
class _Batch:
    samples: np.ndarray  # sample ids, in batch order
    lengths: np.ndarray  # their real lengths
    bad: torch.Tensor  # [arrays, tokens] non-finite values per real token, per stored array (on the device)


@dataclass
class UnitCheck:
    """What one unit's states held: non-finite values per array, and per sample that had any."""

    nonfinite: dict[str, int] = field(default_factory=dict)  # array -> values
    bad_samples: dict[int, dict[str, int]] = field(default_factory=dict)  # sample -> array -> values


def real_token_index(lengths: np.ndarray, width: int) -> np.ndarray | None:
    """Flat positions of the real tokens of a right-padded ``[rows, width]`` batch (None: no padding)."""
    if bool((lengths == width).all()):
        return None
    return np.concatenate([r * width + np.arange(n) for r, n in enumerate(lengths)]).astype(np.int64)


class UnitTransfer:
    """Moves one unit's captured states into its buffer; ``finish`` returns what the check found."""

    def __init__(self, arrays: list[StateArray] | list[tuple[str, int, bool]], storage_dtype: torch.dtype | None = None,
                 device: torch.device | None = None, check_finite: bool = True):
        """``arrays``: every hidden-state array, or (name, layer id, stored as bf16 bits) cast to ``storage_dtype``."""
        device = device or torch.device("cpu")
        self.states = [a if isinstance(a, StateArray) else StateArray(a[0], a[1], storage_dtype, a[2])
                       for a in arrays]
        self.arrays = [(a.name, a.layer_id, a.bits) for a in self.states]
        self.device = device
        self.check_finite = check_finite
        self.cuda = device.type == "cuda"
        # torch.cuda.Stream and Event have unannotated constructors
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.views: dict[str, torch.Tensor] = {}
        self.batches: list[_Batch] = []

    def start(self, buffers: dict[str, np.ndarray]) -> None:
        """The next unit goes to ``buffers`` (the writer's shared arrays)."""
        self.views = {a.name: torch.from_numpy(buffers[a.name].view(np.int16) if a.bits else buffers[a.name])
                      for a in self.states}
        self.views.update({a.scale: torch.from_numpy(buffers[a.scale]) for a in self.states if a.scale})
        self.batches = []

    def add(self, samples: np.ndarray, lengths: np.ndarray, width: int, states: dict[int, torch.Tensor],
            last: torch.Tensor, offset: int) -> None:
        """One forward batch: rows ``samples`` (right-padded to ``width``) go to slots ``offset`` onwards."""
        n = int(lengths.sum())
        index = real_token_index(lengths, width)
        idx = None if index is None else torch.from_numpy(index).to(self.device, non_blocking=True)
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        bad_rows = []
        for a in self.states:
            t = states.get(a.layer_id, last)
            flat = t.reshape(-1, t.shape[-1])
            if idx is not None:
                flat = flat.index_select(0, idx)
            copies: list[tuple[str, torch.Tensor]] = []
            if a.scale is not None:
                if self.check_finite:  # before quantizing: e4m3 has no Inf, and an Inf's scale would hide it
                    bad_rows.append((~torch.isfinite(flat)).sum(dim=-1, dtype=torch.int32))
                bits, scale = quantize_e4m3(flat, a.group)
                copies += [(a.name, bits), (a.scale, scale)]
            else:
                out = flat.to(a.dtype)
                if self.check_finite:  # after the cast: a value finite in compute dtype may overflow fp16
                    bad_rows.append((~torch.isfinite(out)).sum(dim=-1, dtype=torch.int32))
                copies.append((a.name, out.view(torch.int16) if a.bits else out))
            for name, out in copies:
                dst = self.views[name][offset:offset + n]
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        dst.copy_(out, non_blocking=True)
                    out.record_stream(cast(Any, self.stream))  # keep the source alive until the copy is done
                else:
                    dst.copy_(out)
        if self.check_finite:
            self.batches.append(_Batch(np.asarray(samples), np.asarray(lengths), torch.stack(bad_rows)))

    def finish(self) -> UnitCheck:
        """Wait for this unit's copies, then count what was not finite (the unit's one sync on CUDA)."""
        if self.cuda:
            assert self.stream is not None
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # an unannotated constructor
            done.record(self.stream)
            done.synchronize()
        check = UnitCheck()
        names = [a.name for a in self.states]
        for b in self.batches:
            bad = b.bad.cpu().numpy()  # [arrays, tokens]
            if not bad.any():
                continue
            ends = np.cumsum(b.lengths)
            per_sample = np.add.reduceat(bad, np.r_[0, ends[:-1]], axis=1)  # [arrays, samples]
            for j, name in enumerate(names):
                if int(bad[j].sum()):
                    check.nonfinite[name] = check.nonfinite.get(name, 0) + int(bad[j].sum())
            for k in np.flatnonzero(per_sample.any(axis=0)):
                check.bad_samples[int(b.samples[k])] = {names[j]: int(per_sample[j, k])
                                                        for j in range(len(names)) if per_sample[j, k]}
        self.batches = []
        return check


def zero_samples(buffers: dict[str, np.ndarray], names: list[str], spans: list[tuple[int, int]],
                 fills: dict[str, float] | None = None) -> None:
    """Zero the hidden states of dropped samples (token slots ``[a, b)`` of the unit buffer); ``fills`` gives
    other values (fp8 scale arrays: 1, the scale of an all-zero row)."""
    for name in names:
        for a, b in spans:
            buffers[name][a:b] = (fills or {}).get(name, 0)

