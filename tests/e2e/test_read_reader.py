"""The reader in a fresh interpreter and against every codec chain the writer writes.

The e2e part of tests/read/test_reader.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.write.run import run


def test_the_reading_side_imports_nothing_from_transformers():
    code = ("import sys, dspark_precompute.read.reader, dspark_precompute.read.training, "
            "dspark_precompute.read.export, "
            "dspark_precompute.read.verify, dspark_precompute.cli.cache; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'tokenizers', 'hydra')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("extra", [("storage.compressor=none", "storage.dtype=fp32"),
                                   ("storage.compressor=blosc_lz4", "storage.shuffle=bit", "storage.dtype=fp16")])
def test_every_codec_chain_the_writer_writes_reads_back_what_zarr_holds(tmp_path, extra):
    result = run(compose(small(tmp_path, "data.max_samples=4", "storage.chunk_tokens=128", *extra)))
    c = open_cache(result.path)
    g = zarr.open_group(result.path, mode="r")
    meta = json.loads((Path(result.path) / "hidden_states" / "layer_1" / "zarr.json").read_text())
    assert [x["name"] for x in meta["codecs"]] == ["sharding_indexed"]
    codecs = [x["name"] for x in meta["codecs"][0]["configuration"]["codecs"]]  # each inner chunk's chain
    assert codecs == (["bytes", "crc32c"] if "none" in extra[0] else ["bytes", "blosc", "crc32c"])
    for name in ["input_ids", "loss_mask", *dict.fromkeys(c.array_names.values())]:
        want = np.asarray(g[name][:])
        got = c.chunks.read([name], 0, want.shape[0])[name]
        assert got.dtype == want.dtype and np.array_equal(got, want), name
