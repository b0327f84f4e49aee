"""Each trainer reads our exports with its own code: DeepSpec's layout, SpecForge's and speculators' loaders.

Every sample a trainer loads is compared with what our reader gives for it
(``open_cache(path).read_raw(i, layers)``): ids, loss mask and every state, bit for bit.

* DeepSpec is not on PyPI: an independent parser of its target-cache protocol, written
  here from its source (constants below, cited), reads the export.
* SpecForge 0.2.0 and vLLM speculators 0.9.0 are imported (``pytest.importorskip``):
  ``pip install -e ".[interop]" && pip install --no-deps specforge==0.2.0 speculators==0.9.0
  hs-connectors==0.9.0`` (their full dependency sets pin GPU-only packages: sglang, a
  torch CUDA build).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_precompute import open_cache
from dspark_precompute.errors import CacheFormatError, ExportError
from dspark_precompute.read.export import EXPORT_MARKER, export
from dspark_precompute.read.export.common import DROP_NO_SUPERVISED
from dspark_precompute.read.reader import CacheReader

INTEROP = ('pip install -e ".[interop]" && pip install --no-deps specforge==0.2.0 speculators==0.9.0 '
           'hs-connectors==0.9.0')

# DeepSpec's target-cache protocol, from github.com/deepseek-ai/DeepSpec at commit
# afdfa7c9382a3341a3e6f17756dd816da79f132c, deepspec/data/target_cache_dataset.py:
# TARGET_CACHE_VERSION = 2; INDEX_RECORD_STRUCT = struct.Struct("<QIIQQQQQ") (sample_id,
# shard_id, seq_len, then the offsets of input_ids, attention_mask, loss_mask,
# target_hidden_states, target_last_hidden_states); hidden bf16, tokens int32, masks uint8;
# validate_target_cache_manifest's required fields; validate_train_cache's three checks.
DS_VERSION = 2
DS_RECORD = "<QIIQQQQQ"
DS_RECORD_SIZE = 56
DS_REQUIRED = {"version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype",
               "mask_dtype", "index_record_size", "hidden_size", "shards"}


def deepspec_samples(out: Path) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """Read a DeepSpec target cache as its CacheDataset does (an independent re-implementation)."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert DS_REQUIRED <= set(manifest)
    assert manifest["version"] == DS_VERSION and manifest["index_record_size"] == DS_RECORD_SIZE
    assert (manifest["hidden_dtype"], manifest["token_dtype"], manifest["mask_dtype"]) == ("bfloat16", "int32",
                                                                                           "uint8")
    assert manifest["target_layer_ids"] == sorted(manifest["target_layer_ids"])
    assert [s["shard_id"] for s in manifest["shards"]] == list(range(manifest["num_shards"]))
    H, k = manifest["hidden_size"], len(manifest["target_layer_ids"])
    index = (out / "samples.idx").read_bytes()
    assert len(index) == manifest["num_samples"] * DS_RECORD_SIZE
    shards = {s["shard_id"]: (out / s["file_name"]).read_bytes() for s in manifest["shards"]}
    samples = []
    for j in range(manifest["num_samples"]):
        sid, shard, T, o_ids, o_attn, o_mask, o_hid, o_last = struct.unpack_from(DS_RECORD, index, j * DS_RECORD_SIZE)
        assert sid == j and T > 0
        # each sample is contiguous, its arrays in this order
        assert (o_attn, o_mask, o_hid, o_last) == (o_ids + 4 * T, o_ids + 5 * T, o_ids + 6 * T,
                                                   o_ids + 6 * T + 2 * T * k * H)
        buf = shards[shard]
        assert o_last + 2 * T * H <= len(buf)
        samples.append({
            "input_ids": np.frombuffer(buf, "<i4", T, o_ids),
            "attention_mask": np.frombuffer(buf, np.uint8, T, o_attn),
            "loss_mask": np.frombuffer(buf, np.uint8, T, o_mask),
            "hidden": np.frombuffer(buf, "<u2", T * k * H, o_hid).reshape(T, k * H),
            "last": np.frombuffer(buf, "<u2", T * H, o_last).reshape(T, H),
        })
    return manifest, samples


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_deepspec_reads_every_sample_of_the_export_as_our_reader_gives_it(default_run, tmp_path):
    _, result = default_run
    c = open_cache(result.path)
    out = tmp_path / "deepspec"
    r = export(result.path, out, to="deepspec", shard_bytes=300_000, progress=False)
    manifest, samples = deepspec_samples(out)
    assert r.num_samples == len(samples) == len(c) and r.num_shards == manifest["num_shards"] > 1
    assert manifest["target_layer_ids"] == c.layer_ids and manifest["hidden_size"] == c.hidden_size
    assert manifest["target_model_name_or_path"] == "tiny"  # what DeepSpec's trainer compares with its config
    assert manifest["mask_rule"] == "nemo_prefix" and manifest["converted_from"] is None
    for j, got in enumerate(samples):
        want = c.read_raw(j)
        assert np.array_equal(got["input_ids"], want["input_ids"])
        assert np.array_equal(got["loss_mask"], want["loss_mask"]) and got["attention_mask"].all()
        assert np.array_equal(got["hidden"], want["target_hidden_states"])
        assert np.array_equal(got["last"], want["target_last_hidden_states"])
    assert sorted(os.listdir(out)) == sorted([EXPORT_MARKER, "manifest.json", "samples.idx",
                                              *(s["file_name"] for s in manifest["shards"])])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left beside it


