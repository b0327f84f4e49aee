"""``dspark-cache``: info, verify (damage of every kind is named), export and export-nemo, plot, repair."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import compose, drop_chunk, flip_chunk_byte, rebind, shard_file, small

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.write.run import run


def tables(path: Path) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(path), mode="r")
    return {k: np.asarray(g[f"samples/{k}"][:]) for k in ("start", "length", "unit")}


def holders(path: Path, lo: int, hi: int) -> list[int]:
    """Samples with tokens in slots [lo, hi) (the oracle for 'which samples does a chunk hold')."""
    t = tables(path)
    return [i for i in range(len(t["start"])) if t["start"][i] < hi and t["start"][i] + t["length"][i] > lo]


def test_info_prints_the_summary_and_json_gives_the_same_numbers(default_run, capsys):
    _, result = default_run
    assert main(["info", result.path]) == 0
    text = capsys.readouterr().out
    assert f"samples     {result.samples}" in text and f"{result.tokens:,}" in text and "(complete)" in text
    assert main(["info", result.path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = json.loads(json.dumps(open_cache(result.path).summary(), default=str))
    assert got == want and got["samples"] == result.samples


def test_verify_passes_an_intact_cache(cache_copy, capsys):
    assert main(["verify", str(cache_copy)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "chunks checked" in out


def test_verify_names_the_array_chunk_and_samples_of_a_flipped_byte(cache_copy, capsys):
    flip_chunk_byte(cache_copy, "hidden_states/layer_2", 1, at=100)
    assert main(["verify", str(cache_copy)]) == 1
    out = capsys.readouterr().out
    victims = holders(cache_copy, 256, 512)
    assert "array 'hidden_states/layer_2' chunk (1, 0) (in shard hidden_states/layer_2/c.0.0) fails its crc32c" in out
    assert "samples " + ", ".join(map(str, victims)) in out
    assert out.count("[checksum]") == 1 and out.startswith("FAILED")


def test_verify_finds_deleted_chunks_that_would_read_back_as_zeros(cache_copy, capsys):
    drop_chunk(cache_copy, "hidden_states/layer_1", 2)
    drop_chunk(cache_copy, "loss_mask", 3)
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    missing = [p for p in report["problems"] if p["check"] == "missing-chunk"]
    assert {(p["array"], tuple(p["chunk"])) for p in missing} == {("hidden_states/layer_1", (2, 0)),
                                                                  ("loss_mask", (3,))}
    hid = next(p for p in missing if p["array"] == "hidden_states/layer_1")
    assert "in shard hidden_states/layer_1/c.0.0" in hid["message"]
    assert hid["sample"] == holders(cache_copy, 512, 768)[0]
    assert not report["ok"]


def test_verify_checks_a_cache_behind_an_fsspec_url_too(cache_copy, capsys):
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in cache_copy.rglob("*"):
        if f.is_file() and f.relative_to(cache_copy).as_posix() != "hidden_states/layer_3/c.0.0":
            fs.pipe_file(f"/cli-url-test/{f.relative_to(cache_copy).as_posix()}", f.read_bytes())
    try:
        assert main(["verify", "memory://cli-url-test"]) == 1
        out = capsys.readouterr().out
        assert "array 'hidden_states/layer_3' shard (0, 0) (object hidden_states/layer_3/c.0.0) is missing" in out
    finally:
        fs.rm("/cli-url-test", recursive=True)


def test_verify_names_the_sample_whose_offset_was_tampered_with(cache_copy, capsys):
    arr = zarr.open_array(str(cache_copy / "samples" / "start"), mode="r+")
    start = np.asarray(arr[:])
    start[5] += 7
    arr[:] = start  # rewritten through zarr: the checksum is valid, only the value is wrong
    m = json.loads((cache_copy / "manifest.json").read_text())
    m["counts"]["tokens"] += 1
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(cache_copy)]) == 1
    out = capsys.readouterr().out
    assert f"samples/start[5] = {start[5]}, but the layout of the recorded lengths puts sample 5 at token " \
           f"{start[5] - 7}" in out
    assert f"manifest counts.tokens = {m['counts']['tokens']}, the cache holds {m['counts']['tokens'] - 1}" in out



def test_verify_skips_every_check_that_reruns_the_target_when_the_offsets_are_broken(cache_copy, capsys):
    arr = zarr.open_array(str(cache_copy / "samples" / "start"), mode="r+")
    start = np.asarray(arr[:])
    start[5] += 7
    arr[:] = start
    assert main(["verify", str(cache_copy), "--recompute", "2", "--teacher", "4", "--precision", "4", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    skipped = [p["check"] for p in got["problems"] if p["message"].startswith("skipped: the cache's structure")]
    assert skipped == ["recompute", "teacher", "precision"]
    assert got["recomputed"] == 0 and got["precision"] is None

def test_verify_recompute_reproduces_samples_bit_exactly_and_catches_a_value_with_a_valid_checksum(cache_copy,
                                                                                                    capsys):
    t = tables(cache_copy)
    victim = 3
    arr = zarr.open_array(str(cache_copy / "hidden_states" / "layer_2"), mode="r+")
    pos = int(t["start"][victim]) + 10
    row = np.asarray(arr[pos])
    row[7] ^= 0x0040  # a different bf16 value, stored with a fresh (valid) checksum
    arr[pos] = row
    assert main(["verify", str(cache_copy)]) == 1  # format 3: the shard is not the one its unit committed
    assert "[binding] array 'hidden_states/layer_2' shard (0, 0)" in capsys.readouterr().out
    rebind(cache_copy, "hidden_states/layer_2", pos // 1024)  # as a writer with that value would have recorded it
    assert main(["verify", str(cache_copy)]) == 0  # the structure is intact: only a recompute can tell
    capsys.readouterr()
    n = len(t["start"])
    assert main(["verify", str(cache_copy), "--recompute", str(n), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["recomputed"] == n and report["recompute_exact"] == n - 1  # the tiny target is deterministic
    (p,) = report["problems"]
    assert (p["check"], p["sample"], p["array"], p["chunk"]) == ("recompute", victim, "hidden_states/layer_2",
                                                                 [pos // 256, 0])
    assert "worst at token 10" in p["message"]


def test_verify_repair_marks_damaged_units_and_the_precompute_rerun_rewrites_them(default_run, tmp_path, capsys):
    _, result = default_run
    copy = tmp_path / "copy"
    shutil.copytree(result.path, copy)
    victim = shard_file(copy, "hidden_states/layer_3", 4)  # unit 1's shard of layer 3
    before = victim.read_bytes()
    victim.unlink()
    unit = int(tables(copy)["unit"][holders(copy, 1024, 1280)[0]])
    assert main(["verify", str(copy), "--repair"]) == 1
    out = capsys.readouterr().out
    assert f"repair: units [{unit}] marked for recomputation" in out
    assert not (copy / "commits" / f"u{unit:06d}.json").exists()
    again = run(compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024", name="copy")))
    assert again.units_written == 1 and again.resumed_units == 3
    assert victim.read_bytes() == before
    assert main(["verify", str(copy)]) == 0


def test_a_repaired_token_shard_makes_the_rerun_tokenize_again_and_rewrite_it(default_run, tmp_path, capsys):
    _, result = default_run
    copy = tmp_path / "copy"
    shutil.copytree(result.path, copy)
    victim = shard_file(copy, "input_ids", 4)  # unit 1's token ids: a resume would otherwise read them back
    before = victim.read_bytes()
    flip_chunk_byte(copy, "input_ids", 4)
    assert main(["verify", str(copy), "--repair"]) == 1
    out = capsys.readouterr().out
    assert "token ids and masks to be written again" in out
    assert json.loads((copy / "manifest.json").read_text())["tokens_stored"] is False
    again = run(compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024", name="copy")))
    assert again.units_written == 1 and "tokenize_s" in again.timing
    assert victim.read_bytes() == before
    assert main(["verify", str(copy)]) == 0


def test_export_nemo_writes_the_layout_and_refuses_to_clobber(default_run, tmp_path, capsys):
    _, result = default_run
    out = tmp_path / "nemo"
    assert main(["export-nemo", result.path, str(out), "--shard-size", "4"]) == 0
    assert f"recipe_args.cached_target_path={out}" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_samples"] == result.samples and m["shard_size"] == 4
    assert main(["export-nemo", result.path, str(out)]) == 2
    assert "already holds a NeMo DSpark cache" in capsys.readouterr().err
    assert main(["export-nemo", result.path, str(out), "--overwrite", "--layers", "1,3"]) == 0
    assert json.loads((out / "manifest.json").read_text())["target_layer_ids"] == [1, 3]


def test_export_to_each_trainer_prints_its_use_and_the_samples_a_cut_left_out(default_run, tmp_path, capsys):
    _, result = default_run
    out = tmp_path / "ds"
    assert main(["export", result.path, str(out), "--to", "deepspec", "--max-length", "40", "--target-name",
                 "Qwen/Qwen3-8B", "--shard-bytes", "100000"]) == 0
    printed = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert f"exported {m['num_samples']} samples (deepspec, layers [1, 2, 3])" in printed
    dropped = result.samples - m["num_samples"]
    assert dropped > 0 and f"left out {dropped} sample(s): no_supervised_token_within_max_length (max_length=40)" \
        in printed
    assert f"data.target_cache_path={out}" in printed and m["target_model_name_or_path"] == "Qwen/Qwen3-8B"
    assert main(["export", result.path, str(tmp_path / "nemo"), "--to", "nemo", "--shard-size", "4"]) == 0
    assert "recipe_args.cached_target_path=" in capsys.readouterr().out
    assert main(["export", result.path, str(tmp_path / "sp"), "--to", "speculators"]) == 2
    assert "capture.last_state=pre_norm" in capsys.readouterr().err
    assert main(["export", result.path, str(tmp_path / "x"), "--to", "nemo", "--target-name", "a"]) == 2
    assert "--target-name applies to --to deepspec only" in capsys.readouterr().err
    assert main(["export", result.path, str(tmp_path / "y"), "--to", "deepspec", "--max-length", "0"]) == 2
    assert "max_length=0 must be a positive number of tokens" in capsys.readouterr().err


def test_plot_writes_a_png_report(default_run, tmp_path, capsys):
    _, result = default_run
    png = tmp_path / "report.png"
    assert main(["plot", result.path, "-o", str(png), "--max-samples", "4"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    h, w, _ = imread(str(png)).shape
    assert w > 2 * h > 400  # three panels side by side


def test_errors_exit_2_with_the_reason_on_stderr(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "dspark-cache info:" in captured.err and "no manifest.json" in captured.err
    assert main(["export-nemo", str(tmp_path), str(tmp_path / "out"), "--shard-size", "0"]) == 2
    assert "shard_size=0 must be >= 1 (samples per shard)" in capsys.readouterr().err


def test_info_and_its_json_show_the_rejected_rows(default_run, capsys):
    _, result = default_run
    lines = [json.loads(x) for x in (Path(result.path) / "rejects.jsonl").read_text().splitlines() if x.strip()]
    assert main(["info", result.path]) == 0
    assert f"rejected    {len(lines)} of {result.samples + len(lines)} rows" in capsys.readouterr().out
    assert main(["info", result.path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rejected"] == len(lines) == result.rejected and got["rows_in"] == result.samples + len(lines)
    assert got["rejected_by_reason"] == {"no_supervised_tokens": len(lines)}
    assert got["rejected_fraction"] == pytest.approx(len(lines) / (result.samples + len(lines)))


def test_the_plot_title_shows_the_rejected_rows(default_run):
    from dspark_precompute.read.plot import plot_cache

    _, result = default_run
    fig = plot_cache(result.path, max_samples=2)
    title = fig._suptitle.get_text()
    assert "rejected 2 of 16 rows (12.5%): no_supervised_tokens=2" in title
