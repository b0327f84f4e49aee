"""Caches of format 2 (written by dspark-precompute 0.3.0 at 64995d8: sharded, but no shard digests in their commit
records) read as before, and ``verify`` says, as a note, that their shards are not bound to their places.
The fixture was written by that commit (tests/data/format2_caches.tgz: 7 samples in 4 units)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from test_format1 import zarr_rows

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.read.training import build_dataloader


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("format2")
    with tarfile.open(REPO / "tests" / "data" / "format2_caches.tgz") as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "bf16"


def test_a_format_2_cache_reads_every_sample_as_plain_zarr_holds_it(v2):
    m = json.loads((v2 / "manifest.json").read_text())
    assert m["format_version"] == 2 and not (v2 / "commits" / "tokens.json").exists()
    assert "shards" not in json.loads((v2 / "commits" / "u000000.json").read_text())
    c = open_cache(v2)
    assert c.manifest.format_version == 2 and len(c) == m["counts"]["samples"] == 7
    for i in range(len(c)):
        s = int(c.indices[i])
        a, n = c.chunks.span(s)
        got = c.read_raw(i)
        assert np.array_equal(got["input_ids"], zarr_rows(v2, "input_ids", a, a + n))
        layers = [zarr_rows(v2, f"hidden_states/layer_{lid}", a, a + n) for lid in m["layer_ids"]]
        assert np.array_equal(got["target_hidden_states"], np.concatenate(layers, axis=1))
    assert sum(int(b["attention_mask"].sum()) for b in build_dataloader(v2, batch_size=2, shuffle=False)) == \
        int(c.lengths().sum())


def test_verify_passes_a_format_2_cache_with_a_note_that_its_shards_are_not_bound(v2, capsys):
    assert main(["verify", str(v2), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and any(n.startswith("format 2: its shards are not bound to their places") for n in
                                report["notes"]), report
