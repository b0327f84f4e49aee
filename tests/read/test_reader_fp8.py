"""Reading an fp8 cache: bf16 by default (exactly torch's dequantization), raw bits and scales on request, the
training loader and export unchanged, and scales that are not finite and positive refused with a typed error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import rebind
from safetensors.torch import load_file

from dspark_precompute import open_cache
from dspark_precompute.errors import CacheFormatError
from dspark_precompute.read.export import export_nemo
from dspark_precompute.read.training import build_dataloader
from dspark_precompute.read.verify import verify_cache

FP8_LAYERS = [1, 2]  # the tiny target's ids [1, 2, 3]: 3 = N-1 is the post-norm state, kept bf16
H, GROUP = 64, 16


def oracle(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """torch's own float8 decode times each channel's scale, rounded to bf16 (the documented formula)."""
    b = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()
    return (b * torch.from_numpy(scale).repeat_interleave(GROUP, dim=1)).bfloat16()


def test_an_fp8_cache_reads_as_bf16_equal_to_torchs_dequantization_of_its_own_bits(fp8_run):
    _, result = fp8_run
    c = open_cache(result.path)
    assert c.storage_dtype == "fp8_e4m3" and c.output_dtype == c.last_output_dtype == "bf16"
    for i in (0, 5, len(c) - 1):
        s, raw = c[i], c.read_fp8(i)
        assert raw["layer_ids"] == FP8_LAYERS and raw["fp8_group"] == GROUP and "target_last_hidden_states" not in raw
        n = len(s["input_ids"])
        assert raw["target_hidden_states"].dtype == np.uint8
        assert raw["target_hidden_scales"].shape == (n, 2 * H // GROUP)
        assert s["target_hidden_states"].dtype == torch.bfloat16
        want = oracle(raw["target_hidden_states"], raw["target_hidden_scales"])
        assert torch.equal(s["target_hidden_states"][:, :2 * H].view(torch.int16), want.view(torch.int16))
        as_np = c.sample(i, layers=[2], as_numpy=True)["target_hidden_states"]
        assert np.array_equal(as_np, want[:, H:].float().numpy())


def test_fp8_states_are_within_5_percent_rms_of_the_bf16_cache_and_the_post_norm_state_is_bit_identical(
        fp8_run, default_run):
    c, ref = open_cache(fp8_run[1].path), open_cache(default_run[1].path)
    assert len(c) == len(ref)
    num = np.zeros(3)
    den = np.zeros(3)
    for i in range(len(c)):
        got, want = c[i], ref[i]
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["target_last_hidden_states"].view(torch.int16),
                           want["target_last_hidden_states"].view(torch.int16))
        g, w = got["target_hidden_states"].float(), want["target_hidden_states"].float()
        for k in range(3):
            num[k] += float((g[:, k * H:(k + 1) * H] - w[:, k * H:(k + 1) * H]).pow(2).sum())
            den[k] += float(w[:, k * H:(k + 1) * H].pow(2).sum())
    rel = np.sqrt(num / den)
    assert (rel[:2] > 0.005).all() and (rel[:2] <= 0.05).all(), rel  # quantized, and within the bound
    assert rel[2] == 0.0  # layer 3 is the post-norm state: stored bf16 in both


def test_the_training_loader_and_export_nemo_give_bf16_from_an_fp8_cache(fp8_run, tmp_path):
    _, result = fp8_run
    c = open_cache(result.path)
    batch = next(iter(build_dataloader(result.path, batch_size=4, shuffle=False)))
    assert batch["target_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(batch["target_hidden_states"][0, :len(c[0]["input_ids"])].view(torch.int16),
                       c[0]["target_hidden_states"].view(torch.int16))
    out = export_nemo(result.path, tmp_path / "nemo", shard_size=8)
    manifest = json.loads((Path(out.path) / "manifest.json").read_text())
    assert manifest["dtype"] == "bf16" and manifest["num_samples"] == len(c)
    shard = load_file(str(Path(out.path) / "shard-000001.safetensors"))
    n = len(c[9]["input_ids"])
    assert shard["target_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(shard["target_hidden_states"][1, :n].view(torch.int16),
                       c[9]["target_hidden_states"].view(torch.int16))
    assert not shard["target_hidden_states"][1, n:].any()


def test_verify_passes_an_fp8_cache_and_describes_its_storage(fp8_run):
    _, result = fp8_run
    report = verify_cache(result.path)
    assert report.ok, report.problems
    assert "fp8_e4m3 (a float32 scale per 16 channels; last state bf16)" in open_cache(result.path).describe()


def test_raw_fp8_reading_refuses_layers_that_are_not_fp8_and_caches_without_fp8(fp8_run, default_run):
    c = open_cache(fp8_run[1].path)
    with pytest.raises(ValueError, match=r"layers \[3\] are stored as bf16"):
        c.read_fp8(0, layers=[1, 3])
    assert c.read_fp8(0, layers=[2])["target_hidden_states"].shape[1] == H
    with pytest.raises(ValueError, match="stores no fp8 states"):
        open_cache(default_run[1].path).read_fp8(0)


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1.0, float("inf")])
def test_a_scale_that_is_zero_nan_negative_or_inf_is_refused_by_readers_and_named_by_verify(fp8_run, tmp_path, bad):
    """Written through zarr, so the chunk's checksum is valid: only the value check can catch it."""
    _, result = fp8_run
    path = tmp_path / "cache"
    shutil.copytree(result.path, path)
    c = open_cache(path)
    i = 3
    slot = int(c.starts()[i]) + 2
    arr = zarr.open_array(str(path / "hidden_scales/layer_2"), mode="r+")
    arr[slot, 1] = bad
    rebind(path, "hidden_scales/layer_2", slot // c.manifest.layout.unit_tokens)  # as a writer of it would bind it
    fresh = open_cache(path)  # opening reads no chunk: the tables and metadata are fine
    with pytest.raises(CacheFormatError, match=r"hidden_scales/layer_2.*not finite and positive"):
        fresh[i]
    assert fresh.sample(i, layers=[1], last=False)["target_hidden_states"].shape[1] == H  # other arrays still read
    report = verify_cache(path)
    assert not report.ok
    hit = [p for p in report.problems if p.array == "hidden_scales/layer_2"]
    assert hit and "not finite and positive" in hit[0].message and hit[0].unit is not None


@pytest.mark.parametrize(("damage", "pattern"), [
    ("dtype", r"hidden_scales/layer_1.*data_type 'float16', the manifest implies 'float32'"),
    ("shape", r"hidden_scales/layer_1.*inner chunk shape \[256, 2\], the manifest implies \[256, 4\]"),
    ("gone", r"array 'hidden_scales/layer_1' is missing"),
    ("storage", r"hidden_storage = .* disagrees"),
])
def test_a_scale_array_or_storage_record_that_disagrees_with_the_manifest_is_refused_on_open(fp8_run, tmp_path, damage,
                                                                                              pattern):
    path = tmp_path / "cache"
    shutil.copytree(fp8_run[1].path, path)
    meta_file = path / "hidden_scales/layer_1/zarr.json"
    meta = json.loads(meta_file.read_text())
    if damage == "dtype":
        meta["data_type"] = "float16"
    elif damage == "shape":
        meta["codecs"][0]["configuration"]["chunk_shape"] = [256, 2]
    meta_file.write_text(json.dumps(meta))
    if damage == "gone":
        shutil.rmtree(path / "hidden_scales/layer_1")
    if damage == "storage":
        m = json.loads((path / "manifest.json").read_text())
        m["hidden_storage"]["hidden_states/layer_1"]["scale_array"] = "hidden_scales/layer_2"
        (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheFormatError, match=pattern):
        open_cache(path)


def test_a_manifest_written_before_the_per_array_storage_record_still_reads(default_run, tmp_path):
    path = tmp_path / "cache"
    shutil.copytree(default_run[1].path, path)
    m = json.loads((path / "manifest.json").read_text())
    assert m["hidden_storage"]["hidden_states/layer_1"]["dtype"] == "bf16" and "last_dtype" not in m
    del m["hidden_storage"]
    (path / "manifest.json").write_text(json.dumps(m))
    c = open_cache(path)
    assert c.output_dtype == "bf16" and c[0]["target_hidden_states"].dtype == torch.bfloat16
