"""Each array's own metadata (its zarr.json) against the manifest, and the codec chain.

The writer builds every chunk with :func:`codec_chain` (bytes little-endian -> blosc, zstd
or nothing -> crc32c); in format 2 the token arrays wrap that chain in zarr's
``sharding_indexed`` codec (one shard per commit unit, index at the end, checksummed with
crc32c), the sample/unit tables do not. :func:`array_meta_problems` accepts exactly that and
the dtype, shape, chunk and shard shape and ``layer_id``/``logical_dtype`` attributes the
manifest implies, so a reader decodes nothing it did not expect. An fp8 array's scale array
is expected too, and marked ``positive``: :func:`~dspark_precompute.contract.chunks.decode_chunk`
refuses any of its chunks holding a scale that is not finite and positive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark_precompute.contract.fp8 import SCALE_DTYPE
from dspark_precompute.contract.spec import (
    IMAGE_ARRAYS,
    KEY_SEPARATOR,
    MAX_CHUNK_BYTES,
    MAX_SHARD_CHUNKS,
    MAX_TABLE_CHUNK_ROWS,
    POSITION_DTYPE,
    POSITION_IDS,
    SAMPLE_ARRAYS,
    TOKEN_ARRAYS,
    UNIT_ARRAYS,
    VIDEO_ARRAYS,
    array_layer_id,
    final_state,
    is_int,
)
from dspark_precompute.contract.vocab import Compressor, Shuffle, StorageDtype

if TYPE_CHECKING:
    from dspark_precompute.contract.manifest import Manifest

SHARDING = "sharding_indexed"
INNER_CODECS = ("blosc", "zstd")  # between ``bytes`` and ``crc32c``; none is fine too
_WRITES = "bytes (little-endian) -> blosc|zstd|none -> crc32c"


def codec_chain(compressor: str, level: int, shuffle: str, typesize: int) -> list[Any]:
    """The lossless chain the writer gives every chunk; crc32c always last so every chunk is checksummed."""
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    comp = Compressor(compressor)
    chain: list[Any] = []
    if comp is Compressor.zstd:
        chain.append(ZstdCodec(level=int(level)))
    elif comp.cname is not None:
        chain.append(BloscCodec(cname=comp.cname, clevel=int(level),  # type: ignore[arg-type]
                                shuffle=Shuffle(shuffle).blosc, typesize=typesize,  # type: ignore[arg-type]
                                blocksize=1 << 20))
    chain.append(Crc32cCodec())
    return chain


def chunk_encoder(compressor: str, level: int, shuffle: str,
                  typesize: int) -> Callable[[np.ndarray], tuple[Any, bytes]]:
    """One whole chunk -> ``(body, crc)``: what zarr stores for it under :func:`codec_chain` is
    ``body`` (the compressed bytes, or the raw array without a compressor) followed by ``crc``
    (the crc32c of ``body``, 4 bytes little-endian).

    Writers encode whole chunks with it instead of going through zarr's array assignment, which
    costs as much CPU again as the compression; the parts are written one after the other, so
    an uncompressed chunk is never copied. The codecs are built from the very chain the arrays
    are created with, so the bytes cannot drift from what zarr would write.
    """
    import google_crc32c
    import numcodecs

    compress: Callable[[np.ndarray], Any] | None = None
    for codec in codec_chain(compressor, level, shuffle, typesize):
        spec = codec.to_dict()
        conf = dict(spec.get("configuration") or {})
        if spec["name"] == "blosc":
            conf["shuffle"] = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[conf["shuffle"]]
            compress = numcodecs.Blosc(**conf).encode
        elif spec["name"] == "zstd":
            compress = numcodecs.Zstd(**conf).encode
        elif spec["name"] != "crc32c":
            raise ValueError(f"no chunk encoder for codec {spec['name']!r}")

    def encode(chunk: np.ndarray) -> tuple[Any, bytes]:
        raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        body = raw if compress is None else compress(raw)
        return body, int(google_crc32c.value(body)).to_bytes(4, "little")

    return encode


@dataclass(frozen=True)
class ArrayMeta:
    """What a reader needs to find and decode one array's chunks, from a checked zarr.json.

    ``chunks`` is the inner chunk shape (the unit of decoding); ``shard_chunks`` the inner
    chunks per shard along the token axis (None: unsharded, one object per chunk).
    """

    name: str
    dtype: np.dtype          # little-endian
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    compressor: str | None   # "blosc", "zstd" or None (bytes -> [compressor] -> crc32c)
    separator: str
    v2_keys: bool
    positive: bool = False   # fp8 scales: every decoded value must be finite and > 0
    shard_chunks: int | None = None

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    @property
    def num_chunks(self) -> int:
        """Inner chunks along the token (or sample) axis; the other axis is always one chunk."""
        return -(-self.shape[0] // self.chunks[0]) if self.shape[0] else 0

    @property
    def sharded(self) -> bool:
        return self.shard_chunks is not None

    def chunk_index(self, c: int) -> tuple[int, ...]:
        return (c,) + (0,) * (len(self.shape) - 1)

    def object_index(self, c: int) -> tuple[int, ...]:
        """The grid index of the object holding inner chunk ``c``: its shard, or the chunk itself."""
        return self.chunk_index(c // self.shard_chunks if self.shard_chunks else c)

    def chunk_key(self, idx: tuple[int, ...]) -> str:
        """An object's key relative to the array (``c.3.0`` in format 2, ``c/3/0`` in format 1)."""
        parts = [str(i) for i in idx]
        return self.separator.join(parts) if self.v2_keys else self.separator.join(["c", *parts])

    def object_key(self, c: int) -> str:
        """The key (relative to the cache) of the object holding inner chunk ``c``."""
        return f"{self.name}/{self.chunk_key(self.object_index(c))}"

    def max_stored_bytes(self) -> int:
        """The largest a stored inner chunk can be: incompressible data plus codec framing and the crc."""
        return self.chunk_nbytes + self.chunk_nbytes // 8 + (1 << 16)


