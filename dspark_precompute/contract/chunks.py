"""Reading stored chunks: find their bytes, fetch them, check the crc32c and the codec header, decode.

Only this module turns stored bytes into arrays (readers and ``verify`` both call it), so
every chunk read anywhere is checksummed, bounded by the array's chunk size, and an absent
chunk is reported (``None``) instead of silently read as zeros.

:class:`ChunkSource` finds an inner chunk's bytes: in format 2 a byte range of its shard,
from the shard's index (read once, checked by :func:`~dspark_precompute.contract.shards.parse_index`,
kept); in format 1 a whole object per chunk. Local shards are read with ``pread`` on kept
file handles, remote ones with range requests, many at once. In format 3 every shard is also
checked against what its unit's commit record binds to its place
(:class:`~dspark_precompute.contract.binding.Binder`): its index when loaded, each chunk when
decoded (:meth:`ChunkSource.decode`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import ArrayMeta, array_meta_problems, compressed_size_problem, expected_arrays
from dspark_precompute.contract.binding import Binder, BindingProblem
from dspark_precompute.contract.fp8 import scale_problem
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.shards import ShardIndexProblem, index_nbytes, parse_index
from dspark_precompute.contract.spec import (
    FORMAT_NAME,
    GROUPS,
    IMAGE_GROUP,
    MANIFEST,
    MAX_RECORD_BYTES,
    SCALE_GROUP,
    VIDEO_GROUP,
)
from dspark_precompute.contract.store import CacheStore, open_regular
from dspark_precompute.errors import CacheFormatError, ChecksumError, DamagedShardError, NotRegularFileError

MAX_JSON_BYTES = 1 << 20  # an array's zarr.json is a few hundred bytes


_NOT_A_FILE = (FileNotFoundError, NotADirectoryError, IsADirectoryError, NotRegularFileError)


def _absent_or_raise(exc: OSError) -> None:
    """Return (the entry counts as absent) for a missing entry, a dangling or looping symlink, or something
    that is not a file (a directory, a FIFO that would block a read forever); re-raise anything else."""
    if not (isinstance(exc, _NOT_A_FILE) or exc.errno == errno.ELOOP):
        raise exc


def read_file(path: Path, limit: int) -> bytes | None:
    """A file's bytes, at most ``limit + 1`` of them (more means it is too large); None if absent or not a file."""
    try:
        with open_regular(path) as fh:  # unbuffered: one read straight into the bytes object
            size = os.fstat(fh.fileno()).st_size
            return fh.read(min(size, limit + 1))
    except OSError as exc:
        _absent_or_raise(exc)
        return None


def get_many(store: CacheStore, zstore: Any, keys: list[str], limits: list[int]) -> list[bytes | None]:
    """Objects ``keys`` of a cache (None for absent ones), at most ``limit + 1`` bytes each, fetched together
    (locally one after the other, never allocating more than a file holds)."""
    if zstore is None:
        root = Path(store.root)
        return [read_file(root / k, lim) for k, lim in zip(keys, limits)]
    return get_ranges(store, zstore, [(k, 0, lim + 1) for k, lim in zip(keys, limits)])


def get_ranges(store: CacheStore, zstore: Any, ranges: Sequence[tuple[str, int, int]]) -> list[bytes | None]:
    """Bytes ``[start, stop)`` of each ``(key, start, stop)`` (fewer at an object's end; None for an absent
    object), locally one after the other, remotely all requests at once on zarr's event loop."""
    if zstore is None:
        root = Path(store.root)
        return [_read_range(root / k, a, b) for k, a, b in ranges]
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    proto = default_buffer_prototype()

    async def one(key: str, a: int, b: int) -> bytes | None:
        got = await zstore.get(key, proto, byte_range=RangeByteRequest(a, b))
        return None if got is None else got.to_bytes()

    async def gather() -> list[bytes | None]:
        return list(await asyncio.gather(*(one(k, a, b) for k, a, b in ranges)))

    return sync(gather())


