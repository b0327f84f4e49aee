"""Training-side reading: a map-style ``Dataset``, a padding collate, a token-budget sampler.

The batches have NeMo AutoModel's DSpark keys, dtypes and padding (``CachedDSparkDataset``
+ its collate): ``input_ids``/``attention_mask``/``loss_mask`` int64 ``[B, T]``, hidden
states in the cache dtype, zeros on pads. The cache stores no padding, so a batch is
padded to its longest sample (or to a fixed ``pad_to``) only when it is built, and the
length-grouped sampler keeps that padding small.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dspark_precompute.read.reader import DEFAULT_CHUNK_CACHE_BYTES, CacheReader, open_cache

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


class CacheDataset(Dataset):
    """Map-style, lazy dataset over a cache: item ``i`` is sample ``i`` as torch tensors (no padding).

    Only a small description of the opened cache travels to DataLoader workers (pickling
    drops open handles), and each process re-opens the cache on first use, so it is safe
    with fork, spawn and ``DistributedSampler``. The re-opened cache must be the one the
    dataset indexed (same tables, same readable units; :meth:`CacheReader.reopen`), so a worker
    never reads other samples under the same indices. ``layers`` restricts
    ``target_hidden_states`` to those ids.
    """

    def __init__(self, cache: str | Path | CacheReader, layers: Sequence[int] | None = None,
                 allow_incomplete: bool = False, chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES):
        if isinstance(cache, CacheReader):
            opened = cache
            allow_incomplete = allow_incomplete or not cache.complete
        else:
            opened = open_cache(cache, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes)
        self.path = opened.path
        self.layers = None if layers is None else [int(x) for x in layers]
        opened.check_layers(self.layers)  # refuse unknown layer ids now, not inside a worker
        self.allow_incomplete = allow_incomplete
        self.chunk_cache_bytes = chunk_cache_bytes
        self.lengths = opened.lengths().astype(np.int64)
        self.pad_token_id = opened.pad_token_id
        self.seq_length = opened.seq_length
        self.storage_dtype = opened.storage_dtype
        self.manifest = opened.manifest
        self._state = {**opened.handle_state(), "chunk_cache_bytes": chunk_cache_bytes}
        self._cache: CacheReader | None = opened
        self._pid = os.getpid()

    @property
    def cache(self) -> CacheReader:
        """This process's handle (re-opened after a fork or unpickling: no zarr state is shared)."""
        if self._cache is None or self._pid != os.getpid():
            self._cache = CacheReader.reopen(self._state)
            self._pid = os.getpid()
        return self._cache

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.cache.sample(int(i), layers=self.layers)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
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


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray,
                     pad_to: int | None = None) -> float:
    """Share of the padded token slots that are padding, for batches padded to their longest."""
    lengths = np.asarray(lengths)
    real = padded = 0
    for batch in batches:
        ls = lengths[np.asarray(batch, dtype=np.int64)]
        real += int(ls.sum())
        padded += len(ls) * (int(pad_to) if pad_to else int(ls.max()))
    return 1.0 - real / padded if padded else 0.0