@dataclass(frozen=True)
class ExpectedArray:
    """What the manifest implies for one array; ``chunks`` is None for a table (any row count up to a bound)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[int, ...] | None
    attrs: dict[str, Any]
    shape_from: str  # the manifest fields the shape comes from, for messages
    positive: bool = False  # an fp8 scale array (values checked on decode)
    shard_rows: int | None = None  # token rows per shard (format 2 token arrays); None: unsharded
    separator: str = "/"


def expected_arrays(m: Manifest) -> dict[str, ExpectedArray]:
    """Every array a cache must hold, by name, with the dtype, shape, chunks and attributes ``m`` implies."""
    hidden, total, ct = m.hidden_size, m.layout.total_token_slots, m.layout.chunk_tokens
    v2 = m.format_version >= 2
    sep, shard = (KEY_SEPARATOR, m.layout.unit_tokens) if v2 else ("/", None)
    dtypes, scales, cols = m.array_dtypes, m.scale_arrays, m.scale_columns
    out: dict[str, ExpectedArray] = {}
    for name, dt in TOKEN_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (total,), (ct,), {"logical_dtype": np.dtype(dt).name},
                                  "layout.total_token_slots", shard_rows=shard, separator=sep)
    for name in m.hidden_array_names:
        sd = StorageDtype(dtypes[name])
        attrs: dict[str, Any] = {"logical_dtype": sd.logical,
                                 "layer_id": array_layer_id(name, m.arrays, m.num_hidden_layers)}
        if v2 and final_state(name, m.arrays):
            attrs["final_state"] = final_state(name, m.arrays)
        if sd.is_fp8:
            attrs["scale_array"] = scales[name]
        out[name] = ExpectedArray(sd.disk, (total, hidden), (ct, hidden), attrs,
                                  "layout.total_token_slots x hidden_size", shard_rows=shard, separator=sep)
    for name, scale in scales.items():
        out[scale] = ExpectedArray(SCALE_DTYPE, (total, cols), (ct, cols),
                                   {"logical_dtype": SCALE_DTYPE.name, "scale_of": name,
                                    "channels_per_scale": m.fp8_group or hidden},
                                   "layout.total_token_slots x hidden_size / fp8_group", True, shard, sep)
    n, units = m.stored_samples, m.layout.num_units
    for name, dt in SAMPLE_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (n,), None, {},
                                  "counts.samples + dropped_samples" if m.dropped_samples else "counts.samples",
                                  separator=sep)
    for name, dt in UNIT_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (units,), None, {}, "layout.num_units", separator=sep)
    if m.media is not None:  # an image cache: its images' tables, and the model's positions where it has them
        axes = m.media.position_axes
        if axes:
            out[POSITION_IDS] = ExpectedArray(np.dtype(POSITION_DTYPE), (total, axes), (ct, axes),
                                              {"logical_dtype": np.dtype(POSITION_DTYPE).name},
                                              "layout.total_token_slots x media.position_axes", shard_rows=shard,
                                              separator=sep)
        for name, (image_dt, width) in IMAGE_ARRAYS.items():
            shape = (m.media.images,) + (() if width is None else (width,))
            out[name] = ExpectedArray(np.dtype(image_dt), shape, None, {}, "media.images", separator=sep)
        if m.media.videos:  # a cache with videos: the videos/* tables, the columns of the image tables
            for name, (video_dt, width) in VIDEO_ARRAYS.items():
                shape = (m.media.videos,) + (() if width is None else (width,))
                out[name] = ExpectedArray(np.dtype(video_dt), shape, None, {}, "media.videos", separator=sep)
    return out


def _grid(where: str, meta: dict[str, Any], want: ExpectedArray) -> tuple[list[int] | None, list[str]]:
    """The outer chunk grid (a shard, or the chunk of an unsharded array) against ``want``."""
    grid = meta.get("chunk_grid")
    conf = grid.get("configuration") if isinstance(grid, dict) else None
    got = conf.get("chunk_shape") if isinstance(conf, dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(got, list) or not all(
            is_int(x) for x in got) or len(got) != len(want.shape):
        return None, [f"{where} has chunk grid {grid!r:.120}, expected a regular grid of {len(want.shape)} "
                      "dimension(s)"]
    if want.shard_rows is not None:
        outer = (want.shard_rows, *want.shape[1:])
        if tuple(got) != outer:
            return None, [f"{where} has shard shape {got}, the manifest implies {list(outer)} (layout.unit_tokens"
                          + (", hidden_size)" if len(outer) > 1 else ")")]
    elif want.chunks is not None and tuple(got) != want.chunks:
        return None, [f"{where} has chunk shape {got}, the manifest implies {list(want.chunks)} "
                      "(layout.chunk_tokens[, hidden_size])"]
    elif want.chunks is None and (not 1 <= int(got[0]) <= MAX_TABLE_CHUNK_ROWS or tuple(got[1:]) != want.shape[1:]):
        return None, [f"{where} has chunk shape {got}, outside [1, {MAX_TABLE_CHUNK_ROWS}] rows of "
                      f"{list(want.shape[1:]) or 'single'} values"]
    return [int(x) for x in got], []


def _key_encoding(where: str, meta: dict[str, Any], want: ExpectedArray) -> tuple[str, bool, list[str]]:
    """(separator, v2 keys, problems): format 2 writes ``default`` keys with ``.`` (no directory per chunk)."""
    enc = meta.get("chunk_key_encoding")
    if not (isinstance(enc, dict) and enc.get("name") in ("default", "v2")):
        return "/", False, [f"{where} has chunk key encoding {enc!r:.80}, expected zarr's 'default'"]
    v2 = enc["name"] == "v2"
    conf = enc.get("configuration") or {}
    sep = conf.get("separator", "." if v2 else "/") if isinstance(conf, dict) else None
    if sep not in ("/", "."):
        return "/", v2, [f"{where} has chunk key separator {sep!r}, expected '/' or '.'"]
    if want.separator == KEY_SEPARATOR and (v2 or sep != KEY_SEPARATOR):
        return sep, v2, [f"{where} has chunk key encoding {enc!r:.80}; format 2 writes zarr's 'default' encoding "
                         f"with separator {KEY_SEPARATOR!r}"]
    return sep, v2, []


def _sharding(codecs: Any, want: ExpectedArray) -> tuple[Any, int | None, str | None]:
    """(inner codecs, inner chunks per shard, problem) of a sharded array's codec list."""
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == SHARDING and isinstance(codecs[0].get("configuration"), dict)):
        names = [c.get("name") if isinstance(c, dict) else c for c in codecs] if isinstance(codecs, list) else codecs
        return None, None, (f"has codecs {names!r:.80}; format 2 stores token arrays with the single codec "
                            f"{SHARDING!r} (one shard per commit unit)")
    conf = codecs[0]["configuration"]
    inner = conf.get("chunk_shape")
    assert want.chunks is not None and want.shard_rows is not None
    if not isinstance(inner, list) or not all(is_int(x) for x in inner) or [int(x) for x in inner] != list(
            want.chunks):
        return None, None, (f"has inner chunk shape {inner!r:.80}, the manifest implies {list(want.chunks)} "
                            "(layout.chunk_tokens[, hidden_size])")
    if want.shard_rows % want.chunks[0] or not 1 <= want.shard_rows // want.chunks[0] <= MAX_SHARD_CHUNKS:
        return None, None, (f"has shards of {want.shard_rows} rows, not a multiple of its {want.chunks[0]}-row "
                            f"chunks within {MAX_SHARD_CHUNKS} chunks")
    index = conf.get("index_codecs")
    names = [c.get("name") for c in index] if isinstance(index, list) and all(isinstance(c, dict) for c in index) \
        else None
    endian = (index[0].get("configuration") or {}).get("endian") if names and isinstance(index[0], dict) else None
    if names != ["bytes", "crc32c"] or endian != "little":  # uint64 entries: no endianness would be the reader's
        return None, None, (f"has shard index codecs {index!r:.120}; this tool writes bytes (little-endian) -> "
                            "crc32c, so every index is checksummed")
    if conf.get("index_location", "end") != "end":
        return None, None, f"has its shard index at the {conf.get('index_location')!r}; this tool writes it at the end"
    return conf.get("codecs"), want.shard_rows // want.chunks[0], None


