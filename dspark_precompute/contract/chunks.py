"""Reading stored chunks: fetch the bytes, check the crc32c and the codec header, decode.

Only this module turns chunk bytes into arrays (readers and ``verify`` both call it), so
every chunk read anywhere is checksummed, bounded by the array's chunk size, and an absent
chunk is reported (``None`` from :func:`get_many`) instead of silently read as zeros.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import ArrayMeta, array_meta_problems, compressed_size_problem, expected_arrays
from dspark_precompute.contract.fp8 import scale_problem
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import CacheFormatError, ChecksumError

MAX_JSON_BYTES = 1 << 20  # an array's zarr.json is a few hundred bytes


def read_file(path: Path, limit: int) -> bytes | None:
    """A file's bytes, at most ``limit + 1`` of them (more means it is too large); None if absent."""
    try:
        with open(path, "rb", buffering=0) as fh:  # unbuffered: one read straight into the bytes object
            size = os.fstat(fh.fileno()).st_size
            return fh.read(min(size, limit + 1))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def get_many(store: CacheStore, zstore: Any, keys: list[str], limits: list[int]) -> list[bytes | None]:
    """Objects ``keys`` of a cache (None for absent ones), at most ``limit + 1`` bytes each, fetched together."""
    if zstore is None:
        root = Path(store.root)
        return [read_file(root / k, lim) for k, lim in zip(keys, limits)]
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


def decode_chunk(meta: ArrayMeta, idx: tuple[int, ...], raw: bytes, where: str = "") -> np.ndarray:
    """One stored chunk -> its array of ``meta.chunks``: crc32c checked, header sizes checked, bounded.

    Raises :class:`ChecksumError` when the crc32c does not match and :class:`CacheFormatError`
    when the chunk is larger than the array's chunks can be or its codec header declares
    another size than the chunk's (it is then never decompressed), or when a chunk of an fp8
    scale array holds a scale that is not finite and positive (even one written with a valid
    checksum: every row of a written scale chunk is, unwritten ones hold 1).
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
    problem = compressed_size_problem(meta.compressor, body, expected)
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
    out = data.view(meta.dtype).reshape(meta.chunks)
    if meta.positive:
        problem = scale_problem(out)
        if problem:
            raise CacheFormatError(f"{where}array {name!r} chunk {idx} (file {key}) {problem}. The scales were "
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


def read_slots(store: CacheStore, metas: dict[str, ArrayMeta], names: list[str], a: int, b: int,
               zstore: Any = None) -> dict[str, np.ndarray]:
    """Token slots ``[a, b)`` of each named array, decoded chunk by chunk (no reuse, no threads).

    For tools that read a few samples (``verify --recompute``); the reader has its own
    concurrent, cached path. An absent chunk raises :class:`CacheFormatError`.
    """
    out: dict[str, np.ndarray] = {}
    for name in names:
        meta = metas[name]
        ct = meta.chunks[0]
        parts = []
        for c in range(a // ct, -(-b // ct) if b > a else a // ct):
            idx = meta.chunk_index(c)
            key = f"{name}/{meta.chunk_key(idx)}"
            (raw,) = get_many(store, zstore, [key], [meta.max_stored_bytes()])
            if raw is None:
                raise CacheFormatError(f"{store.path}: chunk {key} is missing")
            data = decode_chunk(meta, idx, raw)
            parts.append(data[max(a, c * ct) - c * ct:min(b, (c + 1) * ct) - c * ct])
        out[name] = np.concatenate(parts) if parts else np.zeros((0, *meta.shape[1:]), dtype=meta.dtype)
    return out