def test_an_fp8_cache_goes_to_deepspec_dequantized_to_bf16_and_the_manifest_says_so(fp8_run, tmp_path, caplog):
    _, result = fp8_run
    c = open_cache(result.path)
    out = tmp_path / "deepspec"
    with caplog.at_level("WARNING"):
        r = export(result.path, out, to="deepspec", layers=[1, 3], target_model_name_or_path="Qwen/Qwen3-8B",
                   progress=False)
    manifest, samples = deepspec_samples(out)
    assert manifest["converted_from"] == "fp8_e4m3" and any("dequantized" in n for n in manifest["notes"])
    assert any("dequantized to bf16" in rec.message for rec in caplog.records) and r.notes == manifest["notes"]
    assert manifest["target_layer_ids"] == [1, 3] and manifest["target_model_name_or_path"] == "Qwen/Qwen3-8B"
    for j, got in enumerate(samples):
        want = c.read_raw(j, [1, 3])  # the reader's dequantization (contract/fp8.py), as bf16 bits
        assert np.array_equal(got["hidden"], want["target_hidden_states"])
        assert np.array_equal(got["last"], want["target_last_hidden_states"])


def test_deepspec_refuses_layers_out_of_order_and_nothing_is_written(default_run, tmp_path):
    _, result = default_run
    with pytest.raises(ExportError, match=r"ascending order .* pass --layers 1,3"):
        export(result.path, tmp_path / "d", to="deepspec", layers=[3, 1], progress=False)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("to", ["nemo", "deepspec", "specforge"])