def _codec_chain(codecs: Any, dtype: np.dtype) -> tuple[str | None, str | None]:
    """(compressor, None) for a chunk codec chain the writer writes, else (None, why not)."""
    names = [str(c.get("name")) if isinstance(c, dict) else repr(c) for c in codecs] if isinstance(codecs, list) \
        else None
    if names is None:
        return None, f"has codecs {codecs!r:.80}, expected a list ({_WRITES})"
    unknown = [n for n in names if n not in ("bytes", "crc32c", *INNER_CODECS)]
    if unknown:
        return None, (f"uses codec {unknown[0]!r}, which this tool never writes (its chain is {_WRITES}); a reader "
                      "would not decode it. The cache was altered or written by something else: re-create it")
    if len(names) not in (2, 3) or names[0] != "bytes" or names[-1] != "crc32c" or (
            len(names) == 3 and names[1] not in INNER_CODECS):
        return None, f"has codec chain {' -> '.join(names)}, which this tool never writes (it writes {_WRITES})"
    conf = codecs[0].get("configuration") or {}
    endian = conf.get("endian") if isinstance(conf, dict) else "?"
    if endian not in ("little", None) or (endian is None and dtype.itemsize > 1):
        return None, f"stores {endian!r}-endian bytes; this tool writes little-endian ({_WRITES})"
    return (names[1] if len(names) == 3 else None), None


