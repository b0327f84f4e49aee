"""Read a cache: ``open_cache(path)[i]`` -> one sample's tensors, no padding.

Depends only on the contract (``dspark_precompute.contract``), zarr, numpy and torch
(never on transformers or the write side), so training jobs and notebooks can read caches
without the target.

Opening checks what is cheap and already in hand before anything is read: the manifest
(``Manifest.read``: every field's type and range), every array's zarr.json against it
(``array_meta_problems``: dtype, shape, chunks, layer id, the writer's codec chain) and
the sample/unit tables against the layout (``table_problems``). A cache that fails any of
them is refused with a :class:`CacheFormatError` listing every problem, so nothing sized
by a crafted value is ever allocated.

Chunks are decoded by ``contract.chunks`` (crc32c, header sizes, bounded buffers); a
chunk that is not there raises :class:`MissingChunkError` (zarr would return zeros).
Decoded chunks go through a small LRU: a sample only touches the chunks that hold its
tokens, neighbouring samples (disk order is longest-first within a unit) reuse them, and
one sample's chunks are decoded concurrently.

An fp8 cache (``storage.dtype=fp8_e4m3``) reads like a bf16 one: its states are dequantized
to bf16 by ``contract.fp8`` (exactly as documented there); :meth:`CacheReader.read_fp8` gives
the stored e4m3 bits and scales instead.
"""

from __future__ import annotations

import dataclasses
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

from dspark_precompute.contract.arrays import ArrayMeta
from dspark_precompute.contract.chunks import decode_chunk, get_many, read_array_metas, read_file
from dspark_precompute.contract.commits import CommitRecord, committed_units
from dspark_precompute.contract.fp8 import E4M3, convert
from dspark_precompute.contract.layout import SampleIndex, table_problems
from dspark_precompute.contract.manifest import Manifest, listing, weights_problems
from dspark_precompute.contract.spec import (
    INPUT_IDS,
    LOSS_MASK,
    SAMPLE_ARRAYS,
    STORAGE_DTYPES,
    UNIT_ARRAYS,
    WEIGHTS,
    disk_dtype,
)
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError, MissingChunkError
from dspark_precompute.read import summary

log = logging.getLogger(__name__)

