"""verify --teacher on caches built to fail it: a pre-norm state, a moved or swapped target, a crafted manifest.

The e2e part of tests/write/rerun/test_teacher.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import zarr
from helpers import compose, rebind, small

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.write.config.schema import RandomTargetConfig
from dspark_precompute.write.rerun.recompute import recompute
from dspark_precompute.write.rerun.teacher import teacher_check
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny


def test_a_final_state_taken_before_the_norm_is_named_as_such(default_run, cache_copy):
    cfg, _ = default_run
    c = open_cache(str(cache_copy))
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    raw = {}
    model.model.layers[3].register_forward_hook(lambda m, i, o: raw.__setitem__("x", o[0] if isinstance(o, tuple)
                                                                                  else o))
    arr = zarr.open_group(str(cache_copy), mode="r+")["hidden_states/layer_3"]
    data = np.asarray(arr[:])
    for i in range(len(c)):
        ids = c[i]["input_ids"]
        with torch.no_grad():
            model(input_ids=ids[None])
        a = int(c.starts()[i])
        data[a:a + len(ids)] = raw["x"][0].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    arr[:] = data
    for u in range(c.manifest.layout.num_units):  # bound as a writer of those bytes would bind them
        rebind(cache_copy, "hidden_states/layer_3", u)
    r = teacher_check(str(cache_copy), 256, seed=0)
    (p,) = r.problems
    assert r.rel_error_mean > 0.04 and "the stored state was taken before the final norm" in p["message"]
    assert "Applying the target's Qwen3RMSNorm to the stored state once more" in p["message"]


def test_model_path_finds_a_moved_target_and_refuses_another_one(tmp_path):
    tok = tiny.build_tokenizer()
    src = tmp_path / "target"
    tiny.build_target(RandomTargetConfig(), len(tok)).save_pretrained(src, safe_serialization=True)
    tok.save_pretrained(src)
    cfg = compose(small(tmp_path, f"model.path={src}", "data.max_samples=4"))
    result = run(cfg)
    moved = tmp_path / "moved"
    shutil.move(src, moved)
    r = teacher_check(result.path, 64, model=str(moved))
    assert r.problems == [] and r.top1_agreement == 1.0
    assert recompute(result.path, 2, model=str(moved)).problems == []  # the same rule for --recompute
    other = tmp_path / "other"
    tiny.build_target(RandomTargetConfig(seed=1), len(tok)).save_pretrained(other, safe_serialization=True)
    tok.save_pretrained(other)
    r = teacher_check(result.path, 64, model=str(other))
    assert "the target changed since the cache was written" in r.problems[0]["message"]
    assert "target.weights_fingerprint" in r.problems[0]["message"]


@pytest.mark.parametrize("inside", [True, False])
def test_the_teacher_check_never_runs_code_a_crafted_manifest_points_at(cache_copy, tmp_path, inside, capsys):
    marker = tmp_path / "marker"
    tok_dir = (cache_copy if inside else tmp_path) / "tok"
    tok = tiny.build_tokenizer()
    tok.save_pretrained(tok_dir)
    tcfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tcfg.update(auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]}, tokenizer_class="EvilTokenizer")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (tok_dir / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                     "from transformers import PreTrainedTokenizerFast\n"
                                     "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    m = json.loads((cache_copy / "manifest.json").read_text())
    m["config"]["model"].update(tokenizer=str(tok_dir), trust_remote_code=True)
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(cache_copy), "--teacher", "4"]) == 1 and not marker.exists()
    if inside:  # the user's own flag allows a checkpoint's code, never files inside the cache
        assert main(["verify", str(cache_copy), "--teacher", "4", "--trust-remote-code"]) == 1
        assert not marker.exists() and "inside the cache itself" in capsys.readouterr().out
