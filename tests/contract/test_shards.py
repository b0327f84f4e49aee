"""Shard indexes: what the writer builds parses back exactly, and no byte string crafted or damaged any way makes a
reader trust an offset outside the object."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_precompute.contract.shards import (
    ABSENT,
    ShardDigest,
    ShardIndexProblem,
    encode_index,
    encode_shard,
    index_nbytes,
    parse_index,
)


def with_crc(body: bytes) -> bytes:
    return body + int(google_crc32c.value(body)).to_bytes(4, "little")


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(5, 5000), min_size=0, max_size=40), spare=st.integers(0, 10))
def test_a_shard_the_writer_builds_parses_back_to_its_chunks_in_order(sizes, spare):
    n = len(sizes) + spare
    if n == 0:
        return
    chunks = [(bytes([k % 251]) * (s - 4), bytes(4)) for k, s in enumerate(sizes)]
    blob = b"".join(bytes(memoryview(p)) for p in encode_shard(chunks, n))
    table = parse_index(blob[-index_nbytes(n):], n, len(blob), max_chunk_bytes=5000)
    for k, s in enumerate(sizes):
        off, nbytes = table[k]
        assert nbytes == s and blob[off:off + nbytes] == b"".join(chunks[k])
    assert (table[len(sizes):] == -1).all()  # the unit's unused chunks: absent, zarr reads the fill value


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(min_size=0, max_size=200), n=st.integers(1, 8), size=st.integers(0, 1 << 20))
def test_any_bytes_are_a_parsed_index_or_a_named_problem_never_a_crash(garbage, n, size):
    try:
        table = parse_index(garbage, n, size, max_chunk_bytes=4096)
    except ShardIndexProblem as exc:
        assert str(exc)
        return
    present = table[:, 0] >= 0
    assert ((table[present, 0] + table[present, 1]) <= size - index_nbytes(n)).all()
    ends = table[present, 0] + table[present, 1]
    assert (table[present, 0][1:] >= ends[:-1]).all()  # no two chunks share a byte, in token order


def _index(entries: list[tuple[int, int]]) -> bytes:
    return with_crc(np.asarray(entries, dtype="<u8").tobytes())


@pytest.mark.parametrize("entries,size,words", [
    ([(0, 100), (100, 5000)], 10_000, "exceeds a chunk's"),
    ([(0, 100), (9_990, 50)], 10_000, "points outside"),
    ([(0, 100), (2**63, 2**63 + 10)], 10_000, "points outside"),  # offset + nbytes wraps around 2^64
    ([(0, 0), (ABSENT, ABSENT)], 10_000, "points outside|exceeds"),  # an empty chunk is never written
])
def test_an_index_with_a_valid_checksum_naming_bytes_outside_the_object_is_refused(entries, size, words):
    with pytest.raises(ShardIndexProblem, match=words) as info:
        parse_index(_index(entries), len(entries), size, max_chunk_bytes=4096)
    assert not info.value.checksum


def test_a_flipped_index_byte_and_a_truncated_object_are_checksum_problems():
    raw = bytearray(encode_index([10, 20], 4))
    raw[3] ^= 1
    with pytest.raises(ShardIndexProblem, match="fails its crc32c checksum") as info:
        parse_index(bytes(raw), 4, 1000, 4096)
    assert info.value.checksum
    with pytest.raises(ShardIndexProblem, match="too short to hold its index") as info:
        parse_index(encode_index([10], 4)[:-1], 4, 60, 4096)
    assert info.value.checksum


@pytest.mark.parametrize("entries", [
    [(0, 100), (0, 100), (200, 50)],             # two entries naming the same bytes
    [(0, 100), (50, 100), (ABSENT, ABSENT)],     # a chunk starting inside the one before
    [(100, 100), (0, 100), (ABSENT, ABSENT)],    # two chunks' entries swapped
    [(0, 100), (ABSENT, ABSENT), (40, 60)],      # out of order across an absent chunk
])
def test_an_index_with_a_valid_checksum_whose_chunks_overlap_or_are_out_of_order_is_refused(entries):
    with pytest.raises(ShardIndexProblem, match="overlap or are out of order") as info:
        parse_index(_index(entries), len(entries), 10_000, max_chunk_bytes=4096)
    assert not info.value.checksum


def test_an_index_with_a_gap_where_a_chunk_was_marked_absent_still_parses():
    table = parse_index(_index([(0, 100), (ABSENT, ABSENT), (250, 50)]), 3, 1000, max_chunk_bytes=4096)
    assert table.tolist() == [[0, 100], [-1, -1], [250, 50]]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(5, 3000), min_size=1, max_size=20), spare=st.integers(0, 4),
       split=st.booleans())
def test_a_shards_digest_is_the_crc32c_values_its_written_bytes_hold(sizes, spare, split):
    """Oracle: the digest read from the shard's bytes alone (its last 4 bytes, each present chunk's last 4)."""
    n = len(sizes) + spare
    rng = np.random.default_rng(len(sizes))
    bodies = [rng.integers(0, 256, s - 4, dtype=np.uint8).tobytes() for s in sizes]
    chunks = [((b[:len(b) // 2], b[len(b) // 2:] + with_crc(b)[-4:][:2], with_crc(b)[-2:]) if split
               else (b, with_crc(b)[-4:])) for b in bodies]  # a crc32c spread over parts is taken whole
    shard = encode_shard(chunks, n)
    with pytest.raises(RuntimeError, match="only once all of its parts were written"):
        _ = shard.digest
    blob = b"".join(bytes(memoryview(p)) for p in shard)
    table = parse_index(blob[-index_nbytes(n):], n, len(blob), max_chunk_bytes=5000)
    want = blob[-4:] + b"".join(blob[o + k - 4:o + k] for o, k in table if o >= 0)
    assert shard.digest.hex() == want.hex() and shard.digest.n_chunks == len(sizes)
    assert ShardDigest.from_hex(shard.digest.hex(), n) == shard.digest
    assert [shard.digest.chunk(k) for k in range(len(sizes))] == [with_crc(b)[-4:] for b in bodies]
    assert shard.digest.chunk(len(sizes)) is None


@pytest.mark.parametrize("value", [None, 12, "", "abc", "0" * 7, "0" * 12, "zz" * 4, "AB" * 4, "00" * 4 * 6])
def test_a_value_that_is_not_a_digest_is_none(value):
    assert ShardDigest.from_hex(value, max_chunks=4) is None
