"""``dry_run=true``: the real run's counts and exact raw bytes, before any weights load, and nothing written."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import compose, refuse_building_weights, small

import dspark_precompute
from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt
from dspark_precompute.errors import ConfigError
from dspark_precompute.write.dryrun import DryRunPlan, dry_run
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny

TABLES = (*fmt.SAMPLE_ARRAYS, *fmt.UNIT_ARRAYS)


def present_chunks(path: Path, rows: int, chunk_rows: int) -> int:
    """Inner chunks a shard holds, from its index as the zarr v3 sharding spec lays it out (16 bytes an entry,
    ``2**64 - 1`` twice for an absent chunk, a crc32c after): read here without our code."""
    n = rows // chunk_rows
    index = np.frombuffer(path.read_bytes()[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)
    return int((index[:, 0] != np.uint64(2**64 - 1)).sum())


def stored_bytes(path: str) -> dict[str, int]:
    """The oracle: the rows of every inner chunk the shards hold x row bytes, and the small files' sizes."""
    g = zarr.open_group(path, mode="r")
    names = [fmt.INPUT_IDS, fmt.LOSS_MASK] + [f"{fmt.HIDDEN_GROUP}/{n}" for n, _ in g[fmt.HIDDEN_GROUP].arrays()]
    names += [fmt.POSITION_IDS] if fmt.POSITION_IDS in g else []  # an image cache's multi-axis positions
    row = {n: int(np.prod(g[n].shape[1:])) * g[n].dtype.itemsize for n in names}
    rows = {n: sum(present_chunks(f, g[n].shards[0], g[n].chunks[0]) * g[n].chunks[0]
                   for f in (Path(path) / n).iterdir() if f.name.startswith("c.")) for n in names}
    return {"token_arrays": sum(rows[n] * row[n] for n in names),
            "tables": sum(g[n].shape[0] * g[n].dtype.itemsize for n in TABLES),
            "image_tables": sum(int(np.prod(g[n].shape)) * g[n].dtype.itemsize
                                for n in (*fmt.IMAGE_ARRAYS, *fmt.VIDEO_ARRAYS) if n in g),
            "weights": (Path(path) / fmt.WEIGHTS).stat().st_size,
            "rejects": (Path(path) / fmt.REJECTS).stat().st_size}


def assert_plan_matches(plan: DryRunPlan, path: str) -> None:
    c = open_cache(path)
    m = c.manifest
    counts = m.counts
    assert (plan.rows_in, plan.samples, plan.rejected, plan.tokens, plan.supervised_tokens,
            plan.truncated_samples) == (counts.rows_in, counts.samples, counts.rejected, counts.tokens,
                                        counts.supervised_tokens, counts.truncated_samples)
    assert plan.rejected_by_reason == counts.rejected_by_reason
    assert (plan.num_units, plan.chunk_tokens, plan.unit_tokens, plan.total_token_slots) == (
        m.layout.num_units, m.layout.chunk_tokens, m.layout.unit_tokens, m.layout.total_token_slots)
    assert plan.layer_ids == m.layer_ids and plan.max_length == int(c.lengths().max())
    got = stored_bytes(path)
    assert plan.token_array_bytes == got["token_arrays"] == plan.written_slots * plan.bytes_per_token
    positions = 4 * m.media.position_axes if m.media is not None else 0  # int32 per axis; the manifest's figure
    assert plan.bytes_per_token == m.bytes_per_token + positions  # leaves position_ids out (ids, mask, hidden)
    assert (plan.table_bytes, plan.image_table_bytes, plan.weights_file_bytes, plan.rejects_file_bytes) == (
        got["tables"], got["image_tables"], got["weights"], got["rejects"])
    assert plan.raw_bytes == sum(got.values())


def test_a_dry_run_predicts_the_real_runs_counts_and_exact_uncompressed_bytes(default_run, monkeypatch):
    cfg, result = default_run
    refuse_building_weights(monkeypatch)
    plan = dry_run(dataclasses.replace(cfg, dry_run=True))
    assert_plan_matches(plan, result.path)
    assert "complete: the run would have nothing to do" in plan.storage_state
    on_disk = sum(f.stat().st_size for d in ("input_ids", "loss_mask", "hidden_states")
                  for f in (Path(result.path) / d).rglob("*") if f.is_file() and f.name != "zarr.json")
    est_tokens = sum(a.estimated_bytes for a in plan.arrays)
    assert 0.5 < est_tokens / on_disk < 2  # an estimate from a measured ratio, not a promise
    text = plan.table()
    assert f"{result.samples:,} samples" in text and f"{plan.raw_bytes:,} B" in text and "(estimate)" in text


def assert_inventory_matches(plan: DryRunPlan, result) -> None:
    files = dirs = 0
    for _root, d, f in os.walk(result.path):  # the oracle: the filesystem itself
        files, dirs = files + len(f), dirs + len(d)
    hydra = 3 * os.path.isdir(Path(result.path) / ".hydra")  # an in-process run(cfg) writes no Hydra record
    assert (files, dirs) == (plan.files - (3 - hydra), plan.directories - (hydra == 0))


