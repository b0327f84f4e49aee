"""Forward batches: length-sorted samples grouped under a token budget, right-padded.

Right padding needs no attention mask: causal attention alone keeps every real token
from seeing the pads (positions are 0..T-1 either way), so the mask-free path runs the
fast causal kernels and the real tokens' states are bit-identical to an unpadded forward.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def make_batches(order: np.ndarray, lengths: np.ndarray, max_tokens: int, max_samples: int | None
                 ) -> list[np.ndarray]:
    """Greedy batches over longest-first samples: rows x longest row <= max_tokens."""
    out, i, n = [], 0, len(order)
    cap = max_samples or n
    while i < n:
        longest = int(lengths[order[i]])
        j = i + 1
        while j < n and j - i < cap and (j - i + 1) * longest <= max_tokens:
            j += 1
        out.append(order[i:j])
        i = j
    return out


def batch_inputs(ids_of: Mapping[int, np.ndarray], batch: np.ndarray, lengths: np.ndarray, pad_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward's right-padded ids, and the real-token mask (None when nothing is padded).

    ``ids_of[s]`` holds sample ``s``'s tokens; the mask picks the real tokens out of the output.
    """
    blens = lengths[batch]
    T = int(blens.max())
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : blens[r]] = torch.from_numpy(np.asarray(ids_of[int(s)]).astype(np.int64))
    rows = None
    if bool((blens != T).any()):
        rows = (torch.arange(T)[None, :] < torch.from_numpy(np.asarray(blens))[:, None]).to(device)
    return ids.to(device, non_blocking=True), rows
