"""One sample at a time: a map-style ``Dataset`` over a cache and NeMo's padding collate.

The batches have NeMo AutoModel's DSpark keys, dtypes and padding (``CachedDSparkDataset``
+ its collate): ``input_ids``/``attention_mask``/``loss_mask`` int64 ``[B, T]``, hidden
states in the cache dtype, zeros on pads. The cache stores no padding, so a batch is
padded to its longest sample (or to a fixed ``pad_to``) only when it is built.
``read.assemble`` builds the same batches straight from decoded chunks (what the loader
uses); this module is the per-sample reference it is tested against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dspark_precompute.read.reader import DEFAULT_CHUNK_CACHE_BYTES, CacheReader, open_cache

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


class CacheDataset(Dataset[dict[str, torch.Tensor]]):
    """Map-style, lazy dataset over a cache: item ``i`` is sample ``i`` as torch tensors (no padding).

    Only a small description of the opened cache travels to DataLoader workers (pickling
    drops open handles), and each process re-opens the cache on first use, so it is safe
    with fork, spawn and ``DistributedSampler``. The re-opened cache must be the one the
    dataset indexed (same tables, same readable units; :meth:`CacheReader.reopen`), so a worker
    never reads other samples under the same indices. ``layers`` restricts
    ``target_hidden_states`` to those ids; ``max_length`` cuts every sample at that many tokens
    (samples left without a supervised token are dropped: ``open_cache``).
    """

    def __init__(self, cache: str | Path | CacheReader, layers: Sequence[int] | None = None,
                 allow_incomplete: bool = False, chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
                 max_length: int | None = None):
        if isinstance(cache, CacheReader):
            opened = cache
            allow_incomplete = allow_incomplete or not cache.complete
            if max_length is not None and max_length != (cache.max_length or cache.seq_length):
                raise ValueError(f"max_length={max_length} but the cache was opened with max_length="
                                 f"{cache.max_length}; pass max_length to open_cache, or a path here")
        else:
            opened = open_cache(cache, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes,
                                max_length=max_length)
        self.path = opened.path
        self.layers = None if layers is None else [int(x) for x in layers]
        opened.check_layers(self.layers)  # refuse unknown layer ids now, not inside a worker
        self.allow_incomplete = allow_incomplete
        self.chunk_cache_bytes = chunk_cache_bytes
        self.lengths = opened.lengths().astype(np.int64)
        self.pad_token_id = opened.pad_token_id
        self.seq_length = opened.max_length or opened.seq_length  # a cut cache serves samples of at most this
        self.storage_dtype = opened.storage_dtype
        self.manifest = opened.manifest
        self._state = {**opened.handle_state(), "chunk_cache_bytes": chunk_cache_bytes}
        self._cache: CacheReader | None = opened
        self._inherited: list[CacheReader] = []  # handles of the processes above this one (see cache)
        self._pid = os.getpid()

    @property
    def cache(self) -> CacheReader:
        """This process's handle (re-opened after a fork or unpickling: no zarr state is shared)."""
        if self._cache is None or self._pid != os.getpid():
            if self._cache is not None:
                # the parent's handle, inherited through fork: kept (never used) for this process's life, as are
                # those it inherited itself, since collecting one here would drop another process's object-store
                # sessions, each reported by aiohttp as "Unclosed client session" when a worker stops
                self._inherited.append(self._cache)
            self._cache = CacheReader.reopen(self._state)
            self._pid = os.getpid()
        return self._cache

    @property
    def fingerprint(self) -> str:
        """Identity, layout and sample tables of the cache this dataset indexes (what a re-opened handle must match)."""
        return str(self._state["fingerprint"])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.cache.sample(int(i), layers=self.layers)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        state["_inherited"] = []
        return state

    def collator(self, pad_to: int | None = None, pad_to_multiple_of: int | None = None) -> PadCollator:
        """A collate with this cache's pad id."""
        return PadCollator(self.pad_token_id, pad_to, pad_to_multiple_of)


@dataclass
class PadCollator:
    """Right-pad a list of samples to the longest (or ``pad_to``) with attention masks.

    ``input_ids`` pads with ``pad_token_id``; ``attention_mask``, ``loss_mask`` and the
    hidden states pad with zeros, so pads never contribute to a loss.
    """

    pad_token_id: int = 0
    pad_to: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(features, self.pad_token_id, self.pad_to, self.pad_to_multiple_of)


def collate(features: Sequence[dict[str, torch.Tensor]], pad_token_id: int = 0, pad_to: int | None = None,
            pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Stack samples into one right-padded batch (see :class:`PadCollator`)."""
    if not features:
        raise ValueError("collate got an empty batch; a sampler yielded no indices")
    lengths = [int(f["input_ids"].shape[0]) for f in features]
    longest = max(lengths)
    width = longest if pad_to is None else int(pad_to)
    if longest > width:
        raise ValueError(
            f"a sample has {longest} tokens but pad_to={pad_to}; raise pad_to to at least {longest} "
            "(the cache's seq_length bounds every sample) or leave it None to pad to the longest"
        )
    if pad_to_multiple_of:
        width = -(-width // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
    b = len(features)
    out = {
        "input_ids": torch.full((b, width), int(pad_token_id), dtype=torch.int64),
        "attention_mask": torch.zeros((b, width), dtype=torch.int64),
        "loss_mask": torch.zeros((b, width), dtype=torch.int64),
    }
    for key in ("target_hidden_states", "target_last_hidden_states"):
        if key in features[0]:
            ref = features[0][key]
            out[key] = torch.zeros((b, width, ref.shape[-1]), dtype=ref.dtype)
    for r, (f, n) in enumerate(zip(features, lengths)):
        out["input_ids"][r, :n] = f["input_ids"]
        out["attention_mask"][r, :n] = 1
        out["loss_mask"][r, :n] = f["loss_mask"]
        for key in ("target_hidden_states", "target_last_hidden_states"):
            if key in out:
                out[key][r, :n] = f[key]
    return {k: out[k] for k in BATCH_KEYS if k in out}
