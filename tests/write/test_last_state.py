"""``capture.last_state``: the last decoder layer's output before the final norm (what vLLM speculators trains
on) stored beside or instead of the post-norm state, checked against the target itself, in the identity and the
manifest so a trainer never guesses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.errors import IncompatibleCacheError
from dspark_precompute.read.training import build_dataloader
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny


def target_states(cfg, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """The oracle: transformers' own forward of the tiny target, the last layer's output taken by a hook."""
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("pre", o[0] if
                                                                                        isinstance(o, tuple) else o))
    with torch.no_grad():
        post = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
    hook.remove()
    return seen["pre"][0], post, model.model.norm


def test_both_final_states_are_stored_and_are_the_targets_own(both_states_run):
    cfg, result = both_states_run
    c = open_cache(result.path)
    m = c.manifest
    assert m.arrays["pre_norm"] == "hidden_states/pre_norm" and m.capture.last_state == "both"
    assert m.identity["last_state"] == "both" and c.has_pre_norm
    meta = json.loads((Path(result.path) / "hidden_states" / "pre_norm" / "zarr.json").read_text())["attributes"]
    assert meta == {"logical_dtype": "bfloat16", "layer_id": 3, "final_state": "pre_norm"}
    assert len(c) == result.samples > 0
    for i in range(len(c)):
        s = c.sample(i, pre_norm=True)
        pre, post, norm = target_states(cfg, s["input_ids"])
        stored_pre = s["target_pre_norm_hidden_states"].float()
        step = 2.0 ** -7 * pre.abs().clamp_min(2.0 ** -126)  # one bf16 step at each value
        assert ((stored_pre - pre).abs() <= step).all(), i  # the last layer's output, before the norm
        assert not torch.equal(stored_pre, s["target_last_hidden_states"].float())
        with torch.no_grad():  # and the target's own final norm turns it into the stored post-norm state
            renormed = norm(stored_pre[None])[0]
        post_step = 2.0 ** -7 * post.abs().clamp_min(2.0 ** -126)
        assert ((s["target_last_hidden_states"].float() - post).abs() <= post_step).all()
        assert ((renormed - post).abs() <= 4 * post_step + 1e-3).all(), i


def test_pre_norm_only_stores_no_post_norm_array_and_the_nemo_loader_says_so(tmp_path):
    cfg = compose(small(tmp_path, "model.layer_ids=[0,1]", "capture.last_state=pre_norm", "data.max_samples=4"))
    result = run(cfg)
    c = open_cache(result.path)
    assert "last" not in c.array_names and c.array_names["pre_norm"] == "hidden_states/pre_norm"
    assert c.manifest.capture.last_state == "pre_norm"
    s = c.sample(0, last=False, pre_norm=True)
    pre, _, _ = target_states(cfg, s["input_ids"])
    assert (s["target_pre_norm_hidden_states"].float() - pre).abs().max() <= 2.0 ** -7 * pre.abs().max()
    with pytest.raises(ValueError, match=r"does not store the post-norm state .* capture.last_state=post_norm or both"):
        c.sample(0)
    with pytest.raises(ValueError, match=r"stores no post-norm state \(capture.last_state=pre_norm\)"):
        next(iter(build_dataloader(result.path, batch_size=2)))


def test_the_last_state_is_part_of_the_cache_identity(both_states_run, tmp_path):
    import shutil

    cfg, result = both_states_run
    copy = tmp_path / "copy"
    shutil.copytree(result.path, copy)
    overrides = [o for o in small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024") if not
                 o.startswith("storage.path")]
    with pytest.raises(IncompatibleCacheError, match=r"last_state: recorded 'both', requested None"):
        run(compose([*overrides, f"storage.path={copy}"]))
    assert np.array_equal(open_cache(copy).read_raw(0, pre_norm=True)["input_ids"],
                          open_cache(result.path).read_raw(0)["input_ids"])
