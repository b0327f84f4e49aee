"""The training loader: whole batches built in workers, chunk-aware shuffles, resumable epochs.

:class:`CacheLoader` iterates over padded batches (NeMo's keys, dtypes and padding) of
one rank. Its plan (:class:`~dspark_precompute.read.sampling.CacheBatchSampler`) groups an
epoch's batches into tasks; a task is built whole by one process
(:class:`~dspark_precompute.read.assemble.BatchAssembler`): in a DataLoader worker, into
shared memory that reaches the training process as a file descriptor, without a copy. The
DataLoader hands tasks out in order and returns them in order, so the batches are the same
for any number of workers.

``state_dict()`` / ``load_state_dict()`` save and restore the position within an epoch
(the epoch and the number of batches delivered), as torchdata's ``StatefulDataLoader``
does: a job preempted mid-epoch continues with the next batch it had not received.

Caches behind a URL (``s3://``) are read through a :class:`ChunkPrefetcher` per process:
the chunks of the task being built and of the tasks that process builds next are fetched
ahead, concurrently, within a memory bound.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from dspark_precompute.errors import LoaderStateError
from dspark_precompute.read.arena import BatchArena, SharedBatch
from dspark_precompute.read.assemble import BatchAssembler
from dspark_precompute.read.dataset import CacheDataset
from dspark_precompute.read.prefetch import ChunkPrefetcher, to_device, zarr_fetcher
from dspark_precompute.read.sampling import CacheBatchSampler

log = logging.getLogger(__name__)

STATE_FORMAT = "dspark-cache-loader"
STATE_VERSION = 1
DEFAULT_PREFETCH_BYTES = 256 << 20
DEFAULT_PREFETCH_REQUESTS = 16
_REFUSED_KWARGS = ("collate_fn", "sampler", "batch_sampler", "shuffle", "batch_size", "drop_last")

TaskKey = tuple[int, int, int]  # (epoch, task number, first batch of the task to build)
Built = dict[str, torch.Tensor] | SharedBatch


def _keep(x: Any) -> Any:
    return x


class _TaskRunner(Dataset[Any]):
    """Builds a task's batches in whichever process runs it (a DataLoader worker or the training process)."""

    def __init__(self, dataset: CacheDataset, sampler: CacheBatchSampler, pad_to: int | None,
                 pad_to_multiple_of: int | None, pin: bool, prefetch_bytes: int, prefetch_requests: int,
                 decode_threads: bool | None):
        self.dataset = dataset
        self.sampler = sampler
        self.pad_to = pad_to
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pin = pin
        self.prefetch_bytes = int(prefetch_bytes)
        self.prefetch_requests = int(prefetch_requests)
        self.decode_threads = decode_threads
        self.arena: BatchArena | None = None  # inherited by forked workers, never pickled
        self._assembler: BatchAssembler | None = None
        self._prefetcher: ChunkPrefetcher | None = None
        self._planned: deque[tuple[TaskKey, int]] = deque()  # tasks whose chunks are queued, with their bytes

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_assembler=None, _prefetcher=None, _planned=deque(), arena=None)
        return state

    def __len__(self) -> int:
        return len(self.sampler.tasks())

    @property
    def assembler(self) -> BatchAssembler:
        cache = self.dataset.cache  # re-opened after a fork (a new handle: no zarr state is shared)
        if self._assembler is None or self._assembler.reader is not cache:
            self._assembler = BatchAssembler(cache, self.dataset.layers, self.pad_to, self.pad_to_multiple_of)
            self._prefetcher = None
            self._planned.clear()
            if cache.store.url and self.prefetch_bytes > 0:
                self._prefetcher = ChunkPrefetcher(zarr_fetcher(cache.chunks.zstore), self.prefetch_bytes,
                                                   self.prefetch_requests)
        return self._assembler

    @property
    def prefetcher(self) -> ChunkPrefetcher | None:
        return self._prefetcher

    def __getitem__(self, key: tuple[int, int, int, tuple[int | None, ...] | None]) -> list[Built]:
        """Task ``(epoch, number, first batch, arena offsets or None)`` -> its batches."""
        epoch, t, first = int(key[0]), int(key[1]), int(key[2])
        offsets = key[3] if len(key) > 3 else None
        asm = self.assembler
        info = get_worker_info()
        memory = "shared" if info is not None else ("pinned" if self.pin else "plain")
        threads = (info is None) if self.decode_threads is None else bool(self.decode_threads)
        batches = self.sampler.tasks(epoch)[t][first:]
        arena = self.arena
        if arena is not None and arena.mine and offsets is None and not self.pin:
            offsets = tuple(arena.alloc(asm.nbytes(b)) for b in batches)  # built here: recycle the region
        if arena is None:
            offsets = None
        pf = self._prefetcher
        raws = None
        if pf is not None:
            self._plan_ahead(asm, pf, (epoch, t, first), 1 if info is None else max(1, info.num_workers))
            cache = asm.reader

            def raws(jobs: list[tuple[str, int]]) -> list[bytes | None]:
                return pf.take_many(cache.chunks.refs(jobs))

        return asm.build(batches, memory, raws=raws, threads=threads, arena=arena, offsets=offsets)

    def _plan_ahead(self, asm: BatchAssembler, pf: ChunkPrefetcher, key: TaskKey, step: int) -> None:
        """Queue this task's chunks (unless queued already) and those of the tasks this process builds next.

        A DataLoader deals tasks to its workers in turn, so a worker's next tasks are ``step``
        (= the number of workers) apart. A guess that proves wrong is dropped on the next task.
        """
        cache = asm.reader
        tasks = self.sampler.tasks(key[0])

        def queue(k: TaskKey) -> None:
            items = cache.chunks.refs(asm.jobs(tasks[k[1]][k[2]:]))
            pf.plan(items)
            self._planned.append((k, sum(ref.nbytes for ref in items if ref is not None)))

        if self._planned and self._planned[0][0] == key:
            self._planned.popleft()
        else:
            pf.reset()
            self._planned.clear()
            queue(key)
            self._planned.popleft()
        ahead = sum(b for _, b in self._planned)
        nxt = (self._planned[-1][0][1] if self._planned else key[1]) + step
        while ahead < 2 * pf.max_bytes and nxt < len(tasks) and len(self._planned) < 64:
            queue((key[0], nxt, 0))
            ahead += self._planned[-1][1]
            nxt += step


