"""Read a cache: ``open_cache(path)[i]`` -> one sample's tensors, no padding.

Depends only on the format module, the store, zarr, numpy and torch (never on
transformers), so training jobs and notebooks can read caches without the target.

Reads go chunk by chunk through a small LRU of decoded chunks: a sample only touches
the chunks that hold its tokens, neighbouring samples (disk order is longest-first
within a unit) reuse them, and one sample's chunks are decoded concurrently. Local
caches written with the standard codec chain are decoded straight from their chunk
files (crc32c checked, then decompressed); anything else goes through zarr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute import format as fmt
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError
from dspark_precompute.progress import human_bytes
from dspark_precompute.store import CacheStore

log = logging.getLogger(__name__)

_CRC_RE = re.compile(r"checksum", re.IGNORECASE)
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
DEFAULT_CHUNK_CACHE_BYTES = 64 << 20


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


@dataclass(frozen=True)
class _FastArray:
    """How to decode one local array's chunk files without zarr's per-call machinery."""

    root: Path
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    key: Callable[[tuple[int, ...]], str]
    decompress: Callable[[bytes], Any] | None


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """A decode pool for this process (a forked DataLoader worker gets its own)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="dspark-read")
    return _POOLS[pid]


def _fast_array(arr: Any, root: Path) -> _FastArray | None:
    """A direct decoder when the chain is the writer's (bytes LE -> blosc|zstd|none -> crc32c), else None.

    zarr's own read path costs about as much again as the decompression itself for a
    4 MiB chunk; reading the file, checking its crc32c and decompressing it directly
    gives the same bytes (the tests compare both) at about a third of the time.
    """
    try:
        import google_crc32c  # noqa: F401 - zarr's own crc32c implementation
        from numcodecs import Blosc, Zstd
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

        md = arr.metadata
        codecs = list(md.codecs)
        if len(codecs) < 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[-1], Crc32cCodec):
            return None
        endian = getattr(codecs[0].endian, "value", codecs[0].endian)
        if endian not in (None, "little") or len(codecs) > 3:
            return None
        if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]) or md.fill_value != 0:
            return None
        decompress: Callable[[bytes], Any] | None = None
        if len(codecs) == 3:
            if isinstance(codecs[1], BloscCodec):
                decompress = Blosc().decode
            elif isinstance(codecs[1], ZstdCodec):
                decompress = Zstd().decode
            else:
                return None
        return _FastArray(root, np.dtype(arr.dtype).newbyteorder("<"), tuple(arr.chunks),
                          md.chunk_key_encoding.encode_chunk_key, decompress)
    except Exception:  # any surprise in the metadata: zarr's path is always correct
        return None


