"""Damaged and crafted caches: every reading entry point refuses with a typed error, never wrong numbers.

Entry points: ``open_cache`` (and sample reads), the training DataLoader, ``dspark-cache
info|export-nemo|plot`` (exit 2 with the reason) and ``verify`` (exit 1, a named problem,
never a traceback). Damage is done the way it happens: a deleted chunk file, a table
rewritten through zarr (so its checksum is valid), a hand-edited manifest or zarr.json.

Modules: ``read/verify/checks.py``, ``read/verify/report.py`` (the problems verify names), ``read/verify/repair.py``,
``read/summary.py`` and ``contract/weights.py`` (a damaged ``target_weights.safetensors``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import zarr
from helpers import (
    chunk_span,
    compose,
    drop_chunk,
    flip_chunk_byte,
    rebind,
    shard_file,
    shard_geometry,
    shard_index,
    small,
    write_shard_index,
)
from test_reader import to_memory_fs, zarr_sample

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.errors import CacheFormatError, ChecksumError, DamagedShardError, MissingChunkError
from dspark_precompute.read.training import CacheDataset, build_dataloader
from dspark_precompute.write.run import run

CT = 256  # default_run's chunk_tokens


@pytest.fixture(scope="module")
def zstd_run(tmp_path_factory):
    """Layers [0, 1] of 4 with a zstd chain (test_reader's final_norm_run: built once, reused)."""
    base = tmp_path_factory.getbasetemp()
    return run(compose(small(base, "model.layer_ids=[0,1]", "model.random.tie_word_embeddings=false",
                             "data.max_samples=3", "storage.compressor=zstd", "storage.compression_level=3",
                             name="layers01_untied")))


def tables(path) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(path), mode="r")
    return {k: np.asarray(g[k][:]) for k in ("samples/start", "samples/length", "samples/unit",
                                             "units/token_start", "units/token_stop")}


def holders(path, lo: int, hi: int) -> list[int]:
    """Oracle: samples with a token in slots [lo, hi), by a plain loop over the tables."""
    t = tables(path)
    s, n = t["samples/start"], t["samples/length"]
    return [i for i in range(len(s)) if s[i] < hi and s[i] + n[i] > lo]


def edit_manifest(path, fn) -> None:
    f = Path(path) / "manifest.json"
    m = json.loads(f.read_text())
    out = fn(m)
    f.write_text(json.dumps(m if out is None else out))


def edit_meta(path, array: str, fn) -> None:
    f = Path(path) / array / "zarr.json"
    meta = json.loads(f.read_text())
    fn(meta)
    f.write_text(json.dumps(meta))


def rewrite_table(path, name: str, fn) -> np.ndarray:
    """Change a table through zarr: the chunk gets a fresh, valid checksum (only the values are wrong)."""
    arr = zarr.open_array(str(Path(path) / name), mode="r+")
    values = np.asarray(arr[:])
    fn(values)
    arr[:] = values
    return values


def with_crc(body: bytes) -> bytes:
    return body + int(google_crc32c.value(body)).to_bytes(4, "little")


