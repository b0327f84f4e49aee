"""Export to NeMo AutoModel's DSpark offline layout: files, manifest, shards, padding, weights.

Modules: ``read/export/common.py``, ``read/export/nemo.py``, ``read/export/deepspec.py``,
``read/export/specforge.py`` and ``read/export/speculators.py``, through the one ``export`` entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import compose, small
from safetensors import safe_open
from safetensors.torch import load_file

from dspark_precompute import open_cache
from dspark_precompute.errors import CacheFormatError, IncompleteCacheError
from dspark_precompute.read.export import export_nemo
from dspark_precompute.write.run import run

SHARD_KEYS = {"input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states"}


def zarr_rows(path: str, i: int, layers: list[int]) -> dict[str, np.ndarray]:
    """Oracle: sample ``i`` from the zarr arrays by the documented names (bf16 as uint16 bits)."""
    g = zarr.open_group(path, mode="r")
    a, n = int(g["samples/start"][i]), int(g["samples/length"][i])
    return {
        "input_ids": np.asarray(g["input_ids"][a:a + n]),
        "loss_mask": np.asarray(g["loss_mask"][a:a + n]),
        "hidden": np.concatenate([np.asarray(g[f"hidden_states/layer_{lid}"][a:a + n]) for lid in layers], axis=1),
        "last": np.asarray(g["hidden_states/layer_3"][a:a + n]) if 3 in layers else
        np.asarray(g["hidden_states/final_norm"][a:a + n]),
    }


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory):
    """An untied target capturing layers [0, 1] (so the post-norm state has its own array).

    Same config and place as test_reader's final_norm_run: whichever runs first builds it.
    """
    base = tmp_path_factory.getbasetemp()
    return run(compose(small(base, "model.layer_ids=[0,1]", "model.random.tie_word_embeddings=false",
                             "data.max_samples=3", "storage.compressor=zstd", "storage.compression_level=3",
                             name="layers01_untied")))


def test_the_export_has_nemos_files_manifest_and_shard_shapes(default_run, tmp_path):
    _, result = default_run
    c = open_cache(result.path)
    out = tmp_path / "nemo"
    r = export_nemo(result.path, out, shard_size=5)
    n, S, H = len(c), 256, 64
    assert n == result.samples > 5  # several shards, the last one partial
    shards = -(-n // 5)
    assert (r.num_samples, r.num_shards) == (n, shards)
    assert sorted(os.listdir(out)) == ["dspark_export.json", "manifest.json",
                                       *[f"shard-{k:06d}.safetensors" for k in range(shards)],
                                       "target_weights.safetensors"]  # nothing temporary left behind
    assert os.listdir(tmp_path) == ["nemo"]  # nor beside it
    text = (out / "manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    src = c.manifest.to_json()
    assert manifest == {
        "format_version": 1, "target_model": "tiny", "target_model_type": "qwen3",
        "target_vocab_size": src["target_vocab_size"], "hidden_size": H, "num_hidden_layers": 4, "seq_length": S,
        "dtype": "bf16", "num_samples": n, "shard_size": 5, "target_hidden_dim": 3 * H,
        "target_last_hidden_dim": H, "target_layer_ids": [1, 2, 3], "train_data_path": "embedded",
        "train_split": "train", "shuffle_seed": None, "mask_reasoning_content": False,
        "mask_generation_prompt": False,
        "chat_template_sha256": hashlib.sha256(src["chat_template"].encode()).hexdigest(), "complete": True,
    }
    assert manifest["chat_template_sha256"] == src["identity"]["chat_template_sha256"]
    for k in range(shards):
        rows = min(5, n - 5 * k)  # only the last shard is partial
        with safe_open(str(out / f"shard-{k:06d}.safetensors"), framework="pt") as f:
            assert set(f.keys()) == SHARD_KEYS
            shapes = {key: (f.get_slice(key).get_shape(), f.get_slice(key).get_dtype()) for key in f.keys()}
        assert shapes == {"input_ids": ([rows, S], "I64"), "attention_mask": ([rows, S], "I64"),
                          "loss_mask": ([rows, S], "I64"), "target_hidden_states": ([rows, S, 3 * H], "BF16"),
                          "target_last_hidden_states": ([rows, S, H], "BF16")}


def test_exported_rows_round_trip_to_the_zarr_cache_with_nemo_padding(default_run, tmp_path):
    _, result = default_run
    c = open_cache(result.path)
    out = tmp_path / "nemo"
    export_nemo(result.path, out, shard_size=4)
    pad = c.manifest.to_json()["pad_token_id"]
    assert pad == 256  # the tiny tokenizer's <|endoftext|>
    assert len(c) == result.samples > 4  # every sample of the run, over several shards
    for i in range(len(c)):
        shard = load_file(str(out / f"shard-{i // 4:06d}.safetensors"))
        row = {k: v[i % 4] for k, v in shard.items()}
        want = zarr_rows(result.path, i, [1, 2, 3])
        n = len(want["input_ids"])
        assert np.array_equal(row["input_ids"][:n].numpy(), want["input_ids"].astype(np.int64))
        assert row["input_ids"][n:].eq(pad).all()
        assert row["attention_mask"][:n].eq(1).all() and row["attention_mask"][n:].eq(0).all()
        assert np.array_equal(row["loss_mask"][:n].numpy(), want["loss_mask"].astype(np.int64))
        assert row["loss_mask"][n:].eq(0).all()
        assert np.array_equal(bits(row["target_hidden_states"][:n]), want["hidden"])
        assert np.array_equal(bits(row["target_last_hidden_states"][:n]), want["last"])
        assert row["target_hidden_states"][n:].eq(0).all() and row["target_last_hidden_states"][n:].eq(0).all()


def test_tied_weights_are_written_twice_and_untied_ones_as_they_are(default_run, untied_run, tmp_path):
    _, result = default_run
    for src, tied in ((result.path, True), (untied_run.path, False)):
        out = tmp_path / ("tied" if tied else "untied")
        export_nemo(src, out)
        w = load_file(str(out / "target_weights.safetensors"))
        cached = load_file(str(Path(src) / "target_weights.safetensors"))
        assert sorted(w) == ["embed_tokens.weight", "lm_head.weight"]
        assert ("lm_head.weight" in cached) is (not tied)
        V = open_cache(src).manifest.to_json()["target_vocab_size"]
        for key in w:
            assert w[key].shape == (V, 64) and w[key].dtype == torch.float32  # NeMo's writer stores float32
            assert torch.equal(w[key], cached.get(key, cached["embed_tokens.weight"]).float())
        assert torch.equal(w["embed_tokens.weight"], w["lm_head.weight"]) is tied


def test_a_layer_subset_and_a_separate_final_norm_export_consistently(untied_run, tmp_path):
    out = tmp_path / "nemo"
    export_nemo(untied_run.path, out, layers=[1])
    m = json.loads((out / "manifest.json").read_text())
    assert m["target_layer_ids"] == [1] and m["target_hidden_dim"] == 64 and m["num_samples"] == 3
    shard = load_file(str(out / "shard-000000.safetensors"))
    for i in range(3):
        want = zarr_rows(untied_run.path, i, [1])
        n = len(want["input_ids"])
        assert np.array_equal(bits(shard["target_hidden_states"][i, :n]), want["hidden"])
        assert np.array_equal(bits(shard["target_last_hidden_states"][i, :n]), want["last"])


def test_the_export_appears_by_one_rename_of_a_whole_staging_directory(default_run, tmp_path, monkeypatch):
    _, result = default_run
    renames: list[tuple[Path, Path, list[str]]] = []
    real = os.replace

    def spy(src, dst):
        real(src, dst)
        renames.append((Path(src), Path(dst), sorted(os.listdir(dst)) if Path(dst).is_dir() else []))

    monkeypatch.setattr(os, "replace", spy)
    out = tmp_path / "nemo"
    export_nemo(result.path, out, shard_size=8)
    *inside, (src, dst, listing) = renames
    assert dst == out and src.parent == tmp_path and src.name.startswith(".nemo.partial-")
    assert listing == sorted(os.listdir(out)) and {"manifest.json", "dspark_export.json"} <= set(listing)
    assert all(s.parent == d.parent == src for s, d, _ in inside)  # every file was put together in the staging dir
    assert [d.name for _, d, _ in inside][-2:] == ["manifest.json", "dspark_export.json"]  # the manifest, then ours


def test_export_memory_does_not_grow_with_the_shard(default_run, tmp_path):
    _, result = default_run  # 256-token chunks: what is decoded at a time is small, the writer's footprint shows
    c = open_cache(result.path, chunk_cache_bytes=0)
    n = len(c)
    one_shard = n * 256 * (3 * 64 + 64) * 2 + 3 * n * 256 * 8  # every sample in one shard
    peaks = {}
    for shard_size in (2, n):
        tracemalloc.start()
        export_nemo(c, tmp_path / f"nemo{shard_size}", shard_size=shard_size)
        peaks[shard_size] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert (tmp_path / f"nemo{n}" / "shard-000000.safetensors").stat().st_size > one_shard
    assert peaks[n] < 1.5 * peaks[2], peaks  # a 7x larger shard, not more memory
    assert peaks[n] < one_shard / 2, (peaks, one_shard)  # building the shard in memory would need >= 1x


def test_an_occupied_destination_is_refused_and_overwrite_replaces_it_whole(default_run, tmp_path):
    _, result = default_run
    out = tmp_path / "nemo"
    export_nemo(result.path, out, shard_size=2)
    with pytest.raises(CacheFormatError, match=f"already holds a nemo export of {result.path}; pass overwrite=True"):
        export_nemo(result.path, out)
    export_nemo(result.path, out, shard_size=100, overwrite=True)
    assert sorted(os.listdir(out)) == ["dspark_export.json", "manifest.json", "shard-000000.safetensors",
                                       "target_weights.safetensors"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(CacheFormatError, match=r"holds other files \(notes.txt\)"):
        export_nemo(result.path, other)
    with pytest.raises(CacheFormatError, match="is inside the cache"):
        export_nemo(result.path, Path(result.path) / "nemo")


def test_an_incomplete_cache_is_not_exported(default_run, tmp_path):
    _, result = default_run
    copy = tmp_path / "copy"
    shutil.copytree(result.path, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["complete"] = False
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IncompleteCacheError):
        export_nemo(copy, tmp_path / "a")
    with pytest.raises(IncompleteCacheError, match="NeMo's layout has no partial form"):
        export_nemo(open_cache(copy, allow_incomplete=True), tmp_path / "b")


def test_a_nemo_export_an_earlier_version_wrote_in_place_is_recognised(default_run, tmp_path):
    """0.3.0 and before wrote NeMo's files in place, the manifest last: without it the directory is an export a kill
    interrupted (replaced without overwrite), with it a finished one (replaced only with overwrite)."""
    _, result = default_run
    whole = tmp_path / "whole"
    export_nemo(result.path, whole, shard_size=4)
    out = tmp_path / "nemo"
    out.mkdir()
    for name in ("target_weights.safetensors", "shard-000000.safetensors", "shard-000001.safetensors"):
        shutil.copy(whole / name, out / name)
    (out / ".shard-000002.safetensors.4242.tmp").write_bytes(b"half")  # what the kill left mid-shard
    export_nemo(result.path, out, shard_size=4)  # no overwrite needed: nothing finished was there
    assert files_of(out) == files_of(whole)
    (out / "dspark_export.json").unlink()  # now it looks like a finished export of the earlier version
    with pytest.raises(CacheFormatError, match="already holds a nemo export; pass overwrite=True"):
        export_nemo(result.path, out, shard_size=4)
    export_nemo(result.path, out, shard_size=4, overwrite=True)
    assert files_of(out) == files_of(whole)
    (out / "notes.txt").write_text("mine")
    (out / "dspark_export.json").unlink()
    with pytest.raises(CacheFormatError, match=r"holds other files \(.*notes.txt"):
        export_nemo(result.path, out, shard_size=4, overwrite=True)


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no process has this id (until the kernel reuses it, long after this test)
    return proc.pid


def test_what_a_killed_export_left_beside_the_destination_is_removed_or_put_back(default_run, tmp_path):
    _, result = default_run
    out = tmp_path / "nemo"
    export_nemo(result.path, out, shard_size=4, layers=[1])
    previous = files_of(out)
    dead, alive = a_dead_pid(), os.getppid()
    os.replace(out, tmp_path / f".nemo.old-{dead}")  # a kill between the two renames of a swap
    (tmp_path / f".nemo.partial-{dead}").mkdir()
    (tmp_path / f".nemo.partial-{dead}" / "shard-000000.safetensors").write_bytes(b"partial")
    (tmp_path / f".nemo.partial-{dead}.rows.arrow").write_bytes(b"scratch")
    (tmp_path / f".nemo.partial-{alive}").mkdir()  # another export, still running: not ours to remove
    with pytest.raises(CacheFormatError, match="already holds a nemo export"):
        export_nemo(result.path, out, shard_size=4)
    assert files_of(out) == previous  # the previous export is back, whole
    assert sorted(os.listdir(tmp_path)) == [f".nemo.partial-{alive}", "nemo"]