def _read_range(path: Path, a: int, b: int) -> bytes | None:
    try:
        with open_regular(path) as fh:
            return os.pread(fh.fileno(), max(0, b - a), a)
    except OSError as exc:
        _absent_or_raise(exc)
        return None


@dataclass(frozen=True)
class ChunkRef:
    """Where one inner chunk's stored bytes are: ``[start, stop)`` of object ``key`` (relative to the cache).

    ``exact``: the range is the chunk (format 2, from its shard's index), so fewer bytes mean a
    shard cut short; otherwise it is a bound on a whole object (format 1: the chunk's own object,
    read up to one byte past the largest a chunk can be).
    """

    key: str
    start: int
    stop: int
    exact: bool

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class _Handles:
    """Open read handles of local shard files, the most recently used kept (``pread`` is thread-safe).

    An evicted handle is only forgotten, never closed here: a thread still reading through it
    holds a reference, and the file closes when the last one goes.
    """

    def __init__(self, root: Path, limit: int):
        self.root, self.limit = root, int(limit)
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            fh = self._open.get(key)
            if fh is not None:
                self._open.move_to_end(key)
                return fh
        fh = open_regular(self.root / key)  # FileNotFoundError, NotRegularFileError: the caller's to report
        with self._lock:
            self._open[key] = fh
            while len(self._open) > self.limit:
                self._open.popitem(last=False)
        return fh

    def forget(self, key: str) -> None:
        with self._lock:
            self._open.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._open.clear()


