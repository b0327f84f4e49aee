"""Read a cache: ``open_cache(path)[i]`` -> one sample's tensors, no padding.

Depends only on the format module, the store, zarr, numpy and torch (never on
transformers), so training jobs and notebooks can read caches without the target.

Opening checks what is cheap and already in hand before anything is read: the manifest's
fields (``format.manifest_problems``), every array's zarr.json against the manifest
(``format.array_meta_problems``: dtype, shape, chunks, layer id, a codec chain the writer
writes) and the sample/unit tables against the layout (``format.table_problems``). A
cache that fails any of them is refused with a :class:`CacheFormatError` listing every
problem, so nothing sized by a crafted value is ever allocated.

Array data is read by this module alone, one whole chunk at a time: the chunk's bytes
come straight from its file (local caches) or through the zarr store (fsspec URLs), its
crc32c is checked, its codec header must declare exactly the chunk's size, and it is
decompressed into a buffer of that size. A chunk that is not there raises
:class:`MissingChunkError` (zarr would return zeros): the writer writes every chunk of a
committed unit and of the tables, so an absent one is damage. Decoded chunks go through a
small LRU: a sample only touches the chunks that hold its tokens, neighbouring samples
(disk order is longest-first within a unit) reuse them, and one sample's chunks are
decoded concurrently.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute import format as fmt
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError, MissingChunkError
from dspark_precompute.progress import human_bytes
from dspark_precompute.store import CacheStore

log = logging.getLogger(__name__)

_CRC_RE = re.compile(r"checksum", re.IGNORECASE)
_COMMIT_RE = re.compile(r"^u(\d{1,12})\.json$")
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
DEFAULT_CHUNK_CACHE_BYTES = 64 << 20
TABLES = (*fmt.SAMPLE_ARRAYS, *fmt.UNIT_ARRAYS)
_MAX_JSON_BYTES = 1 << 20  # an array's zarr.json is a few hundred bytes
_MASK_WINDOW = 1 << 22  # loss_mask tokens read at a time when counting supervised tokens


def is_checksum_error(exc: BaseException) -> bool:
    """zarr's crc32c codec raises a plain ValueError; recognise it by its message."""
    return isinstance(exc, ValueError) and bool(_CRC_RE.search(str(exc)))


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly (bf16 is the top half of a float32)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def to_torch(a: np.ndarray, storage_dtype: str) -> torch.Tensor:
    """A stored hidden-state array as a tensor of its logical dtype (bf16 bits viewed back)."""
    a = np.ascontiguousarray(a)
    if fmt.STORAGE_DTYPES[storage_dtype][1] == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """A decode pool for this process (a forked DataLoader worker gets its own)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="dspark-read")
    return _POOLS[pid]


# -- chunk bytes and their decoding -------------------------------------------------------------
@dataclass(frozen=True)
class _FastArray:
    """A local array whose chunk files are read straight from disk (no zarr machinery per call)."""

    root: Path
    meta: fmt.ArrayMeta


def _fast_array(meta: fmt.ArrayMeta, root: Path) -> _FastArray | None:
    """The direct file reader for a local array (every checked array has the writer's codec chain)."""
    return _FastArray(root, meta)


def _read_file(path: Path, limit: int) -> bytes | None:
    """A file's bytes, at most ``limit + 1`` of them (more means it is too large); None if absent."""
    try:
        with open(path, "rb", buffering=0) as fh:  # unbuffered: one read straight into the bytes object
            size = os.fstat(fh.fileno()).st_size
            return fh.read(min(size, limit + 1))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _get_many(store: CacheStore, zstore: Any, keys: list[str], limits: list[int]) -> list[bytes | None]:
    """Objects ``keys`` of a cache (None for absent ones), at most ``limit + 1`` bytes each, fetched together."""
    if zstore is None:
        root = Path(store.root)
        return [_read_file(root / k, lim) for k, lim in zip(keys, limits)]
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    proto = default_buffer_prototype()

    async def one(key: str, lim: int) -> bytes | None:
        got = await zstore.get(key, proto, byte_range=RangeByteRequest(0, lim + 1))
        return None if got is None else got.to_bytes()

    async def gather() -> list[bytes | None]:
        return list(await asyncio.gather(*(one(k, lim) for k, lim in zip(keys, limits))))

    return sync(gather())


_CODECS: dict[str, Any] = {}


def _codec(name: str) -> Any:
    """One numcodecs decoder per compressor (decoding keeps no state: shared by the decode threads)."""
    if name not in _CODECS:
        from numcodecs import Blosc, Zstd

        _CODECS[name] = Blosc() if name == "blosc" else Zstd()
    return _CODECS[name]


def decode_chunk(meta: fmt.ArrayMeta, idx: tuple[int, ...], raw: bytes, where: str = "") -> np.ndarray:
    """One stored chunk -> its array of ``meta.chunks``: crc32c checked, header sizes checked, bounded.

    Raises :class:`ChecksumError` when the crc32c does not match and :class:`CacheFormatError`
    when the chunk is larger than the array's chunks can be or its codec header declares
    another size than the chunk's (it is then never decompressed).
    """
    import google_crc32c

    name = meta.name
    key = f"{name}/{meta.chunk_key(idx)}"
    if len(raw) > meta.max_stored_bytes():
        raise CacheFormatError(f"{where}array {name!r} chunk {idx} (file {key}) is larger than any chunk of this "
                               f"array can be ({meta.max_stored_bytes():,} bytes); it was not written by this tool. "
                               "Re-create the cache")
    buf = np.frombuffer(raw, dtype=np.uint8)
    body = buf[:-4]
    if len(raw) < 4 or int(google_crc32c.value(body)).to_bytes(4, "little") != raw[-4:]:
        raise ChecksumError(name, idx, "Stored and computed checksum do not match")
    expected = meta.chunk_nbytes
    problem = fmt.compressed_size_problem(meta.compressor, body, expected)
    if problem:
        raise CacheFormatError(f"{where}array {name!r} chunk {idx} (file {key}) {problem}; it is not decoded. The "
                               "chunk was altered or not written by this tool: re-create the cache")
    if meta.compressor is None:
        data = body
    else:
        data = np.empty(expected, dtype=np.uint8)
        try:
            _codec(meta.compressor).decode(body, out=data)
        except Exception as exc:  # the codec's own error types
            raise CacheFormatError(f"{where}array {name!r} chunk {idx} (file {key}) cannot be decompressed "
                                   f"({type(exc).__name__}: {exc}); re-create the cache") from None
    return data.view(meta.dtype).reshape(meta.chunks)


def read_array_metas(store: CacheStore, manifest: dict[str, Any], zstore: Any = None
                     ) -> tuple[dict[str, fmt.ArrayMeta], list[tuple[str, str]]]:
    """Every array's zarr.json, checked against the manifest: (parsed metas, [(array, problem)]).

    Read as plain JSON, never handed to zarr, so an unknown codec is named here instead
    of surfacing as zarr's own error.
    """
    want = fmt.expected_arrays(manifest)
    names = list(want)
    blobs = _get_many(store, zstore, [f"{n}/zarr.json" for n in names], [_MAX_JSON_BYTES] * len(names))
    metas: dict[str, fmt.ArrayMeta] = {}
    problems: list[tuple[str, str]] = []
    for name, blob in zip(names, blobs):
        if blob is None:
            problems.append((name, f"array {name!r} is missing (no {name}/zarr.json)"))
            continue
        try:
            if len(blob) > _MAX_JSON_BYTES:
                raise ValueError(f"{len(blob):,}+ bytes")
            meta = json.loads(blob)
        except ValueError as exc:
            problems.append((name, f"array {name!r}: {name}/zarr.json is not valid JSON ({exc})"))
            continue
        parsed, found = fmt.array_meta_problems(name, meta, want[name])
        problems.extend((name, p) for p in found)
        if parsed is not None:
            metas[name] = parsed
    return metas, problems


def load_manifest(store: CacheStore) -> dict[str, Any]:
    """The manifest, checked by ``format.manifest_problems``; raises :class:`CacheFormatError` listing problems."""
    path = store.path
    if not store.exists(fmt.MANIFEST):
        raise CacheFormatError(
            f"{path}: no {fmt.MANIFEST}; this is not a dspark-precompute cache (or its run never "
            "started). Point open_cache at the storage.path of a precompute run."
        )
    try:
        manifest = json.loads(store.read_bytes(fmt.MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{path}/{fmt.MANIFEST} is not valid JSON ({exc}); re-run the precompute "
                               "job with overwrite=true to rewrite the cache") from exc
    problems = fmt.manifest_problems(manifest)
    if problems:
        raise CacheFormatError(_listing(f"{path}: {fmt.MANIFEST} is invalid", problems,
                                        "The manifest was altered or is damaged: re-create the cache (re-run the "
                                        "precompute command with overwrite=true)."))
    return manifest


def _listing(head: str, problems: Sequence[str], tail: str) -> str:
    if len(problems) == 1:
        return f"{head}: {problems[0]}. {tail}"
    return f"{head} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{tail}"


def weights_sha256(store: CacheStore) -> str:
    """sha256 of the stored weights file, streamed for a local cache."""
    h = hashlib.sha256()
    if store.url:
        h.update(store.read_bytes(fmt.WEIGHTS))
    else:
        with open(Path(store.root) / fmt.WEIGHTS, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


class _ChunkLRU:
    """Decoded chunks keyed by (array, chunk index), evicted least-recently-used by bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.items: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self.nbytes = 0

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
        return hit

    def put(self, key: tuple[str, int], value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes or key in self.items:
            return
        self.items[key] = value
        self.nbytes += value.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.nbytes -= old.nbytes


class Cache:
    """A read-only view of one cache (``len``, ``c[i]``, ``c[a:b]``, ``c[[i, j]]``).

    Index ``i`` is the i-th *readable* sample: every sample of a complete cache, in input
    order; for an incomplete cache opened with ``allow_incomplete=True``, the samples of
    committed units only (``c.indices[i]`` is then its id in the full cache).
    """

    def __init__(self, path: str | Path, allow_incomplete: bool = False,
                 chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES):
        self.store = CacheStore(str(path))
        self.path = self.store.path
        self.allow_incomplete = bool(allow_incomplete)
        self._zstore: Any = None
        self._group: Any = None
        self.manifest: dict[str, Any] = load_manifest(self.store)
        self.complete = bool(self.manifest["complete"])
        committed = self._committed_units()
        if not self.complete and not allow_incomplete:
            raise IncompleteCacheError(
                f"{path} is incomplete ({len(committed)}/{self.num_units} units committed): the precompute run "
                "has not finished. Re-run it with the same command to finish, or open_cache(..., "
                "allow_incomplete=True) to read the committed samples only."
            )
        self.layer_ids: list[int] = [int(x) for x in self.manifest["layer_ids"]]
        self.hidden_size = int(self.manifest["hidden_size"])
        self.storage_dtype: str = self.manifest["storage_dtype"]
        self.logical_dtype = fmt.STORAGE_DTYPES[self.storage_dtype][1]
        self.torch_dtype = TORCH_DTYPES[self.storage_dtype]
        self.seq_length = int(self.manifest["seq_length"])
        self.chunk_tokens = int(self.manifest["layout"]["chunk_tokens"])
        self._names: dict[str, str] = dict(self.manifest["arrays"])
        self._fast: dict[str, _FastArray | None] = {}
        self._lru = _ChunkLRU(chunk_cache_bytes)
        self._where: fmt.SampleIndex | None = None
        metas, problems = read_array_metas(self.store, self.manifest, self._zarr_store() if self.store.url else None)
        if problems:
            raise CacheFormatError(_listing(f"{self.path}: the arrays disagree with the manifest",
                                            [p for _, p in problems],
                                            f"Run `dspark-cache verify {self.path}` for a full report; re-create the "
                                            "cache (re-run the precompute command with overwrite=true)."))
        self._metas = metas
        tables = self._read_tables()
        problems = fmt.table_problems(self.manifest, tables)
        if problems:
            raise CacheFormatError(_listing(f"{self.path}: the sample/unit tables disagree with the layout", problems,
                                            "Samples would be read from the wrong tokens, so the cache is refused. "
                                            f"Run `dspark-cache verify {self.path}` for a full report; re-create the "
                                            "cache (re-run the precompute command with overwrite=true)."))
        self._start = tables["samples/start"]
        self._length = tables["samples/length"]
        self._source_row = tables["samples/source_row"]
        self._unit = tables["samples/unit"]
        self._untruncated = tables["samples/untruncated_length"]
        self._unit_start = tables["units/token_start"]
        self._unit_stop = tables["units/token_stop"]
        if self.complete:
            self.indices = np.arange(len(self._start), dtype=np.int64)
        else:
            self.indices = np.flatnonzero(np.isin(self._unit, sorted(committed))).astype(np.int64)
        self._supervised: np.ndarray | None = None

    # -- metadata --------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return int(self.manifest["layout"]["num_units"])

    @property
    def pad_token_id(self) -> int:
        """The id NeMo pads with: the tokenizer's pad token, else its eos token, else 0."""
        for key in ("pad_token_id", "eos_token_id"):
            if self.manifest.get(key) is not None:
                return int(self.manifest[key])
        return 0

    @property
    def source_row(self) -> np.ndarray:
        """Row of the input selection each readable sample came from."""
        return self._source_row[self.indices]

    @property
    def array_names(self) -> dict[str, str]:
        """Layer id (as a string, plus ``"last"``) -> zarr array name."""
        return dict(self._names)

    @property
    def group(self) -> Any:
        """The cache as a zarr group (read-only), for inspection with zarr's own API."""
        if self._group is None:
            import zarr

            self._group = zarr.open_group(self._zarr_store(), mode="r")
        return self._group

    def _zarr_store(self) -> Any:
        if self._zstore is None:
            self._zstore = self.store.zarr_store(read_only=True)
        return self._zstore

    def _committed_units(self) -> set[int]:
        """Units with a commit record (file names that are not ``u<digits>.json`` are ignored)."""
        out = set()
        for k in self.store.list_keys(fmt.COMMITS):
            m = _COMMIT_RE.match(k.rsplit("/", 1)[-1])
            if m and int(m.group(1)) < self.num_units:
                out.add(int(m.group(1)))
        return out

    # -- low-level reads -------------------------------------------------------------------
    def _fast_spec(self, name: str) -> _FastArray | None:
        """The direct file reader for array ``name`` (None for a cache behind a URL: read through zarr's store)."""
        if name not in self._fast:
            self._fast[name] = None if self.store.url else _fast_array(self._metas[name], Path(self.store.root) / name)
        return self._fast[name]

    def _samples_in(self, lo: int, hi: int) -> np.ndarray:
        if self._where is None:
            self._where = fmt.SampleIndex(self._start, self._length)
        return self._where.in_range(lo, hi)

    def _missing(self, name: str, idx: tuple[int, ...]) -> MissingChunkError:
        meta = self._metas[name]
        key = f"{name}/{meta.chunk_key(idx)}"
        lo, hi = idx[0] * meta.chunks[0], min((idx[0] + 1) * meta.chunks[0], meta.shape[0])
        if name in TABLES:
            return MissingChunkError(
                f"{self.path}: table {name!r} chunk {idx} is missing (file {key}): its rows [{lo}, {hi}) would read "
                "back as zeros, so every sample's place is unknown. The cache is damaged: re-create it (re-run the "
                "precompute command with overwrite=true).", array=name, chunk=idx)
        holds = self._samples_in(lo, hi)
        units = sorted({int(u) for u in self._unit[holds]}) if len(holds) else []
        shown = ", ".join(str(int(i)) for i in holds[:8]) + (f" (+{len(holds) - 8} more)" if len(holds) > 8 else "")
        pending = [] if self.complete else sorted(set(units) - self._committed_units())
        if pending:  # read_tokens asked for slots of a unit the run has not committed: nothing is damaged
            return MissingChunkError(
                f"{self.path}: array {name!r} chunk {idx} (file {key}) is not written yet: it belongs to unit(s) "
                f"{pending}, which have no commit record; only committed units of an incomplete cache are readable.",
                array=name, chunk=idx, samples=tuple(int(i) for i in holds))
        return MissingChunkError(
            f"{self.path}: array {name!r} chunk {idx} is missing (file {key}): it holds token slots [{lo}, {hi}) of "
            f"unit(s) {units}, " + (f"samples {shown}" if len(holds) else "no samples") + ", which would read back as "
            f"zeros. The cache is damaged: run `dspark-cache verify --repair {self.path}` to mark the unit(s) for "
            "recomputation, then re-run the precompute command that wrote the cache (same overrides).",
            array=name, chunk=idx, samples=tuple(int(i) for i in holds))

    def _decode_jobs(self, jobs: list[tuple[str, int]], legacy_zeros: bool = False) -> list[np.ndarray]:
        """Chunks ``(array, chunk number)`` decoded, concurrently when there are several.

        Local arrays are read straight from their files; others (a URL) through the zarr
        store, every object fetched in one round of requests. ``legacy_zeros`` reads an
        absent chunk as zeros (tables of caches written before every table chunk was).
        """
        where = f"{self.path}: "

        def finish(job: tuple[str, int], raw: bytes | None) -> np.ndarray:
            meta = self._metas[job[0]]
            idx = meta.chunk_index(job[1])
            if raw is None:
                if legacy_zeros:
                    return np.zeros(meta.chunks, dtype=meta.dtype)
                raise self._missing(job[0], idx)
            return decode_chunk(meta, idx, raw, where)

        fast = [self._fast_spec(name) for name, _ in jobs]
        if all(f is not None for f in fast):
            def one(k: int) -> np.ndarray:
                spec, c = fast[k], jobs[k][1]
                meta = spec.meta
                raw = _read_file(spec.root / meta.chunk_key(meta.chunk_index(c)), meta.max_stored_bytes())
                return finish(jobs[k], raw)

            return list(_pool().map(one, range(len(jobs)))) if len(jobs) > 1 else [one(0)] if jobs else []
        metas = [self._metas[name] for name, _ in jobs]
        keys = [f"{m.name}/{m.chunk_key(m.chunk_index(c))}" for m, (_, c) in zip(metas, jobs)]
        raws = _get_many(self.store, self._zarr_store(), keys, [m.max_stored_bytes() for m in metas])
        if len(jobs) > 1:
            return list(_pool().map(finish, jobs, raws))
        return [finish(j, r) for j, r in zip(jobs, raws)]

    def _read_tables(self) -> dict[str, np.ndarray]:
        """Every sample/unit table, whole. A missing table chunk is damage, except in caches from before
        the writer wrote all-zero table chunks (no ``weights_sha256``), where it reads as zeros and the
        table checks that follow catch any zero that is not the truth."""
        legacy = "weights_sha256" not in self.manifest
        jobs = [(name, c) for name in TABLES for c in range(self._metas[name].num_chunks)]
        decoded = self._decode_jobs(jobs, legacy_zeros=legacy)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in TABLES}
        for (name, _), data in zip(jobs, decoded):
            parts[name].append(data)
        out = {}
        for name in TABLES:
            meta = self._metas[name]
            out[name] = (np.concatenate(parts[name]) if parts[name] else np.zeros(0, meta.dtype))[:meta.shape[0]]
        return out

    def _chunks(self, wants: dict[str, tuple[int, int]]) -> dict[tuple[str, int], np.ndarray]:
        """Decoded chunks ``first..last`` of each array in ``{array: (first, last)}``, from the LRU when there."""
        out: dict[tuple[str, int], np.ndarray] = {}
        jobs: list[tuple[str, int]] = []
        for name, (c0, c1) in wants.items():
            for c in range(c0, c1 + 1):
                hit = self._lru.get((name, c))
                if hit is None:
                    jobs.append((name, c))
                else:
                    out[(name, c)] = hit
        for job, piece in zip(jobs, self._decode_jobs(jobs)):
            out[job] = piece
            self._lru.put(job, piece)
        return out

    def read_tokens(self, names: Sequence[str], a: int, b: int) -> dict[str, np.ndarray]:
        """Token slots ``[a, b)`` of each named token array, as stored (bf16 as uint16 bits), copied."""
        ct = self.chunk_tokens
        names = list(dict.fromkeys(names))
        unknown = [nm for nm in names if nm in TABLES or nm not in self._metas]
        if unknown:
            raise ValueError(f"read_tokens: {unknown} are not token arrays of this cache; those are "
                             f"{sorted(n for n in self._metas if n not in TABLES)}")
        total = int(self.manifest["layout"]["total_token_slots"])
        if not 0 <= a <= total or not 0 <= b <= total:
            raise ValueError(f"read_tokens: token slots [{a}, {b}) lie outside the token axis [0, {total})")
        if b <= a:
            return {nm: np.zeros((0, *self._metas[nm].shape[1:]), dtype=self._metas[nm].dtype) for nm in names}
        c0, c1 = a // ct, (b - 1) // ct
        chunks = self._chunks({name: (c0, c1) for name in names})
        out: dict[str, np.ndarray] = {}
        for name in names:
            parts = [chunks[(name, c)][max(a, c * ct) - c * ct:min(b, (c + 1) * ct) - c * ct]
                     for c in range(c0, c1 + 1)]
            out[name] = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        return out

    # -- sequence protocol -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray) -> Any:
        if isinstance(key, slice):
            return [self.sample(i) for i in range(*key.indices(len(self)))]
        if isinstance(key, (list, tuple, np.ndarray, range)):
            return [self.sample(int(i)) for i in key]
        if isinstance(key, (int, np.integer)):
            return self.sample(int(key))
        raise TypeError(f"cache indices must be an int, a slice or a list of ints, not {type(key).__name__}")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.sample(i)

    def _resolve(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} is out of range for a cache of {n} readable samples")
        return int(self.indices[i])

    def check_layers(self, layers: Sequence[int] | None) -> list[int]:
        """The layer ids ``layers`` names (all captured ones for None); refuses ids not captured."""
        if layers is None:
            return list(self.layer_ids)
        chosen = [int(x) for x in layers]
        missing = [lid for lid in chosen if lid not in self.layer_ids]
        if missing:
            raise ValueError(f"layers={list(layers)}: {missing} were not captured; this cache holds layer ids "
                             f"{self.layer_ids}. Pick a subset of those.")
        return chosen

    def read_raw(self, i: int, layers: Sequence[int] | None = None, last: bool = True) -> dict[str, np.ndarray]:
        """Sample ``i`` as stored: int32 ids, uint8 mask, hidden states in the storage dtype.

        bf16 stays as its uint16 bit pattern: the cheapest form to copy elsewhere (export).
        """
        s = self._resolve(i)
        chosen = self.check_layers(layers)
        a, n = int(self._start[s]), int(self._length[s])
        layer_names = [self._names[str(lid)] for lid in chosen]
        last_name = self._names["last"]
        names = [fmt.INPUT_IDS, fmt.LOSS_MASK, *layer_names] + ([last_name] if last else [])
        got = self.read_tokens(names, a, a + n)
        if layer_names:
            hidden = got[layer_names[0]] if len(layer_names) == 1 else np.concatenate(
                [got[nm] for nm in layer_names], axis=1)
        else:
            hidden = np.zeros((n, 0), dtype=fmt.STORAGE_DTYPES[self.storage_dtype][0])
        out = {"input_ids": got[fmt.INPUT_IDS], "loss_mask": got[fmt.LOSS_MASK], "target_hidden_states": hidden}
        if last:
            out["target_last_hidden_states"] = got[last_name]
        return out

    def sample(self, i: int, layers: Sequence[int] | None = None, as_numpy: bool = False,
               last: bool = True) -> dict[str, Any]:
        """Sample ``i``: input_ids, loss_mask, target_hidden_states (chosen layers), last state.

        ``layers`` picks a subset (and order) of the captured layer ids; only their arrays'
        chunks are read. ``last=False`` skips the post-norm state. Torch output (training)
        keeps the storage dtype (bf16/fp16/fp32) with int64 ids and mask, as NeMo does;
        ``as_numpy=True`` (notebooks) gives float32 for bf16 caches, numpy having no bf16.
        """
        raw = self.read_raw(i, layers, last)
        ids = raw["input_ids"].astype(np.int64)
        mask = raw["loss_mask"].astype(np.int64)
        floats = {k: raw[k] for k in ("target_hidden_states", "target_last_hidden_states") if k in raw}
        if as_numpy:
            if self.logical_dtype == "bfloat16":
                floats = {k: bf16_bits_to_float32(v) for k, v in floats.items()}
            return {"input_ids": ids, "loss_mask": mask, **floats}
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                **{k: to_torch(v, self.storage_dtype) for k, v in floats.items()}}

    def target_weights(self) -> dict[str, torch.Tensor]:
        """``embed_tokens.weight`` (+ ``lm_head.weight`` when untied) from the cache's weights file.

        The file's sha256 must equal the manifest's ``weights_sha256`` (:class:`ChecksumError`
        otherwise; caches written before it was recorded are read unchecked) and its tensors
        must have the manifest's shapes (:class:`CacheFormatError`).
        """
        from safetensors.torch import load as st_load

        if not self.store.exists(fmt.WEIGHTS):
            raise CacheFormatError(f"{self.path}: {fmt.WEIGHTS} is missing; training and export need the target's "
                                   "embedding and lm_head. Re-run the precompute job with the same command to "
                                   "rewrite it.")
        blob = self.store.read_bytes(fmt.WEIGHTS)
        want = self.manifest.get("weights_sha256")
        if want is not None:
            got = hashlib.sha256(blob).hexdigest()
            if got != want:
                raise ChecksumError(fmt.WEIGHTS, file=f"{self.path}/{fmt.WEIGHTS}",
                                    detail=f"its sha256 is {got}, the manifest records {want}")
        try:
            tensors = st_load(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise CacheFormatError(f"{self.path}/{fmt.WEIGHTS} cannot be read ({exc}); re-run the precompute "
                                   "job") from exc
        problems = fmt.weights_problems({k: tuple(v.shape) for k, v in tensors.items()}, self.manifest)
        if problems:
            raise CacheFormatError(_listing(f"{self.path}/{fmt.WEIGHTS} does not fit the manifest", problems,
                                            "Re-create the cache."))
        return tensors

    # -- description -----------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        """Tokens per readable sample (int32)."""
        return self._length[self.indices]

    def starts(self) -> np.ndarray:
        """First token slot of each readable sample (int64): sort by it to read in disk order."""
        return self._start[self.indices]

    def untruncated_lengths(self) -> np.ndarray:
        return self._untruncated[self.indices]

    def supervised_counts(self) -> np.ndarray:
        """Supervised (loss_mask=1) tokens per readable sample, from the stored masks.

        Reads ``loss_mask`` (1 byte per token, a bounded window at a time), never the hidden states.
        """
        if self._supervised is None:
            counts = np.zeros(len(self._start), dtype=np.int64)
            members = self._unit[self.indices]
            window = max(self.chunk_tokens, _MASK_WINDOW // self.chunk_tokens * self.chunk_tokens)
            for u in np.unique(members):
                u = int(u)
                ids = self.indices[members == u]
                s0 = self._start[ids].astype(np.int64)
                s1 = s0 + self._length[ids]
                for w0 in range(int(self._unit_start[u]), int(self._unit_stop[u]), window):
                    w1 = min(w0 + window, int(self._unit_stop[u]))
                    mask = self.read_tokens([fmt.LOSS_MASK], w0, w1)[fmt.LOSS_MASK]
                    csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
                    lo, hi = np.clip(s0 - w0, 0, w1 - w0), np.clip(s1 - w0, 0, w1 - w0)
                    counts[ids] += csum[hi] - csum[lo]
            self._supervised = counts[self.indices]
        return self._supervised

    def _bytes_under(self, prefix: str) -> int:
        if self.store.url:
            full = f"{self.store.root}/{prefix}"
            return int(sum(self.store.fs.du(full, total=False).values())) if self.store.fs.exists(full) else 0
        root = Path(self.store.root) / prefix
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0

    def rejects(self) -> dict[str, Any]:
        """Input rows that did not become samples: counts, share and counts per reason (from the manifest)."""
        counts = self.manifest["counts"]
        rows_in, rejected = int(counts["rows_in"]), int(counts["rejected"])
        by = {str(k): int(v) for k, v in (counts.get("rejected_by_reason") or {}).items()}
        return {"rows_in": rows_in, "rejected": rejected, "rejected_fraction": rejected / rows_in if rows_in else 0.0,
                "rejected_by_reason": dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))}

    def rejects_line(self) -> str:
        """``1,234 of 1,400 rows (88.1%): no_supervised_tokens=1,200, malformed_json=34``."""
        r = self.rejects()
        line = f"{r['rejected']:,} of {r['rows_in']:,} rows ({r['rejected_fraction']:.1%})"
        if r["rejected_by_reason"]:
            line += ": " + ", ".join(f"{k}={v:,}" for k, v in r["rejected_by_reason"].items())
        return line

    def summary(self) -> dict[str, Any]:
        """What is in the cache and what it costs on disk (for ``info`` and notebooks; walks the store)."""
        counts = self.manifest["counts"]
        lengths = self.lengths()
        tokens = int(lengths.sum())
        supervised = int(counts["supervised_tokens"]) if self.complete else int(self.supervised_counts().sum())
        on_disk = self.store.nbytes()
        token_disk = sum(self._bytes_under(p) for p in (fmt.INPUT_IDS, fmt.LOSS_MASK, fmt.HIDDEN_GROUP))
        raw = tokens * int(self.manifest.get("bytes_per_token", 0))
        target = self.manifest["identity"]["target"]
        return {
            "path": self.path,
            "complete": self.complete,
            "samples": len(self),
            "tokens": tokens,
            "supervised_tokens": supervised,
            "supervised_fraction": supervised / max(1, tokens),
            "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
            "max_length": int(lengths.max()) if len(lengths) else 0,
            "seq_length": self.seq_length,
            "truncated_samples": int((self.untruncated_lengths() > lengths).sum()) if len(lengths) else 0,
            **self.rejects(),
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "target_hidden_dim": self.hidden_size * len(self.layer_ids),
            "num_hidden_layers": int(self.manifest["num_hidden_layers"]),
            "dtype": self.storage_dtype,
            "chunk_tokens": self.chunk_tokens,
            "units_committed": len(self._committed_units()),
            "num_units": self.num_units,
            "bytes_on_disk": on_disk,
            "token_bytes_on_disk": token_disk,
            "raw_token_bytes": raw,
            "compression_ratio": (raw / token_disk) if token_disk else None,
            "target": target["path"],
            "target_model_type": self.manifest.get("target_model_type"),
            "target_vocab_size": self.manifest.get("target_vocab_size"),
        }

    def describe(self) -> str:
        """The summary as a few aligned lines of text (``dspark-cache info``, ``print(c.describe())``)."""
        s = self.summary()
        last = self._names["last"]
        last_src = next((f"layer {lid}" for lid in self.layer_ids if self._names[str(lid)] == last), "final norm")
        ratio = f"{s['compression_ratio']:.2f}x" if s["compression_ratio"] else "n/a"
        status = "complete" if s["complete"] else f"INCOMPLETE: {s['units_committed']}/{s['num_units']} units committed"
        lines = [
            f"dspark cache {s['path']} ({status})",
            f"  target      {s['target']} ({s['target_model_type']}), {s['num_hidden_layers']} layers, "
            f"hidden {s['hidden_size']}, vocab {s['target_vocab_size']}",
            f"  samples     {s['samples']:,}  tokens {s['tokens']:,} (mean {s['mean_length']:.1f}, max "
            f"{s['max_length']}, seq_length {s['seq_length']}; {s['truncated_samples']} truncated)",
            f"  rejected    {self.rejects_line()}",
            f"  supervised  {s['supervised_tokens']:,} tokens ({s['supervised_fraction']:.1%})",
            f"  layers      {s['layer_ids']} -> target_hidden_states [T, {s['target_hidden_dim']}], "
            f"target_last_hidden_states [T, {s['hidden_size']}] ({last_src})",
            f"  storage     {s['dtype']}, {s['chunk_tokens']} tokens per chunk, {s['num_units']} unit(s)",
            f"  on disk     {human_bytes(s['bytes_on_disk'])} (token arrays {human_bytes(s['token_bytes_on_disk'])}"
            f" = {ratio} compression of {human_bytes(s['raw_token_bytes'])})",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        """What is in hand (no store walk: ``summary()`` lists every file, which a repr must not)."""
        lengths = self.lengths()
        tokens = int(lengths.sum())
        if self.complete:
            sup = f"{int(self.manifest['counts']['supervised_tokens']) / max(1, tokens):.1%} supervised, "
        else:
            sup = ""
        r = self.rejects()
        return (
            f"<dspark cache {self.path!r}: {len(self)} samples, {tokens} tokens ({sup}{r['rejected']} of "
            f"{r['rows_in']} rows rejected), layers {self.layer_ids} x {self.hidden_size}, {self.storage_dtype}"
            + ("" if self.complete else ", INCOMPLETE") + ">"
        )

    def plot(self, path: str | Path | None = None, **kwargs: Any) -> Any:
        """Lengths, supervised fraction and per-layer RMS in one figure (needs the ``plot`` extra)."""
        from dspark_precompute.plot import plot_cache

        return plot_cache(self, path, **kwargs)

    # -- re-opening in another process (DataLoader workers) ---------------------------------
    def _fingerprint(self) -> str:
        """What a re-opened handle must find unchanged: identity, layout and the sample tables."""
        h = hashlib.sha256()
        keep = {k: self.manifest.get(k) for k in ("config_hash", "created_at", "layout", "arrays")}
        h.update(json.dumps(keep, sort_keys=True).encode())
        for t in (self._start, self._length, self._unit, self._source_row):
            h.update(np.ascontiguousarray(t).tobytes())
        return h.hexdigest()

    def handle_state(self) -> dict[str, Any]:
        """A small picklable description from which :meth:`reopen` rebuilds this very view elsewhere."""
        units = None if self.complete else sorted({int(u) for u in self._unit[self.indices]})
        return {"path": self.path, "chunk_cache_bytes": self._lru.max_bytes, "complete": self.complete,
                "units": units, "samples": len(self), "fingerprint": self._fingerprint()}

    @classmethod
    def reopen(cls, state: dict[str, Any]) -> Cache:
        """Open the cache of ``state`` (from :meth:`handle_state`) afresh: the same samples under the same indices.

        Refuses (:class:`CacheFormatError`) a cache rewritten or repaired since: a worker
        must never read different samples under the indices its parent handed out.
        """
        fresh = cls(state["path"], allow_incomplete=True, chunk_cache_bytes=state["chunk_cache_bytes"])
        if fresh._fingerprint() != state["fingerprint"]:
            raise CacheFormatError(f"{state['path']} changed since it was opened (it was re-created or its tables "
                                   "rewritten): samples would not be the ones the opening process indexed. Open it "
                                   "again (restart the DataLoader or training job).")
        units = state["units"]
        committed = fresh._committed_units()
        need = set(range(fresh.num_units)) if units is None else set(units)
        lost = sorted(need - committed) if not fresh.complete else []
        if lost:
            raise CacheFormatError(f"{state['path']}: units {lost[:10]} were readable when the cache was opened and "
                                   "have no commit record now (marked for repair?); open it again once the "
                                   "precompute run has rewritten them.")
        if units is not None:
            fresh.indices = np.flatnonzero(np.isin(fresh._unit, units)).astype(np.int64)
            fresh.complete = False
        if len(fresh) != state["samples"]:
            raise CacheFormatError(f"{state['path']}: {len(fresh)} samples are readable now, {state['samples']} "
                                   "were when it was opened; open it again.")
        return fresh

    def __getstate__(self) -> dict[str, Any]:
        return self.handle_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(Cache.reopen(state).__dict__)


def open_cache(path: str | Path, allow_incomplete: bool = False,
               chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> Cache:
    """Open a cache written by ``python -m dspark_precompute`` (a local path or fsspec URL).

    An unfinished cache raises :class:`IncompleteCacheError` unless ``allow_incomplete``;
    ``chunk_cache_bytes`` bounds the decoded chunks kept for reuse (0 disables it). A
    cache whose manifest, array metadata or tables are inconsistent raises
    :class:`CacheFormatError` listing every problem.
    """
    return Cache(path, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes)
