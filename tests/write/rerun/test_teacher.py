"""``verify --teacher``: the stored final state reproduces the target's own logits, and a wrong one is caught.

Modules: ``write/rerun/recompute.py`` and ``write/rerun/precision.py`` (the precision check of a
stored cache against a recompute).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr
from helpers import rebind

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.write.rerun.recompute import sample_positions
from dspark_precompute.write.rerun.teacher import teacher_check
from dspark_precompute.write.target import tiny


def test_positions_are_seeded_distinct_and_spread_over_the_readable_samples():
    lengths = np.array([5, 1, 7, 3])
    readable = np.array([0, 2, 3])
    a = sample_positions(lengths, readable, 8, seed=1)
    assert a == sample_positions(lengths, readable, 8, seed=1) != sample_positions(lengths, readable, 8, seed=2)
    assert len(set(a)) == 8 and all(s in (0, 2, 3) and 0 <= t < lengths[s] for s, t in a)
    every = sample_positions(lengths, readable, 100, seed=0)  # more than there are: each token once
    assert sorted(every) == [(s, t) for s in (0, 2, 3) for t in range(lengths[s])]


def test_the_stored_final_state_gives_the_tiny_targets_own_logits_at_every_position(default_run):
    cfg, result = default_run
    r = teacher_check(result.path, 10**9, seed=0)
    assert r.problems == [] and len(r.positions) == result.tokens  # every token of every sample
    assert r.top1_agreement == 1.0  # exactly: not one position's argmax differs
    # the oracle: HF's own full forward (logits and output_hidden_states), independently of the check
    c = open_cache(result.path)
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    head = model.get_output_embeddings().weight
    rel = []
    for i in range(len(c)):
        s = c[i]
        with torch.no_grad():
            out = model(input_ids=s["input_ids"][None], output_hidden_states=True)
        stored = s["target_last_hidden_states"]
        assert torch.equal(stored, out.hidden_states[-1][0].to(torch.bfloat16))  # post-norm, same position
        student = stored.float() @ head.T
        assert torch.equal(out.logits[0].argmax(-1), student.argmax(-1))
        rel += ((out.logits[0] - student).norm(dim=-1) / out.logits[0].norm(dim=-1)).tolist()
    assert r.rel_error_mean == pytest.approx(float(np.mean(rel)), rel=1e-3)
    assert r.rel_error_mean < 0.005 and r.tv_max < 1e-6


def _swap_last_for(path, other: str) -> None:
    """Replace the post-norm array's data with another layer's, written through zarr (valid checksums)."""
    g = zarr.open_group(str(path), mode="r+")
    g["hidden_states/layer_3"][:] = np.asarray(g[other][:])
    units = json.loads((path / "manifest.json").read_text())["layout"]["num_units"]
    for u in range(units):  # bound as a writer of those bytes would have bound them: only the target can tell
        rebind(path, "hidden_states/layer_3", u)


def test_a_final_state_swapped_for_another_layers_fails_the_teacher_check(cache_copy, capsys):
    _swap_last_for(cache_copy, "hidden_states/layer_2")
    assert main(["verify", str(cache_copy)]) == 0  # whole and consistent: only the target can tell
    capsys.readouterr()
    assert main(["verify", str(cache_copy), "--teacher", "128", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (p,) = report["problems"]
    assert p["check"] == "teacher" and p["array"] == "hidden_states/layer_3"
    assert "does not reproduce the target's own logits over 128 positions" in p["message"]
    assert "mean relative logit error" in p["message"] and "overwrite=true" in p["message"]
    t = report["teacher"]
    assert t["positions"] == 128 and t["rel_error_mean"] > 0.1 and t["max_logit_diff"] > 5
    assert not report["ok"]


def test_the_teacher_check_takes_no_remote_code_or_path_from_the_cache(cache_copy, monkeypatch):
    m = json.loads((cache_copy / "manifest.json").read_text())
    m["config"]["model"]["trust_remote_code"] = True
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    seen = {}
    # every check that reruns the target loads it there
    real = __import__("dspark_precompute.write.rerun.recompute", fromlist=["load_target"]).load_target

    def spy(cfg, *a, **k):
        seen["trust"] = cfg.trust_remote_code
        return real(cfg, *a, **k)
    monkeypatch.setattr("dspark_precompute.write.rerun.recompute.load_target", spy)
    r = teacher_check(str(cache_copy), 16)
    assert seen["trust"] is False and r.problems == []
    assert any("loads without it" in n for n in r.notes)
    m["config"]["model"]["tokenizer"] = str(cache_copy / "tokenizer")
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    r = teacher_check(str(cache_copy), 16)
    assert "inside the cache itself" in r.problems[0]["message"] and "model.tokenizer=" in r.problems[0]["message"]