def test_a_real_run_holds_exactly_the_files_and_directories_the_dry_run_counts(default_run):
    cfg, result = default_run
    plan = dry_run(dataclasses.replace(cfg, dry_run=True))
    assert_inventory_matches(plan, result)
    assert plan.num_units > 1 and plan.entries_per_tb > 0


def test_the_time_comes_from_plan_tokens_per_second_or_from_the_parameter_count(default_run):
    cfg, _ = default_run
    given = dry_run(dataclasses.replace(cfg, dry_run=True, plan=dataclasses.replace(cfg.plan, tokens_per_second=500)))
    assert given.estimated_seconds == pytest.approx(given.tokens / 500) and "plan.tokens_per_second" in given.rate_note
    est = dry_run(dataclasses.replace(cfg, dry_run=True))
    model = tiny.build_target(cfg.model.random, len(tiny.build_tokenizer()))
    assert est.parameters == sum(p.numel() for p in model.parameters())
    matmul = est.parameters - model.get_input_embeddings().weight.numel()  # tied: the head is the embedding
    assert est.tokens_per_second == pytest.approx(300e12 / (2 * matmul))
    assert est.estimated_seconds == pytest.approx(est.forward_tokens / est.tokens_per_second)
    assert "assumed 300 TFLOP/s" in est.rate_note and est.forward_tokens >= est.tokens
    with pytest.raises(ConfigError, match="plan.tokens_per_second=0.0 must be a positive rate"):
        compose(["plan.tokens_per_second=0"])


def test_a_dry_run_says_what_the_run_would_find_at_storage_path(default_run, tmp_path):
    cfg, result = default_run
    fresh = dry_run(compose(small(tmp_path, "dry_run=true", name="new")))
    assert fresh.storage_state == "new cache" and not (tmp_path / "new").exists()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    foreign = dry_run(compose(small(tmp_path, "dry_run=true", name="foreign")))
    assert "the run would be refused" in foreign.storage_state and "notes.txt" in foreign.storage_state
    other = dry_run(dataclasses.replace(cfg, dry_run=True, seq_length=200))
    assert "other settings" in other.storage_state and "seq_length: recorded 256, requested 200" in other.storage_state


def test_the_run_function_refuses_a_dry_run_and_the_package_entry_point_plans_it(tmp_path):
    cfg = compose(small(tmp_path, "dry_run=true", "data.max_samples=2"))
    with pytest.raises(ConfigError, match="dry_run=true plans a run without running it"):
        run(cfg)
    assert isinstance(dspark_precompute.run(cfg), DryRunPlan)
    assert not (tmp_path / "cache").exists()


def test_a_dry_run_reports_each_ranks_share_of_the_weights_for_the_layout(tmp_path):
    """Planned on one process (a login node): the layout's world size is not checked, its share is reported."""
    moe = ["model.random.model_type=qwen3_moe", "model.dtype=bf16"]
    one = dry_run(compose(small(tmp_path, *moe, "dry_run=true")))
    model = tiny.build_target(compose(small(tmp_path, *moe)).model.random, len(tiny.build_tokenizer()))
    whole = sum(p.numel() for p in model.parameters()) * 2  # bf16: the oracle is the built model itself
    assert one.weight_bytes == one.rank_weight_bytes == whole and "one copy per rank" in one.weights_layout
    four = dry_run(compose(small(tmp_path, *moe, "dry_run=true", "parallel.fsdp=4", "parallel.ep=2")))
    assert four.weight_bytes == whole and four.rank_weight_bytes == -(-whole // 4)
    assert "parallel.fsdp=4 parallel.ep=2 (4 ranks per copy)" in dict(four.rows())["weights per rank"]


# ---- planning before the download: config.json and the tokenizer alone ----

QWEN3_235B_A22B = {  # Qwen/Qwen3-235B-A22B's config.json, as the hub ships it
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 94, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "attention_bias": False,
    "hidden_act": "silu", "norm_topk_prob": True, "bos_token_id": 151643, "eos_token_id": 151645}


def qwen3_235b_parameters(c: dict) -> int:
    """The oracle: Qwen3-MoE's parameters counted by hand from the config (attention, norms, router, experts)."""
    h, d, q, kv, e, m = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                         c["num_experts"], c["moe_intermediate_size"])
    layer = h * q * d * 2 + h * kv * d * 2 + 2 * d + 2 * h + e * h + e * 3 * h * m
    return c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h + h


