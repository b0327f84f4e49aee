"""The chunk level of an opened cache: token slots and inner chunks, decoded and checked.

Why a class of its own: the sample view (:class:`~dspark_precompute.read.reader.CacheReader`)
reads samples, but the batch assembler, the loader's prefetcher, the exports, the benchmarks
and the damage tests work in token slots and chunks. They use this class's public methods
instead of reaching into the reader.

Inner chunks are found by ``contract.chunks.ChunkSource`` (format 2 and later: a byte range
of the unit's shard, from its index, read once per shard) and decoded by ``contract.chunks``
(crc32c, header sizes, bounded buffers, and in format 3 the digest the unit's commit record
binds to that place). A chunk that is not there raises :class:`MissingChunkError` and a
damaged or misplaced one :class:`DamagedShardError`, each naming the array and the samples.
Decoded chunks go through a small LRU of bytes, and several chunks decode at once on this
object's own threads (:meth:`close` stops them).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import ArrayMeta
from dspark_precompute.contract.chunks import ChunkRef, ChunkSource
from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.layout import SampleIndex
from dspark_precompute.contract.opener import OpenedCache
from dspark_precompute.contract.spec import INPUT_IDS, LOSS_MASK, TABLES
from dspark_precompute.contract.window import released_units
from dspark_precompute.errors import DamagedShardError, MissingChunkError, ReleasedUnitError

Job = tuple[str, int]  # (array name, chunk number along the token axis)


class ChunkLRU:
    """Decoded chunks keyed by (array, chunk number), evicted least-recently-used by bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.items: OrderedDict[Job, np.ndarray] = OrderedDict()
        self.nbytes = 0

    def get(self, key: Job) -> np.ndarray | None:
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
        return hit

    def put(self, key: Job, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes or key in self.items:
            return
        self.items[key] = value
        self.nbytes += value.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.nbytes -= old.nbytes


def _named(ids: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:8]) + (f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")
    return f"samples {shown}" if len(ids) else "no samples"


class CacheChunks:
    """Token-slot and chunk reads of one opened cache, in stored sample numbers (not a view's indices).

    ``chunks.read(["input_ids"], a, b)`` gives token slots ``[a, b)`` as stored;
    ``chunks.span(s)`` says where stored sample ``s`` lies; ``decoded(jobs)`` gives whole
    inner chunks. Owned by a reader (``reader.chunks``), closed with it.
    """

    def __init__(self, opened: OpenedCache, chunk_cache_bytes: int):
        self.path: str = opened.path
        self.store, self.manifest = opened.store, opened.manifest
        self.source: ChunkSource = opened.source
        self.zstore: Any = opened.zstore  # the zarr store the shards are read through (the loader's prefetcher)
        self.chunk_tokens: int = opened.manifest.layout.chunk_tokens
        t = opened.tables
        self.sample_start, self.sample_length, self.sample_unit = t["samples/start"], t["samples/length"], \
            t["samples/unit"]
        self.unit_start, self.unit_stop = t["units/token_start"], t["units/token_stop"]
        self._metas = opened.metas
        self.lru = ChunkLRU(chunk_cache_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._where: SampleIndex | None = None

    # -- what is stored where -----------------------------------------------------------------
    @property
    def metas(self) -> Mapping[str, ArrayMeta]:
        """Every stored array's metadata (shape, chunking, dtype, sharding), read-only."""
        return MappingProxyType(self._metas)

    @property
    def token_arrays(self) -> list[str]:
        """The names of the arrays along the token axis (ids, mask, hidden states, fp8 scales)."""
        return sorted(n for n in self._metas if n not in TABLES)

    def span(self, s: int) -> tuple[int, int]:
        """Stored sample ``s``: its first token slot and its stored length."""
        return int(self.sample_start[s]), int(self.sample_length[s])

    def unit_spans(self) -> list[tuple[int, int]]:
        """Each unit's token slots ``[start, stop)`` (units are chunk-aligned; ``stop`` is its last real token)."""
        return [(int(a), int(b)) for a, b in zip(self.unit_start, self.unit_stop, strict=True)]

    def samples_in(self, lo: int, hi: int) -> np.ndarray:
        """Stored samples with a token in slots ``[lo, hi)``."""
        if self._where is None:
            self._where = SampleIndex(self.sample_start, self.sample_length)
        return self._where.in_range(lo, hi)

    def token_bytes(self, names: Sequence[str] | None = None) -> int:
        """Bytes one token slot takes, decoded, in the named arrays (each counted once; None: the ids, the mask
        and every hidden-state array, what a sample reads)."""
        if names is None:
            names = [INPUT_IDS, LOSS_MASK, *self.manifest.arrays.values()]
        return sum(int(self._metas[n].dtype.itemsize) * int(np.prod(self._metas[n].chunks[1:], dtype=np.int64))
                   for n in dict.fromkeys(names))

    # -- errors that name samples ---------------------------------------------------------------
    def _missing(self, name: str, c: int) -> MissingChunkError:
        meta = self._metas[name]
        idx, key = meta.chunk_index(c), meta.object_key(c)
        lo, hi = c * meta.chunks[0], min((c + 1) * meta.chunks[0], meta.shape[0])
        holds = self.samples_in(lo, hi)
        units = sorted({int(u) for u in self.sample_unit[holds]}) if len(holds) else []
        num_units = self.manifest.layout.num_units
        pending = [] if self.manifest.complete else sorted(set(units) - committed_units(self.store, num_units))
        where = f"chunk {idx} ({'in shard ' if meta.sharded else 'file '}{key})"
        gone = sorted(set(units) & released_units(self.store, num_units))
        if gone:  # a streamed cache's trainer released the unit: deleted on purpose (contract/window.py)
            return ReleasedUnitError(
                f"{self.path}: array {name!r} {where} was deleted on purpose: unit(s) {gone} were released by the "
                "stream's trainer (window/released/); only units not yet released can be read. Read another "
                "sample, or write the cache in full (no storage.window_units) to keep every unit.",
                unit=gone[0], array=name, chunk=idx, samples=tuple(int(i) for i in holds))
        if pending:  # slots of a unit the run has not committed: nothing is damaged
            return MissingChunkError(
                f"{self.path}: array {name!r} {where} is not written yet: it belongs to unit(s) {pending}, which have "
                "no commit record; only committed units of an incomplete cache are readable.",
                array=name, chunk=idx, samples=tuple(int(i) for i in holds))
        return MissingChunkError(
            f"{self.path}: array {name!r} {where} is missing: it holds token slots [{lo}, {hi}) of unit(s) {units}, "
            f"{_named(holds)}, which would read back as zeros. The cache is damaged: run `dspark-cache verify "
            f"--repair {self.path}` to mark the unit(s) for recomputation, then re-run the precompute command that "
            "wrote the cache (same overrides).", array=name, chunk=idx, samples=tuple(int(i) for i in holds))

    def _damaged(self, exc: DamagedShardError, jobs: Sequence[Job]) -> DamagedShardError:
        """``exc`` again, naming the samples of the shard (or of the chunks asked for)."""
        name = exc.array or (jobs[0][0] if jobs else "")
        meta = self._metas.get(name)
        if meta is not None and meta.sharded and exc.shard is not None:
            lo = exc.shard[0] * int(meta.shard_chunks or 1) * meta.chunks[0]
            holds = self.samples_in(lo, lo + int(meta.shard_chunks or 1) * meta.chunks[0])
        else:
            ct = self.chunk_tokens
            holds = np.unique(np.concatenate([self.samples_in(c * ct, (c + 1) * ct) for n, c in jobs if n == name]
                                             or [np.zeros(0, dtype=np.int64)]))
        units = sorted({int(u) for u in self.sample_unit[holds]}) if len(holds) else []
        return DamagedShardError(
            f"{self.path}: {exc}; it holds {_named(holds)} of unit(s) {units}. Nothing was decoded from it. Run "
            f"`dspark-cache verify --repair {self.path}` to mark the unit(s) for recomputation, then re-run the "
            "precompute command that wrote the cache.", array=name, shard=exc.shard,
            samples=tuple(int(i) for i in holds), checksum=exc.checksum, misplaced=exc.misplaced)

    # -- reads -----------------------------------------------------------------------------------
    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="dspark-read")
        return self._pool

    def refs(self, jobs: Sequence[Job]) -> list[ChunkRef | None]:
        """Where each chunk's stored bytes are (loading the shard indexes not in hand); None for an absent one."""
        try:
            return self.source.locate(jobs)
        except DamagedShardError as exc:
            raise self._damaged(exc, jobs) from None

    def decode(self, jobs: list[Job], raws: Sequence[bytes | None] | None = None,
               threads: bool = True) -> list[np.ndarray]:
        """Chunks decoded and checked, concurrently when there are several (and ``threads``); no LRU.

        The stored bytes are fetched together (local shards with ``pread``, remote ones with
        range requests all at once) unless given in ``raws`` (fetched ahead).
        """
        where = f"{self.path}: "
        refs: Sequence[ChunkRef | None] = [None] * len(jobs)
        if raws is None:
            refs = self.refs(jobs)
            if not self.source.local:  # remote: every range requested at once
                raws = self.fetch(refs, jobs)

        def finish(job: Job, raw: Any, ref: ChunkRef | None) -> np.ndarray:
            if raws is None:  # local: read just before decoding, so the bytes are still in the CPU's cache
                raw = self.fetch([ref], [job])[0]
            if raw is None:
                raise self._missing(job[0], job[1])
            try:
                return self.source.decode(job[0], job[1], raw, where)
            except DamagedShardError as exc:  # format 3: not the chunk its unit's record binds to this place
                raise self._damaged(exc, [job]) from None

        given = [None] * len(jobs) if raws is None else raws
        if threads and len(jobs) > 1:
            return list(self._threads().map(finish, jobs, given, refs))
        return [finish(j, r, f) for j, r, f in zip(jobs, given, refs, strict=True)]

    def fetch(self, refs: Sequence[ChunkRef | None], jobs: Sequence[Job]) -> list[Any]:
        """The located chunks' stored bytes, into recycled buffers (decoded at once, then let go)."""
        try:
            return self.source.fetch(refs, pooled=True)
        except DamagedShardError as exc:
            raise self._damaged(exc, jobs) from None

    def decoded(self, jobs: list[Job], raws: Sequence[bytes | None] | None = None,
                threads: bool = True, reuse: bool = True) -> list[np.ndarray]:
        """Chunks ``(array, chunk number)``, decoded and checked, as stored (read-only use).

        ``reuse`` takes chunks from (and keeps them in) the LRU of decoded chunks; ``raws``
        are the chunks' stored bytes when fetched ahead (then the LRU is bypassed: the bytes
        in hand are decoded). ``threads`` decodes several at once.
        """
        if raws is not None or not reuse:
            return self.decode(jobs, raws=raws, threads=threads)
        out: list[np.ndarray | None] = [self.lru.get(job) for job in jobs]
        todo = [k for k, hit in enumerate(out) if hit is None]
        for k, piece in zip(todo, self.decode([jobs[k] for k in todo], threads=threads), strict=True):
            out[k] = piece
            self.lru.put(jobs[k], piece)
        return [x for x in out if x is not None]

    def read(self, names: Sequence[str], a: int, b: int) -> dict[str, np.ndarray]:
        """Token slots ``[a, b)`` of each named token array, as stored (bf16 as uint16 bits), copied."""
        ct = self.chunk_tokens
        names = list(dict.fromkeys(names))
        unknown = [nm for nm in names if nm in TABLES or nm not in self._metas]
        if unknown:
            raise ValueError(f"{unknown} are not token arrays of {self.path}; those are {self.token_arrays}")
        total = self.manifest.layout.total_token_slots
        if not 0 <= a <= total or not 0 <= b <= total:
            raise ValueError(f"token slots [{a}, {b}) lie outside the token axis [0, {total}) of {self.path}")
        if b <= a:
            return {nm: np.zeros((0, *self._metas[nm].shape[1:]), dtype=self._metas[nm].dtype) for nm in names}
        c0, c1 = a // ct, (b - 1) // ct
        jobs = [(name, c) for name in names for c in range(c0, c1 + 1)]
        chunks = dict(zip(jobs, self.decoded(jobs), strict=True))
        out: dict[str, np.ndarray] = {}
        for name in names:
            parts = [chunks[(name, c)][max(a, c * ct) - c * ct:min(b, (c + 1) * ct) - c * ct]
                     for c in range(c0, c1 + 1)]
            out[name] = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        return out

    def close(self) -> None:
        """Stop the decode threads and close the shard files (reads still work: both come back)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.source.forget()

    def release(self) -> None:
        """Like :meth:`close`, without waiting for running decodes (a garbage-collected reader)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
