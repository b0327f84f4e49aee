"""One cache, every shorter length: a cache made at seq_length S read at L < S equals a run made at L (ids and masks
exactly, states within one bf16 step), and the samples left without supervision are dropped and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.read.training import build_dataloader
from dspark_precompute.write.run import run

L = 128


@pytest.fixture(scope="module")
def fresh_at_l(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fresh_at_l")
    return run(compose(small(tmp, f"seq_length={L}", "storage.chunk_tokens=256", "storage.unit_tokens=1024")))


def test_a_cache_read_at_a_shorter_length_is_the_run_made_at_that_length(default_run, fresh_at_l):
    cut = open_cache(default_run[1].path, max_length=L)
    fresh = open_cache(fresh_at_l.path)
    full = open_cache(default_run[1].path)
    assert int(cut.lengths().max()) <= L and cut.max_length == L
    assert sorted(cut.source_row.tolist()) == sorted(fresh.source_row.tolist())  # the same samples survive
    assert cut.cut_dropped == len(full) - len(cut) > 0  # counted, not silent
    where = {int(r): i for i, r in enumerate(fresh.source_row)}
    for i, row in enumerate(cut.source_row):
        a, b = cut.sample(i), fresh.sample(where[int(row)])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in ("target_hidden_states", "target_last_hidden_states"):
            x, y = a[k].float(), b[k].float()
            step = 2.0 ** -7 * torch.maximum(x.abs(), y.abs()).clamp_min(2.0 ** -126)
            assert ((x - y).abs() <= step).all(), (i, k)  # the same causal prefix, batched differently


def test_the_loader_and_export_take_the_same_cut(default_run, tmp_path):
    from dspark_precompute.read.export import export

    cut = open_cache(default_run[1].path, max_length=L)
    batches = list(build_dataloader(default_run[1].path, batch_size=4, shuffle=False, max_length=L))
    assert sum(len(b["input_ids"]) for b in batches) == len(cut)
    assert max(b["input_ids"].shape[1] for b in batches) <= L
    assert sum(int(b["attention_mask"].sum()) for b in batches) == int(cut.lengths().sum())
    r = export(default_run[1].path, tmp_path / "nemo", to="nemo", max_length=L, progress=False)
    assert r.num_samples == len(cut)
    with pytest.raises(ValueError, match=r"max_length=999 must be a number of tokens in \[1, seq_length=256\]"):
        open_cache(default_run[1].path, max_length=999)
    assert np.array_equal(open_cache(default_run[1].path, max_length=256).lengths(),
                          open_cache(default_run[1].path).lengths())  # the cache's own length: no cut


def test_the_summary_of_a_cut_view_counts_what_a_run_at_that_length_holds(default_run, fresh_at_l):
    cut, fresh, full = (open_cache(default_run[1].path, max_length=L), open_cache(fresh_at_l.path),
                        open_cache(default_run[1].path))
    s, f, whole = cut.summary(), fresh.summary(), full.summary()
    assert (s["samples"], s["tokens"], s["supervised_tokens"]) == (f["samples"], f["tokens"], f["supervised_tokens"])
    assert s["supervised_tokens"] == f["supervised_tokens"] == fresh.manifest.counts.supervised_tokens
    assert 0 < s["supervised_fraction"] <= 1
    assert (s["cut_at"], s["cut_dropped"]) == (L, len(full) - len(cut))
    # the token arrays on disk are the whole cache's, so the ratio is the cache's own, not the view's
    assert s["compression_ratio"] == pytest.approx(whole["compression_ratio"])
    text = cut.describe()
    assert f"read at max_length {L}: {cut.cut_dropped:,} samples dropped" in text
    assert "cut " not in full.describe() and whole["cut_at"] is None
