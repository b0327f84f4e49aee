"""``dspark-cache``: info, verify (damage of every kind is named), export and export-nemo, plot, repair."""

from __future__ import annotations

import json
import os
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
    assert "already holds a nemo export" in capsys.readouterr().err
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


# -- writes that fail: one line, exit 2, nothing left behind, a previous export kept whole ------------------------
TARGETS = ("nemo", "deepspec", "specforge", "speculators")


def cache_for(request, to: str) -> str:
    """The shared small cache; speculators needs the pre-norm state too (capture.last_state=both)."""
    if to == "speculators":
        pytest.importorskip("datasets", reason='the speculators export writes a datasets folder: pip install -e '
                                               '".[interop]"')
        return request.getfixturevalue("both_states_run")[1].path
    return request.getfixturevalue("default_run")[1].path


def one_line_exit_2(argv: list[str], capsys) -> str:
    """``dspark-cache ARGV`` in this process: exit 2 and one line on stderr (besides log warnings); an exception
    escaping ``main`` (a traceback for the user) fails the test."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and not line.startswith("WARNING ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def export_fault():
    """``arm(spec)`` sets ``DSPARK_FAULT`` for this process's exports; unset and read again afterwards."""
    from dspark_precompute import faults

    def arm(spec: str) -> None:
        os.environ["DSPARK_FAULT"] = spec
        faults.reload()

    yield arm
    os.environ.pop("DSPARK_FAULT", None)
    faults.reload()


@pytest.mark.parametrize("to", TARGETS)
def test_an_export_to_a_read_only_destination_is_one_line_naming_it_and_exit_2(request, read_only_dir, capsys, to):
    out = read_only_dir / "out"
    line = one_line_exit_2(["export", cache_for(request, to), str(out), "--to", to], capsys)
    assert line.startswith("dspark-cache export: exporting the ") and f" to {out} failed: " in line, line
    why = "the file system is read-only" if os.geteuid() == 0 else "permission denied"
    assert why in line and "or choose another destination, then run the export again" in line, line
    assert os.listdir(read_only_dir) == []


@pytest.mark.parametrize("to", TARGETS)
def test_an_export_onto_a_full_disk_says_the_disk_is_full_and_leaves_nothing_behind(request, tiny_disk, capsys, to):
    out = tiny_disk / "out"  # every export of the small cache is over 1 MB; the disk holds 200 KiB
    line = one_line_exit_2(["export", cache_for(request, to), str(out), "--to", to], capsys)
    assert f" to {out} failed: the disk is full ([Errno 28] No space left on device). Free space on that disk" in line
    assert os.listdir(tiny_disk) == []  # no temporary (.shard-*.tmp), no staging directory, no scratch file


@pytest.mark.parametrize("failure", ["disk_full", "unreadable_sample"])
@pytest.mark.parametrize("to", TARGETS)
def test_an_overwrite_that_fails_partway_keeps_the_previous_export_whole(request, tmp_path, capsys, monkeypatch,
                                                                        export_fault, to, failure):
    from dspark_precompute.read.reader import CacheReader

    cache, out = cache_for(request, to), tmp_path / "out"
    assert main(["export", cache, str(out), "--to", to, "--layers", "1,3", "--shard-size", "4"]) == 0
    before = files_of(out)
    capsys.readouterr()
    if failure == "disk_full":
        export_fault("export_sample=3:enospc")  # the disk fills after the third sample
    else:
        real, reads = CacheReader.read_raw, {"n": 0}

        def fails(self, i, layers=None, *a, **k):
            reads["n"] += bool(layers)  # reading a sample's states (the plan reads ids and masks only)
            if reads["n"] == 3:
                raise OSError(5, "Input/output error", "hidden_states/layer_1/c.0.0")
            return real(self, i, layers, *a, **k)
        monkeypatch.setattr(CacheReader, "read_raw", fails)
    line = one_line_exit_2(["export", cache, str(out), "--to", to, "--overwrite", "--shard-size", "2"], capsys)
    assert ("the disk is full" if failure == "disk_full" else "Input/output error") in line, line
    assert files_of(out) == before  # every file of the previous export, byte for byte, and nothing else
    assert os.listdir(tmp_path) == ["out"]  # no staging directory or scratch file beside it


def test_export_nemo_is_export_to_nemo(default_run, tmp_path):
    _, result = default_run
    assert main(["export-nemo", result.path, str(tmp_path / "a"), "--shard-size", "4", "--max-length", "64"]) == 0
    assert main(["export", result.path, str(tmp_path / "b"), "--to", "nemo", "--shard-size", "4",
                 "--max-length", "64"]) == 0
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")


def test_repair_of_a_read_only_cache_and_a_plot_to_a_read_only_place_are_one_line(default_run, cache_copy,
                                                                                 read_only_view, read_only_dir,
                                                                                 capsys):
    shard_file(cache_copy, "hidden_states/layer_3", 4).unlink()  # unit 1 damaged: --repair would mark it
    view = read_only_view(cache_copy)
    code = main(["verify", str(view), "--repair"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    assert captured.err == f"dspark-cache verify: marking units [1] of {view} for recomputation failed: the file " \
        f"system is read-only ([Errno 30] Read-only file system: '{view}/.writer.lock'). Make it writable, then run " \
        "verify --repair again.\n"
    png = read_only_dir / "report.png"
    line = one_line_exit_2(["plot", default_run[1].path, "-o", str(png), "--max-samples", "2"], capsys)
    assert line.startswith(f"dspark-cache plot: writing the plot to {png} failed: ") and "give -o another path" in line