def test_max_length_cuts_every_sample_and_counts_the_samples_left_without_supervision(default_run, tmp_path, to):
    pytest.importorskip("specforge.runtime.data_plane.offline_reader", reason=f"needs SpecForge: {INTEROP}") \
        if to == "specforge" else None
    _, result = default_run
    c = open_cache(result.path)
    L = 40
    masks = [c.read_raw(i, [], last=False)["loss_mask"] for i in range(len(c))]
    keep = [i for i, m in enumerate(masks) if m[:L].any()]
    assert 0 < len(keep) < len(c)  # the fixture has samples whose first answer starts past 40 tokens
    r = export(result.path, tmp_path / to, to=to, max_length=L, progress=False)
    assert r.dropped == {DROP_NO_SUPERVISED: len(c) - len(keep)} and r.num_samples == len(keep)
    if to == "deepspec":
        manifest, samples = deepspec_samples(tmp_path / to)
        assert manifest["max_length"] == L and manifest["dropped_samples"] == r.dropped
        for j, i in enumerate(keep):
            want = c.read_raw(i)
            assert np.array_equal(samples[j]["input_ids"], want["input_ids"][:L])
            assert np.array_equal(samples[j]["hidden"], want["target_hidden_states"][:L])
    elif to == "nemo":
        from safetensors.torch import load_file

        shard = load_file(str(tmp_path / to / "shard-000000.safetensors"))
        assert shard["input_ids"].shape == (len(keep), L)
        for j, i in enumerate(keep):
            want = c.read_raw(i)
            n = min(L, len(want["input_ids"]))
            assert np.array_equal(shard["loss_mask"][j, :n].numpy(), want["loss_mask"][:n].astype(np.int64))
            assert np.array_equal(bits(shard["target_last_hidden_states"][j, :n]),
                                  want["target_last_hidden_states"][:n])
    else:
        marker = json.loads((tmp_path / to / EXPORT_MARKER).read_text())
        assert marker["dropped_samples"] == r.dropped and marker["max_length"] == L


# -- SpecForge 0.2.0 -----------------------------------------------------------------------
def specforge_batches(out: Path, max_len: int) -> list[dict[str, torch.Tensor]]:
    """SpecForge's own offline path: reader -> feature store -> DSpark normalizer -> collator, one sample a batch."""
    pytest.importorskip("specforge.runtime.data_plane.offline_reader", reason=f"needs SpecForge 0.2.0: {INTEROP}")
    from specforge.algorithms.common.dflash_family_data import (
        build_dspark_collator,
        build_dspark_offline_normalizer,
        build_dspark_offline_reader,
    )
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    refs = build_dspark_offline_reader("dspark", str(out), run_id="test", ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=1, collate_fn=build_dspark_collator(),
                               per_sample_transform=build_dspark_offline_normalizer(max_len), drop_last=False,
                               strategy="dspark", gc_interval_s=None)
    return [b.tensors for b in loader]


def test_specforge_loads_every_exported_sample_through_its_own_dspark_loader(default_run, tmp_path):
    _, result = default_run
    c = open_cache(result.path)
    out = tmp_path / "specforge"
    r = export(result.path, out, to="specforge", layers=[2, 3], progress=False)
    batches = specforge_batches(out, c.seq_length)
    assert len(batches) == r.num_samples == len(c)  # every sample of the fixture has two adjacent supervised tokens
    for j, b in enumerate(batches):
        want = c.read_raw(j, [2, 3])
        assert np.array_equal(b["input_ids"][0].numpy(), want["input_ids"].astype(np.int64))
        assert np.array_equal(b["loss_mask"][0].numpy(), want["loss_mask"].astype(np.int64))
        assert b["hidden_states"].dtype == torch.bfloat16 and b["hidden_states"].shape[-1] == 2 * c.hidden_size
        assert np.array_equal(bits(b["hidden_states"][0]), want["target_hidden_states"])
        assert np.array_equal(bits(b["target_last_hidden_states"][0]), want["target_last_hidden_states"])


def test_specforge_file_names_sort_as_strings_in_export_order():
    from dspark_precompute.read.export.specforge import sample_file

    names = [sample_file(j) for j in (0, 2, 10, 4999, 5000, 12345, 99_999_999)]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert sample_file(5000) == "rows_000005000/data_000005000.ckpt"


def test_specforge_export_leaves_out_samples_its_normalizer_refuses_and_counts_them(default_run, tmp_path,
                                                                                  monkeypatch):
    _, result = default_run
    c = open_cache(result.path)
    real = CacheReader.read_raw

    def sparse(self, i, layers=None, last=True, **kw):  # sample 0 keeps only every other supervised token
        out = real(self, i, layers, last=last, **kw)
        if int(i) == 0:
            m = out["loss_mask"].copy()
            m[1::2] = 0
            out["loss_mask"] = m
        return out

    monkeypatch.setattr(CacheReader, "read_raw", sparse)
    r = export(result.path, tmp_path / "sf", to="specforge", progress=False)
    assert r.dropped == {"no_two_consecutive_supervised_tokens": 1} and r.num_samples == len(c) - 1
    monkeypatch.setattr(CacheReader, "read_raw", real)
    batches = specforge_batches(tmp_path / "sf", c.seq_length)
    assert len(batches) == len(c) - 1
    assert np.array_equal(batches[0]["input_ids"][0].numpy(), c.read_raw(1)["input_ids"].astype(np.int64))


