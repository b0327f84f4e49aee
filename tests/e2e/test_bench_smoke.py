"""Benchmark smoke test: ``scripts/bench.py`` runs end to end at tiny sizes, and what holds anywhere.

Speed ratios depend on the machine and are only reported by the full bench
(docs/benchmarks.md); what is asserted here holds on any machine:

- the cache costs at most 0.3x the bytes per real token of the reference tool's padded
  layout (int64 ids/masks, every sample padded to seq_length) for the same samples, both
  as the bench writes it and as computed analytically;
- the tool never computes vocabulary logits: the target's lm_head is never called during
  the tool's run or the bare-forward limit, while the padded baseline (a positive control)
  calls it once per batch;
- the numbers agree with what was written and read: the bytes a read sample takes follow from
  the run's tokens and the target's shape, the padded layout from seq_length, the cache's
  compression ratio from the compressor sweep over its own hidden states, the timings add up,
  and every loader epoch of the reader bench delivers the run's tokens once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from dspark_precompute import open_cache

BENCH = REPO / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out, md = tmp / "bench.json", tmp / "bench.md"
    proc = subprocess.run([sys.executable, str(BENCH), "--cases", "byte@2048=16", "--scale-cases", "", "--sweep-on",
                           "", "--repeats", "1", "--no-rss", "--sweep-repeats", "1", "--sweep-mib", "1", "--data",
                           "embedded", "--workdir", str(tmp / "work"), "--json", str(out), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), md.read_text()


def test_bench_end_to_end_tiny_bytes_per_real_token_at_most_0_3x_the_padded_layout(bench_run):
    res, md = bench_run
    (case,) = res["cases"]
    s, info = case["summary"], case["info"]
    assert s["samples"] == info["samples"] == 16 and s["tokens"] == info["tokens"] > 0
    # the written baseline matches the analytic padded layout (safetensors headers aside)
    assert s["padded_bytes_data"] == pytest.approx(s["padded_layout_B_per_tok"] * s["tokens"], rel=0.01)
    # the regression guard: ragged + compressed vs padded int64 layout, same samples
    assert s["tool_B_per_tok_data"] <= 0.3 * s["padded_layout_B_per_tok"], s
    assert s["bytes_ratio_data"] <= 0.3, s
    # every table the docs show is produced
    for title in ("tool vs limit vs padded", "Bytes on disk per real token", "Where the tool's time goes",
                  "Compressors", "Read-back"):
        assert title in md
    assert {r["compressor"].split()[0] for r in case["sweep"]} >= {"none", "blosc_lz4", "blosc_zstd", "zstd"}


def _row_bytes(info: dict) -> tuple[int, int]:
    """Bytes per token: stored (int32 ids, uint8 mask, one bf16 row per hidden array, N-1 stored once) and read
    (int64 ids and mask, target_hidden_states [T, L*H] and target_last_hidden_states [T, H] in bf16)."""
    hidden, ids = info["hidden_size"], info["layer_ids"]
    arrays = len(ids) + (info["num_layers"] - 1 not in ids)
    return 4 + 1 + 2 * hidden * arrays, 8 + 8 + 2 * hidden * (len(ids) + 1)


def test_the_bench_numbers_agree_with_the_cache_it_wrote_and_read_back(bench_run):
    res, _ = bench_run
    (case,) = res["cases"]
    s, info, rb, (tool,) = case["summary"], case["info"], case["readback"], case["raw"]["tool"]
    stored, read = _row_bytes(info)
    samples, tokens, seq = info["samples"], s["tokens"], case["seq_length"]
    assert (tool["samples"], tool["tokens"]) == (samples, tokens)  # the timed run is the run that wrote the cache
    # read-back went over every sample; bytes/s over samples/s is the bytes of the run's samples as read
    assert rb["random_samples"] == rb["sequential_samples"] == samples
    for kind in ("random", "sequential"):
        per_sample = rb[f"{kind}_MBps"] / rb[f"{kind}_samples_per_s"] * 1e6
        assert per_sample * samples == pytest.approx(tokens * read, rel=1e-6), kind
    # the padded baseline: every sample is seq_length rows, as read and as NeMo lays it out (attention mask too)
    assert rb["padded_random_MBps"] / rb["padded_random_samples_per_s"] * 1e6 == pytest.approx(seq * read, rel=1e-6)
    assert s["padded_layout_B_per_tok"] * tokens == pytest.approx(samples * seq * (read + 8), rel=1e-9)
    # the cache's ratio (raw token bytes over its bytes on disk, tables included) is the one the sweep measured
    # on its own hidden states with the default codec, give or take a factor of 2; lossless codecs never grow data
    ratios = {r["compressor"]: r["ratio"] for r in case["sweep"]}
    default = next(v for k, v in ratios.items() if k.endswith("(default)"))
    assert 0.5 * default <= tokens * stored / s["tool_bytes_data"] <= 2 * default, (tokens * stored, s, ratios)
    assert ratios["none"] == pytest.approx(1.0, abs=0.01) and min(ratios.values()) >= 0.99
    # target_weights: the embedding (and an untied lm_head) in bf16, plus the safetensors header
    matrix = 2 * info["vocab_size"] * info["hidden_size"]
    assert matrix < tool["bytes_weights"] <= 2 * matrix + 4096
    assert s["tool_bytes_total"] - s["tool_bytes_data"] == tool["bytes_weights"]
    # the timings add up: parts within the whole, rates from the same seconds
    tm = tool["timing"]
    assert tm["forward_s"] <= tm["forward_write_s"]
    assert tm["tokenize_s"] + tm["load_target_s"] + tm["forward_write_s"] <= tm["wall_s"] <= tool["wall_s"]
    assert s["tool_tok_s"] == pytest.approx(tokens / s["tool_wall_s"]) and \
        s["tool_over_limit"] == pytest.approx(s["tool_wall_s"] / s["limit_wall_s"])


def test_the_pipeline_never_calls_the_lm_head_but_the_padded_baseline_does(bench_run):
    res, _ = bench_run
    (case,) = res["cases"]
    calls = case["summary"]["lm_head_calls"]
    assert calls["tool"] == 0, "the tool computed vocabulary logits"
    assert calls["limit"] == 0
    batches = -(-case["info"]["samples"] // 4)  # the baseline's batch size, NeMo's default
    assert calls["padded"] == batches > 0


def test_the_reader_bench_reports_every_loader_nemo_and_the_decode_limit(default_run, tmp_path):
    """``scripts/bench_reader.py`` end to end on the small shared cache (its speeds mean nothing at this size;
    what each loader delivered, and the bytes, must match the run)."""
    import shutil

    cfg, result = default_run
    cache = tmp_path / "cache"
    shutil.copytree(result.path, cache)
    out = tmp_path / "reader.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_reader.py"), "--cache", str(cache),
                           "--repeats", "1", "--batch-size", "4", "--max-tokens", "1024", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    c, reader = res["cache"], open_cache(result.path)
    assert (c["samples"], c["tokens"], c["seq_length"]) == (result.samples, result.tokens, cfg.seq_length)
    assert (c["layers"], c["hidden"]) == (reader.layer_ids, reader.hidden_size)
    assert c["bytes_on_disk"] == sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    # the decode limit decoded every chunk of every token array once: each token slot's bytes
    assert res["decode_limit_bytes"] == [reader.manifest.layout.total_token_slots * c["token_bytes"]]
    cases = {k["case"]: k for k in res["cases"]}
    assert len(cases) == 9 and any(k.startswith("NeMo CachedDSparkDataset") for k in cases)
    nemo = next(k for name, k in cases.items() if name.startswith("NeMo"))["tokens_per_s"]
    for name, k in cases.items():
        assert k["epoch_tokens"] == [result.tokens], name  # every real token, once per epoch
        if "batch 4" in name:
            assert k["epoch_batches"] == [-(-result.samples // 4)], name
        assert k["GBps"] == pytest.approx(k["tokens_per_s"] * c["token_bytes"] / 1e9)
        assert k["of_decode_limit"] == pytest.approx(k["tokens_per_s"] / (res["decode_limit_tokens_per_s"]
                                                                          * max(1, k["workers"])))
        assert k["vs_nemo"] == pytest.approx(k["tokens_per_s"] / nemo) and k["cpu_us_per_token"] >= 0
    assert "| loader | real tokens/s |" in proc.stdout
