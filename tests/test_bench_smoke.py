"""Benchmark smoke test: the machine-independent ratios of scripts/bench.py at tiny sizes.

Speed ratios depend on the machine and are only reported by the full bench
(docs/benchmarks.md); what is asserted here holds anywhere:

- the cache costs at most 0.3x the bytes per real token of the reference tool's padded
  layout (int64 ids/masks, every sample padded to seq_length) for the same samples, both
  as the bench writes it and as computed analytically;
- the tool never computes vocabulary logits: the target's lm_head is not called during
  ``pipeline.run`` (while the padded baseline, as a positive control, does call it).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import REPO, compose, small

BENCH = REPO / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dspark_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_bench_end_to_end_tiny_bytes_per_real_token_at_most_0_3x_the_padded_layout(bench, tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--cases", "byte@2048=16", "--scale-cases", "", "--sweep-on", "", "--repeats", "1", "--no-rss",
                     "--sweep-repeats", "1", "--sweep-mib", "1", "--data", "embedded",
                     "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    s, info = case["summary"], case["info"]
    assert s["samples"] == info["samples"] == 16 and s["tokens"] == info["tokens"] > 0
    # the written baseline matches the analytic padded layout (safetensors headers aside)
    assert s["padded_bytes_data"] == pytest.approx(s["padded_layout_B_per_tok"] * s["tokens"], rel=0.01)
    # the regression guard: ragged + compressed vs padded int64 layout, same samples
    assert s["tool_B_per_tok_data"] <= 0.3 * s["padded_layout_B_per_tok"], s
    assert s["bytes_ratio_data"] <= 0.3, s
    # every table the docs show is produced
    md = bench.markdown(res)
    for title in ("tool vs limit vs padded", "Bytes on disk per real token", "Where the tool's time goes",
                  "Compressors", "Read-back"):
        assert title in md
    assert {r["compressor"].split()[0] for r in case["sweep"]} >= {"none", "blosc_lz4", "blosc_zstd", "zstd"}
    assert case["readback"]["random_samples_per_s"] > 0 and case["readback"]["sequential_MBps"] > 0


def test_the_pipeline_never_calls_the_lm_head_but_the_padded_baseline_does(bench, tmp_path, monkeypatch):
    import dspark_precompute.pipeline as pipeline

    calls = {"lm_head": 0, "loads": 0}
    real_load = pipeline.load_target

    def counting_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        calls["loads"] += 1

        def hook(_module, _inputs, _output):
            calls["lm_head"] += 1

        model.get_output_embeddings().register_forward_hook(hook)
        return model

    monkeypatch.setattr(pipeline, "load_target", counting_load)
    cfg = compose(small(tmp_path))
    result = pipeline.run(cfg)
    assert result.samples > 0 and calls["loads"] >= 1
    assert calls["lm_head"] == 0, "the tool computed vocabulary logits"

    # positive control on the same kind of model: the hook fires for the padded full-CausalLM forward,
    # and the bench's "limit" (bare decoder) does not call it either
    case = bench.make_case("byte", 256, 4, None, tmp_path / "case")
    model = counting_load(case.cfg.model, case.plan.target, len(case.plan.tokenizer), case.plan.device,
                          case.plan.compute_dtype)
    bench.run_limit(model, bench.limit_inputs(case), case.plan.device)
    assert calls["lm_head"] == 0
    r = bench.run_padded(case, tmp_path / "padded", model=model, tokenize=False)
    assert calls["lm_head"] == -(-r["samples"] // bench.BASELINE_BATCH) > 0
    assert r["shards"] == 1 and (tmp_path / "padded" / "shard-000000.safetensors").exists()
