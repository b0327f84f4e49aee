"""The dry run through the command and against the real run's bytes.

The e2e part of tests/write/test_dry_run.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import compose, small
from test_dry_run import assert_plan_matches

from dspark_precompute.write.config.schema import RandomTargetConfig
from dspark_precompute.write.dryrun import dry_run
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny


def test_a_dry_run_writes_nothing_but_hydras_output_directory(tmp_path):
    tok = tiny.build_tokenizer()
    target = tmp_path / "target"  # a checkpoint on disk: a real run would hash it and remember the hash
    tiny.build_target(RandomTargetConfig(), len(tok)).save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    work = tmp_path / "work"
    work.mkdir()
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    env = {**os.environ, "DSPARK_CACHE_DIR": str(tmp_path / "hashes"), "HF_HOME": str(tmp_path / "hf")}
    args = [f"storage.path={tmp_path / 'cache'}", f"model.path={target}", "seq_length=256",
            "batch.max_tokens=1024", "data.max_samples=6", "dry_run=true"]
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout[proc.stdout.index("dry run: nothing was written"):]  # after Hydra's console log
    assert "  uncompressed  " in table and "  on disk (estimate)  " in table and "  time (estimate)  " in table
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    changed = sorted(str(p.relative_to(tmp_path)) for p in after if before.get(p) != after[p])
    hydra_dir = work / "outputs"
    assert changed and all(Path(tmp_path / c) == work or hydra_dir in (tmp_path / c).parents
                           or tmp_path / c == hydra_dir for c in changed), changed
    assert not (tmp_path / "cache").exists() and not (tmp_path / "hashes").exists()
    # the same command without dry_run: the plan's numbers are the run's
    real = subprocess.run([sys.executable, "-m", "dspark_precompute", *args[:-1]], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, real.stderr[-2000:]
    plan = dry_run(compose(args))
    assert re.search(rf"  uncompressed +{plan.raw_bytes:,} B", table)  # the same plan as the command printed
    assert_plan_matches(plan, str(tmp_path / "cache"))


def test_a_dry_run_of_a_servable_untied_fp16_cache_predicts_its_exact_bytes(tmp_path):
    overrides = small(tmp_path, "model.random.num_hidden_layers=6", "model.random.tie_word_embeddings=false",
                      "model.layer_preset=servable", "model.draft_num_hidden_layers=2", "storage.dtype=fp16",
                      "storage.chunk_tokens=128", "storage.unit_tokens=512", "data.max_samples=10")
    plan = dry_run(compose([*overrides, "dry_run=true"]))
    assert not (tmp_path / "cache").exists()
    run(compose(overrides))
    assert_plan_matches(plan, str(tmp_path / "cache"))
    assert [a.name for a in plan.arrays][-1] == "hidden_states/final_norm" and plan.num_units > 1
