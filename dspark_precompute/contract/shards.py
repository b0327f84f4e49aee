"""Shards: zarr v3's ``sharding_indexed`` codec, as format 2 writes and reads it.

One shard object holds one commit unit's token slots of one array. Its inner chunks
(``chunk_tokens`` rows each, encoded as ``bytes -> [blosc|zstd] -> crc32c``) lie back to
back from byte 0 in token order; the index follows them at the end::

    [chunk 0][chunk 1]...[chunk k-1][index: n x (offset u64 LE, nbytes u64 LE)][crc32c of the index, u32 LE]

``n`` is the shard's inner chunk count (``unit_tokens / chunk_tokens``); an inner chunk no
sample touches (past the unit's last token) is absent: its entry is ``(2**64-1, 2**64-1)``
and plain zarr reads the fill value there. Everything else in a written unit is present,
so an absent chunk that holds samples is damage.

:func:`encode_shard` builds the exact bytes zarr-python writes for the same chunks (they lie
in C order, which for a shard one chunk wide is also zarr's Morton order), and
:func:`parse_index` checks an index before any offset in it is trusted: its size, its
crc32c, that every present chunk lies inside the data region and is no larger than a chunk
of the array can be, and that the present chunks lie in token order without overlapping.

Nothing in a shard's own bytes says where it belongs: each crc32c covers only its own chunk or
index. :class:`ShardDigest` is what binds it to its place (format 3): the crc32c values a writer
wrote into the shard (its index's, then each present chunk's, in token order), taken from the
parts as :class:`EncodedShard` yields them and recorded in the unit's commit record, so a reader
can check a shard it loads, and each chunk it decodes, against what was written there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ABSENT = (1 << 64) - 1
ENTRY_BYTES = 16


def index_nbytes(n_chunks: int) -> int:
    """Bytes of a shard index for ``n_chunks`` inner chunks (the trailing crc32c included)."""
    return ENTRY_BYTES * int(n_chunks) + 4


def _crc(data: bytes | memoryview | np.ndarray) -> bytes:
    import google_crc32c

    return int(google_crc32c.value(data)).to_bytes(4, "little")


def encode_index(lengths: Sequence[int], n_chunks: int) -> bytes:
    """The index of a shard whose first ``len(lengths)`` inner chunks hold ``lengths`` bytes each, in order."""
    if len(lengths) > n_chunks:
        raise ValueError(f"{len(lengths)} chunks do not fit a shard of {n_chunks}")
    table = np.full((n_chunks, 2), ABSENT, dtype="<u8")
    sizes = np.asarray(lengths, dtype=np.uint64)
    table[:len(sizes), 1] = sizes
    table[:len(sizes), 0] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64) if len(sizes) else sizes
    raw = table.tobytes()
    return raw + _crc(raw)


CRC_BYTES = 4


@dataclass(frozen=True)
class ShardDigest:
    """The crc32c values a writer wrote into one shard: its index's (the shard's last 4 bytes) and each present
    inner chunk's (each chunk's last 4 bytes), in token order, as stored (little-endian).

    Written in a commit record as one lowercase hex string, the index's 8 digits first, then 8 per
    chunk (:meth:`hex`): a shard moved to another place, copied from another cache or given a
    reordered index then disagrees with it, although each of its crc32c values is valid.
    """

    index: bytes
    chunks: bytes  # CRC_BYTES per present inner chunk

    @property
    def n_chunks(self) -> int:
        return len(self.chunks) // CRC_BYTES

    def chunk(self, k: int) -> bytes | None:
        """The stored crc32c of present inner chunk ``k``; None past the last one written."""
        return self.chunks[k * CRC_BYTES:(k + 1) * CRC_BYTES] if 0 <= k < self.n_chunks else None

    def hex(self) -> str:
        return (self.index + self.chunks).hex()

    @classmethod
    def from_hex(cls, value: Any, max_chunks: int) -> ShardDigest | None:
        """The digest a record holds; None when ``value`` is not one (not a hex string of 1 + k crc32c values,
        k at most ``max_chunks``)."""
        n = 2 * CRC_BYTES
        if not isinstance(value, str) or not n <= len(value) <= n * (max_chunks + 1) or len(value) % n:
            return None
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            return None
        return cls(raw[:CRC_BYTES], raw[CRC_BYTES:]) if raw.hex() == value else None  # lowercase only


def _last_crc(pieces: Sequence[Any]) -> bytes:
    """The last 4 bytes of a chunk given as its parts (its crc32c as written)."""
    tail = b""
    for p in reversed(pieces):
        tail = bytes(memoryview(p).cast("B")[-(CRC_BYTES - len(tail)):]) + tail
        if len(tail) == CRC_BYTES:
            break
    return tail


class EncodedShard:
    """The parts of a shard object, yielded in the order they are written; then :attr:`digest`.

    ``chunks`` are the encoded inner chunks in token order, each given as its parts (``(body,
    crc)`` from :func:`~dspark_precompute.contract.arrays.chunk_encoder`: written as they are,
    never joined); the index goes last. Lazy: a writer holds one chunk at a time, whatever the
    shard's size. The digest is taken from the very parts handed out, so it is what was written,
    never recomputed from what a read finds later; it exists only once every part was taken.
    """

    def __init__(self, chunks: Iterable[Sequence[Any]], n_chunks: int):
        self._chunks, self._n = chunks, int(n_chunks)
        self._digest: ShardDigest | None = None

    def __iter__(self) -> Iterator[Any]:
        lengths, crcs = [], []
        for pieces in self._chunks:
            n = 0
            for p in pieces:
                n += memoryview(p).nbytes
                yield p
            lengths.append(n)
            crcs.append(_last_crc(pieces))
        index = encode_index(lengths, self._n)
        yield index
        self._digest = ShardDigest(index[-CRC_BYTES:], b"".join(crcs))

    @property
    def digest(self) -> ShardDigest:
        if self._digest is None:
            raise RuntimeError("a shard's digest exists only once all of its parts were written")
        return self._digest


def encode_shard(chunks: Iterable[Sequence[Any]], n_chunks: int) -> EncodedShard:
    """The parts of a shard object (iterate once, in write order) and, after them, its digest."""
    return EncodedShard(chunks, n_chunks)


class ShardIndexProblem(ValueError):
    """Why a shard's index cannot be used (its bytes, checksum or entries)."""

    def __init__(self, message: str, checksum: bool = False):
        super().__init__(message)
        self.checksum = checksum  # the index's own crc32c failed (corrupt or truncated bytes)