class BufferPool:
    """Recycled byte buffers for chunk reads and decodes: fresh memory is the read path's hidden cost.

    A new buffer of a chunk's size (about 1 MiB) is fresh pages from the kernel, each a fault
    and a zeroing (measured on a 200-row cache: an epoch's loader CPU fell from 14.9 to 12.8
    us per token with glibc told to keep such buffers). :meth:`take` hands out a view of a
    kept buffer that nothing references any more (its reference count says so: a decoded
    chunk, or any view of it, still held by a caller keeps its buffer out of reuse), else a
    fresh one, kept while the pool holds under ``max_bytes``.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._kept: dict[int, list[np.ndarray]] = {}
        self._next: dict[int, int] = {}  # where the next search starts: after the buffer handed out last
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """``n`` writable uint8 bytes (contents undefined)."""
        size = 1 << max(12, (max(1, n) - 1).bit_length())  # size classes: powers of two from a page
        with self._lock:
            kept = self._kept.setdefault(size, [])
            start = self._next.get(size, 0)
            for j in range(len(kept)):
                k = (start + j) % len(kept)
                if sys.getrefcount(kept[k]) == 2:  # the list's reference and the call's: free
                    self._next[size] = k + 1
                    return kept[k][:n]
            buf = np.empty(size, dtype=np.uint8)
            if self.nbytes + size <= self.max_bytes:
                kept.append(buf)
                self.nbytes += size
        return buf[:n]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._next.clear()
            self.nbytes = 0


class ChunkSource:
    """Finds and fetches the stored bytes of inner chunks ``(array, chunk number)`` of one cache.

    Format 2 token arrays: the chunk's byte range in its shard, from the shard's index (read
    once per shard, checked, kept up to ``max_indexes``); a shard object that does not exist
    makes each of its chunks absent (None), a damaged one raises
    :class:`~dspark_precompute.errors.DamagedShardError` (array and shard named; the caller adds
    the samples). Format 1 arrays and the tables: one object per chunk. ``bound`` (format 3):
    each shard is checked against its unit's record too, and one that disagrees is a
    :class:`~dspark_precompute.errors.DamagedShardError` with ``misplaced`` set.
    """

    def __init__(self, store: CacheStore, metas: dict[str, ArrayMeta], zstore: Any = None,
                 max_indexes: int = 1 << 16, max_files: int = 64, bound: bool = False):
        self.store, self.metas, self.zstore = store, metas, zstore
        self.binder = Binder(store, lambda keys: get_many(store, zstore, keys, [MAX_RECORD_BYTES] * len(keys))) \
            if bound else None
        self._indexes: OrderedDict[tuple[str, int], np.ndarray | None] = OrderedDict()
        self._max_indexes = int(max_indexes)
        self._lock = threading.Lock()
        self._files = None if store.url else _Handles(Path(store.root), max_files)
        self.index_reads = 0  # shard indexes fetched (for tests and benchmarks)
        self.buffers = BufferPool()

    @property
    def local(self) -> bool:
        """Whether the shards are local files (read with ``pread``), not objects behind a URL."""
        return self._files is not None

    # -- finding ----------------------------------------------------------------------------
    def locate(self, jobs: Sequence[tuple[str, int]]) -> list[ChunkRef | None]:
        """Where each chunk is (None: absent), loading the shard indexes not yet in hand (together)."""
        need = sorted({(n, c // int(self.metas[n].shard_chunks or 1)) for n, c in jobs
                       if self.metas[n].sharded} - self._indexes.keys())
        if need:
            self._load_indexes(need)
        out: list[ChunkRef | None] = []
        for name, c in jobs:
            meta = self.metas[name]
            if not meta.sharded:
                out.append(ChunkRef(meta.object_key(c), 0, meta.max_stored_bytes() + 1, False))
                continue
            per = int(meta.shard_chunks or 1)
            table = self._index(name, c // per)
            if table is None or table[c % per, 0] < 0:
                out.append(None)
                continue
            a, n = int(table[c % per, 0]), int(table[c % per, 1])
            out.append(ChunkRef(meta.object_key(c), a, a + n, True))
        return out

    def shard_index(self, name: str, shard: int) -> np.ndarray | None:
        """Shard ``shard`` of array ``name``: its checked index (``[n, 2]`` offset, nbytes; -1 for absent chunks),
        or None when the shard object does not exist."""
        return self._index(name, shard)

    def _index(self, name: str, shard: int) -> np.ndarray | None:
        with self._lock:
            if (name, shard) in self._indexes:
                self._indexes.move_to_end((name, shard))
                return self._indexes[(name, shard)]
        return self._load_indexes([(name, shard)])[(name, shard)]

    def _load_indexes(self, shards: list[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray | None]:
        found: dict[tuple[str, int], np.ndarray | None] = {}
        ranges, todo = [], []
        for name, j in shards:
            size = self._object_size(name, j)
            if size is None:
                found[(name, j)] = None
                continue
            want = index_nbytes(int(self.metas[name].shard_chunks or 1))
            ranges.append((self._shard_key(name, j), max(0, size - want), size))
            todo.append((name, j, size))
        units = self.binder.missing([j for _, j, _ in todo]) if self.binder is not None else []
        remote = self.zstore is not None
        if remote:  # the records in the same round of requests as the indexes
            ranges += [(Binder.key(u), 0, MAX_RECORD_BYTES + 1) for u in units]
        got = get_ranges(self.store, self.zstore, ranges) if ranges else []
        self.index_reads += len(todo)
        if self.binder is not None and units:
            self.binder.take(units, got[len(todo):] if remote else self.binder.read([Binder.key(u) for u in units]))
        for (name, j, size), raw in zip(todo, got):
            meta = self.metas[name]
            per = int(meta.shard_chunks or 1)
            if raw is None:  # removed since its size was read
                found[(name, j)] = None
                continue
            try:
                found[(name, j)] = index = parse_index(raw, per, size, meta.max_stored_bytes())
                if self.binder is not None:
                    self.binder.check_index(name, j, bytes(raw[-4:]), int((index[:, 0] >= 0).sum()))
            except (ShardIndexProblem, BindingProblem) as exc:
                raise self._damaged(name, j, str(exc), checksum=getattr(exc, "checksum", False),
                                    misplaced=isinstance(exc, BindingProblem)) from None
        for key, table in found.items():
            self._keep(key, table)
        return found

    def _damaged(self, name: str, shard: int, why: str, checksum: bool = False, misplaced: bool = False
                 ) -> DamagedShardError:
        meta = self.metas[name]
        where = meta.object_index(shard * int(meta.shard_chunks or 1))
        return DamagedShardError(f"array {name!r} shard {where} (object {self._shard_key(name, shard)}) {why}",
                                 array=name, shard=where, checksum=checksum, misplaced=misplaced)

    def _keep(self, key: tuple[str, int], table: np.ndarray | None) -> None:
        with self._lock:
            self._indexes[key] = table
            while len(self._indexes) > self._max_indexes:
                self._indexes.popitem(last=False)

    def _shard_key(self, name: str, shard: int) -> str:
        meta = self.metas[name]
        return meta.object_key(shard * int(meta.shard_chunks or 1))

    def _object_size(self, name: str, shard: int) -> int | None:
        """The shard object's size; None when it does not exist (a dangling symlink included). Something else
        in its place (a directory, a FIFO, a device, a symlink loop, an unreadable file) is a damaged shard."""
        key = self._shard_key(name, shard)
        if self._files is None:
            return self.store.size(key)
        try:
            return os.fstat(self._files.get(key).fileno()).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            meta = self.metas[name]
            where = meta.object_index(shard * int(meta.shard_chunks or 1))
            raise DamagedShardError(f"array {name!r} shard {where} (object {key}) cannot be read as a shard: "
                                    + (f"it is {exc.kind}, not a file" if isinstance(exc, NotRegularFileError)
                                       else str(exc.strerror or exc)), array=name, shard=where) from None

    # -- fetching ---------------------------------------------------------------------------
    def fetch(self, refs: Sequence[ChunkRef | None], pooled: bool = False) -> list[Any]:
        """The stored bytes of each located chunk (None for an absent one or a format 1 object not there).

        ``pooled``: local chunks are read into recycled buffers (:class:`BufferPool`) and come
        as uint8 arrays, for a caller that decodes them at once and lets them go.
        """
        live = [(k, r) for k, r in enumerate(refs) if r is not None]
        out: list[Any] = [None] * len(refs)
        if self._files is None:
            got = get_ranges(self.store, self.zstore, [(r.key, r.start, r.stop) for _, r in live])
        else:
            got = [self._pread(r, pooled) for _, r in live]
        for (k, r), raw in zip(live, got):
            if r.exact and (raw is None or len(raw) != r.nbytes):
                name = r.key.rsplit("/", 1)[0]
                raise DamagedShardError(f"array {name!r} object {r.key} is cut short: bytes [{r.start:,}, "
                                        f"{r.stop:,}) named by its index are not all there (truncated or replaced "
                                        "after its index was read)", array=name)
            out[k] = raw
        return out

    def _pread(self, ref: ChunkRef, pooled: bool = False) -> Any:
        assert self._files is not None
        if not ref.exact:
            return read_file(self._files.root / ref.key, ref.stop - 1)
        try:
            fh = self._files.get(ref.key)
        except OSError as exc:  # replaced since its index was read: fetch() reports the shard cut short
            _absent_or_raise(exc)
            return None
        if not pooled:
            return os.pread(fh.fileno(), ref.nbytes, ref.start)
        buf = self.buffers.take(ref.nbytes)
        return buf[:os.preadv(fh.fileno(), [buf.data], ref.start)]  # fewer bytes: fetch() reports the shard cut short

    def read(self, jobs: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """Located and fetched: each chunk's stored bytes, None for an absent one."""
        return self.fetch(self.locate(jobs))

    # -- decoding ---------------------------------------------------------------------------
    def decode(self, name: str, c: int, raw: Any, where: str = "") -> np.ndarray:
        """Inner chunk ``c`` of array ``name`` from its stored bytes (:func:`decode_chunk`, into a recycled
        buffer), in format 3 after checking that it is the chunk its unit's record binds to that place in its
        shard."""
        meta = self.metas[name]
        bound = partial(self._check_chunk, name, c) if self.binder is not None and meta.sharded else None
        out = None if meta.compressor is None else self.buffers.take(meta.chunk_nbytes)
        return decode_chunk(meta, meta.chunk_index(c), raw, where, bound, out)

    def _check_chunk(self, name: str, c: int, crc: bytes) -> None:
        assert self.binder is not None
        unit, k = divmod(c, int(self.metas[name].shard_chunks or 1))
        index = self._index(name, unit)  # kept since the chunk was located (its crc32c already bound to the record)
        rank = k if index is None else int(np.count_nonzero(index[:k, 0] >= 0))  # its place among present chunks
        try:
            self.binder.check_chunk(name, unit, k, rank, crc)
        except BindingProblem as exc:
            raise self._damaged(name, unit, str(exc), misplaced=True) from None

    def forget(self) -> None:
        """Drop every kept index, record and file handle (the cache was rewritten or repaired under us)."""
        with self._lock:
            self._indexes.clear()
        if self.binder is not None:
            self.binder.forget()
        if self._files is not None:
            self._files.clear()

    def close(self) -> None:
        self.forget()


