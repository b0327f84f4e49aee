"""End to end: order, no padding, resume after SIGKILL, refusal of incompatible caches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt
from dspark_precompute.errors import ConfigError, IncompatibleCacheError
from dspark_precompute.write.config.schema import DataConfig
from dspark_precompute.write.run import run
from dspark_precompute.write.samples.chat import ChatEncoder
from dspark_precompute.write.samples.files import resolve_source
from dspark_precompute.write.samples.normalize import normalize
from dspark_precompute.write.samples.rows import read_rows
from dspark_precompute.write.target import tiny


def test_sample_i_is_row_i_of_the_selection_whatever_order_batches_ran_in(default_run):
    cfg, result = default_run
    c = open_cache(result.path)
    enc = ChatEncoder(tiny.build_tokenizer(), tiny.CHAT_TEMPLATE, cfg.seq_length)
    rows = read_rows(resolve_source("embedded"), DataConfig(max_samples=16))
    encoded = [enc.encode(normalize(raw), i) for i, raw in enumerate(rows)]
    kept = [i for i, e in enumerate(encoded) if not hasattr(e, "reason")]
    rejected = [json.loads(line)["row"] for line in (Path(result.path) / fmt.REJECTS).read_text().splitlines()]
    assert sorted(kept + rejected) == list(range(16)) and rejected  # every row accounted for
    assert list(c.source_row) == kept and len(c) == len(kept) == c.manifest.to_json()["counts"]["samples"]
    lengths = []
    for i, row in enumerate(kept):
        got, want = c[i], encoded[row]
        assert np.array_equal(got["input_ids"].numpy(), want.input_ids), i
        assert np.array_equal(got["loss_mask"].numpy(), want.loss_mask), i
        lengths.append(len(want.input_ids))
    # the batches ran longest-first, so disk order is not input order
    assert list(np.argsort(-np.asarray(lengths), kind="stable")) != list(range(len(kept)))
    assert result.units_written > 1


def test_a_complete_cache_is_left_alone(default_run, caplog):
    cfg, first = default_run
    again = run(cfg)
    assert again.units_written == 0 and again.samples == first.samples


@pytest.mark.parametrize("override,field", [
    ("seq_length=128", "seq_length"),
    ("model.layer_ids=[0,3]", "layer_ids"),
    ("storage.dtype=fp16", "storage.dtype"),
    ("data.mask_reasoning_content=true", "data.mask_reasoning_content"),
    ("data.mask_generation_prompt=true", "data.mask_generation_prompt"),
    ("model.random.seed=1", "target.weights_fingerprint"),
    ("storage.chunk_tokens=512", "storage.chunk_tokens"),
    ("storage.compressor=zstd", "storage.compressor"),
    ("data.max_samples=8", "data.max_samples"),
    ("model.dtype=bf16", "compute_dtype"),
    ("data.chat_template=\"{% for m in messages %}{{ m.content }}{% endfor %}\"", "chat_template_sha256"),
])
def test_resuming_with_a_changed_hashed_field_is_refused_naming_it(default_run, no_weights, override, field):
    cfg, result = default_run
    overrides = small(Path(result.path).parent, "storage.chunk_tokens=256", "storage.unit_tokens=1024",
                      name=Path(result.path).name)
    changed = compose([*overrides, override])
    with pytest.raises(IncompatibleCacheError) as err:
        run(changed)
    assert any(k.endswith(field) for k, _, _ in err.value.differences), err.value.differences
    assert field.split(".")[-1] in str(err.value) and "overwrite=true" in str(err.value)


def test_batch_size_device_and_process_counts_are_not_part_of_the_identity(default_run, no_weights):
    cfg, result = default_run
    overrides = small(Path(result.path).parent, "storage.chunk_tokens=256", "storage.unit_tokens=1024",
                      name=Path(result.path).name)
    again = run(compose([*overrides, "batch.max_tokens=2048", "batch.max_samples=2", "model.device=cpu",
                         "storage.writers=3", "data.num_workers=0", "data.on_nonfinite=error"]))
    assert again.units_written == 0


def test_invalid_values_are_all_reported_before_any_weights_load(tmp_path, no_weights):
    with pytest.raises(ConfigError) as err:
        compose([f"storage.path={tmp_path}/x", "seq_length=0", "storage.dtype=int8", "model.layer_ids=[3,1]",
                 "data.path=''", "model.device=tpu"])
    text = str(err.value)
    for key in ("seq_length=0", "storage.dtype", "model.layer_ids", "data.path", "model.device"):
        assert key in text, key
    assert len(err.value.problems) >= 5
    with pytest.raises(ConfigError, match="data.path='/nope/missing.jsonl' does not exist on this machine"):
        run(compose(small(tmp_path, "data.path=/nope/missing.jsonl")))
    with pytest.raises(ConfigError, match="batch.max_tokens=100 is smaller than seq_length=256"):
        compose(small(tmp_path, "batch.max_tokens=100"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        run(compose(small(tmp_path, f"storage.path={tmp_path / 'afile'}")))
    with pytest.raises(ConfigError, match="outside"):
        run(compose(small(tmp_path, "model.layer_ids=[0,9]")))
