"""Each array's own metadata (its zarr.json) against the manifest, and the codec chain.

The writer builds every array with :func:`codec_chain` (bytes little-endian -> blosc, zstd
or nothing -> crc32c); :func:`array_meta_problems` accepts exactly that chain and the
dtype, shape, chunk shape and ``layer_id``/``logical_dtype`` attributes the manifest
implies, so a reader decodes nothing it did not expect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from dspark_precompute.contract.spec import (
    COMPRESSORS,
    MAX_CHUNK_BYTES,
    MAX_TABLE_CHUNK_ROWS,
    SAMPLE_ARRAYS,
    STORAGE_DTYPES,
    TOKEN_ARRAYS,
    UNIT_ARRAYS,
    is_int,
)

if TYPE_CHECKING:
    from dspark_precompute.contract.manifest import Manifest

SHUFFLES = {"none": "noshuffle", "byte": "shuffle", "bit": "bitshuffle"}


def codec_chain(compressor: str, level: int, shuffle: str, typesize: int) -> list[Any]:
    """The lossless chain the writer gives every array; crc32c always last so every chunk is checksummed."""
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    chain: list[Any] = []
    if compressor == "zstd":
        chain.append(ZstdCodec(level=int(level)))
    elif compressor.startswith("blosc"):
        chain.append(BloscCodec(cname=compressor.split("_", 1)[1], clevel=int(level),  # type: ignore[arg-type]
                                shuffle=SHUFFLES[shuffle], typesize=typesize, blocksize=1 << 20))  # type: ignore[arg-type]
    chain.append(Crc32cCodec())
    return chain


@dataclass(frozen=True)
class ArrayMeta:
    """What a reader needs to find and decode one array's chunks, from a checked zarr.json."""

    name: str
    dtype: np.dtype          # little-endian
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    compressor: str | None   # "blosc", "zstd" or None (bytes -> [compressor] -> crc32c)
    separator: str
    v2_keys: bool

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    @property
    def num_chunks(self) -> int:
        """Chunks along the token (or sample) axis; the other axis is always one chunk."""
        return -(-self.shape[0] // self.chunks[0]) if self.shape[0] else 0

    def chunk_index(self, c: int) -> tuple[int, ...]:
        return (c,) + (0,) * (len(self.shape) - 1)

    def chunk_key(self, idx: tuple[int, ...]) -> str:
        """The chunk's key relative to the array (``c/3/0`` with zarr v3's default encoding)."""
        parts = [str(i) for i in idx]
        return self.separator.join(parts) if self.v2_keys else self.separator.join(["c", *parts])

    def max_stored_bytes(self) -> int:
        """The largest a stored chunk can be: incompressible data plus codec framing and the crc."""
        return self.chunk_nbytes + self.chunk_nbytes // 8 + (1 << 16)


class ExpectedArray(NamedTuple):
    """What the manifest implies for one array; ``chunks`` is None for a table (any row count up to a bound)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[int, ...] | None
    attrs: dict[str, Any]
    shape_from: str  # the manifest fields the shape comes from, for messages


def expected_arrays(m: Manifest) -> dict[str, ExpectedArray]:
    """Every array a cache must hold, by name, with the dtype, shape, chunks and attributes ``m`` implies."""
    hidden, total, ct = m.hidden_size, m.layout.total_token_slots, m.layout.chunk_tokens
    disk, logical = STORAGE_DTYPES[m.storage_dtype]
    out: dict[str, ExpectedArray] = {}
    for name, dt in TOKEN_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (total,), (ct,), {"logical_dtype": np.dtype(dt).name},
                                  "layout.total_token_slots")
    layer_of = {v: int(k) for k, v in m.arrays.items() if k != "last"}
    for name in m.hidden_array_names:
        lid = layer_of.get(name, m.num_hidden_layers - 1)  # final_norm: the post-norm state
        out[name] = ExpectedArray(np.dtype(disk), (total, hidden), (ct, hidden),
                                  {"logical_dtype": logical, "layer_id": lid},
                                  "layout.total_token_slots x hidden_size")
    n, units = m.stored_samples, m.layout.num_units
    for name, dt in SAMPLE_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (n,), None, {},
                                  "counts.samples + dropped_samples" if m.dropped_samples else "counts.samples")
    for name, dt in UNIT_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (units,), None, {}, "layout.num_units")
    return out


def array_meta_problems(name: str, meta: Any, want: ExpectedArray) -> tuple[ArrayMeta | None, list[str]]:
    """Check one array's zarr.json against what the manifest implies; the parsed meta when it passes.

    The codec chain must be one the writer writes (``bytes`` little-endian, then ``blosc``,
    ``zstd`` or nothing, then ``crc32c``): the reader decodes exactly that and nothing else.
    """
    dtype, shape, chunks, attrs, shape_from = want
    where = f"array {name!r} ({name}/zarr.json)"
    if not isinstance(meta, dict):
        return None, [f"{where} is not a JSON object; the array's metadata is damaged"]
    problems: list[str] = []
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        problems.append(f"{where} is not zarr v3 array metadata (zarr_format={meta.get('zarr_format')!r}, "
                        f"node_type={meta.get('node_type')!r})")
    if meta.get("data_type") != dtype.name:
        problems.append(f"{where} has data_type {meta.get('data_type')!r}, the manifest implies {dtype.name!r}")
    got_shape = meta.get("shape")
    if not (isinstance(got_shape, list) and all(is_int(x) for x in got_shape)) or tuple(got_shape) != shape:
        problems.append(f"{where} has shape {got_shape!r:.80}, the manifest implies {list(shape)} ({shape_from})")
    grid = meta.get("chunk_grid")
    got_chunks = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and isinstance(
        grid.get("configuration"), dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(got_chunks, list) or not all(
            is_int(x) for x in got_chunks) or len(got_chunks) != len(shape):
        problems.append(f"{where} has chunk grid {grid!r:.120}, expected a regular grid of {len(shape)} dimension(s)")
        got_chunks = None
    elif chunks is not None and tuple(got_chunks) != chunks:
        problems.append(f"{where} has chunk shape {got_chunks}, the manifest implies {list(chunks)} "
                        "(layout.chunk_tokens[, hidden_size])")
    elif chunks is None and not 1 <= int(got_chunks[0]) <= MAX_TABLE_CHUNK_ROWS:
        problems.append(f"{where} has chunk shape {got_chunks}, outside [1, {MAX_TABLE_CHUNK_ROWS}] rows")
    enc = meta.get("chunk_key_encoding")
    sep: Any = "/"
    v2 = False
    if isinstance(enc, dict) and enc.get("name") in ("default", "v2"):
        v2 = enc["name"] == "v2"
        conf = enc.get("configuration") or {}
        sep = conf.get("separator", "." if v2 else "/") if isinstance(conf, dict) else None
        if sep not in ("/", "."):
            problems.append(f"{where} has chunk key separator {sep!r}, expected '/' or '.'")
    else:
        problems.append(f"{where} has chunk key encoding {enc!r:.80}, expected zarr's 'default'")
    if meta.get("storage_transformers") not in (None, []):
        problems.append(f"{where} has storage transformers {meta.get('storage_transformers')!r:.80}; this tool "
                        "never writes any")
    compressor, chain_problem = _codec_chain(meta.get("codecs"), dtype)
    if chain_problem:
        problems.append(f"{where} {chain_problem}")
    got_attrs = meta.get("attributes") or {}
    if not isinstance(got_attrs, dict):
        problems.append(f"{where} attributes are not an object")
    else:
        for k, v in attrs.items():
            if got_attrs.get(k) != v:
                problems.append(f"{where} has attribute {k}={got_attrs.get(k)!r}, the manifest implies {v!r}"
                                + (": the array holds another layer than the manifest names" if k == "layer_id"
                                   else ""))
    if problems:
        return None, problems
    assert got_chunks is not None  # a grid problem would have returned above
    parsed = ArrayMeta(name, dtype.newbyteorder("<"), shape, tuple(int(x) for x in got_chunks), compressor, sep, v2)
    if parsed.chunk_nbytes > MAX_CHUNK_BYTES:
        return None, [f"{where} has {parsed.chunk_nbytes:,}-byte chunks, more than a reader decodes at once "
                      f"({MAX_CHUNK_BYTES:,})"]
    return parsed, []


def _codec_chain(codecs: Any, dtype: np.dtype) -> tuple[str | None, str | None]:
    """(compressor, None) for a chain the writer writes, else (None, why not)."""
    names = [str(c.get("name")) if isinstance(c, dict) else repr(c) for c in codecs] if isinstance(codecs, list) \
        else None
    writes = "bytes (little-endian) -> blosc|zstd|none -> crc32c"
    if names is None:
        return None, f"has codecs {codecs!r:.80}, expected a list ({writes})"
    unknown = [n for n in names if n not in ("bytes", "crc32c", *COMPRESSORS)]
    if unknown:
        return None, (f"uses codec {unknown[0]!r}, which this tool never writes (its chain is {writes}); a reader "
                      "would not decode it. The cache was altered or written by something else: re-create it")
    if len(names) not in (2, 3) or names[0] != "bytes" or names[-1] != "crc32c" or (
            len(names) == 3 and names[1] not in COMPRESSORS):
        return None, f"has codec chain {' -> '.join(names)}, which this tool never writes (it writes {writes})"
    conf = codecs[0].get("configuration") or {}
    endian = conf.get("endian") if isinstance(conf, dict) else "?"
    if endian not in ("little", None) or (endian is None and dtype.itemsize > 1):
        return None, f"stores {endian!r}-endian bytes; this tool writes little-endian ({writes})"
    return (names[1] if len(names) == 3 else None), None


def compressed_size_problem(compressor: str | None, body: bytes | memoryview | np.ndarray, expected: int) -> str | None:
    """Why a chunk's compressed body cannot decode to exactly ``expected`` bytes (from its header), or None.

    Checked before decompressing into a buffer of ``expected`` bytes, so a crafted header
    can neither make a reader allocate what it claims nor decode to a short chunk.
    """
    b = bytes(body[:32])
    if compressor is None:
        n = len(body)
        return None if n == expected else f"holds {n:,} bytes, a chunk of this array is {expected:,}"
    if compressor == "blosc":
        if len(b) < 16:
            return f"is {len(body)} bytes, shorter than a blosc header"
        nbytes, cbytes = int.from_bytes(b[4:8], "little"), int.from_bytes(b[12:16], "little")
        if nbytes != expected:
            return f"has a blosc header declaring {nbytes:,} decompressed bytes, a chunk of this array is {expected:,}"
        if cbytes != len(body):
            return f"has a blosc header declaring {cbytes:,} compressed bytes, the chunk holds {len(body):,}"
        return None
    if compressor == "zstd":
        size = _zstd_content_size(b)
        if size is None:
            return "has no zstd frame header with a content size"
        if size != expected:
            return f"has a zstd frame declaring {size:,} decompressed bytes, a chunk of this array is {expected:,}"
        return None
    return f"uses compressor {compressor!r}, which this tool never writes"


def _zstd_content_size(b: bytes) -> int | None:
    """Frame_Content_Size of a zstd frame (RFC 8878 3.1.1.1), or None when absent or not zstd."""
    if len(b) < 6 or b[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = b[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(b) < pos + size:
        return None
    value = int.from_bytes(b[pos:pos + size], "little")
    return value + 256 if size == 2 else value