_CODECS: dict[str, Any] = {}


def _codec(name: str) -> Any:
    """One numcodecs decoder per compressor (decoding keeps no state: shared by the decode threads)."""
    if name not in _CODECS:
        from numcodecs import Blosc, Zstd

        _CODECS[name] = Blosc() if name == "blosc" else Zstd()
    return _CODECS[name]


def decode_chunk(meta: ArrayMeta, idx: tuple[int, ...], raw: Any, where: str = "",
                 bound: Callable[[bytes], None] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """One stored chunk (bytes or a uint8 array) -> its array of ``meta.chunks``: crc32c checked, header sizes
    checked, bounded; decompressed into ``out`` (``meta.chunk_nbytes`` uint8) when given.

    ``bound`` is given the chunk's stored crc32c once it matches the bytes, and raises when it is
    not the one recorded for the chunk's place (:meth:`ChunkSource.decode`).
    Raises :class:`ChecksumError` when the crc32c does not match and :class:`CacheFormatError`
    when the chunk is larger than the array's chunks can be or its codec header declares
    another size than the chunk's (it is then never decompressed), or when a chunk of an fp8
    scale array holds a scale that is not finite and positive (even one written with a valid
    checksum: every row of a written scale chunk is, unwritten ones hold 1).
    """
    import google_crc32c

    name = meta.name
    key = f"in shard {meta.object_key(idx[0])}" if meta.sharded else f"file {meta.object_key(idx[0])}"
    if len(raw) > meta.max_stored_bytes():
        raise CacheFormatError(f"{where}array {name!r} chunk {idx} ({key}) is larger than any chunk of this "
                               f"array can be ({meta.max_stored_bytes():,} bytes); it was not written by this tool. "
                               "Re-create the cache")
    buf = np.frombuffer(raw, dtype=np.uint8)
    body = buf[:-4]
    if len(raw) < 4 or int(google_crc32c.value(body)).to_bytes(4, "little") != bytes(buf[-4:]):
        raise ChecksumError(name, idx, "Stored and computed checksum do not match")
    if bound is not None:
        bound(bytes(buf[-4:]))
    expected = meta.chunk_nbytes
    problem = compressed_size_problem(meta.compressor, body, expected)
    if problem:
        raise CacheFormatError(f"{where}array {name!r} chunk {idx} ({key}) {problem}; it is not decoded. The "
                               "chunk was altered or not written by this tool: re-create the cache")
    if meta.compressor is None:
        data = body
    else:
        data = np.empty(expected, dtype=np.uint8) if out is None else out
        try:
            _codec(meta.compressor).decode(body, out=data)
        except Exception as exc:  # the codec's own error types
            raise CacheFormatError(f"{where}array {name!r} chunk {idx} ({key}) cannot be decompressed "
                                   f"({type(exc).__name__}: {exc}); re-create the cache") from None
    out = data.view(meta.dtype).reshape(meta.chunks)
    if meta.positive:
        problem = scale_problem(out)
        if problem:
            raise CacheFormatError(f"{where}array {name!r} chunk {idx} ({key}) {problem}. The scales were "
                                   "altered or not written by this tool: re-create the cache (or run `dspark-cache "
                                   "verify --repair` and re-run the precompute command)")
    return out


def read_array_metas(store: CacheStore, m: Manifest, zstore: Any = None
                     ) -> tuple[dict[str, ArrayMeta], list[tuple[str, str]]]:
    """Every array's zarr.json, checked against the manifest: (parsed metas, [(array, problem)]).

    Read as plain JSON, never handed to zarr, so an unknown codec is named here instead
    of surfacing as zarr's own error.
    """
    want = expected_arrays(m)
    names = list(want)
    blobs = get_many(store, zstore, [f"{n}/zarr.json" for n in names], [MAX_JSON_BYTES] * len(names))
    metas: dict[str, ArrayMeta] = {}
    problems: list[tuple[str, str]] = []
    for name, blob in zip(names, blobs):
        if blob is None:
            problems.append((name, f"array {name!r} is missing (no {name}/zarr.json)"))
            continue
        try:
            if len(blob) > MAX_JSON_BYTES:
                raise ValueError(f"{len(blob):,}+ bytes")
            meta = json.loads(blob)
        except ValueError as exc:
            problems.append((name, f"array {name!r}: {name}/zarr.json is not valid JSON ({exc})"))
            continue
        parsed, found = array_meta_problems(name, meta, want[name])
        problems.extend((name, p) for p in found)
        if parsed is not None:
            metas[name] = parsed
    return metas, problems


def group_problems(store: CacheStore, m: Manifest, zstore: Any = None) -> list[str]:
    """The cache's zarr groups against the manifest: the root group's attributes name the format, the manifest's
    ``format_version`` and the manifest file; ``samples``, ``units``, ``hidden_states`` (and ``hidden_scales``
    with an fp8 array; ``images`` in an image cache) are groups. A reader of this package goes by the manifest; plain
    zarr starts here."""
    names = ["", *(g for g in GROUPS if g != SCALE_GROUP or m.scale_arrays), *([IMAGE_GROUP] if m.media else []),
             *([VIDEO_GROUP] if m.media and m.media.videos else [])]
    keys = [f"{g}/zarr.json" if g else "zarr.json" for g in names]
    problems = []
    for g, key, blob in zip(names, keys, get_many(store, zstore, keys, [MAX_JSON_BYTES] * len(keys))):
        where = f"the group {g or 'at the root'} ({key})"
        if blob is None:
            problems.append(f"{where} is missing: zarr cannot open the cache without it")
            continue
        try:
            meta: Any = json.loads(blob) if len(blob) <= MAX_JSON_BYTES else None
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
            problems.append(f"{where} is not zarr v3 group metadata")
            continue
        if not g:
            attrs = meta["attributes"] if isinstance(meta.get("attributes"), dict) else {}
            want = {"format": FORMAT_NAME, "format_version": m.format_version, "manifest": MANIFEST}
            problems += [f"{where} has attribute {k}={attrs.get(k)!r:.60}, the manifest implies {v!r}"
                         for k, v in want.items() if attrs.get(k) != v or type(attrs.get(k)) is not type(v)]
    return problems


def read_slots(source: ChunkSource, names: list[str], a: int, b: int) -> dict[str, np.ndarray]:
    """Token slots ``[a, b)`` of each named array, decoded chunk by chunk (no reuse, no threads).

    For tools that read a few samples or whole tables (resume, ``verify --recompute``); the
    reader has its own concurrent, cached path. An absent chunk raises :class:`CacheFormatError`.
    """
    out: dict[str, np.ndarray] = {}
    for name in names:
        meta = source.metas[name]
        ct = meta.chunks[0]
        jobs = [(name, c) for c in range(a // ct, -(-b // ct) if b > a else a // ct)]
        parts = []
        for (_, c), raw in zip(jobs, source.read(jobs)):
            if raw is None:
                raise CacheFormatError(f"{source.store.path}: array {name!r} chunk {c} is missing "
                                       f"({meta.object_key(c)})")
            data = source.decode(name, c, raw)
            parts.append(data[max(a, c * ct) - c * ct:min(b, (c + 1) * ct) - c * ct])
        out[name] = np.concatenate(parts) if parts else np.zeros((0, *meta.shape[1:]), dtype=meta.dtype)
    return out