# -- vLLM speculators 0.9.0 ----------------------------------------------------------------
def test_speculators_arrow_dataset_reads_every_sample_with_the_pre_norm_state_last(both_states_run, tmp_path):
    pytest.importorskip("speculators.train.data", reason=f"needs vLLM speculators 0.9.0: {INTEROP}")
    from speculators.train.data import ArrowDataset

    _, result = both_states_run  # capture.last_state=both: the pre-norm state is stored beside the post-norm one
    c = open_cache(result.path)
    out = tmp_path / "spec"
    r = export(result.path, out, to="speculators", layers=[2, 3], progress=False)
    ds = ArrowDataset(c.seq_length, str(out), on_missing="raise")
    assert len(ds) == r.num_samples == len(c)
    for j in range(len(ds)):
        got = ds[j]  # a SampleUnavailable (ids mismatch) has no keys: indexing it fails the test
        want = c.read_raw(j, [2, 3])
        assert np.array_equal(got["input_ids"].numpy(), want["input_ids"].astype(np.int64))
        assert np.array_equal(got["loss_mask"].numpy(), want["loss_mask"].astype(np.int64))
        assert np.array_equal(bits(got["hidden_states"]), want["target_hidden_states"])
        pre = c.read_raw(j, [], last=False, pre_norm=True)["target_pre_norm_hidden_states"]
        assert np.array_equal(bits(got["verifier_last_hidden_states"]), pre)
        assert not np.array_equal(bits(got["verifier_last_hidden_states"]), want["target_last_hidden_states"])
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["slots"] == [2, 3, "pre_norm"]


def test_speculators_export_refuses_a_cache_without_the_pre_norm_state(default_run, tmp_path):
    _, result = default_run
    with pytest.raises(ExportError, match=r"capture.last_state=pre_norm \(or both\)"):
        export(result.path, tmp_path / "spec", to="speculators", progress=False)
    assert not (tmp_path / "spec").exists()


# -- staging: a killed export is never readable, an occupied destination is refused ---------
def test_a_failed_export_leaves_nothing_a_trainer_could_read(default_run, tmp_path, monkeypatch):
    _, result = default_run
    real = CacheReader.read_raw
    calls = {"n": 0}

    def dies(self, i, layers=None, last=True, **kw):
        calls["n"] += 1
        if calls["n"] == 8:
            raise OSError("disk went away")
        return real(self, i, layers, last=last, **kw)

    monkeypatch.setattr(CacheReader, "read_raw", dies)
    out = tmp_path / "sf"
    with pytest.raises(OSError, match="disk went away"):
        export(result.path, out, to="specforge", progress=False)
    assert calls["n"] == 8 and not out.exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_a_staged_export_refuses_foreign_files_and_replaces_its_own_only_with_overwrite(default_run, tmp_path):
    _, result = default_run
    out = tmp_path / "ds"
    export(result.path, out, to="deepspec", progress=False)
    with pytest.raises(CacheFormatError, match="already holds a deepspec export .* pass overwrite=True"):
        export(result.path, out, to="deepspec", progress=False)
    r = export(result.path, out, to="deepspec", layers=[1], overwrite=True, progress=False)
    assert json.loads((out / "manifest.json").read_text())["target_layer_ids"] == [1] and r.layers == [1]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(CacheFormatError, match=r"holds other files \(notes.txt\)"):
        export(result.path, other, to="deepspec", overwrite=True, progress=False)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(CacheFormatError, match="is inside the cache"):
        export(result.path, Path(result.path) / "x", to="specforge", progress=False)