class _TaskIndex(Sampler[tuple[int, int, int, tuple[int | None, ...] | None]]):
    """The task keys of one pass, from where it starts, each with the arena extents its batches go to."""

    def __init__(self, sampler: CacheBatchSampler, runner: _TaskRunner):
        self.sampler = sampler
        self.runner = runner
        self.start: TaskKey = (0, 0, 0)
        self.generation = 0

    def __iter__(self) -> Iterator[tuple[int, int, int, tuple[int | None, ...] | None]]:
        # Runs from the DataLoader's first request of a pass: after a persistent DataLoader has
        # drained the previous pass, so no worker still writes an extent issued for it.
        self.generation += 1
        arena = self.runner.arena
        if arena is not None:
            arena.sweep(keep_tag=self.generation)
        epoch, t0, first = self.start
        tasks = self.sampler.tasks(epoch)
        asm = self.runner.assembler if arena is not None else None
        for t in range(t0, len(tasks)):
            skip = first if t == t0 else 0
            offsets = None
            if arena is not None and asm is not None:
                offsets = tuple(arena.alloc(asm.nbytes(b), tag=self.generation) for b in tasks[t][skip:])
            yield (epoch, t, skip, offsets)

    def __len__(self) -> int:
        epoch, t0, _ = self.start
        return max(0, len(self.sampler.tasks(epoch)) - t0)


