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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch


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

    def __init__(self, arrays: list[tuple[str, int, bool]], storage_dtype: torch.dtype, device: torch.device,
                 check_finite: bool = True):
        """``arrays``: (array name, layer id, stored as bf16 bits) of every hidden-state array."""
        self.arrays = arrays
        self.storage_dtype = storage_dtype
        self.device = device
        self.check_finite = check_finite
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.views: dict[str, torch.Tensor] = {}
        self.batches: list[_Batch] = []

    def start(self, buffers: dict[str, np.ndarray]) -> None:
        """The next unit goes to ``buffers`` (the writer's shared arrays)."""
        self.views = {name: torch.from_numpy(buffers[name].view(np.int16) if bits else buffers[name])
                      for name, _, bits in self.arrays}
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
        for name, lid, bits in self.arrays:
            t = states.get(lid, last)
            flat = t.reshape(-1, t.shape[-1])
            if idx is not None:
                flat = flat.index_select(0, idx)
            out = flat.to(self.storage_dtype)
            if self.check_finite:  # after the cast: a value finite in compute dtype may overflow fp16
                bad_rows.append((~torch.isfinite(out)).sum(dim=-1, dtype=torch.int32))
            if bits:
                out = out.view(torch.int16)
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
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()
        check = UnitCheck()
        names = [name for name, _, _ in self.arrays]
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


def zero_samples(buffers: dict[str, np.ndarray], names: list[str], spans: list[tuple[int, int]]) -> None:
    """Zero the hidden states of dropped samples (token slots ``[a, b)`` of the unit buffer)."""
    for name in names:
        for a, b in spans:
            buffers[name][a:b] = 0