def _dist_defaults(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        ready = dist.is_available() and dist.is_initialized()
        num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if ready else 1)
        rank = rank if rank is not None else (dist.get_rank() if ready else 0)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} is outside [0, num_replicas={num_replicas}); pass 0 <= rank < num_replicas")
    return int(num_replicas), int(rank)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-grouped batches under a token budget: ``rows x padded length <= max_tokens``.

    Each epoch shuffles the samples (seeded by ``seed + epoch``), cuts the permutation into
    buckets of ``bucket_batches`` batches' worth of samples, sorts each bucket by length and
    packs it greedily, then shuffles the batch order: batches are random but their rows
    have similar lengths, so little compute goes to padding. A sample longer than the
    budget gets a batch of its own.

    With ``num_replicas`` > 1 (default: the torch.distributed world) every rank builds the
    same batches and takes every ``num_replicas``-th one; when the count does not divide,
    the first batches are repeated (or the tail dropped with ``drop_last``) so all ranks run
    the same number of steps, as ``DistributedSampler`` does. Call :meth:`set_epoch`.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, *, max_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, bucket_batches: int = 64, pad_to: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 (padded tokens per batch)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        if bucket_batches < 1:
            raise ValueError(f"bucket_batches={bucket_batches} must be >= 1")
        if pad_to is not None and len(self.lengths) and int(self.lengths.max()) > pad_to:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({int(self.lengths.max())} tokens)")
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.num_replicas, self.rank = _dist_defaults(num_replicas, rank)
        self.bucket_batches = int(bucket_batches)
        self.pad_to = pad_to
        self.epoch = 0
        self._memo: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _pack(self, ids: np.ndarray) -> list[list[int]]:
        """Greedy batches over ``ids`` sorted longest first."""
        order = ids[np.argsort(-self.lengths[ids], kind="stable")]
        cap = self.max_batch_size or len(order) or 1
        out: list[list[int]] = []
        cur: list[int] = []
        width = 0
        for s in order.tolist():
            w = self.pad_to or max(width, int(self.lengths[s]))
            if cur and ((len(cur) + 1) * w > self.max_tokens or len(cur) >= cap):
                out.append(cur)
                cur, w = [], self.pad_to or int(self.lengths[s])
            cur.append(s)
            width = w
        if cur:
            out.append(cur)
        return out

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over every rank, before they are dealt out."""
        if self._memo is not None and self._memo[0] == self.epoch:
            return self._memo[1]
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g).numpy() if self.shuffle else np.arange(n)
        if self.shuffle:
            typical = max(1, int(np.median(self.lengths))) if n else 1
            per_batch = max(1, self.max_tokens // (self.pad_to or typical))
            if self.max_batch_size:
                per_batch = min(per_batch, self.max_batch_size)
            bucket = max(1, per_batch * self.bucket_batches)
            batches = [b for k in range(0, n, bucket) for b in self._pack(perm[k:k + bucket])]
            order = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[k] for k in order]
        else:
            batches = self._pack(perm)
        self._memo = (self.epoch, batches)
        return batches

    def _mine(self) -> list[list[int]]:
        batches = self.all_batches()
        r = self.num_replicas
        if r > 1:
            if self.drop_last:
                batches = batches[: len(batches) // r * r]
            elif len(batches) % r:
                extra = r - len(batches) % r
                batches = batches + [batches[k % len(batches)] for k in range(extra)]
        return batches[self.rank::r]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._mine()

    def __len__(self) -> int:
        return len(self._mine())


def build_dataloader(cache: str | Path | CacheReader | CacheDataset, *, batch_size: int | None = None,
                     max_tokens: int | None = None, pad_to: int | None = None, shuffle: bool = True, seed: int = 0,
                     num_workers: int = 0, distributed: bool | None = None, layers: Sequence[int] | None = None,
                     drop_last: bool = False, **loader_kwargs: Any) -> DataLoader:
    """A DataLoader over a cache: fixed ``batch_size`` (NeMo's way) or a ``max_tokens`` budget.

    ``distributed`` (default: whether torch.distributed is initialised) shards samples
    (``DistributedSampler``) or batches (the token-budget sampler) over the ranks. Workers
    are kept alive across epochs, as NeMo's DSpark loaders do.
    """
    if (batch_size is None) == (max_tokens is None):
        raise ValueError(f"pass exactly one of batch_size={batch_size} or max_tokens={max_tokens}")
    ds = cache if isinstance(cache, CacheDataset) else CacheDataset(cache, layers=layers)
    if distributed is None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
    kwargs: dict[str, Any] = {"num_workers": num_workers, "collate_fn": ds.collator(pad_to),
                              "pin_memory": torch.cuda.is_available()}
    if num_workers > 0:
        kwargs["persistent_workers"] = True
    kwargs.update(loader_kwargs)
    if max_tokens is not None:
        sampler = TokenBudgetBatchSampler(ds.lengths, max_tokens, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                          num_replicas=None if distributed else 1, rank=None if distributed else 0,
                                          pad_to=pad_to)
        return DataLoader(ds, batch_sampler=sampler, **kwargs)
    if distributed:
        from torch.utils.data.distributed import DistributedSampler

        dsampler: DistributedSampler[int] = DistributedSampler(ds, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(ds, batch_size=batch_size, sampler=dsampler, drop_last=drop_last, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen if shuffle else None,
                      drop_last=drop_last, **kwargs)

