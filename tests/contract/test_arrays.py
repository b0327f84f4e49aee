"""The codec chain and the chunk encoder writers use instead of zarr's array assignment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dspark_precompute.contract.arrays import chunk_encoder, codec_chain


@pytest.mark.parametrize("compressor,shuffle", [("blosc_zstd", "byte"), ("blosc_zstd", "bit"), ("blosc_lz4", "none"),
                                                ("zstd", "none"), ("none", "byte")])
@pytest.mark.parametrize("dtype,width", [("uint16", 48), ("int32", None), ("uint8", None)])
def test_an_encoded_chunk_is_the_file_zarr_writes_for_it(tmp_path, compressor, shuffle, dtype, width):
    import zarr

    rng = np.random.default_rng(0)
    shape = (256,) if width is None else (256, width)
    data = rng.integers(0, 60000 if dtype == "uint16" else 200, size=shape).astype(dtype)
    data[:40] = 0  # a run of zeros: compressible, and never skipped
    chunks = (128,) + shape[1:]
    g = zarr.create_group(zarr.storage.LocalStore(tmp_path))
    a = g.create_array("x", shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
                       compressors=codec_chain(compressor, 1, shuffle, np.dtype(dtype).itemsize))
    a[:] = data
    encode = chunk_encoder(compressor, 1, shuffle, np.dtype(dtype).itemsize)
    for c in range(2):
        key = Path(tmp_path, "x", "c", str(c), *(["0"] if width else []))
        body, crc = encode(data[c * 128:(c + 1) * 128])
        assert key.read_bytes() == bytes(body) + crc, c
