"""End to end: order, no padding, resume after SIGKILL, refusal of incompatible caches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import REPO, assert_same_cache, compose, poison_second_batch, small

from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt
from dspark_precompute.errors import ConfigError, IncompatibleCacheError
from dspark_precompute.write import tiny
from dspark_precompute.write.chat import ChatEncoder
from dspark_precompute.write.config import DataConfig
from dspark_precompute.write.data import normalize, read_rows, resolve_source
from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024")


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


@pytest.mark.e2e
def test_only_real_tokens_are_stored(tmp_path, default_run):
    cfg, result = default_run
    m = open_cache(result.path).manifest.to_json()
    lengths = np.asarray(zarr.open_group(result.path, mode="r")["samples/length"][:])
    assert int(lengths.sum()) == m["counts"]["tokens"] == result.tokens
    # unit tails are the only slack: less than one chunk per unit
    assert m["layout"]["total_token_slots"] - result.tokens < m["layout"]["num_units"] * m["layout"]["chunk_tokens"]

    def hidden_bytes_per_token(path, tokens):
        files = [f for f in (Path(path) / "hidden_states").rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files) / tokens

    # with 4x the seq_length a padded layout would take ~4x the bytes per real token; ours stays put
    long = compose(small(tmp_path, *UNITS, "seq_length=1024", "batch.max_tokens=4096"))
    r_long = run(long)
    a = hidden_bytes_per_token(result.path, result.tokens)
    b = hidden_bytes_per_token(r_long.path, r_long.tokens)
    assert 0.75 < b / a < 1.33


@pytest.mark.e2e
def test_a_killed_run_resumes_to_a_cache_bit_identical_to_an_uninterrupted_one(tmp_path):
    ref = compose(small(tmp_path, *UNITS, name="ref"))
    run(ref)
    path = tmp_path / "killed"
    overrides = small(tmp_path, *UNITS, name="killed")
    env = {**os.environ, "DSPARK_FAULT": "unit_submitted=3"}
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    with pytest.raises(Exception, match="incomplete"):
        open_cache(str(path))
    partial = open_cache(str(path), allow_incomplete=True)
    assert 0 < len(partial) < partial.manifest.to_json()["counts"]["samples"]
    result = run(compose(overrides))
    assert result.resumed_units >= 1 and result.units_written >= 1
    assert_same_cache(str(tmp_path / "ref"), str(path))


def test_a_complete_cache_is_left_alone(default_run, caplog):
    cfg, first = default_run
    again = run(cfg)
    assert again.units_written == 0 and again.samples == first.samples


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if anything tries to load target weights."""
    def boom(*a, **k):
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr("dspark_precompute.write.run.load_target", boom)


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


@pytest.mark.e2e
def test_data_changed_under_the_same_path_is_refused_and_overwrite_replaces(tmp_path, no_weights, monkeypatch):
    data = tmp_path / "chat.jsonl"
    shutil.copy(REPO / "dspark_precompute" / "assets" / "embedded_chat.jsonl", data)
    overrides = small(tmp_path, f"data.path={data}", "data.max_samples=4")
    monkeypatch.undo()
    first = run(compose(overrides))
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    row = json.loads(lines[0])
    row["messages"][-1]["content"] += " (edited)"
    lines[0] = json.dumps(row, ensure_ascii=False) + "\n"
    data.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(IncompatibleCacheError, match="content_sha256"):
        run(compose(overrides))
    replaced = run(compose([*overrides, "overwrite=true"]))
    assert replaced.units_written >= 1 and replaced.path == first.path
    assert "(edited)" in tiny.build_tokenizer().decode(open_cache(first.path)[0]["input_ids"])


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


@pytest.mark.e2e
def test_a_sample_with_inf_states_is_dropped_accounted_and_never_read(tmp_path, default_run, monkeypatch):
    from dspark_precompute.read.export import export_nemo
    from dspark_precompute.read.verify import verify_cache
    from dspark_precompute.write.recompute import open_stored

    _, ref = default_run
    poison_second_batch(monkeypatch)
    result = run(compose(small(tmp_path, *UNITS)))
    c, r = open_cache(result.path), open_cache(ref.path)
    m = c.manifest
    assert len(m.dropped_samples) == 1 and sum(m.nonfinite_values.values()) == 1
    dropped = m.dropped_samples[0]
    assert m.counts.samples == len(r) - 1 == len(c) and m.counts.rejected == r.manifest.counts.rejected + 1
    assert m.counts.rejected_by_reason["nonfinite_hidden_states"] == 1
    assert m.counts.rows_in == m.counts.samples + m.counts.rejected
    assert dropped not in set(c.indices.tolist())
    rejects = [json.loads(x) for x in (Path(result.path) / fmt.REJECTS).read_text().splitlines()]
    bad_row = int(zarr.open_group(result.path, mode="r")["samples/source_row"][dropped])
    assert [x["row"] for x in rejects if x["reason"] == "nonfinite_hidden_states"] == [bad_row]
    assert bad_row not in set(c.source_row.tolist())
    for i, row in enumerate(c.source_row):  # every other sample equals the clean run's
        j = int(np.flatnonzero(r.source_row == row)[0])
        got, want = c[i], r[j]
        for k in want:
            assert torch_equal(got[k], want[k]), (row, k)
        assert all(bool(v.float().isfinite().all()) for v in got.values())
    report = verify_cache(result.path)
    assert report.ok, report.problems
    assert export_nemo(result.path, tmp_path / "nemo").num_samples == len(c)
    # the checks that rerun the target (--recompute, --teacher, --precision) never pick the zeroed sample
    stored, _, problem = open_stored(result.path, model=None, trust_remote_code=False, device=None, what="a check")
    assert problem is None and sorted(stored.readable.tolist()) == sorted(c.indices.tolist())


def torch_equal(a, b) -> bool:
    return bool(a.float().eq(b.float()).all())


@pytest.mark.e2e
def test_on_nonfinite_error_stops_naming_the_sample_and_a_reject_run_then_completes(tmp_path, monkeypatch):
    from dspark_precompute.errors import NonFiniteStatesError

    poison_second_batch(monkeypatch)
    overrides = small(tmp_path, *UNITS)
    with pytest.raises(NonFiniteStatesError, match=r"sample \d+ has non-finite hidden states.*on_nonfinite=reject"):
        run(compose([*overrides, "data.on_nonfinite=error"]))
    monkeypatch.undo()
    poison_second_batch(monkeypatch)  # the resumed run meets an Inf too, and drops that sample
    m = open_cache(run(compose(overrides)).path).manifest
    assert len(m.dropped_samples) == 1 and m.counts.rows_in == m.counts.samples + m.counts.rejected