def _decode_fast(spec: _FastArray, name: str, idx: tuple[int, ...]) -> np.ndarray:
    import google_crc32c

    try:
        raw = (spec.root / spec.key(idx)).read_bytes()
    except FileNotFoundError:  # never written: zarr reads it as the fill value
        return np.zeros(spec.chunk_shape, dtype=spec.dtype)
    body = np.frombuffer(raw, dtype=np.uint8)[:-4]
    if len(raw) < 4 or np.uint32(google_crc32c.value(body)).tobytes() != raw[-4:]:
        raise ChecksumError(name, idx, "Stored and computed checksum do not match")
    data = spec.decompress(body) if spec.decompress is not None else body
    return np.frombuffer(data, dtype=spec.dtype).reshape(spec.chunk_shape)


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
        import zarr

        self.store = CacheStore(str(path))
        self.path = self.store.path
        if not self.store.exists(fmt.MANIFEST):
            raise CacheFormatError(
                f"{path}: no {fmt.MANIFEST}; this is not a dspark-precompute cache (or its run never "
                "started). Point open_cache at the storage.path of a precompute run."
            )
        try:
            self.manifest: dict[str, Any] = json.loads(self.store.read_bytes(fmt.MANIFEST))
        except json.JSONDecodeError as exc:
            raise CacheFormatError(f"{path}/{fmt.MANIFEST} is not valid JSON ({exc}); re-run the precompute "
                                   "job with overwrite=true to rewrite the cache") from exc
        problems = fmt.manifest_problems(self.manifest)
        if problems:
            raise CacheFormatError(f"{path}: " + "; ".join(problems))
        self.complete = bool(self.manifest["complete"])
        committed = self._committed_units()
        if not self.complete and not allow_incomplete:
            raise IncompleteCacheError(
                f"{path} is incomplete ({len(committed)}/{self.num_units} units committed): the precompute run "
                "has not finished. Re-run it with the same command to finish, or open_cache(..., "
                "allow_incomplete=True) to read the committed samples only."
            )
        self.group = zarr.open_group(self.store.zarr_store(read_only=True), mode="r")
        self.layer_ids: list[int] = [int(x) for x in self.manifest["layer_ids"]]
        self.hidden_size = int(self.manifest["hidden_size"])
        self.storage_dtype: str = self.manifest["storage_dtype"]
        self.logical_dtype = fmt.STORAGE_DTYPES[self.storage_dtype][1]
        self.torch_dtype = TORCH_DTYPES[self.storage_dtype]
        self.seq_length = int(self.manifest.get("seq_length") or 0)
        self.chunk_tokens = int(self.manifest["layout"]["chunk_tokens"])
        self._names: dict[str, str] = dict(self.manifest["arrays"])
        self._arrays: dict[str, Any] = {}
        self._fast: dict[str, _FastArray | None] = {}
        self._lru = _ChunkLRU(chunk_cache_bytes)
        self._start = self._table("samples/start")
        self._length = self._table("samples/length")
        self._source_row = self._table("samples/source_row")
        self._unit = self._table("samples/unit")
        if self.complete:
            self.indices = np.arange(len(self._start), dtype=np.int64)
        else:
            self.indices = np.flatnonzero(np.isin(self._unit, sorted(committed))).astype(np.int64)
        self._supervised: np.ndarray | None = None

    # -- metadata --------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return int(self.manifest.get("layout", {}).get("num_units", 0))

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

    def _committed_units(self) -> set[int]:
        return {int(k.rsplit("u", 1)[1].split(".")[0]) for k in self.store.list_keys(fmt.COMMITS)
                if k.endswith(".json")}

    # -- low-level reads -------------------------------------------------------------------
    def _array(self, name: str) -> Any:
        if name not in self._arrays:
            try:
                self._arrays[name] = self.group[name]
            except KeyError:
                raise CacheFormatError(
                    f"{self.path}: array {name!r} named by the manifest is missing; the cache is damaged. "
                    f"Run `dspark-cache verify {self.path}` to see everything that is wrong."
                ) from None
        return self._arrays[name]

    def _table(self, name: str) -> np.ndarray:
        arr = self._array(name)
        try:
            return np.asarray(arr[:])
        except ValueError as exc:
            if is_checksum_error(exc):
                raise ChecksumError(name, (0,), str(exc)) from None
            raise

    def _fast_spec(self, name: str) -> _FastArray | None:
        if name not in self._fast:
            self._fast[name] = None if self.store.url else _fast_array(self._array(name), Path(self.store.root) / name)
        return self._fast[name]

    def _chunk_index(self, name: str, c: int) -> tuple[int, ...]:
        return (c,) if self._array(name).ndim == 1 else (c, 0)

    def _chunks(self, wants: dict[str, tuple[int, int]]) -> dict[tuple[str, int], np.ndarray]:
        """Decoded chunks ``first..last`` of each array in ``{array: (first, last)}``.

        Chunks come from the LRU when they can. Missing ones are decoded concurrently:
        straight from their files on the direct path, else as one contiguous zarr range
        per array with all arrays awaited together, so a sample costs one round of I/O
        rather than one per array. On a zarr checksum failure the ranges are re-read one
        chunk at a time so the error names the corrupt chunk.
        """
        from zarr.core.sync import sync

        ct = self.chunk_tokens
        out: dict[tuple[str, int], np.ndarray] = {}
        todo: list[tuple[str, int, int]] = []
        for name, (c0, c1) in wants.items():
            missing = []
            for c in range(c0, c1 + 1):
                hit = self._lru.get((name, c))
                if hit is None:
                    missing.append(c)
                else:
                    out[(name, c)] = hit
            if missing:
                todo.append((name, missing[0], missing[-1]))
        if not todo:
            return out
        fast = {name: self._fast_spec(name) for name, _, _ in todo}
        if all(v is not None for v in fast.values()):
            jobs = [(name, c) for name, c0, c1 in todo for c in range(c0, c1 + 1) if (name, c) not in out]

            def one(job: tuple[str, int]) -> np.ndarray:
                return _decode_fast(fast[job[0]], job[0], self._chunk_index(job[0], job[1]))

            decoded = list(_pool().map(one, jobs)) if len(jobs) > 1 else [one(j) for j in jobs]
            for job, piece in zip(jobs, decoded):
                out[job] = piece
                self._lru.put(job, piece)
            return out

        arrays = {name: self._array(name) for name, _, _ in todo}  # resolved outside the event loop

        async def _gather(reqs: list[tuple[str, int, int]]) -> list[Any]:
            coros = []
            for name, c0, c1 in reqs:
                arr = arrays[name]
                coros.append(arr.async_array.getitem(slice(c0 * ct, min((c1 + 1) * ct, arr.shape[0]))))
            return await asyncio.gather(*coros)

        try:
            results = sync(_gather(todo))
        except ValueError as exc:
            if not is_checksum_error(exc):
                raise
            for name, c0, c1 in todo:
                for c in range(c0, c1 + 1):
                    try:
                        sync(_gather([(name, c, c)]))
                    except ValueError as inner:
                        if is_checksum_error(inner):
                            raise ChecksumError(name, self._chunk_index(name, c), str(inner)) from None
                        raise
            raise ChecksumError(todo[0][0], f"one of chunks {todo[0][1]}..{todo[0][2]}", str(exc)) from None
        for (name, c0, c1), data in zip(todo, results):
            data = np.asarray(data)
            for c in range(c0, c1 + 1):
                piece = data[(c - c0) * ct:(c - c0 + 1) * ct]
                out[(name, c)] = piece
                self._lru.put((name, c), piece)
        return out

    def _read_direct(self, names: list[str], a: int, b: int) -> dict[str, np.ndarray]:
        from zarr.core.sync import sync

        arrays = {name: self._array(name) for name in names}

        async def _gather() -> list[Any]:
            return await asyncio.gather(*(arrays[nm].async_array.getitem(slice(a, b)) for nm in names))

        try:
            return {nm: np.asarray(v) for nm, v in zip(names, sync(_gather()))}
        except ValueError as exc:
            if not is_checksum_error(exc):
                raise
            ct = self.chunk_tokens
            self._chunks({nm: (a // ct, (b - 1) // ct) for nm in names})  # raises, naming the chunk
            raise

    def read_tokens(self, names: Sequence[str], a: int, b: int) -> dict[str, np.ndarray]:
        """Token slots ``[a, b)`` of each named array, as stored (bf16 as uint16 bits), copied."""
        ct = self.chunk_tokens
        names = list(dict.fromkeys(names))
        if b <= a:
            return {nm: np.zeros((0, *self._array(nm).shape[1:]), dtype=self._array(nm).dtype) for nm in names}
        c0, c1 = a // ct, (b - 1) // ct
        if self._lru.max_bytes <= 0 and any(self._fast_spec(nm) is None for nm in names):
            return self._read_direct(names, a, b)  # no reuse: let zarr decode and keep only [a, b)
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

    # -- description -----------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        """Tokens per readable sample (int32)."""
        return self._length[self.indices]

    def starts(self) -> np.ndarray:
        """First token slot of each readable sample (int64): sort by it to read in disk order."""
        return self._start[self.indices]

    def untruncated_lengths(self) -> np.ndarray:
        return self._table("samples/untruncated_length")[self.indices]

    def supervised_counts(self) -> np.ndarray:
        """Supervised (loss_mask=1) tokens per readable sample, from the stored masks.

        Reads ``loss_mask`` one unit at a time (1 byte per token), never the hidden states.
        """
        if self._supervised is None:
            counts = np.zeros(len(self._start), dtype=np.int64)
            unit_start = self._table("units/token_start")
            unit_stop = self._table("units/token_stop")
            members = self._unit[self.indices]
            for u in np.unique(members):
                u = int(u)
                a, b = int(unit_start[u]), int(unit_stop[u])
                mask = self.read_tokens([fmt.LOSS_MASK], a, b)[fmt.LOSS_MASK]
                csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
                ids = self.indices[members == u]
                rel = self._start[ids] - a
                counts[ids] = csum[rel + self._length[ids]] - csum[rel]
            self._supervised = counts[self.indices]
        return self._supervised

    def _bytes_under(self, prefix: str) -> int:
        if self.store.url:
            full = f"{self.store.root}/{prefix}"
            return int(sum(self.store.fs.du(full, total=False).values())) if self.store.fs.exists(full) else 0
        root = Path(self.store.root) / prefix
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0

    def summary(self) -> dict[str, Any]:
        """What is in the cache and what it costs on disk (for ``repr``, ``info`` and notebooks)."""
        counts = self.manifest["counts"]
        lengths = self.lengths()
        tokens = int(lengths.sum())
        supervised = int(counts.get("supervised_tokens", 0)) if self.complete else int(self.supervised_counts().sum())
        on_disk = self.store.nbytes()
        token_disk = sum(self._bytes_under(p) for p in (fmt.INPUT_IDS, fmt.LOSS_MASK, fmt.HIDDEN_GROUP))
        raw = tokens * int(self.manifest.get("bytes_per_token", 0))
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
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "target_hidden_dim": self.hidden_size * len(self.layer_ids),
            "num_hidden_layers": int(self.manifest.get("num_hidden_layers", 0)),
            "dtype": self.storage_dtype,
            "chunk_tokens": self.chunk_tokens,
            "units_committed": len(self._committed_units()),
            "num_units": self.num_units,
            "bytes_on_disk": on_disk,
            "token_bytes_on_disk": token_disk,
            "raw_token_bytes": raw,
            "compression_ratio": (raw / token_disk) if token_disk else None,
            "target": self.manifest["identity"]["target"]["path"],
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
            f"  supervised  {s['supervised_tokens']:,} tokens ({s['supervised_fraction']:.1%})",
            f"  layers      {s['layer_ids']} -> target_hidden_states [T, {s['target_hidden_dim']}], "
            f"target_last_hidden_states [T, {s['hidden_size']}] ({last_src})",
            f"  storage     {s['dtype']}, {s['chunk_tokens']} tokens per chunk, {s['num_units']} unit(s)",
            f"  on disk     {human_bytes(s['bytes_on_disk'])} (token arrays {human_bytes(s['token_bytes_on_disk'])}"
            f" = {ratio} compression of {human_bytes(s['raw_token_bytes'])})",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"<dspark cache {s['path']!r}: {s['samples']} samples, {s['tokens']} tokens "
            f"({s['supervised_fraction']:.1%} supervised), layers {s['layer_ids']} x {s['hidden_size']}, "
            f"{s['dtype']}, {s['bytes_on_disk'] / 1e6:.1f} MB on disk"
            + (f" ({s['compression_ratio']:.2f}x)" if s["compression_ratio"] else "")
            + ("" if s["complete"] else ", INCOMPLETE") + ">"
        )

    def plot(self, path: str | Path | None = None, **kwargs: Any) -> Any:
        """Lengths, supervised fraction and per-layer RMS in one figure (needs the ``plot`` extra)."""
        from dspark_precompute.plot import plot_cache

        return plot_cache(self, path, **kwargs)

    # -- pickling (DataLoader workers with spawn) ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for k in ("group", "_arrays", "_lru", "store", "_fast"):
            state.pop(k, None)
        state["_lru_bytes"] = self._lru.max_bytes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        import zarr

        lru_bytes = state.pop("_lru_bytes")
        self.__dict__.update(state)
        self.store = CacheStore(self.path)
        self.group = zarr.open_group(self.store.zarr_store(read_only=True), mode="r")
        self._arrays = {}
        self._fast = {}
        self._lru = _ChunkLRU(lru_bytes)


def open_cache(path: str | Path, allow_incomplete: bool = False,
               chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> Cache:
    """Open a cache written by ``python -m dspark_precompute`` (a local path or fsspec URL).

    An unfinished cache raises :class:`IncompleteCacheError` unless ``allow_incomplete``;
    ``chunk_cache_bytes`` bounds the decoded chunks kept for reuse (0 disables it).
    """
    return Cache(path, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes)