def _attribute_problems(where: str, meta: dict[str, Any], want: ExpectedArray) -> list[str]:
    got = meta.get("attributes") or {}
    if not isinstance(got, dict):
        return [f"{where} attributes are not an object"]
    return [f"{where} has attribute {k}={got.get(k)!r}, the manifest implies {v!r}"
            + (": the array holds another layer than the manifest names" if k == "layer_id" else "")
            for k, v in want.attrs.items() if got.get(k) != v]


def array_meta_problems(name: str, meta: Any, want: ExpectedArray) -> tuple[ArrayMeta | None, list[str]]:
    """Check one array's zarr.json against what the manifest implies; the parsed meta when it passes.

    The chunk codec chain must be one the writer writes (``bytes`` little-endian, then
    ``blosc``, ``zstd`` or nothing, then ``crc32c``), inside ``sharding_indexed`` (index
    checksummed, at the end) for a format 2 token array: the reader decodes exactly that.
    """
    where = f"array {name!r} ({name}/zarr.json)"
    if not isinstance(meta, dict):
        return None, [f"{where} is not a JSON object; the array's metadata is damaged"]
    problems: list[str] = []
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        problems.append(f"{where} is not zarr v3 array metadata (zarr_format={meta.get('zarr_format')!r}, "
                        f"node_type={meta.get('node_type')!r})")
    if meta.get("data_type") != want.dtype.name:
        problems.append(f"{where} has data_type {meta.get('data_type')!r}, the manifest implies {want.dtype.name!r}")
    got_shape = meta.get("shape")
    if not (isinstance(got_shape, list) and all(is_int(x) for x in got_shape)) or tuple(got_shape) != want.shape:
        problems.append(f"{where} has shape {got_shape!r:.80}, the manifest implies {list(want.shape)} "
                        f"({want.shape_from})")
    outer, found = _grid(where, meta, want)
    problems += found
    sep, v2, found = _key_encoding(where, meta, want)
    problems += found
    if meta.get("storage_transformers") not in (None, []):
        problems.append(f"{where} has storage transformers {meta.get('storage_transformers')!r:.80}; this tool "
                        "never writes any")
    codecs, per_shard = meta.get("codecs"), None
    if want.shard_rows is not None:
        codecs, per_shard, problem = _sharding(codecs, want)
        if problem:
            problems.append(f"{where} {problem}")
    compressor, chain_problem = _codec_chain(codecs, want.dtype) if codecs is not None else (None, None)
    if chain_problem:
        problems.append(f"{where} {chain_problem}")
    problems += _attribute_problems(where, meta, want)
    if problems or outer is None:
        return None, problems
    inner = tuple(want.chunks) if want.shard_rows is not None and want.chunks else tuple(outer)
    parsed = ArrayMeta(name, want.dtype.newbyteorder("<"), want.shape, inner, compressor, sep, v2, want.positive,
                       per_shard)
    if parsed.chunk_nbytes > MAX_CHUNK_BYTES:
        return None, [f"{where} has {parsed.chunk_nbytes:,}-byte chunks, more than a reader decodes at once "
                      f"({MAX_CHUNK_BYTES:,})"]
    return parsed, []


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