def parse_index(raw: bytes | memoryview, n_chunks: int, object_size: int, max_chunk_bytes: int) -> np.ndarray:
    """A shard's index -> ``int64 [n_chunks, 2]`` (offset, nbytes; ``-1, -1`` for an absent chunk).

    ``raw`` is the object's last :func:`index_nbytes` bytes and ``object_size`` its size.
    Raises :class:`ShardIndexProblem` when the index is not that long, fails its crc32c, or
    names a chunk outside ``[0, object_size - index)``, an empty one, one larger than
    ``max_chunk_bytes``, or chunks that overlap or lie out of token order (each would pass its
    own crc32c and decode as another); a reader then decodes nothing from the shard.
    """
    want = index_nbytes(n_chunks)
    raw = bytes(raw)
    if len(raw) != want or object_size < want:
        raise ShardIndexProblem(f"is {object_size:,} bytes, too short to hold its index of {want:,} bytes "
                                "(truncated)", checksum=True)
    body, crc = raw[:-4], raw[-4:]
    if _crc(body) != crc:
        raise ShardIndexProblem("has an index that fails its crc32c checksum (the shard was truncated, altered or "
                                "overwritten)", checksum=True)
    table = np.frombuffer(body, dtype="<u8").reshape(n_chunks, 2)
    absent = (table[:, 0] == ABSENT) & (table[:, 1] == ABSENT)
    offset, nbytes = table[:, 0], table[:, 1]
    data_end = object_size - want
    with np.errstate(over="ignore"):
        end = offset + nbytes
    bad = ~absent & ((nbytes == 0) | (nbytes > max_chunk_bytes) | (offset > data_end) | (end > data_end)
                     | (end < offset))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ShardIndexProblem(f"has an index entry for inner chunk {k} (offset {int(offset[k]):,}, "
                                f"{int(nbytes[k]):,} bytes) that points outside its {data_end:,} data bytes or "
                                f"exceeds a chunk's {max_chunk_bytes:,}")
    # chunks lie back to back in token order: two entries naming the same bytes (or a later chunk before an
    # earlier one) would each pass their own crc32c and decode one chunk's values as another's
    present = np.flatnonzero(~absent)
    wrong = np.flatnonzero(offset[present][1:] < end[present][:-1])
    if len(wrong):
        j, k = int(present[wrong[0]]), int(present[wrong[0] + 1])
        raise ShardIndexProblem(f"has index entries for inner chunks {j} and {k} that overlap or are out of order "
                                f"(chunk {k} at offset {int(offset[k]):,} starts before chunk {j} ends at "
                                f"{int(end[j]):,}); a shard holds its chunks back to back in token order, so one "
                                "chunk's bytes would be read as another's")
    out = table.astype(np.int64)
    out[absent] = -1
    return out