class CacheLoader:
    """An iterable of padded batches over a cache, for one rank; resumable within an epoch.

    Build it with :func:`~dspark_precompute.read.training.build_dataloader`. Iterating runs
    one pass over this rank's share of the current epoch; a finished pass moves to the next
    epoch (``set_epoch`` sets it, as with ``DistributedSampler``). ``state_dict()`` holds the
    epoch and the number of batches delivered so far; after ``load_state_dict(state)`` the
    next pass continues from there (``set_epoch`` with that same epoch keeps the position).
    With ``device`` set, batches arrive on it: on CUDA from pinned memory, copied on a side
    stream one batch ahead of the step.
    """

    def __init__(self, dataset: CacheDataset, sampler: CacheBatchSampler, *, num_workers: int = 0,
                 device: str | torch.device | None = None, pin_memory: bool | None = None,
                 pad_to: int | None = None, pad_to_multiple_of: int | None = None,
                 prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, prefetch_requests: int = DEFAULT_PREFETCH_REQUESTS,
                 decode_threads: bool | None = None, shared_memory_bytes: int | None = None,
                 **dataloader_kwargs: Any):
        refused = sorted(set(dataloader_kwargs) & set(_REFUSED_KWARGS))
        if refused:
            raise ValueError(f"{refused} cannot be passed to the cache loader: it builds whole batches itself from "
                             "its own plan (batch_size/max_tokens, shuffle, drop_last are build_dataloader's own "
                             "arguments). For a custom collate, use CacheDataset with a torch DataLoader.")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.dataset = dataset
        self.batch_sampler = sampler
        self.sampler = sampler
        self.batch_size = sampler.batch_size
        self.num_workers = int(num_workers)
        self.device = None if device is None else torch.device(device)
        on_cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory is None else bool(pin_memory)
        self.runner = _TaskRunner(dataset, sampler, pad_to, pad_to_multiple_of, self.pin_memory and num_workers == 0,
                                  prefetch_bytes, prefetch_requests, decode_threads)
        self._index = _TaskIndex(sampler, self.runner)
        self.dataloader: DataLoader[Any] | None = None
        kwargs: dict[str, Any] = {"persistent_workers": True, "pin_memory": self.pin_memory}
        if num_workers > 0 and sampler.mode == "block":
            kwargs["prefetch_factor"] = 1  # a task is a window of batches: one queued per worker keeps them busy
        if self.pin_memory and on_cuda:
            kwargs["pin_memory_device"] = str(self.device)
        kwargs.update(dataloader_kwargs)
        if self._arena_fits(kwargs) and shared_memory_bytes != 0:
            size = self._arena_size(kwargs) if shared_memory_bytes is None else int(shared_memory_bytes)
            self.runner.arena = BatchArena(size)
        if num_workers > 0:
            self.dataloader = DataLoader(self.runner, sampler=self._index, batch_size=None, collate_fn=_keep,
                                         num_workers=num_workers, **kwargs)
        elif dataloader_kwargs:
            log.debug("DataLoader options %s have no effect without workers", sorted(dataloader_kwargs))
        self._epoch = 0
        self._done = 0
        self._resume: int | None = None

    @property
    def arena(self) -> BatchArena | None:
        """The recycled shared memory batches are built into (None: fresh memory per batch)."""
        return self.runner.arena

    def _arena_fits(self, kwargs: dict[str, Any]) -> bool:
        """Workers inherit the region only when forked, and may write it only while their DataLoader drains a
        pass before the next (persistent workers); without workers, pinned batches come from torch's allocator."""
        if self.num_workers == 0:
            return not self.runner.pin
        ctx = kwargs.get("multiprocessing_context")
        if ctx is None:
            method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        else:
            method = ctx if isinstance(ctx, str) else ctx.get_start_method()
        return method == "fork" and bool(kwargs.get("persistent_workers"))

    def _arena_size(self, kwargs: dict[str, Any]) -> int:
        """Room for the tasks in flight (the DataLoader's prefetch, one being read) and two batches held."""
        asm = self.runner.assembler
        tasks = self.sampler.tasks(self.sampler.epoch)
        sizes = sorted((sum(asm.nbytes(b) for b in t) for t in tasks), reverse=True)
        batch = max((asm.nbytes(b) for t in tasks[:64] for b in t), default=0)
        flight = (int(kwargs.get("prefetch_factor") or 2) * self.num_workers + 1) if self.num_workers else 1
        need = sum(sizes[:flight]) + 2 * batch
        return int(min(max(need, 64 << 20), 4 << 30))

    # -- epochs and state ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next pass (a restored position in that same epoch is kept)."""
        epoch = int(epoch)
        if epoch != self._epoch:
            self._epoch, self._done, self._resume = epoch, 0, None
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches in this rank's share of the current epoch (a resumed pass yields the rest)."""
        return sum(len(t) for t in self.sampler.tasks(self._epoch))

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch and the batches of it delivered (JSON-serialisable)."""
        done = self._resume if self._resume is not None else self._done
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "epoch": self._epoch, "batches_done": done,
                "plan": self.sampler.describe(), "cache": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) on the next pass.

        Refuses (:class:`LoaderStateError`) a state of another cache, another plan (shuffle,
        batch settings, seed, world size or rank) or a position past the epoch's end.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise LoaderStateError(f"load_state_dict got {type(state).__name__} {str(state)[:120]!r}, not a state "
                                   "from CacheLoader.state_dict(); pass the dict it returned (saved with torch.save "
                                   "or json)")
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was "
                                   "saved by another version of dspark-precompute: start the epoch afresh (do not "
                                   "load it)")
        if state.get("cache") != self.dataset.fingerprint:
            raise LoaderStateError(f"the loader state was saved for another cache (or {self.dataset.path} was "
                                   "re-created since): its batches would be other samples. Load it with the cache it "
                                   "was saved for, or start the epoch afresh")
        mine, theirs = self.sampler.describe(), dict(state.get("plan") or {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise LoaderStateError(f"the loader state was saved with another plan ({shown}); the rest of the epoch "
                                   "would repeat or skip samples. Build the loader with the saved settings (same "
                                   "shuffle, batch_size/max_tokens, seed, world size and rank), or start the epoch "
                                   "afresh")
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        total = sum(len(t) for t in self.sampler.tasks(epoch))
        if not 0 <= done <= total:
            raise LoaderStateError(f"batches_done={done} is outside [0, {total}] for epoch {epoch} of this plan; "
                                   "the state is damaged: start the epoch afresh")
        self._epoch, self._done, self._resume = epoch, done, done
        self.sampler.set_epoch(epoch)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self._epoch
        start = self._resume or 0
        self._resume = None
        self.sampler.set_epoch(epoch)
        batches: Iterator[dict[str, torch.Tensor]] = self._host_batches(epoch, start)
        if self.device is not None:
            batches = to_device(batches, self.device)
        return self._count(batches, epoch, start)

    def _count(self, batches: Iterator[dict[str, torch.Tensor]], epoch: int,
               start: int) -> Iterator[dict[str, torch.Tensor]]:
        self._done = start
        for b in batches:
            self._done += 1
            yield b
        if self._epoch == epoch and self._resume is None:
            self._epoch, self._done = epoch + 1, 0
            self.sampler.set_epoch(self._epoch)

    def _host_batches(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        tasks = self.sampler.tasks(epoch)
        t0, first = len(tasks), 0
        seen = 0
        for k, task in enumerate(tasks):
            if seen + len(task) > start:
                t0, first = k, start - seen
                break
            seen += len(task)
        if self.dataloader is None:
            for t in range(t0, len(tasks)):
                yield from _opened(self.runner[(epoch, t, first if t == t0 else 0, None)])
            return
        self._index.start = (epoch, t0, first)
        if t0 >= len(tasks):
            return
        for built in self.dataloader:
            yield from _opened(built)


def _opened(built: list[Built]) -> Iterator[dict[str, torch.Tensor]]:
    for b in built:
        yield b.tensors() if isinstance(b, SharedBatch) else b