def config_only_dir(tmp_path: Path, config: dict) -> Path:
    import json
    import shutil

    import helpers

    if not helpers.QWEN3_TOKENIZER.is_dir():
        pytest.skip(f"the Qwen3 tokenizer fixture {helpers.QWEN3_TOKENIZER} is not present")
    d = tmp_path / "config-only"
    shutil.copytree(helpers.QWEN3_TOKENIZER, d)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_a_235b_moe_with_no_weight_files_is_planned_from_its_config_and_the_fingerprint_is_not_computed(
        tmp_path, monkeypatch):
    d = config_only_dir(tmp_path, QWEN3_235B_A22B)
    refuse_building_weights(monkeypatch)
    common = (f"model.path={d}", "model.dtype=bf16", "dry_run=true", "data.max_samples=4")
    plan = dry_run(compose(small(tmp_path, *common, "parallel.fsdp=16", "parallel.ep=8")))
    params = qwen3_235b_parameters(QWEN3_235B_A22B)
    assert plan.parameters == params and 234e9 < params < 236e9
    assert plan.weight_bytes == 2 * params and plan.rank_weight_bytes == -(-2 * params // 16)
    rows = dict(plan.rows())
    assert "config.json alone" in rows["weights per rank"]
    assert rows["weights fingerprint"].startswith("not computed (no weight files yet")
    one = dict(dry_run(compose(small(tmp_path, *common))).rows())
    assert "shard it over" in one["fit here"] and "parallel.fsdp=" in one["fit here"]  # the layout that fits


def test_a_real_run_of_a_config_only_directory_is_refused_naming_the_missing_weights(tmp_path, monkeypatch):
    d = config_only_dir(tmp_path, QWEN3_235B_A22B)
    refuse_building_weights(monkeypatch)
    with pytest.raises(ConfigError, match=r"has no weight files \(\*\.safetensors\).*dry_run=true plans"):
        run(compose(small(tmp_path, f"model.path={d}", "data.max_samples=4")))


def test_a_dry_run_of_an_image_text_checkpoint_counts_its_language_model_only(tmp_path, monkeypatch):
    src = tmp_path / "src"
    full = tiny.save_image_text_checkpoint("qwen3_5_moe", src, dtype=__import__("torch").bfloat16)
    lm = sum(p.numel() for n, p in full.named_parameters() if not n.startswith("model.visual."))
    refuse_building_weights(monkeypatch)
    plan = dry_run(compose(small(tmp_path, f"model.path={src}", "model.dtype=bf16", "dry_run=true",
                                 "data.max_samples=4", "parallel.fsdp=2", "parallel.ep=2")))
    assert plan.parameters == lm and plan.weight_bytes == 2 * lm and plan.rank_weight_bytes == lm
    assert "Qwen3_5MoeForConditionalGeneration" in plan.target_part and "model.visual" in plan.target_part


def test_a_dry_run_of_rows_with_images_counts_the_position_ids_and_the_image_tables_a_real_run_writes(tmp_path):
    """The oracle: the real run's cache (position_ids' stored chunks, the images/* tables' shapes, the files)."""
    import json

    from test_media import TEXT_ROW, openai_row, sharegpt_row, write_images

    src = tmp_path / "src"
    tiny.save_image_text_checkpoint("qwen3_vl", src)
    names = write_images(tmp_path / "imgs")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt_row(names), TEXT_ROW, openai_row(names))))
    cfg = compose(small(tmp_path, f"model.path={src}", f"data.path={rows}", "seq_length=4096",
                        "batch.max_tokens=8192", "model.layer_ids=[0,1]"))
    result = run(cfg)
    plan = dry_run(dataclasses.replace(cfg, dry_run=True))
    assert_plan_matches(plan, result.path)
    assert_inventory_matches(plan, result)
    positions = next(a for a in plan.arrays if a.name == fmt.POSITION_IDS)
    assert positions.raw_bytes == plan.written_slots * 3 * 4 > 0  # int32 x 3 axes per token slot
    assert plan.images == 4 and plan.image_table_bytes == 4 * (8 + 3 * 4 + 32)
    assert "4 images" in dict(plan.rows())["other files"]
    assert "vision tower included" in plan.target_part


def test_a_sharded_dry_run_of_rows_with_images_holds_the_vision_tower_whole_on_each_rank(tmp_path, monkeypatch):
    """The oracle: the checkpoint's own parameters, split into the language model (over the ranks) and the rest."""
    import json

    from test_media import TEXT_ROW, sharegpt_row, write_images

    src = tmp_path / "src"
    full = tiny.save_image_text_checkpoint("qwen3_5_moe", src, dtype=__import__("torch").bfloat16)
    vision = sum(p.numel() for n, p in full.named_parameters() if n.startswith("model.visual."))
    lm = sum(p.numel() for n, p in full.named_parameters()) - vision
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt_row(write_images(tmp_path / "imgs")), TEXT_ROW)))
    refuse_building_weights(monkeypatch)
    plan = dry_run(compose(small(tmp_path, f"model.path={src}", f"data.path={rows}", "model.dtype=bf16",
                                 "dry_run=true", "parallel.fsdp=2", "parallel.ep=2")))
    assert vision > 0 and plan.weight_bytes == 2 * (lm + vision)
    assert plan.rank_weight_bytes == -(-2 * lm // 2) + 2 * vision  # bf16: 2 bytes a parameter
