"""Caches of format 1 (written by dspark-precompute 0.2.0, one object per chunk, units packed back to back) still
open, read, load, export and verify. The fixture was written by that release (tests/data/format1_caches.tgz)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import REPO

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.errors import MissingChunkError
from dspark_precompute.read.training import build_dataloader


@pytest.fixture(scope="module")
def v1(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("format1")
    with tarfile.open(REPO / "tests" / "data" / "format1_caches.tgz") as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def zarr_rows(path: Path, name: str, a: int, b: int) -> np.ndarray:
    return np.asarray(zarr.open_array(str(path / name), mode="r")[a:b])


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_a_format_1_cache_opens_and_every_sample_reads_what_plain_zarr_holds(v1, dtype):
    path = v1 / dtype
    m = json.loads((path / "manifest.json").read_text())
    assert m["format_version"] == 1 and not (path / "input_ids" / "c.0").exists()  # one file per chunk: c/<k>
    c = open_cache(path)
    assert c.manifest.format_version == 1 and len(c) == m["counts"]["samples"] == 5
    for i in range(len(c)):
        s = int(c.indices[i])
        a, n = c.chunks.span(s)
        got = c.read_raw(i)
        assert np.array_equal(got["input_ids"], zarr_rows(path, "input_ids", a, a + n))
        assert np.array_equal(got["loss_mask"], zarr_rows(path, "loss_mask", a, a + n))
        if dtype == "bf16":
            layers = [zarr_rows(path, f"hidden_states/layer_{lid}", a, a + n) for lid in m["layer_ids"]]
            assert np.array_equal(got["target_hidden_states"], np.concatenate(layers, axis=1))
    sample = c[0]
    assert sample["target_hidden_states"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_a_format_1_cache_verifies_loads_and_exports(v1, dtype, tmp_path, capsys):
    path = v1 / dtype
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "note: format 1: its chunks are not bound to their places" in out
    batches = list(build_dataloader(path, batch_size=2, shuffle=False))
    assert sum(int(b["attention_mask"].sum()) for b in batches) == int(open_cache(path).lengths().sum())
    assert main(["export-nemo", str(path), str(tmp_path / "nemo")]) == 0
    assert json.loads((tmp_path / "nemo" / "manifest.json").read_text())["num_samples"] == 5


def test_a_missing_format_1_chunk_is_still_a_missing_chunk_error(v1, tmp_path):
    import shutil

    path = tmp_path / "copy"
    shutil.copytree(v1 / "bf16", path)
    (path / "hidden_states" / "layer_1" / "c" / "0" / "0").unlink()
    c = open_cache(path)
    with pytest.raises(MissingChunkError, match=r"chunk \(0, 0\) \(file hidden_states/layer_1/c/0/0\) is missing"):
        c[int(np.flatnonzero(c.starts() < 64)[0])]
