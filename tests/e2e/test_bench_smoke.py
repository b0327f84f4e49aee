"""Benchmark smoke test: ``scripts/bench.py`` runs end to end at tiny sizes, and what holds anywhere.

Speed ratios depend on the machine and are only reported by the full bench
(docs/benchmarks.md); what is asserted here holds on any machine:

- the cache costs at most 0.3x the bytes per real token of the reference tool's padded
  layout (int64 ids/masks, every sample padded to seq_length) for the same samples, both
  as the bench writes it and as computed analytically;
- the tool never computes vocabulary logits: the target's lm_head is never called during
  the tool's run or the bare-forward limit, while the padded baseline (a positive control)
  calls it once per batch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e
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
    assert case["readback"]["random_samples_per_s"] > 0 and case["readback"]["sequential_MBps"] > 0


def test_the_pipeline_never_calls_the_lm_head_but_the_padded_baseline_does(bench_run):
    res, _ = bench_run
    (case,) = res["cases"]
    calls = case["summary"]["lm_head_calls"]
    assert calls["tool"] == 0, "the tool computed vocabulary logits"
    assert calls["limit"] == 0
    batches = -(-case["info"]["samples"] // 4)  # the baseline's batch size, NeMo's default
    assert calls["padded"] == batches > 0


def test_the_reader_bench_reports_every_loader_nemo_and_the_decode_limit(default_run, tmp_path):
    """``scripts/bench_reader.py`` end to end on the small shared cache (its numbers mean nothing at this size)."""
    import shutil

    _, result = default_run
    cache = tmp_path / "cache"
    shutil.copytree(result.path, cache)
    out = tmp_path / "reader.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_reader.py"), "--cache", str(cache),
                           "--repeats", "1", "--batch-size", "4", "--max-tokens", "1024", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cases = {c["case"]: c for c in res["cases"]}
    assert len(cases) == 9 and any(k.startswith("NeMo CachedDSparkDataset") for k in cases)
    assert all(c["tokens_per_s"] > 0 and c["cpu_us_per_token"] >= 0 for c in cases.values())
    assert res["decode_limit_tokens_per_s"] > 0 and res["cache"]["tokens"] > 0
    assert "| loader | real tokens/s |" in proc.stdout