_CRC_RE = re.compile(r"checksum", re.IGNORECASE)
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
DEFAULT_CHUNK_CACHE_BYTES = 64 << 20
TABLES = (*SAMPLE_ARRAYS, *UNIT_ARRAYS)
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
    if STORAGE_DTYPES[storage_dtype][1] == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """A decode pool for this process (a forked DataLoader worker gets its own)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="dspark-read")
    return _POOLS[pid]


@dataclass(frozen=True)
class _FastArray:
    """A local array whose chunk files are read straight from disk (no zarr machinery per call)."""

    root: Path
    meta: ArrayMeta


def _fast_array(meta: ArrayMeta, root: Path) -> _FastArray | None:
    """The direct file reader for a local array (every checked array has the writer's codec chain)."""
    return _FastArray(root, meta)


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


class CacheReader:
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
        self.manifest = Manifest.read(self.store)
        self.complete = self.manifest.complete
        committed = self._committed_units()
        if not self.complete and not allow_incomplete:
            raise IncompleteCacheError(
                f"{path} is incomplete ({len(committed)}/{self.num_units} units committed): the precompute run "
                "has not finished. Re-run it with the same command to finish, or open_cache(..., "
                "allow_incomplete=True) to read the committed samples only."
            )
        self.layer_ids: list[int] = list(self.manifest.layer_ids)
        self.hidden_size = self.manifest.hidden_size
        self.storage_dtype: str = self.manifest.storage_dtype
        # what samples hold: the storage dtype, except fp8 (dequantized to bf16); the last state may differ
        self.output_dtype: str = self.manifest.output_dtype
        self.last_output_dtype: str = self.manifest.last_output_dtype
        self.logical_dtype = STORAGE_DTYPES[self.output_dtype][1]
        self.torch_dtype = TORCH_DTYPES[self.output_dtype]
        self._dtypes = self.manifest.array_dtypes  # hidden array -> storage dtype
        self._scales = self.manifest.scale_arrays  # fp8 array -> its scale array
        self.seq_length = self.manifest.seq_length
        self.chunk_tokens = self.manifest.layout.chunk_tokens
        self._names: dict[str, str] = dict(self.manifest.arrays)
        self._fast: dict[str, _FastArray | None] = {}
        self._lru = _ChunkLRU(chunk_cache_bytes)
        self._where: SampleIndex | None = None
        metas, problems = read_array_metas(self.store, self.manifest, self._zarr_store() if self.store.url else None)
        if problems:
            raise CacheFormatError(listing(f"{self.path}: the arrays disagree with the manifest",
                                            [p for _, p in problems],
                                            f"Run `dspark-cache verify {self.path}` for a full report; re-create the "
                                            "cache (re-run the precompute command with overwrite=true)."))
        self._metas = metas
        tables = self._read_tables()
        table_found = table_problems(self.manifest, tables)
        if table_found:
            raise CacheFormatError(listing(f"{self.path}: the sample/unit tables disagree with the layout", table_found,
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
        self._dropped = self._dropped_samples(committed)
        self.indices = self._readable(None if self.complete else sorted(committed))
        self._supervised: np.ndarray | None = None

    def _dropped_samples(self, committed: set[int]) -> np.ndarray:
        """Samples whose states were not finite: the manifest lists them once complete, the commits before."""
        if self.complete:
            return np.asarray(self.manifest.dropped_samples or [], dtype=np.int64)
        out = []
        for u in sorted(committed):
            rec = CommitRecord.read(self.store, u)
            for d in (rec.extra.get("dropped") or []) if rec is not None else []:
                out.append(int(d["sample"]))
        return np.asarray(sorted(out), dtype=np.int64)

    def _readable(self, units: list[int] | None) -> np.ndarray:
        """Sample ids a reader may return: every sample (or those of ``units``), minus the dropped ones."""
        ids = np.arange(len(self._start), dtype=np.int64) if units is None else np.flatnonzero(
            np.isin(self._unit, units)).astype(np.int64)
        return ids[~np.isin(ids, self._dropped)] if len(self._dropped) else ids

    # -- metadata --------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return self.manifest.layout.num_units

    @property
    def pad_token_id(self) -> int:
        """The id NeMo pads with: the tokenizer's pad token, else its eos token, else 0."""
        return self.manifest.pad_id

    @property
    def source_row(self) -> np.ndarray:
        """Row of the input selection each readable sample came from."""
        return self._source_row[self.indices]

    @property
    def token_bytes(self) -> int:
        """Bytes one token slot takes in the stored arrays, decoded (ids, mask and every hidden array once)."""
        names = dict.fromkeys([INPUT_IDS, LOSS_MASK, *self._names.values()])
        return sum(int(self._metas[n].dtype.itemsize) * int(np.prod(self._metas[n].chunks[1:], dtype=np.int64))
                   for n in names)

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
        return committed_units(self.store, self.num_units)

    # -- low-level reads -------------------------------------------------------------------
    def _fast_spec(self, name: str) -> _FastArray | None:
        """The direct file reader for array ``name`` (None for a cache behind a URL: read through zarr's store)."""
        if name not in self._fast:
            self._fast[name] = None if self.store.url else _fast_array(self._metas[name], Path(self.store.root) / name)
        return self._fast[name]

    def _samples_in(self, lo: int, hi: int) -> np.ndarray:
        if self._where is None:
            self._where = SampleIndex(self._start, self._length)
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

    def chunk_object(self, name: str, c: int) -> tuple[str, int]:
        """Where chunk ``c`` (along the token axis) of array ``name`` is stored: (key in the store, size limit).

        A stored chunk is never larger than the limit (the reader fetches at most one byte more to tell)."""
        meta = self._metas[name]
        return f"{name}/{meta.chunk_key(meta.chunk_index(c))}", meta.max_stored_bytes()

    def _decode_jobs(self, jobs: list[tuple[str, int]], legacy_zeros: bool = False,
                     raws: Sequence[bytes | None] | None = None, threads: bool = True) -> list[np.ndarray]:
        """Chunks ``(array, chunk number)`` decoded, concurrently when there are several (and ``threads``).

        Local arrays are read straight from their files; others (a URL) through the zarr
        store, every object fetched in one round of requests, unless their bytes are given
        in ``raws`` (fetched ahead). ``legacy_zeros`` reads an absent chunk as zeros (tables
        of caches written before every table chunk was).
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

        parallel = threads and len(jobs) > 1
        if raws is not None:
            return list(_pool().map(finish, jobs, raws)) if parallel else [finish(j, r) for j, r in zip(jobs, raws)]
        maybe_fast = [self._fast_spec(name) for name, _ in jobs]
        if all(f is not None for f in maybe_fast):
            fast = [f for f in maybe_fast if f is not None]

            def one(k: int) -> np.ndarray:
                spec, c = fast[k], jobs[k][1]
                meta = spec.meta
                raw = read_file(spec.root / meta.chunk_key(meta.chunk_index(c)), meta.max_stored_bytes())
                return finish(jobs[k], raw)

            return list(_pool().map(one, range(len(jobs)))) if parallel else [one(k) for k in range(len(jobs))]
        metas = [self._metas[name] for name, _ in jobs]
        keys = [f"{m.name}/{m.chunk_key(m.chunk_index(c))}" for m, (_, c) in zip(metas, jobs)]
        fetched = get_many(self.store, self._zarr_store(), keys, [m.max_stored_bytes() for m in metas])
        if parallel:
            return list(_pool().map(finish, jobs, fetched))
        return [finish(j, r) for j, r in zip(jobs, fetched)]

    def decoded_chunks(self, jobs: list[tuple[str, int]], raws: Sequence[bytes | None] | None = None,
                       threads: bool = True, reuse: bool = True) -> list[np.ndarray]:
        """Chunks ``(array, chunk number along the token axis)``, decoded and checked, as stored (read-only use).

        ``reuse`` takes chunks from (and keeps them in) the small LRU of decoded chunks;
        ``raws`` are the chunks' stored bytes when fetched ahead (then the LRU is bypassed:
        the bytes in hand are decoded). ``threads`` decodes several at once.
        """
        if raws is not None:
            return self._decode_jobs(jobs, raws=raws, threads=threads)
        if not reuse:
            return self._decode_jobs(jobs, threads=threads)
        out: list[np.ndarray | None] = [self._lru.get(job) for job in jobs]
        todo = [k for k, hit in enumerate(out) if hit is None]
        for k, piece in zip(todo, self._decode_jobs([jobs[k] for k in todo], threads=threads)):
            out[k] = piece
            self._lru.put(jobs[k], piece)
        return [x for x in out if x is not None]

    def _read_tables(self) -> dict[str, np.ndarray]:
        """Every sample/unit table, whole. A missing table chunk is damage, except in caches from before
        the writer wrote all-zero table chunks (no ``weights_sha256``), where it reads as zeros and the
        table checks that follow catch any zero that is not the truth."""
        legacy = self.manifest.tool_version in ("", "0.1.0")  # before every table chunk was written
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
        total = self.manifest.layout.total_token_slots
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
        """Sample ``i`` as stored: int32 ids, uint8 mask, hidden states in the output dtype.

        bf16 stays as its uint16 bit pattern: the cheapest form to copy elsewhere (export).
        fp8 states come dequantized, as bf16 bits (``contract.fp8``); a layer stored in
        another dtype than the rest (the post-norm state under ``storage.last_dtype``) is
        converted to ``output_dtype`` in ``target_hidden_states``.
        """
        s = self._resolve(i)
        chosen = self.check_layers(layers)
        a, n = int(self._start[s]), int(self._length[s])
        layer_names = [self._names[str(lid)] for lid in chosen]
        last_name = self._names["last"]
        names = [INPUT_IDS, LOSS_MASK, *layer_names] + ([last_name] if last else [])
        got = self.read_tokens(names + [self._scales[nm] for nm in names if nm in self._scales], a, a + n)

        def states(nm: str, to: str) -> np.ndarray:
            scale = got[self._scales[nm]] if nm in self._scales else None
            return convert(got[nm], self._dtypes[nm], to, scale)

        if layer_names:
            parts = [states(nm, self.output_dtype) for nm in layer_names]
            hidden = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        else:
            hidden = np.zeros((n, 0), dtype=disk_dtype(self.output_dtype))
        out = {"input_ids": got[INPUT_IDS], "loss_mask": got[LOSS_MASK], "target_hidden_states": hidden}
        if last:
            out["target_last_hidden_states"] = states(last_name, self.last_output_dtype)
        return out

    def read_fp8(self, i: int, layers: Sequence[int] | None = None, last: bool = True) -> dict[str, Any]:
        """Sample ``i``'s fp8 states as stored: e4m3 bits and their float32 scales (numpy), nothing dequantized.

        ``target_hidden_states`` is ``uint8 [T, L*H]`` (view it as ``torch.float8_e4m3fn``),
        ``target_hidden_scales`` ``float32 [T, L*H/g]``: channel ``c`` of the row is
        ``E4M3[bits[t, c]] * scales[t, c // g]`` with ``g = fp8_group`` (``contract.fp8``).
        ``layers`` None takes every captured layer stored as fp8 (``layer_ids`` says which: the
        post-norm state under ``storage.last_dtype=bf16`` is not); the post-norm state is
        included (``target_last_hidden_states``/``_scales``) when ``last`` and it is fp8.
        """
        if E4M3 not in self._dtypes.values():
            raise ValueError(f"{self.path} stores no fp8 states (storage dtype {self.storage_dtype}); use sample()")
        if layers is None:
            chosen = [lid for lid in self.layer_ids if self._dtypes[self._names[str(lid)]] == E4M3]
        else:
            chosen = self.check_layers(layers)
            other = [lid for lid in chosen if self._dtypes[self._names[str(lid)]] != E4M3]
            if other:
                raise ValueError(f"layers {other} are stored as {self._dtypes[self._names[str(other[0])]]}, not fp8 "
                                 "(the post-norm state keeps storage.last_dtype); read them with sample()")
        s = self._resolve(i)
        a, n = int(self._start[s]), int(self._length[s])
        layer_names = [self._names[str(lid)] for lid in chosen]
        last_name = self._names["last"]
        with_last = last and self._dtypes[last_name] == E4M3
        names = [*layer_names] + ([last_name] if with_last else [])
        got = self.read_tokens([INPUT_IDS, LOSS_MASK, *names, *(self._scales[nm] for nm in names)], a, a + n)

        def joined(arrays: list[np.ndarray], width: int, dtype: Any) -> np.ndarray:
            return np.concatenate(arrays, axis=1) if arrays else np.zeros((n, width), dtype=dtype)

        out: dict[str, Any] = {
            "input_ids": got[INPUT_IDS], "loss_mask": got[LOSS_MASK], "layer_ids": chosen,
            "fp8_group": self.manifest.fp8_group or self.hidden_size,
            "target_hidden_states": joined([got[nm] for nm in layer_names], 0, np.uint8),
            "target_hidden_scales": joined([got[self._scales[nm]] for nm in layer_names], 0, np.float32),
        }
        if with_last:
            out["target_last_hidden_states"] = got[last_name]
            out["target_last_hidden_scales"] = got[self._scales[last_name]]
        return out

    def sample(self, i: int, layers: Sequence[int] | None = None, as_numpy: bool = False,
               last: bool = True) -> dict[str, Any]:
        """Sample ``i``: input_ids, loss_mask, target_hidden_states (chosen layers), last state.

        ``layers`` picks a subset (and order) of the captured layer ids; only their arrays'
        chunks are read. ``last=False`` skips the post-norm state. Torch output (training)
        keeps the storage dtype (bf16/fp16/fp32; fp8 dequantized to bf16) with int64 ids and mask, as NeMo does;
        ``as_numpy=True`` (notebooks) gives float32 for bf16 caches, numpy having no bf16.
        """
        raw = self.read_raw(i, layers, last)
        ids = raw["input_ids"].astype(np.int64)
        mask = raw["loss_mask"].astype(np.int64)
        dtypes = {"target_hidden_states": self.output_dtype, "target_last_hidden_states": self.last_output_dtype}
        floats: dict[str, np.ndarray] = {k: raw[k] for k in dtypes if k in raw}
        if as_numpy:
            floats = {k: bf16_bits_to_float32(v) if dtypes[k] == "bf16" else v for k, v in floats.items()}
            return {"input_ids": ids, "loss_mask": mask, **floats}
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                **{k: to_torch(v, dtypes[k]) for k, v in floats.items()}}

    def target_weights(self) -> dict[str, torch.Tensor]:
        """``embed_tokens.weight`` (+ ``lm_head.weight`` when untied) from the cache's weights file.

        The file's sha256 must equal the manifest's ``weights_sha256`` (:class:`ChecksumError`
        otherwise; caches written before it was recorded are read unchecked) and its tensors
        must have the manifest's shapes (:class:`CacheFormatError`).
        """
        from safetensors.torch import load as st_load

        if not self.store.exists(WEIGHTS):
            raise CacheFormatError(f"{self.path}: {WEIGHTS} is missing; training and export need the target's "
                                   "embedding and lm_head. Re-run the precompute job with the same command to "
                                   "rewrite it.")
        blob = self.store.read_bytes(WEIGHTS)
        want = self.manifest.weights_sha256
        if want is not None:
            got = hashlib.sha256(blob).hexdigest()
            if got != want:
                raise ChecksumError(WEIGHTS, file=f"{self.path}/{WEIGHTS}",
                                    detail=f"its sha256 is {got}, the manifest records {want}")
        try:
            tensors = st_load(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise CacheFormatError(f"{self.path}/{WEIGHTS} cannot be read ({exc}); re-run the precompute "
                                   "job") from exc
        problems = weights_problems({k: tuple(v.shape) for k, v in tensors.items()}, self.manifest)
        if problems:
            raise CacheFormatError(listing(f"{self.path}/{WEIGHTS} does not fit the manifest", problems,
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
                    mask = self.read_tokens([LOSS_MASK], w0, w1)[LOSS_MASK]
                    csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
                    lo, hi = np.clip(s0 - w0, 0, w1 - w0), np.clip(s1 - w0, 0, w1 - w0)
                    counts[ids] += csum[hi] - csum[lo]
            self._supervised = counts[self.indices]
        return self._supervised

    def rejects(self) -> dict[str, Any]:
        """Input rows that did not become samples: counts, share and counts per reason."""
        return summary.rejects(self)

    def summary(self) -> dict[str, Any]:
        """What is in the cache and what it costs on disk (for ``info`` and notebooks; walks the store)."""
        return summary.summary(self)

    def describe(self) -> str:
        """The summary as a few aligned lines of text (``dspark-cache info``, ``print(c.describe())``)."""
        return summary.describe(self)

    def __repr__(self) -> str:
        """What is in hand (no store walk: ``summary()`` lists every file, which a repr must not)."""
        lengths = self.lengths()
        tokens = int(lengths.sum())
        if self.complete:
            sup = f"{self.manifest.counts.supervised_tokens / max(1, tokens):.1%} supervised, "
        else:
            sup = ""
        r = self.rejects()
        return (
            f"<dspark cache {self.path!r}: {len(self)} samples, {tokens} tokens ({sup}{r['rejected']} of "
            f"{r['rows_in']} rows rejected), layers {self.layer_ids} x {self.hidden_size}, {self.storage_dtype}"
            + ("" if self.complete else ", INCOMPLETE") + ">"
        )

    # -- re-opening in another process (DataLoader workers) ---------------------------------
    def _fingerprint(self) -> str:
        """What a re-opened handle must find unchanged: identity, layout and the sample tables."""
        h = hashlib.sha256()
        m = self.manifest
        keep = {"config_hash": m.config_hash, "created_at": m.created_at, "layout": dataclasses.asdict(m.layout),
                "arrays": m.arrays}
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
    def reopen(cls, state: dict[str, Any]) -> CacheReader:
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
            fresh.indices = fresh._readable(units)
            fresh.complete = False
        if len(fresh) != state["samples"]:
            raise CacheFormatError(f"{state['path']}: {len(fresh)} samples are readable now, {state['samples']} "
                                   "were when it was opened; open it again.")
        return fresh

    def __getstate__(self) -> dict[str, Any]:
        return self.handle_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(CacheReader.reopen(state).__dict__)


def open_cache(path: str | Path, allow_incomplete: bool = False,
               chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> CacheReader:
    """Open a cache written by ``python -m dspark_precompute`` (a local path or fsspec URL).

    An unfinished cache raises :class:`IncompleteCacheError` unless ``allow_incomplete``;
    ``chunk_cache_bytes`` bounds the decoded chunks kept for reuse (0 disables it). A
    cache whose manifest, array metadata or tables are inconsistent raises
    :class:`CacheFormatError` listing every problem.
    """
    return CacheReader(path, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes)


Cache = CacheReader  # the name before 0.2
