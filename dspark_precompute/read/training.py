"""Training from a cache: ``build_dataloader`` and the pieces it is made of.

The batches have NeMo AutoModel's DSpark keys, dtypes and padding (``CachedDSparkDataset``
+ its collate): ``input_ids``/``attention_mask``/``loss_mask`` int64 ``[B, T]``, hidden
states in the cache dtype, zeros on pads. The cache stores no padding, so a batch is
padded to its longest sample (or to a fixed ``pad_to``) only when it is built, and the
length-grouped token budget keeps that padding small.

* :func:`build_dataloader` -> :class:`CacheLoader`: whole batches built in workers straight
  into shared memory, exact or chunk-aware (``shuffle="block"``) order, resumable epochs,
  read-ahead from object storage, optional device prefetch.
* :class:`CacheDataset` + :func:`collate`: one sample at a time, for a plain torch
  ``DataLoader`` with a sampler or collate of your own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch

from dspark_precompute.contract.window import DEFAULT_GROUP
from dspark_precompute.read.dataset import BATCH_KEYS, CacheDataset, PadCollator, collate
from dspark_precompute.read.loader import (
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_PREFETCH_REQUESTS,
    CacheLoader,
)
from dspark_precompute.read.prefetch import to_device
from dspark_precompute.read.reader import CacheReader
from dspark_precompute.read.sampling import (
    DEFAULT_WINDOW_BLOCKS,
    CacheBatchSampler,
    TokenBudgetBatchSampler,
    default_block_chunks,
    padding_fraction,
)
from dspark_precompute.read.stream import StreamLoader

log = logging.getLogger(__name__)

__all__ = ["BATCH_KEYS", "CacheBatchSampler", "CacheDataset", "CacheLoader", "PadCollator", "StreamLoader",
           "TokenBudgetBatchSampler", "build_dataloader", "collate", "padding_fraction", "to_device"]


@overload
def build_dataloader(cache: str | Path | CacheReader | CacheDataset, *, batch_size: int | None = None,
                     max_tokens: int | None = None, pad_to: int | None = None, shuffle: bool | str = True,
                     seed: int = 0, num_workers: int = 0, distributed: bool | None = None,
                     layers: Sequence[int] | None = None, drop_last: bool = False,
                     device: str | torch.device | None = None, pin_memory: bool | None = None,
                     pad_to_multiple_of: int | None = None, max_batch_size: int | None = None,
                     block_chunks: int | None = None, window_blocks: int = DEFAULT_WINDOW_BLOCKS,
                     num_replicas: int | None = None, rank: int | None = None,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, prefetch_requests: int = DEFAULT_PREFETCH_REQUESTS,
                     max_length: int | None = None, stream: Literal[False] = False, passes: int = 1,
                     group: str = DEFAULT_GROUP, release: str = "checkpoint",
                     **loader_kwargs: Any) -> CacheLoader: ...


@overload
def build_dataloader(cache: str | Path | CacheReader | CacheDataset, *, batch_size: int | None = None,
                     max_tokens: int | None = None, pad_to: int | None = None, shuffle: bool | str = True,
                     seed: int = 0, num_workers: int = 0, distributed: bool | None = None,
                     layers: Sequence[int] | None = None, drop_last: bool = False,
                     device: str | torch.device | None = None, pin_memory: bool | None = None,
                     pad_to_multiple_of: int | None = None, max_batch_size: int | None = None,
                     block_chunks: int | None = None, window_blocks: int = DEFAULT_WINDOW_BLOCKS,
                     num_replicas: int | None = None, rank: int | None = None,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, prefetch_requests: int = DEFAULT_PREFETCH_REQUESTS,
                     max_length: int | None = None, stream: Literal[True], passes: int = 1,
                     group: str = DEFAULT_GROUP, release: str = "checkpoint",
                     **loader_kwargs: Any) -> StreamLoader: ...


def build_dataloader(cache: str | Path | CacheReader | CacheDataset, *, batch_size: int | None = None,
                     max_tokens: int | None = None, pad_to: int | None = None, shuffle: bool | str = True,
                     seed: int = 0, num_workers: int = 0, distributed: bool | None = None,
                     layers: Sequence[int] | None = None, drop_last: bool = False,
                     device: str | torch.device | None = None, pin_memory: bool | None = None,
                     pad_to_multiple_of: int | None = None, max_batch_size: int | None = None,
                     block_chunks: int | None = None, window_blocks: int = DEFAULT_WINDOW_BLOCKS,
                     num_replicas: int | None = None, rank: int | None = None,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, prefetch_requests: int = DEFAULT_PREFETCH_REQUESTS,
                     max_length: int | None = None, stream: bool = False, passes: int = 1,
                     group: str = DEFAULT_GROUP, release: str = "checkpoint",
                     **loader_kwargs: Any) -> CacheLoader | StreamLoader:
    """A loader over a cache: fixed ``batch_size`` (NeMo's way) or a ``max_tokens`` budget (length-grouped).

    ``shuffle``: ``True``/``"exact"`` (every sample in a uniformly random order),
    ``"block"`` (random groups of ``block_chunks`` chunks, samples shuffled within windows
    of ``window_blocks`` groups: each chunk is decoded once per epoch; see
    :class:`CacheBatchSampler` for the randomness it gives up) or ``False`` (index order).
    ``distributed`` (default: whether torch.distributed is initialised) splits the epoch
    over the ranks without overlap (``num_replicas``/``rank`` override the world).
    Workers build whole batches into shared memory and are kept alive across epochs;
    ``device="cuda"`` delivers batches on the GPU (pinned memory, copied one batch ahead).
    A cache behind a URL is read ahead with at most ``prefetch_requests`` requests in flight
    and ``prefetch_bytes`` held per process. ``max_length`` trains at a shorter length than the
    cache was made at: every sample is cut there (a causal target's states for the first L tokens
    do not depend on later ones) and samples left without a supervised token are dropped. Other
    keyword arguments go to the torch ``DataLoader`` that runs the workers (``prefetch_factor``,
    ``timeout``, ...).

    ``stream=True`` trains on a cache while its run writes it through a window
    (``storage.window_units``): a :class:`~dspark_precompute.read.stream.StreamLoader` that takes the
    units in order as they commit, makes ``passes`` shuffled passes over each (``batch_size`` only),
    then releases it (``release``: after the next checkpoint, or at delivery) for trainer ``group``.
    """
    if (batch_size is None) == (max_tokens is None):
        raise ValueError(f"pass exactly one of batch_size={batch_size} or max_tokens={max_tokens}")
    if stream:
        return _stream(cache, batch_size, max_tokens, shuffle, seed, distributed, num_replicas, rank, layers, pad_to,
                       pad_to_multiple_of, drop_last, device, max_length, passes, group, release, loader_kwargs)
    if isinstance(cache, CacheDataset) and max_length is not None and max_length != cache.seq_length:
        raise ValueError(f"max_length={max_length} but the dataset serves {cache.seq_length} tokens; build the "
                         "CacheDataset with max_length, or pass a path here")
    ds = cache if isinstance(cache, CacheDataset) else CacheDataset(cache, layers=layers, max_length=max_length)
    if distributed is None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        num_replicas = 1 if num_replicas is None else num_replicas
        rank = 0 if rank is None else rank
    reader = ds.cache
    if block_chunks is None:
        block_chunks = default_block_chunks(reader.chunks.token_bytes() * reader.chunk_tokens)
    sampler = CacheBatchSampler(ds.lengths, reader.starts(), reader.chunk_tokens, batch_size=batch_size,
                                max_tokens=max_tokens, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                num_replicas=num_replicas, rank=rank, pad_to=pad_to, max_batch_size=max_batch_size,
                                block_chunks=block_chunks, window_blocks=window_blocks)
    return CacheLoader(ds, sampler, num_workers=num_workers, device=device, pin_memory=pin_memory, pad_to=pad_to,
                       pad_to_multiple_of=pad_to_multiple_of, prefetch_bytes=prefetch_bytes,
                       prefetch_requests=prefetch_requests, **loader_kwargs)



def _world(distributed: bool | None, num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(world size, rank): torch.distributed's when it is initialised (unless overridden), else one process."""
    import torch.distributed as dist

    on = (dist.is_available() and dist.is_initialized()) if distributed is None else distributed
    if on:
        return (dist.get_world_size() if num_replicas is None else int(num_replicas),
                dist.get_rank() if rank is None else int(rank))
    return (1 if num_replicas is None else int(num_replicas)), (0 if rank is None else int(rank))


def _stream(cache: Any, batch_size: int | None, max_tokens: int | None, shuffle: bool | str, seed: int,
            distributed: bool | None, num_replicas: int | None, rank: int | None, layers: Sequence[int] | None,
            pad_to: int | None, pad_to_multiple_of: int | None, drop_last: bool, device: Any,
            max_length: int | None, passes: int, group: str, release: str,
            extra: dict[str, Any]) -> StreamLoader:
    """``build_dataloader(..., stream=True)``: the stream loader, refusing what it does not take."""
    if batch_size is None or max_tokens is not None:
        raise ValueError(f"stream=True takes batch_size (got max_tokens={max_tokens}): a unit's samples are split "
                         "over the ranks by count")
    if shuffle not in (True, False, "exact"):
        raise ValueError(f"stream=True shuffles within each unit (shuffle=True) or not (False), not "
                         f"shuffle={shuffle!r}")
    if not isinstance(cache, (str, Path)):
        raise ValueError("stream=True takes the cache's path (it opens the stream itself)")
    refused = sorted(set(extra) - {"poll_s", "wait_timeout_s"})
    if refused:
        raise ValueError(f"{refused} are not options of the stream loader (it builds batches in this process)")
    world, r = _world(distributed, num_replicas, rank)
    return StreamLoader(cache, batch_size=batch_size, passes=passes, shuffle=bool(shuffle), seed=seed,
                        num_replicas=world, rank=r, group=group, layers=layers, pad_to=pad_to,
                        pad_to_multiple_of=pad_to_multiple_of, drop_last=drop_last, device=device,
                        max_length=max_length, release=release, **extra)
