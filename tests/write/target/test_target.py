"""Captured hidden states against HF's own ``output_hidden_states`` (the independent oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.write.config.schema import RandomTargetConfig
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny
from dspark_precompute.write.target.capture import HiddenStateCapture, export_weights


def hf_states(model, ids: torch.Tensor) -> tuple:
    with torch.no_grad():
        return model(input_ids=ids[None], output_hidden_states=True).hidden_states


def test_layer_ids_map_to_hf_hidden_states_including_embeddings_and_the_post_norm_state():
    tok = tiny.build_tokenizer()
    model = tiny.build_target(RandomTargetConfig(num_hidden_layers=4), len(tok))
    cap = HiddenStateCapture(model, [-1, 0, 2, 3])
    ids = torch.tensor(tok("hello there, general kenobi")["input_ids"])
    states, last = cap(ids[None], None)
    hs = hf_states(model, ids)
    assert len(hs) == 5
    for lid in (-1, 0, 2, 3):
        assert torch.equal(states[lid][0], hs[lid + 1][0]), lid
    assert torch.equal(last[0], hs[-1][0])
    # the post-norm state differs from the raw output of the last decoder layer
    raw = {}
    h = model.model.layers[3].register_forward_hook(lambda m, i, o: raw.setdefault("x", o))
    cap(ids[None], None)
    h.remove()
    assert not torch.equal(raw["x"][0], last[0])


def test_the_cache_holds_hf_hidden_states_rounded_to_bf16_exactly(tmp_path):
    cfg = compose(small(tmp_path, "model.layer_ids=[-1,0,1,3]", "batch.max_samples=1", "data.max_samples=6"))
    result = run(cfg)
    c = open_cache(cfg.storage.path)
    tok = tiny.build_tokenizer()
    model = tiny.build_target(cfg.model.random, len(tok))
    H = cfg.model.random.hidden_size
    assert len(c) == result.samples > 0
    for i in range(len(c)):
        s = c[i]
        hs = hf_states(model, s["input_ids"])
        for j, lid in enumerate([-1, 0, 1, 3]):
            want = hs[lid + 1][0].to(torch.bfloat16)
            assert torch.equal(s["target_hidden_states"][:, j * H:(j + 1) * H], want), (i, lid)
        assert torch.equal(s["target_last_hidden_states"], hs[-1][0].to(torch.bfloat16))


def test_batched_padded_forwards_match_unbatched_hf_within_one_bf16_step(tmp_path):
    cfg = compose(small(tmp_path, "batch.max_tokens=4096", "data.max_samples=12"))
    run(cfg)
    c = open_cache(cfg.storage.path)
    tok = tiny.build_tokenizer()
    model = tiny.build_target(cfg.model.random, len(tok))
    worst = 0.0
    for i in range(len(c)):
        s = c[i]
        want = hf_states(model, s["input_ids"])[-1][0]
        got = s["target_last_hidden_states"].float()
        step = want.abs().clamp_min(1e-3) * 2 ** -7  # one bf16 ulp (7 mantissa bits) of the value
        worst = max(worst, float(((got - want).abs() / step).max()))
    assert worst <= 1.0


def test_exported_weights_store_a_tied_embedding_once():
    model = tiny.build_target(RandomTargetConfig(tie_word_embeddings=True), 300)
    assert list(export_weights(model)) == ["embed_tokens.weight"]
    untied = tiny.build_target(RandomTargetConfig(tie_word_embeddings=False), 300)
    assert sorted(export_weights(untied)) == ["embed_tokens.weight", "lm_head.weight"]


@pytest.mark.parametrize("ids", [[0, 1, 2], [1, 3]])
def test_when_the_last_layer_is_captured_it_is_stored_once(tmp_path, ids):
    cfg = compose(small(tmp_path, f"model.layer_ids=[{','.join(map(str, ids))}]", "data.max_samples=2"))
    run(cfg)
    c = open_cache(cfg.storage.path)
    names = c.manifest.to_json()["arrays"]
    import zarr

    stored = sorted(zarr.open_group(cfg.storage.path, mode="r")["hidden_states"].array_keys())
    if 3 in ids:
        assert names["last"] == names["3"] and "final_norm" not in stored
    else:
        assert names["last"].endswith("final_norm") and "final_norm" in stored
    s = c[0]
    H = cfg.model.random.hidden_size
    if 3 in ids:
        assert torch.equal(s["target_hidden_states"][:, -H:], s["target_last_hidden_states"])
    assert np.isfinite(s["target_last_hidden_states"].float().numpy()).all()
