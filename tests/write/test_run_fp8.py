"""Writing fp8 caches: the settings are checked before weights load, are part of the cache identity, keep the
identity of every other cache, and a dropped sample leaves zero bits and scale 1; verify --precision measures it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import zarr
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.errors import ConfigError, IncompatibleCacheError
from dspark_precompute.write.dryrun import dry_run
from dspark_precompute.write.plan.prepare import prepare
from dspark_precompute.write.rerun.recompute import recompute
from dspark_precompute.write.run import run

FP8 = ["storage.chunk_tokens=256", "storage.unit_tokens=1024", "storage.dtype=fp8_e4m3", "storage.fp8_group=16"]


def test_fp8_settings_are_all_checked_before_weights_load(tmp_path):
    with pytest.raises(ConfigError) as err:
        compose(small(tmp_path, "storage.dtype=fp8_e4m3", "storage.fp8_group=48", "storage.last_dtype=int4"))
    text = "\n".join(err.value.problems)
    assert "storage.fp8_group=48 does not divide the target's hidden size 64" in text
    assert "storage.last_dtype=int4: it must be one of [bf16, fp16, fp32, fp8_e4m3]" in text
    with pytest.raises(ConfigError, match=r"storage.fp8_group=16 applies only to fp8 arrays"):
        compose(small(tmp_path, "storage.fp8_group=16"))
    with pytest.raises(ConfigError, match=r"storage.fp8_group=0 must be a positive number"):
        compose(small(tmp_path, "storage.dtype=fp8_e4m3", "storage.fp8_group=0"))
    assert compose(small(tmp_path, "storage.last_dtype=fp8_e4m3", "storage.fp8_group=32")).storage.fp8_group == 32


def test_an_fp8_group_that_does_not_divide_a_checkpoints_hidden_size_is_listed_with_the_other_problems(tmp_path):
    """For a target on disk the hidden size is known only once its config is read: still before weights load."""
    from dspark_precompute.write.config.schema import RandomTargetConfig
    from dspark_precompute.write.target import tiny

    tok = tiny.build_tokenizer()
    src = tmp_path / "target"
    tiny.build_target(RandomTargetConfig(), len(tok)).save_pretrained(src, safe_serialization=True)
    tok.save_pretrained(src)
    cfg = compose(small(tmp_path, f"model.path={src}", "storage.dtype=fp8_e4m3", "storage.fp8_group=48",
                        "model.layer_ids=[1,9]"))
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    text = "\n".join(err.value.problems)
    assert "storage.fp8_group=48 does not divide the target's hidden size 64" in text and "contains [9]" in text


def test_fp8_settings_enter_the_identity_only_when_they_mean_something(tmp_path):
    bf16 = prepare(compose(small(tmp_path))).identity["storage"]
    assert sorted(bf16) == ["chunk_tokens", "compression_level", "compressor", "dtype", "shuffle", "unit_tokens"]
    fp8 = prepare(compose(small(tmp_path, "storage.dtype=fp8_e4m3"))).identity["storage"]
    assert fp8["last_dtype"] == "bf16" and fp8["fp8_group"] is None and fp8["fp8_shuffle"] == "bit"
    assert fp8["chunk_tokens"] == bf16["chunk_tokens"]  # the bf16 post-norm state sizes the chunk
    assert "fp8_group" not in prepare(compose(small(tmp_path, "storage.last_dtype=fp32"))).identity["storage"]


@pytest.mark.parametrize(("change", "field"), [("storage.fp8_group=32", "storage.fp8_group"),
                                               ("storage.last_dtype=fp8_e4m3", "storage.last_dtype"),
                                               ("storage.dtype=bf16", "storage.dtype")])
def test_a_resume_with_another_fp8_setting_is_refused_naming_it(fp8_run, tmp_path, change, field):
    _, result = fp8_run
    path = tmp_path / "cache"
    shutil.copytree(result.path, path)
    overrides = [o for o in small(tmp_path, *FP8) if not o.startswith("storage.path")]
    if change == "storage.dtype=bf16":
        overrides.remove("storage.fp8_group=16")
    with pytest.raises(IncompatibleCacheError, match=field.replace(".", r"\.")):
        run(compose([*overrides, f"storage.path={path}", change]))


def test_fp8_bits_are_bit_shuffled_and_their_scales_byte_shuffled_as_zarr_reads_them(fp8_run):
    _, result = fp8_run
    g = zarr.open_group(result.path, mode="r")
    meta = {name: json.loads((Path(result.path) / name / "zarr.json").read_text())
            for name in ("hidden_states/layer_1", "hidden_scales/layer_1", "hidden_states/layer_3")}
    shuffle = {k: v["codecs"][0]["configuration"]["codecs"][1]["configuration"]["shuffle"] for k, v in meta.items()}
    assert shuffle == {"hidden_states/layer_1": "bitshuffle", "hidden_scales/layer_1": "shuffle",
                       "hidden_states/layer_3": "shuffle"}
    assert meta["hidden_states/layer_1"]["attributes"] == {"logical_dtype": "float8_e4m3fn", "layer_id": 1,
                                                           "scale_array": "hidden_scales/layer_1"}
    assert g["hidden_scales/layer_1"].attrs["channels_per_scale"] == 16 and g["hidden_scales/layer_1"].fill_value == 1


def test_the_dry_run_counts_the_exact_bytes_an_fp8_run_allocates(fp8_run):
    cfg, result = fp8_run
    plan = dry_run(cfg)
    m = open_cache(result.path).manifest
    written = sum(-(-int(n) // m.layout.chunk_tokens) * m.layout.chunk_tokens
                  for n in open_cache(result.path).chunks.unit_stop - open_cache(result.path).chunks.unit_start)
    assert plan.token_array_bytes == written * m.bytes_per_token
    assert [a.name for a in plan.arrays if a.name.startswith("hidden_scales/")] == [
        "hidden_scales/layer_1", "hidden_scales/layer_2"]


def test_recompute_finds_the_fp8_cache_bit_exact(fp8_run):
    _, result = fp8_run
    r = recompute(result.path, 2)
    assert not r.problems and r.recomputed == r.exact == 2
