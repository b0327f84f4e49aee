"""Whole runs: only real tokens stored, a killed run resumed bit-identical, changed data refused.

Non-finite states dropped or stopping the run.

The e2e part of tests/write/test_run.py.
"""

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
from dspark_precompute.errors import IncompatibleCacheError
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024")


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


def test_a_sample_with_inf_states_is_dropped_accounted_and_never_read(tmp_path, default_run, monkeypatch):
    from dspark_precompute.read.export import export_nemo
    from dspark_precompute.read.verify import verify_cache
    from dspark_precompute.write.rerun.recompute import open_for_rerun

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
    stored, _, problem = open_for_rerun(result.path, model=None, trust_remote_code=False, device=None, what="a check")
    assert problem is None and sorted(stored.readable.tolist()) == sorted(c.indices.tolist())


def torch_equal(a, b) -> bool:
    return bool(a.float().eq(b.float()).all())


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