def same_sample(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- item 1: a missing chunk is damage, never zeros ---------------------------------------------
@pytest.mark.parametrize("array,shard,idx", [
    ("hidden_states/layer_2", "hidden_states/layer_2/c.0.0", (1, 0)),
    ("input_ids", "input_ids/c.0", (2,)),
    ("loss_mask", "loss_mask/c.0", (3,)),
])
def test_a_chunk_missing_from_its_shard_raises_missing_chunk_error_naming_array_chunk_and_samples(
        cache_copy, array, shard, idx):
    ref = {i: zarr_sample(str(cache_copy), i) for i in range(14)}
    drop_chunk(cache_copy, array, idx[0])  # its index entry says absent (re-checksummed): zarr would read zeros
    victims = holders(cache_copy, idx[0] * CT, (idx[0] + 1) * CT)
    assert victims
    c = open_cache(cache_copy)
    for i in victims:
        with pytest.raises(MissingChunkError, match=rf"array '{array}' chunk {re.escape(str(idx))} \(in shard "
                                                    rf"{shard}\) is missing: it holds token slots "
                                                    rf"\[{idx[0] * CT}, {(idx[0] + 1) * CT}\)") as info:
            c[i]
        assert info.value.array == array and info.value.chunk == idx and list(info.value.samples) == victims
        assert "dspark-cache verify --repair" in str(info.value)
    for i in sorted(set(range(len(c))) - set(victims)):  # everything else still reads exactly
        got = c.sample(i, as_numpy=True)
        assert np.array_equal(got["input_ids"], ref[i]["input_ids"].astype(np.int64))
    if array.startswith("hidden_states/"):  # a layer subset without the damaged array still reads
        assert np.array_equal(c.sample(victims[0], layers=[1], last=False, as_numpy=True)["input_ids"],
                              ref[victims[0]]["input_ids"])


def test_a_deleted_shard_raises_missing_chunk_error_for_every_sample_of_its_unit(cache_copy):
    shard_file(cache_copy, "hidden_states/layer_1", 4).unlink()  # unit 1's shard of layer 1
    t = tables(cache_copy)
    victims = sorted(np.flatnonzero(t["samples/unit"] == 1).tolist())
    c = open_cache(cache_copy)
    for i in victims:
        with pytest.raises(MissingChunkError, match=r"array 'hidden_states/layer_1' chunk \(\d+, 0\) \(in shard "
                                                    r"hidden_states/layer_1/c.1.0\) is missing") as info:
            c[i]
        assert i in info.value.samples
    other = sorted(set(range(14)) - set(victims))[0]
    assert c.sample(other, as_numpy=True)["input_ids"].size


def test_a_missing_chunk_is_also_damage_with_the_chunk_cache_off_and_in_a_slice(cache_copy):
    drop_chunk(cache_copy, "hidden_states/layer_3", 0)
    c = open_cache(cache_copy, chunk_cache_bytes=0)
    victim = holders(cache_copy, 0, CT)[0]
    with pytest.raises(MissingChunkError):
        c[:]
    with pytest.raises(MissingChunkError):
        c.chunks.read(["hidden_states/layer_3"], 0, 1)
    with pytest.raises(MissingChunkError):
        c[victim]


def test_a_missing_chunk_behind_an_fsspec_url_raises_too(cache_copy):
    import fsspec

    drop_chunk(cache_copy, "hidden_states/layer_1", 2)
    url = to_memory_fs(str(cache_copy), "damage-url-test")
    try:
        c = open_cache(url)
        victims = holders(cache_copy, 2 * CT, 3 * CT)
        with pytest.raises(MissingChunkError, match=r"'hidden_states/layer_1' chunk \(2, 0\) \(in shard "
                                                    r"hidden_states/layer_1/c.0.0\) is missing") as info:
            c[victims[0]]
        assert list(info.value.samples) == victims
        other = holders(cache_copy, 0, CT)[0]
        assert np.array_equal(c.sample(other, as_numpy=True)["target_hidden_states"],
                              open_cache(cache_copy).sample(other, as_numpy=True)["target_hidden_states"])
    finally:
        fsspec.filesystem("memory").rm("/damage-url-test", recursive=True)


def test_a_deleted_table_chunk_is_refused_at_open(cache_copy):
    (cache_copy / "samples" / "unit" / "c.0").unlink()  # one unit's worth of zeros would look plausible
    with pytest.raises(MissingChunkError, match=r"table 'samples/unit' chunk \(0,\) is missing \(file "
                                                r"samples/unit/c.0\): its rows \[0, 14\)"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1


def test_export_plot_info_and_the_dataloader_refuse_a_missing_chunk(cache_copy, tmp_path, capsys):
    drop_chunk(cache_copy, "hidden_states/layer_2", 1)
    drop_chunk(cache_copy, "loss_mask", 1)
    named = r"chunk \(1(, 0)?,?\) \(in shard [^)]*\) is missing"
    assert main(["export-nemo", str(cache_copy), str(tmp_path / "nemo")]) == 2
    err = capsys.readouterr().err
    assert "dspark-cache export-nemo:" in err and ") is missing: it holds token slots" in err
    assert not (tmp_path / "nemo" / "manifest.json").exists()  # no finished-looking export of zeros
    assert main(["plot", str(cache_copy), "-o", str(tmp_path / "p.png")]) == 2  # supervised counts read the mask
    assert "dspark-cache plot:" in capsys.readouterr().err and not (tmp_path / "p.png").exists()
    with pytest.raises(MissingChunkError, match=named):
        for _ in build_dataloader(cache_copy, batch_size=4, shuffle=False):
            pass
    # info reads the stored masks of an incomplete cache (its counts are not final)
    edit_manifest(cache_copy, lambda m: m.update(complete=False))
    assert main(["info", str(cache_copy), "--allow-incomplete"]) == 2
    assert "loss_mask' chunk (1,) (in shard loss_mask/c.0) is missing" in capsys.readouterr().err


def test_a_dataloader_worker_raises_the_typed_error_in_the_training_process(cache_copy):
    drop_chunk(cache_copy, "input_ids", 0)
    loader = build_dataloader(cache_copy, batch_size=2, shuffle=False, num_workers=1)
    with pytest.raises(MissingChunkError, match=r"array 'input_ids' chunk \(0,\) \(in shard input_ids/c.0\) is "
                                                r"missing"):
        for _ in loader:
            pass


def test_a_corrupt_chunk_in_a_worker_stays_a_checksum_error(cache_copy):
    flip_chunk_byte(cache_copy, "hidden_states/layer_1", 0)
    loader = build_dataloader(cache_copy, batch_size=2, shuffle=False, num_workers=1)
    with pytest.raises(ChecksumError, match=r"hidden_states/layer_1"):
        for _ in loader:
            pass


# -- item 2: the manifest and tables are checked on open -----------------------------------------
def test_swapped_starts_of_two_equal_length_samples_are_refused_by_the_reader_and_verify(cache_copy, capsys):
    lengths = tables(cache_copy)["samples/length"]
    vals, counts = np.unique(lengths, return_counts=True)
    a, b = np.flatnonzero(lengths == vals[counts > 1][0])[:2]  # default_run has 12 samples truncated to 256
    rewrite_table(cache_copy, "samples/start", lambda s: s.__setitem__([a, b], s[[b, a]]))
    with pytest.raises(CacheFormatError, match=r"samples/start: the disk order is not the layout of the recorded "
                                               rf"lengths .* holds sample {b} \(length {lengths[b]}\) where the layout "
                                               rf"puts sample {a}"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1
    assert f"samples/start[{a}] = " in capsys.readouterr().out


def test_an_edited_chunk_tokens_is_refused_naming_the_arrays(cache_copy, capsys):
    edit_manifest(cache_copy, lambda m: m["layout"].update(chunk_tokens=128))
    with pytest.raises(CacheFormatError, match=r"array 'hidden_states/layer_1' \(hidden_states/layer_1/zarr.json\) "
                                               r"has inner chunk shape \[256, 64\], the manifest implies \[128, 64\]"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1
    assert "the manifest implies [128]" in capsys.readouterr().out


def test_swapped_layer_names_in_the_manifest_fail_the_reader_and_verify(cache_copy, capsys):
    edit_manifest(cache_copy, lambda m: m["arrays"].update({"1": "hidden_states/layer_2",
                                                            "2": "hidden_states/layer_1"}))
    with pytest.raises(CacheFormatError, match=r"arrays\['1'\] = 'hidden_states/layer_2', but the naming rule gives "
                                               r"'hidden_states/layer_1'"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and "naming rule gives 'hidden_states/layer_2'" in out


def test_layer_directories_swapped_on_disk_are_caught_by_their_layer_id_attribute(cache_copy, capsys):
    h = cache_copy / "hidden_states"
    (h / "layer_1").rename(h / "tmp")
    (h / "layer_2").rename(h / "layer_1")
    (h / "tmp").rename(h / "layer_2")
    with pytest.raises(CacheFormatError, match=r"array 'hidden_states/layer_1' .* has attribute layer_id=2, the "
                                               r"manifest implies 1: the array holds another layer"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1
    assert "has attribute layer_id=1, the manifest implies 2" in capsys.readouterr().out


def test_an_unknown_or_foreign_codec_is_refused_at_open_naming_array_and_codec(cache_copy, capsys):
    inner = lambda m: m["codecs"][0]["configuration"]["codecs"]  # noqa: E731 - the chunk chain inside the shard
    edit_meta(cache_copy, "hidden_states/layer_3", lambda m: inner(m).__setitem__(1, {"name": "no-such-codec"}))
    with pytest.raises(CacheFormatError, match=r"array 'hidden_states/layer_3' .* uses codec 'no-such-codec', which "
                                               r"this tool never writes"):
        open_cache(cache_copy)
    assert main(["verify", str(cache_copy)]) == 1 and "uses codec 'no-such-codec'" in capsys.readouterr().out
    # a codec zarr knows (it would decode it silently) is refused just the same
    edit_meta(cache_copy, "hidden_states/layer_3", lambda m: inner(m).__setitem__(
        1, {"name": "gzip", "configuration": {"level": 1}}))
    with pytest.raises(CacheFormatError, match=r"uses codec 'gzip'"):
        open_cache(cache_copy)


# Each case damages the cache one way; every entry point must refuse it with this message.
CRAFTED = {
    "chunk_tokens 0": (lambda p: edit_manifest(p, lambda m: m["layout"].update(chunk_tokens=0)),
                       r"layout.chunk_tokens = 0 is outside \[1, "),
    "chunk_tokens a string": (lambda p: edit_manifest(p, lambda m: m["layout"].update(chunk_tokens="256")),
                              r"layout.chunk_tokens = '256' \(a string\)"),
    "chunk_tokens a float": (lambda p: edit_manifest(p, lambda m: m["layout"].update(chunk_tokens=256.5)),
                             r"layout.chunk_tokens = 256.5 \(a float\)"),
    "hidden_size 10**12": (lambda p: edit_manifest(p, lambda m: m.update(hidden_size=10 ** 12)),
                           r"hidden_size = 1000000000000 is outside"),
    "hidden_size negative": (lambda p: edit_manifest(p, lambda m: m.update(hidden_size=-64)),
                             r"hidden_size = -64 is outside"),
    "seq_length 0": (lambda p: edit_manifest(p, lambda m: m.update(seq_length=0)), r"seq_length = 0 is outside"),
    "layout missing": (lambda p: edit_manifest(p, lambda m: m.pop("layout") and None), r"manifest lacks 'layout'"),
    "num_units off by one": (lambda p: edit_manifest(p, lambda m: m["layout"].update(num_units=3)),
                             r"layout.total_token_slots = \d+ does not end in the last of layout.num_units = 3 "
                             r"shards"),
    "num_units and the axis off by one": (lambda p: edit_manifest(p, lambda m: m["layout"].update(
        num_units=5, total_token_slots=m["layout"]["total_token_slots"] + 1024)),
        r"array 'units/token_start' .* has shape \[4\], the manifest implies \[5\] \(layout.num_units\)"),
    "samples count off": (lambda p: edit_manifest(p, lambda m: m["counts"].update(samples=15, rows_in=17)),
                          r"has shape \[14\], the manifest implies \[15\] \(counts.samples\)"),
    "manifest a JSON list": (lambda p: edit_manifest(p, lambda m: [m]), r"is not a JSON object \(it holds a list\)"),
    "manifest a JSON number": (lambda p: edit_manifest(p, lambda m: 7), r"is not a JSON object \(it holds an integer"),
    "manifest not UTF-8": (lambda p: (Path(p) / "manifest.json").write_bytes(b"\xff\xfe{"), r"is not valid JSON"),
    "array outside hidden_states": (lambda p: edit_manifest(p, lambda m: m["arrays"].update({"2": "input_ids"})),
                                    r"arrays\['2'\] = 'input_ids' is not an array under hidden_states/"),
    "path traversal": (lambda p: edit_manifest(p, lambda m: m["arrays"].update({"2": "../../etc"})),
                       r"arrays\['2'\] = '../../etc' is not an array under hidden_states/"),
    "unknown storage dtype": (lambda p: edit_manifest(p, lambda m: m.update(storage_dtype="int4")),
                              r"storage_dtype = 'int4' is unknown"),
    "layer id a boolean": (lambda p: edit_manifest(p, lambda m: m.update(layer_ids=[True, 2, 3])),
                           r"layer_ids = \[True, 2, 3\] \(a list\) must be a list of integers"),
    "unknown codec": (lambda p: edit_meta(p, "hidden_states/layer_2",
                                          lambda m: m["codecs"][0]["configuration"]["codecs"].__setitem__(
                                              1, {"name": "lzw"})),
                      r"uses codec 'lzw', which this tool never writes"),
    "zarr.json deleted": (lambda p: (Path(p) / "hidden_states" / "layer_2" / "zarr.json").unlink(),
                          r"array 'hidden_states/layer_2' is missing \(no hidden_states/layer_2/zarr.json\)"),
    "sample length 2**31-1": (lambda p: rewrite_table(p, "samples/length", lambda t: t.__setitem__(0, 2 ** 31 - 1)),
                              r"samples/length: 1 sample\(s\) outside \[1, seq_length=256\]: sample 0 has length "
                              r"2147483647"),
    "shard shape 2**27 rows": (lambda p: edit_meta(p, "hidden_states/layer_1", lambda m: m["chunk_grid"][
        "configuration"].update(chunk_shape=[2 ** 27, 64])),
        r"has shard shape \[134217728, 64\], the manifest implies"),
    "inner chunk rows a float": (lambda p: edit_meta(p, "hidden_states/layer_1", lambda m: m["codecs"][0][
        "configuration"].update(chunk_shape=[256.0, 64])),
        r"has inner chunk shape \[256.0, 64\], the manifest implies \[256, 64\]"),
    "shard index of no stated endianness": (lambda p: edit_meta(p, "input_ids", lambda m: m["codecs"][0][
        "configuration"]["index_codecs"][0].pop("configuration")),
        r"array 'input_ids' .* has shard index codecs \[\{'name': 'bytes'\}, \{'name': 'crc32c'\}\]; this tool "
        r"writes bytes \(little-endian\)"),
    "inner chunk 2**27 rows": (lambda p: edit_meta(p, "hidden_states/layer_1", lambda m: m["codecs"][0][
        "configuration"].update(chunk_shape=[2 ** 27, 64])),
        r"has inner chunk shape \[134217728, 64\], the manifest implies"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_cache_is_a_cache_format_error_from_every_entry_point(cache_copy, tmp_path, capsys, case):
    damage, message = CRAFTED[case]
    damage(cache_copy)
    p = str(cache_copy)
    with pytest.raises(CacheFormatError, match=message):
        open_cache(p)
    with pytest.raises(CacheFormatError, match=message):
        build_dataloader(p, batch_size=2)
    for argv in (["info", p], ["info", p, "--json"], ["export-nemo", p, str(tmp_path / "nemo")],
                 ["plot", p, "-o", str(tmp_path / "p.png")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"dspark-cache {argv[0]}: ") and "Traceback" not in err, err
        assert re.search(message, err), err
    assert main(["verify", p]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and re.search(message, out) and "[verify]" not in out, out
    assert main(["verify", p, "--repair"]) == 1  # nothing to mark: the report says re-create, no crash
    capsys.readouterr()


def test_a_zstd_chunk_declaring_another_size_is_not_decoded(zstd_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(zstd_run.path, copy)
    f, off, n = chunk_span(copy, "hidden_states/layer_0", 0)
    blob = bytearray(f.read_bytes())
    body = blob[off:off + n - 4]
    from dspark_precompute.contract import arrays as fmt

    size = fmt._zstd_content_size(bytes(body[:32]))
    ct = json.loads((copy / "manifest.json").read_text())["layout"]["chunk_tokens"]
    assert size == ct * 64 * 2
    fhd = body[4]
    pos = 5 + (0 if (fhd >> 5) & 1 else 1) + (0, 1, 2, 4)[fhd & 3]
    width = (1 if (fhd >> 5) & 1 else 0, 2, 4, 8)[fhd >> 6]
    assert width >= 2
    value = size * 2 - (256 if width == 2 else 0)
    body[pos:pos + width] = value.to_bytes(width, "little")
    blob[off:off + n] = with_crc(bytes(body))
    f.write_bytes(bytes(blob))
    rebind(copy, "hidden_states/layer_0", 0)  # as its writer would have recorded it: the header is what is wrong
    c = open_cache(copy)
    with pytest.raises(CacheFormatError, match=r"array 'hidden_states/layer_0' chunk \(0, 0\) \(in shard "
                                               rf"hidden_states/layer_0/c.0.0\) has a zstd frame declaring "
                                               rf"{2 * size:,} "
                                               rf"decompressed bytes, a chunk of this array is {size:,}"):
        c[0]


# -- item 3: the weights file's checksum ----------------------------------------------------------
def test_target_weights_returns_the_files_tensors_and_refuses_a_changed_file(cache_copy, tmp_path, capsys):
    from safetensors.torch import load_file

    c = open_cache(cache_copy)
    got = c.target_weights()
    want = load_file(str(cache_copy / "target_weights.safetensors"))
    assert got.keys() == want.keys() == {"embed_tokens.weight"} and torch.equal(got["embed_tokens.weight"],
                                                                             want["embed_tokens.weight"])
    assert main(["export-nemo", str(cache_copy), str(tmp_path / "nemo")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "nemo").iterdir()}
    f = cache_copy / "target_weights.safetensors"
    blob = bytearray(f.read_bytes())
    blob[-3] ^= 0x01  # a weight value: the file still loads, only its sha256 tells
    f.write_bytes(bytes(blob))
    with pytest.raises(ChecksumError, match=r"checksum mismatch in .*/target_weights.safetensors: .* the manifest "
                                            r"records [0-9a-f]{64}") as info:
        c.target_weights()
    assert info.value.file.endswith("target_weights.safetensors")
    capsys.readouterr()
    assert main(["export-nemo", str(cache_copy), str(tmp_path / "nemo"), "--overwrite"]) == 2
    assert "checksum mismatch in" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "nemo").iterdir()} == before  # the old export is kept
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["check"] for p in report["problems"]] == ["weights"]
    assert "target_weights.safetensors has sha256" in report["problems"][0]["message"]


def test_a_cache_without_a_recorded_weights_checksum_reads_and_verifies_with_a_note(cache_copy, capsys):
    edit_manifest(cache_copy, lambda m: m.pop("weights_sha256") and None)
    f = cache_copy / "target_weights.safetensors"
    assert torch.equal(open_cache(cache_copy).target_weights()["embed_tokens.weight"],
                       __import__("safetensors.torch").torch.load_file(str(f))["embed_tokens.weight"])
    assert main(["verify", str(cache_copy)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "note: no weights checksum recorded" in out


def _as_interrupted_before_the_weights(path: Path) -> None:
    """What a run stopped while writing the token ids leaves (docs/format.md, section 9): steps 1-2 of 5 begun."""
    edit_manifest(path, lambda m: m.update(complete=False, tokens_stored=False, weights_sha256=None, timing=None,
                                           provenance=None) and None)
    for name in ("target_weights.safetensors", ".hydra"):
        p = path / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for record in (path / "commits").iterdir():
        record.unlink()


def test_an_incomplete_cache_stopped_before_its_weights_were_written_verifies_as_incomplete_naming_what_is_missing(
        cache_copy, capsys):
    _as_interrupted_before_the_weights(cache_copy)
    assert main(["verify", str(cache_copy), "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "target_weights.safetensors is missing" not in out
    assert "incomplete: 0 of 4 unit(s) committed (0 samples, 0 tokens readable)" in out
    assert re.search(r"written: the tables, rejects\.jsonl, the manifest; not written yet: every unit's input_ids "
                     r"and loss_mask, target_weights\.safetensors, the hidden states and commit records of 4 unit",
                     out), out
    assert main(["verify", str(cache_copy), "--json"]) == 1  # without --allow-incomplete: the one problem there is
    assert [p["check"] for p in json.loads(capsys.readouterr().out)["problems"]] == ["manifest"]
    assert main(["info", str(cache_copy), "--allow-incomplete"]) == 0  # the run record comes with the final manifest
    out = capsys.readouterr().out
    assert "written by  not yet: recorded when the run finishes" in out
    assert "command     not yet: recorded when the run finishes" in out


def test_missing_weights_beside_a_committed_unit_and_a_missing_rejects_file_are_damage_in_an_incomplete_cache(
        cache_copy, default_run, capsys):
    """The run writes the weights before the first unit and rejects.jsonl before the first manifest."""
    _as_interrupted_before_the_weights(cache_copy)
    shutil.copy(Path(default_run[1].path) / "commits" / "u000001.json", cache_copy / "commits")
    (cache_copy / "rejects.jsonl").unlink()
    assert main(["verify", str(cache_copy), "--allow-incomplete", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted((p["check"], p["message"].split(":")[0]) for p in report["problems"]) == [
        ("structure", "rejects.jsonl is missing"), ("weights", "target_weights.safetensors is missing")]
    assert any("incomplete: 1 of 4 unit(s) committed" in n for n in report["notes"])


# -- siblings -------------------------------------------------------------------------------------
def test_repr_reads_only_what_is_in_hand(default_run, monkeypatch):
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.read import summary

    _, result = default_run
    c = open_cache(result.path)

    def walk(*a, **k):
        raise AssertionError("repr walked the store")

    monkeypatch.setattr(CacheStore, "nbytes", walk)
    monkeypatch.setattr(summary, "_bytes_under", walk)
    monkeypatch.setattr(Path, "rglob", walk)
    text = repr(c)
    assert text.startswith(f"<dspark cache {result.path!r}: 14 samples, 3501 tokens (61.2% supervised, 2 of 16 rows "
                           "rejected), layers [1, 2, 3] x 64, bf16>"), text


def test_a_stray_file_in_commits_does_not_break_opening(cache_copy):
    (cache_copy / "commits" / "notes.json").write_text("{}")
    (cache_copy / "commits" / "u99.json.bak").write_text("{}")
    c = open_cache(cache_copy)
    assert len(c) == 14 and c.summary()["units_committed"] == 4


def test_read_tokens_refuses_tables_and_slots_outside_the_token_axis(default_run):
    _, result = default_run
    c = open_cache(result.path)
    with pytest.raises(ValueError, match=r"\['samples/start'\] are not token arrays"):
        c.chunks.read(["samples/start"], 0, 1)
    total = c.manifest.layout.total_token_slots
    with pytest.raises(ValueError, match=rf"token slots \[{total - 4}, {total + 16}\) lie outside the token axis "
                                         rf"\[0, {total}\)"):
        c.chunks.read(["input_ids"], total - 4, total + 16)


def test_an_unpickled_dataset_refuses_a_cache_re_created_since_it_was_opened(cache_copy, tmp_path):
    ds = CacheDataset(cache_copy)
    blob, cache_blob = pickle.dumps(ds), pickle.dumps(ds.cache)
    one = pickle.loads(blob)
    assert same_sample(one[0], ds[0]) and same_sample(pickle.loads(cache_blob)[0], ds[0])
    # the same path re-created with other data: a worker would read other samples under the same indices
    run(compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024", "data.max_samples=10",
                      "overwrite=true", name="copy")))
    back = pickle.loads(blob)
    with pytest.raises(CacheFormatError, match="changed since it was opened"):
        back[0]
    with pytest.raises(CacheFormatError, match="changed since it was opened"):
        pickle.loads(cache_blob)
    assert len(pickle.loads(pickle.dumps(open_cache(cache_copy)))) == 9  # a handle opened now is fine


def test_a_worker_reads_the_samples_its_parent_indexed_while_a_run_commits_more(cache_copy):
    edit_manifest(cache_copy, lambda m: m.update(complete=False))
    record = cache_copy / "commits" / "u000001.json"
    saved = record.read_bytes()
    record.unlink()
    ds = CacheDataset(cache_copy, allow_incomplete=True)
    expected = [ds[j] for j in range(len(ds))]
    assert len(ds) < 14
    blob = pickle.dumps(ds)
    record.write_bytes(saved)  # the run commits unit 1 while training reads
    back = pickle.loads(blob)
    assert len(back) == len(ds)
    assert all(same_sample(back[j], expected[j]) for j in range(len(ds)))
    c = pickle.loads(pickle.dumps(open_cache(cache_copy, allow_incomplete=True)))
    assert len(c) == 14  # a new handle sees every committed unit
    record.unlink()  # marked for repair: samples the worker may be handed are gone
    with pytest.raises(CacheFormatError, match=r"units \[1\] were readable when the cache was opened"):
        pickle.loads(pickle.dumps(c))


def test_export_refuses_a_non_integer_shard_size_and_an_unknown_target_as_export_errors(default_run, tmp_path):
    from dspark_precompute.errors import ExportError
    from dspark_precompute.read.export import export, export_nemo

    _, result = default_run
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ExportError, match="must be >= 1"):
            export_nemo(result.path, tmp_path / "nemo", shard_size=bad)
    with pytest.raises(ExportError, match="to='eagle' is not a known export target; choose one of nemo"):
        export(result.path, tmp_path / "nemo", to="eagle")
    assert not (tmp_path / "nemo").exists()


def test_verify_repair_on_a_crafted_manifest_reports_instead_of_crashing(cache_copy, capsys):
    edit_manifest(cache_copy, lambda m: [m])
    assert main(["verify", str(cache_copy), "--repair"]) == 1
    out = capsys.readouterr().out
    assert "is not a JSON object" in out and "Traceback" not in out
    from dspark_precompute.read.verify import mark_for_recompute

    with pytest.raises(CacheFormatError, match="is not a JSON object"):
        mark_for_recompute(cache_copy, [0])


def test_a_shard_index_naming_a_chunk_larger_than_any_chunk_can_be_is_refused_unread(cache_copy):
    import fsspec

    inner, per = shard_geometry(cache_copy, "input_ids")
    f = shard_file(cache_copy, "input_ids", 1)
    index = shard_index(f, per)
    blob = f.read_bytes()
    f.write_bytes(blob[:-(16 * per + 4)] + os.urandom(5 << 20) + blob[-(16 * per + 4):])  # 5 MiB more data
    index[1] = (index[1][0], 5 << 20)  # where a 1 KiB chunk (256 x int32, compressed) belongs
    write_shard_index(f, index)
    url = to_memory_fs(str(cache_copy), "damage-big-chunk")
    try:
        for path in (str(cache_copy), url):
            c = open_cache(path)
            with pytest.raises(DamagedShardError, match=r"array 'input_ids' shard \(0,\) \(object input_ids/c.0\) "
                                                        r"has an index entry for inner chunk 1 .* exceeds a chunk's"):
                c[holders(cache_copy, CT, 2 * CT)[0]]
    finally:
        fsspec.filesystem("memory").rm("/damage-big-chunk", recursive=True)


def test_slots_of_a_unit_not_yet_committed_are_named_as_unwritten_not_damaged(cache_copy):
    edit_manifest(cache_copy, lambda m: m.update(complete=False))
    (cache_copy / "commits" / "u000002.json").unlink()
    c = open_cache(cache_copy, allow_incomplete=True)
    t = tables(cache_copy)
    a = int(t["units/token_start"][2])
    assert len(c) == 14 - int((t["samples/unit"] == 2).sum())
    assert len(c.chunks.read(["input_ids"], a, a + 1)["input_ids"]) == 1  # token ids are stored before any forward
    shard_file(cache_copy, "hidden_states/layer_1", a // CT).unlink()  # as if the writers had not reached it
    with pytest.raises(MissingChunkError, match=r"is not written yet: it belongs to unit\(s\) \[2\], which have no "
                                                r"commit record"):
        c.chunks.read(["hidden_states/layer_1"], a, a + 1)


# -- shards: the index is checked before any offset in it is trusted ----------------------------------------
def _unit_samples(path, unit: int) -> list[int]:
    return sorted(np.flatnonzero(tables(path)["samples/unit"] == unit).tolist())


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])  # a copy cut short: the index is gone from the end


def _flip_index_byte(f: Path) -> None:
    blob = bytearray(f.read_bytes())
    blob[-10] ^= 0x01  # inside the index (before its crc32c)
    f.write_bytes(bytes(blob))


def _index_past_end(f: Path) -> None:
    per = 4  # default_run: units of 1024 tokens in chunks of 256
    index = shard_index(f, per)
    index[0] = (len(f.read_bytes()), index[0][1])  # valid crc32c, an offset past the data
    write_shard_index(f, index)


def _index_aliased(f: Path) -> None:
    index = shard_index(f, 4)
    index[1] = index[0]  # valid crc32c, chunk 1 names chunk 0's bytes (each passes its own crc32c)
    write_shard_index(f, index)


def _index_swapped(f: Path) -> None:
    index = shard_index(f, 4)
    index[[0, 1]] = index[[1, 0]]  # valid crc32c: chunks 0 and 1 would read each other's values
    write_shard_index(f, index)


@pytest.mark.parametrize("damage,words,checksum", [
    (_truncate, r"has an index that fails its crc32c checksum \(the shard was truncated", True),
    (_flip_index_byte, r"has an index that fails its crc32c checksum", True),
    (_index_past_end, r"has an index entry for inner chunk 0 .* points outside its", False),
    (_index_aliased, r"has index entries for inner chunks 0 and 1 that overlap or are out of order", False),
    (_index_swapped, r"has index entries for inner chunks 0 and 1 that overlap or are out of order", False),
])
def test_a_damaged_shard_is_a_typed_error_naming_array_shard_and_samples_everywhere(cache_copy, tmp_path, capsys,
                                                                                      damage, words, checksum):
    f = shard_file(cache_copy, "hidden_states/layer_2", 4)  # unit 1's shard
    damage(f)
    victims = _unit_samples(cache_copy, 1)
    c = open_cache(cache_copy)
    with pytest.raises(DamagedShardError, match=r"array 'hidden_states/layer_2' shard \(1, 0\) \(object "
                                                r"hidden_states/layer_2/c.1.0\) " + words) as info:
        c[victims[0]]
    assert info.value.array == "hidden_states/layer_2" and info.value.shard == (1, 0)
    assert list(info.value.samples) == victims and info.value.checksum == checksum
    assert "dspark-cache verify --repair" in str(info.value)
    other = _unit_samples(cache_copy, 0)[0]  # other units' shards still read exactly
    assert np.array_equal(c.sample(other, as_numpy=True)["input_ids"], zarr_sample(str(cache_copy), other)
                          ["input_ids"].astype(np.int64))
    with pytest.raises(DamagedShardError):
        for _ in build_dataloader(cache_copy, batch_size=4, shuffle=False):
            pass
    assert main(["export-nemo", str(cache_copy), str(tmp_path / "nemo")]) == 2
    assert "shard (1, 0)" in capsys.readouterr().err and not (tmp_path / "nemo" / "manifest.json").exists()
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    hits = [p for p in report["problems"] if p["array"] == "hidden_states/layer_2"]
    assert hits and all(p["unit"] == 1 for p in hits) and hits[0]["sample"] in victims


def test_a_shard_object_cut_short_after_its_index_was_read_is_refused_not_zero_filled(cache_copy):
    c = open_cache(cache_copy, chunk_cache_bytes=0)
    victims = _unit_samples(cache_copy, 1)
    c.sample(victims[0])  # the index of unit 1's shards is in hand now
    f, off, n = chunk_span(cache_copy, "hidden_states/layer_1", 4)
    blob = f.read_bytes()
    f.write_bytes(blob[:off + n // 2])  # the data behind the kept index is gone
    c.chunks.source.forget()  # ... and the file handle: a fresh open sees the short file; the index read before stays
    c.chunks.source._indexes[("hidden_states/layer_1", 1)] = np.asarray([[off, n], [-1, -1], [-1, -1], [-1, -1]])
    with pytest.raises(DamagedShardError, match=r"is cut short"):
        c.chunks.read(["hidden_states/layer_1"], 4 * CT, 4 * CT + 1)


@pytest.fixture
def no_hang():
    """Turn a read that blocks (a FIFO opened like a file waits for a writer forever) into a failure."""
    import signal

    def hang(*_):
        raise TimeoutError("a read blocked: something in the cache was opened that never answers")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _not_a_file(f: Path, kind: str) -> None:
    f.unlink()
    if kind == "directory":
        f.mkdir()
    elif kind == "fifo":
        os.mkfifo(f)
    elif kind == "device":
        f.symlink_to("/dev/zero")
    else:
        f.symlink_to(f.name)  # a symlink to itself: ELOOP


@pytest.mark.parametrize("kind,words", [
    ("directory", "it is a directory, not a file"),
    ("fifo", r"it is a FIFO \(named pipe\), not a file"),
    ("device", "it is a character device, not a file"),
    ("loop", "it is a symlink loop, not a file"),
])
def test_a_shard_that_is_not_a_file_is_a_damaged_shard_everywhere_never_a_hang_or_an_os_error(
        cache_copy, tmp_path, capsys, no_hang, kind, words):
    _not_a_file(shard_file(cache_copy, "hidden_states/layer_2", 4), kind)  # unit 1's shard
    victims = _unit_samples(cache_copy, 1)
    named = r"array 'hidden_states/layer_2' shard \(1, 0\) \(object hidden_states/layer_2/c.1.0\) cannot be read as " \
            r"a shard: " + words
    with pytest.raises(DamagedShardError, match=named) as info:
        open_cache(cache_copy)[victims[0]]
    assert list(info.value.samples) == victims
    with pytest.raises(DamagedShardError, match=named):
        for _ in build_dataloader(cache_copy, batch_size=4, shuffle=False):
            pass
    assert main(["export-nemo", str(cache_copy), str(tmp_path / "nemo")]) == 2
    err = capsys.readouterr().err
    assert re.search(named, err) and "Traceback" not in err
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["check"], p["array"], p["unit"]) for p in report["problems"]] == [
        ("structure", "hidden_states/layer_2", 1)]


@pytest.mark.parametrize("rel,check", [
    ("manifest.json", "manifest"),
    ("commits/u000001.json", "commits"),
    ("target_weights.safetensors", "weights"),
    ("rejects.jsonl", "structure"),
    ("samples/start/c.0", "missing-chunk"),
    ("input_ids/zarr.json", "structure"),
])
def test_a_fifo_in_place_of_a_cache_file_is_named_by_verify_and_never_blocks_a_reader(cache_copy, capsys, no_hang,
                                                                                     rel, check):
    _not_a_file(cache_copy / rel, "fifo")
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert check in {p["check"] for p in report["problems"]} and "verify" not in {p["check"] for p in
                                                                                   report["problems"]}, report
    if rel in ("manifest.json", "samples/start/c.0", "input_ids/zarr.json"):
        with pytest.raises(CacheFormatError):
            open_cache(cache_copy)
    elif rel == "target_weights.safetensors":
        with pytest.raises(CacheFormatError, match=r"is a FIFO \(named pipe\), not a file"):
            open_cache(cache_copy).target_weights()
    elif rel == "rejects.jsonl":
        assert len(open_cache(cache_copy)[:]) == 14  # the reader does not read it
    else:  # the record binding unit 1's shards is not one: nothing of unit 1 is read, the other units are
        c = open_cache(cache_copy)
        victims = _unit_samples(cache_copy, 1)
        with pytest.raises(DamagedShardError, match=r"is not bound to its place: unit 1 has no commit record"):
            c[victims[0]]
        assert len([c[i] for i in range(len(c)) if int(c.indices[i]) not in victims]) == 14 - len(victims)


@pytest.mark.parametrize("rel,check", [
    ("commits/u000001.json", "commits"),
    ("target_weights.safetensors", "weights"),
    ("rejects.jsonl", "structure"),
])
def test_a_symlink_loop_in_place_of_a_cache_file_is_a_named_problem_not_a_stopped_verify(cache_copy, capsys, no_hang,
                                                                                        rel, check):
    _not_a_file(cache_copy / rel, "loop")
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    checks = {p["check"] for p in report["problems"]}
    assert check in checks and "verify" not in checks, report
    assert any(rel in p["message"] for p in report["problems"] if p["check"] == check), report


def test_a_fifo_for_the_weights_of_a_cache_without_their_checksum_does_not_block_verify(cache_copy, capsys, no_hang):
    """Without a recorded sha256 (an older or unfinished cache) verify opens the weights with safetensors: never a
    FIFO, which would wait for a writer for ever."""
    edit_manifest(cache_copy, lambda m: m.pop("weights_sha256") and None)
    _not_a_file(cache_copy / "target_weights.safetensors", "fifo")
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["check"] for p in report["problems"]] == ["weights"], report
    assert "FIFO" in report["problems"][0]["message"]


def _edit_group(attrs: dict):
    def go(p):
        f = Path(p) / "zarr.json"
        meta = json.loads(f.read_text())
        meta["attributes"].update(attrs)
        f.write_text(json.dumps(meta))
    return go


@pytest.mark.parametrize("damage,words", [
    (lambda p: (Path(p) / "zarr.json").unlink(), r"the group at the root \(zarr.json\) is missing"),
    (lambda p: (Path(p) / "hidden_states" / "zarr.json").unlink(),
     r"the group hidden_states \(hidden_states/zarr.json\) is missing"),
    (lambda p: (Path(p) / "samples" / "zarr.json").write_text("[]"),
     r"the group samples \(samples/zarr.json\) is not zarr v3 group metadata"),
    (_edit_group({"format_version": 4}), r"has attribute format_version=4, the manifest implies 3"),
    (_edit_group({"format_version": "3"}), r"has attribute format_version='3', the manifest implies 3"),
    (_edit_group({"format": "something-else"}), r"has attribute format='something-else'"),
])
def test_verify_names_a_group_that_is_missing_or_disagrees_with_the_manifest(cache_copy, capsys, damage, words):
    damage(cache_copy)
    assert main(["verify", str(cache_copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["check"] for p in report["problems"]] == ["structure"]
    assert re.search(words, report["problems"][0]["message"]), report
    assert len(open_cache(cache_copy)) == 14  # the reader goes by the manifest; plain zarr starts at the groups
