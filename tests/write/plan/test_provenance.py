"""What a finished cache records about how it was made (capture) and by what (provenance).

The tool's version in the provenance is ``version.py``'s.
"""

from __future__ import annotations

import json
import socket
from importlib import metadata

import torch

import dspark_precompute
from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.write.config.schema import DataConfig, ModelConfig, RandomTargetConfig
from dspark_precompute.write.plan.provenance import mask_policy, run_record, weights_dtype
from dspark_precompute.write.target import tiny
from dspark_precompute.write.target.load import inspect_target


def test_a_finished_cache_records_the_post_norm_state_its_norm_class_preset_masks_and_weights(default_run):
    cfg, result = default_run
    m = open_cache(result.path).manifest
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    cap = m.capture
    assert cap is not None
    assert cap.last_state == "post_norm"
    assert cap.final_norm_class == type(model.model.norm).__name__ == "Qwen3RMSNorm"
    assert cap.layer_preset == "nemo" and m.layer_ids == [1, 2, 3]
    assert (cap.mask.rule, cap.mask.fallback) == ("nemo_prefix", "full_render_alignment")  # no {% generation %}
    assert (cap.mask.mask_reasoning_content, cap.mask.mask_generation_prompt) == (False, False)
    assert cap.target_weights_dtype == "float32"  # the tiny target is initialised in float32
    assert cap.weights_fingerprint == m.identity["target"]["weights_fingerprint"]
    assert cap.fingerprint_kind == "full"


def test_the_run_record_names_the_versions_hosts_and_world_size(default_run):
    _, result = default_run
    prov = open_cache(result.path).manifest.provenance
    assert prov is not None
    assert prov.versions == {"dspark_precompute": dspark_precompute.__version__, "torch": metadata.version("torch"),
                             "transformers": metadata.version("transformers"), "zarr": metadata.version("zarr"),
                             "numcodecs": metadata.version("numcodecs")}
    assert prov.hosts == [socket.gethostname()] and prov.world_size == 1
    assert prov.argv is None  # run(cfg) from Python: no command line to record


def test_hosts_of_units_an_earlier_run_committed_come_from_their_commit_records(tmp_path):
    store = CacheStore(str(tmp_path))
    CommitRecord(0, 0, 10, 1, host="node-a").write(store)
    CommitRecord(1, 16, 20, 1, host="node-b").write(store)
    rec = run_record({"argv": ["x", "y"], "overrides": ["y"], "files": {"a": "b"}}, ["node-c", "node-c"], 2,
                     store, {0, 1})
    assert rec.hosts == ["node-a", "node-b", "node-c"] and rec.world_size == 2
    assert rec.argv == ["x", "y"] and rec.overrides == ["y"]


def test_the_mask_policy_names_the_rule_the_template_selects():
    gen = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    p = mask_policy(gen, DataConfig(mask_reasoning_content=True))
    assert (p.rule, p.fallback, p.mask_reasoning_content, p.mask_generation_prompt) == \
        ("generation_template", None, True, False)
    assert mask_policy(tiny.CHAT_TEMPLATE, DataConfig()).rule == "nemo_prefix"


def test_the_weight_dtype_of_a_checkpoint_comes_from_its_safetensors_headers(tmp_path):
    tok = tiny.build_tokenizer()
    tiny.build_target(RandomTargetConfig(), len(tok), torch.bfloat16).save_pretrained(tmp_path,
                                                                                      safe_serialization=True)
    tok.save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path), fingerprint="sampled")
    assert weights_dtype(cfg, inspect_target(cfg, tok)) == "bfloat16"


def test_info_describe_and_json_show_the_provenance(default_run, capsys):
    _, result = default_run
    assert main(["info", result.path]) == 0
    text = capsys.readouterr().out
    assert "last state  after the final norm (Qwen3RMSNorm); layer preset nemo" in text
    assert "masks       NeMo's prefix rule" in text and "weights     float32, computed in float32" in text
    assert f"on {socket.gethostname()} (world size 1)" in text and f"torch {metadata.version('torch')}" in text
    assert main(["info", result.path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["final_norm_class"] == "Qwen3RMSNorm" and got["last_state"] == "post_norm"
    assert got["mask_policy"]["rule"] == "nemo_prefix" and got["world_size"] == 1
    assert got["hosts"] == [socket.gethostname()] and got["versions"]["zarr"] == metadata.version("zarr")
