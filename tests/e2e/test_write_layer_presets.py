"""A servable-preset cache against the target's own hidden states.

The e2e part of tests/write/config/test_layer_presets.py.
"""

from __future__ import annotations

import torch
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny


def test_a_servable_cache_stores_no_minus_1_or_n_minus_1_and_keeps_the_post_norm_state_apart(tmp_path):
    cfg = compose(small(tmp_path, "model.random.num_hidden_layers=6", "model.layer_preset=servable",
                        "model.draft_num_hidden_layers=3", "data.max_samples=4",
                        "batch.max_samples=1"))  # one row per forward: the oracle's unbatched forward, bit for bit
    run(cfg)
    c = open_cache(cfg.storage.path)
    m = c.manifest
    assert m.layer_ids == [1, 2, 3] and m.arrays["last"] == "hidden_states/final_norm"
    assert m.capture is not None and m.capture.layer_preset == "servable"
    assert m.identity["layer_preset"] == "servable"
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    s = c[0]
    with torch.no_grad():
        hs = model(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
    assert torch.equal(s["target_last_hidden_states"], hs[-1][0].to(torch.bfloat16))  # post-norm, N-1
    H = cfg.model.random.hidden_size
    for j, lid in enumerate([1, 2, 3]):
        assert torch.equal(s["target_hidden_states"][:, j * H:(j + 1) * H], hs[lid + 1][0].to(torch.bfloat16))
