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
  and every loader epoch of the reader bench delivers the run's tokens once;
- ``bench.py scale`` counts exactly the files and directories the contract's inventory says a cache holds,
  and its growth table is what its measurements give.
"""

from __future__ import annotations

import json
import re
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
    import tarfile

    cfg, result = default_run
    cache = tmp_path / "cache"
    shutil.copytree(result.path, cache)
    with tarfile.open(REPO / "tests" / "data" / "format1_caches.tgz") as tar:  # a format 1 cache (other samples)
        tar.extractall(tmp_path / "format1", filter="data")
    out = tmp_path / "reader.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_reader.py"), "--cache", str(cache),
                           "--repeats", "2", "--batch-size", "4", "--max-tokens", "1024", "--workers", "0,2",
                           "--v1-cache", str(tmp_path / "format1" / "bf16"), "--reads", "30", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    c, reader = res["cache"], open_cache(result.path)
    assert (c["samples"], c["tokens"], c["seq_length"]) == (result.samples, result.tokens, cfg.seq_length)
    assert (c["layers"], c["hidden"]) == (reader.layer_ids, reader.hidden_size)
    assert c["bytes_on_disk"] == sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    # the decode limit decoded every stored chunk of every token array once: each unit's tokens up to its last
    # chunk's end (format 2 leaves the chunks past a unit's last token out of its shard)
    ct = reader.chunk_tokens
    stored = sum(-(-int(b - a) // ct) * ct for a, b in reader.chunks.unit_spans())
    assert stored <= reader.manifest.layout.total_token_slots  # a unit's chunks past its last token are not read
    assert res["decode_limit_bytes"] == [stored * c["token_bytes"]] * 2
    # random single-sample reads, format 2 against format 1, the same count each, the ratio from the same repeats
    rr = res["random_reads"]
    # "format 2" names the sharded layout, which format 3 keeps (it adds only the shards' digests to the records)
    assert (rr["format 2 cache"]["format_version"], rr["format 1 cache"]["format_version"]) == (3, 1)
    for name in ("format 2", "format 1"):
        assert rr["samples_per_s"][name] == pytest.approx(30 / (sum(rr["seconds"][name]) / 2))  # median of 2
    ratios = [a / b for a, b in zip(rr["seconds"]["format 2"], rr["seconds"]["format 1"], strict=True)]
    assert rr["format 2_time_over_format 1_paired"] == pytest.approx(sum(ratios) / 2)
    assert "Random single-sample reads" in proc.stdout
    cases = {k["case"]: k for k in res["cases"]}
    assert len(cases) == 7 and any(k.startswith("NeMo CachedDSparkDataset") for k in cases)
    nemo = next(k for name, k in cases.items() if name.startswith("NeMo"))["tokens_per_s"]
    for name, k in cases.items():
        assert k["epoch_tokens"] == [result.tokens] * 2, name  # every real token, once per epoch
        if "batch 4" in name:
            assert k["epoch_batches"] == [-(-result.samples // 4)] * 2, name
        assert k["GBps"] == pytest.approx(k["tokens_per_s"] * c["token_bytes"] / 1e9)
        assert k["of_decode_limit"] == pytest.approx(k["tokens_per_s"] / (res["decode_limit_tokens_per_s"]
                                                                          * max(1, k["workers"])))
        assert k["vs_nemo"] == pytest.approx(k["tokens_per_s"] / nemo) and k["cpu_us_per_token"] >= 0
    assert "| loader | real tokens/s |" in proc.stdout


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    """``bench.py scale`` at 20 and 40 rows of the byte-level tiny target (units of 1,024 tokens, so several each),
    without the kill-and-resume runs (they take two more runs per size), the caches kept."""
    tmp = tmp_path_factory.mktemp("scale")
    out = tmp / "scale.json"
    proc = subprocess.run([sys.executable, str(BENCH), "scale", "--rows", "20,40", "--target", "tiny", "--data",
                           "embedded", "--seq", "256", "--set", "storage.chunk_tokens=256", "--set",
                           "storage.unit_tokens=1024", "--reads", "20", "--repeats", "1", "--no-resume", "--workdir",
                           str(tmp / "work"), "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, tmp / "work"


def test_the_scale_bench_counts_the_files_the_contract_says_each_cache_holds(scale_run):
    import os

    import numpy as np

    res, md, work = scale_run
    assert [size["rows"] for size in res["sizes"]] == [20, 40]  # the sizes asked for
    for size in res["sizes"]:
        facts, path = size["cache"], work / f"fresh-{size['rows']}"
        files = dirs = 0
        for _, ds, fs in os.walk(path):
            files, dirs = files + len(fs), dirs + len(ds)
        assert (facts["files"], facts["directories"]) == (files, dirs) == (facts["inventory_files"],
                                                                           facts["inventory_directories"])
        c = open_cache(path)
        assert (len(c), int(c.lengths().sum()), c.num_units) == (facts["samples"], facts["tokens"], facts["units"])
        assert c.manifest.counts.rows_in == size["rows"]  # every synthetic row read, each its own
        ct, hidden_arrays = c.chunk_tokens, facts["token_arrays"] - 2
        slots = sum(-(-int(b - a) // ct) * ct for a, b in c.chunks.unit_spans())
        assert facts["raw_hidden_bytes"] == slots * hidden_arrays * c.hidden_size * 2  # bf16
        assert facts["entries_per_tb"] == pytest.approx((files + dirs) * 1e12 / facts["raw_hidden_bytes"])
        assert facts["units"] >= -(-facts["tokens"] // facts["unit_tokens"]) > 1
        c.close()
        # the run's own phases lie within what was watched from outside
        timing, fresh = facts["timing"], size["fresh"]
        assert timing["tokenize_s"] < fresh["first_commit_s"] < fresh["wall_s"]
        assert timing["wall_s"] < fresh["wall_s"]
    assert np.all(np.diff([s["cache"]["entries"] for s in res["sizes"]]) > 0)  # more rows, more units, more files
    assert "| files + directories |" in md


def test_the_scale_bench_growth_table_is_the_largest_size_over_the_smallest(scale_run):
    res, md, _ = scale_run
    a, b = res["sizes"][0], res["sizes"][-1]
    rows = {g["metric"]: g for g in res["growth"]}
    for g in rows.values():  # a per-TB figure must stay flat; every other cost may grow with the rows
        flat = g["metric"].startswith("entries per TB")
        assert g["limit"] == pytest.approx(1.1 if flat else 1.1 * b["rows"] / a["rows"])
        assert g["ratio"] == pytest.approx(g["values"][-1] / g["values"][0])
        assert g["met"] == (g["ratio"] <= g["limit"])
    assert rows["files + directories"]["values"] == [a["cache"]["entries"], b["cache"]["entries"]]
    assert rows["verify (in process)"]["values"][0] == pytest.approx(a["read_costs_median"]["verify_s"])
    assert "**ratio**" in md


def _figures(text: str, pattern: str) -> tuple[str, ...]:
    found = re.search(pattern, " ".join(text.split()))  # the figures of a sentence, wherever its lines break
    assert found, pattern
    return found.groups()


def test_the_readme_capacity_example_holds_at_most_5000_entries_per_tb_of_hidden_states(scale_run):
    """The README's (and scaling.md's) capacity figures are what the bench computes for 1M samples of Qwen3-8B
    (330M tokens, 5 bf16 arrays of hidden 4096) by the dry run's own arithmetic."""
    from dspark_precompute.contract.inventory import inventory

    readme, scaling = (REPO / "README.md").read_text(), (REPO / "docs" / "scaling.md").read_text()
    per_token, per_tb = _figures(readme, r"\*\*([\d,]+) bytes per real token\*\* .*? about \*\*([\d,]+) files and "
                                         r"directories per TB\*\*")
    millions, length, tb, entries = _figures(readme, r"(\d+)M conversations of (\d+) tokens are ([\d.]+) TB in "
                                                     r"([\d,]+) entries")
    units, entries_again, per_tb_again = _figures(scaling, r"([\d,]+) units: \*\*([\d,]+)\*\* \(about ([\d,]+) per TB")
    cap = scale_run[0]["capacity"]
    (case,) = [c for c in cap["cases"].values() if c["tokens"] == cap["samples"] * int(length)]  # every sample 330
    assert cap["samples"] == int(millions) * 1_000_000 and cap["hidden"] == 4096 and cap["hidden_arrays"] == 5
    assert cap["bytes_per_token"] == int(per_token.replace(",", ""))
    assert f"{case['tokens'] * cap['bytes_per_token'] / 1e12:.1f}" == tb
    assert case["entries"] == int(entries.replace(",", "")) == int(entries_again.replace(",", ""))
    assert case["units"] == int(units.replace(",", ""))
    assert round(case["entries_per_tb"], -1) == int(per_tb.replace(",", "")) == int(per_tb_again.replace(",", ""))
    for case in cap["cases"].values():
        assert case["units"] >= case["tokens"] / cap["unit_tokens"]
        assert case["entries"] == inventory(7, case["units"], cap["samples"], fp8=False).entries
        assert case["raw_hidden_bytes"] >= case["tokens"] * 5 * 4096 * 2
        assert case["entries_per_tb"] <= 5000 and case["entries"] < 70_000
        assert case["format1_chunk_files"] > 50 * case["entries"]  # one file per chunk before format 2
