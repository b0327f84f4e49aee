"""``verify --recompute`` on an image cache: each rerun batch gets the very images the capture fed it.

The stored states are the checkpoint's own forward on the processor's inputs (proved against
``AutoModelForImageTextToText`` in ``tests/write/samples/test_media.py``), so a rerun that dropped the pixels, or
re-encoded an image row as text, could not find them bit-exact. Each image is checked against the images table's
sha256 first: a changed or missing one is a problem of the samples it feeds, and the others are still compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import compose, rebind, small
from PIL import Image
from test_media import (
    TEXT_ROW,
    data_dir,
    encoder,
    image_cache,
    openai_row,
    processor_inputs,
    sharegpt_row,
    vl_dir,
    write_images,
)
from transformers import AutoModelForImageTextToText

from dspark_precompute.read.reader import CacheReader
from dspark_precompute.write.rerun.recompute import ImageFeed, recompute
from dspark_precompute.write.run import run

__all__ = ["data_dir", "image_cache", "vl_dir"]  # the image checkpoint and cache fixtures, shared with test_media


def test_recompute_of_an_image_cache_reruns_each_batch_with_its_images_and_finds_every_sample_bit_exact(
        image_cache, monkeypatch):
    path, _ = image_cache
    cache = CacheReader(path)
    images = [i for i in range(len(cache)) if cache.images(i)["sha256"]]
    assert len(images) == 2 and len(cache) == 3  # two image rows and a text row, in one forward batch
    r = recompute(path, 3)
    assert r.problems == [], r.problems
    assert r.recomputed == r.exact == 3  # fp32 forward, bf16 storage: the same batch gives the same bits
    monkeypatch.setattr(ImageFeed, "inputs", lambda *a, **k: None)  # the pixels dropped: the check must see it
    r = recompute(path, 3)
    assert sorted({p["sample"] for p in r.problems}) == images and r.exact == 1


def altered_image_sample(image_cache, tmp_path: Path) -> tuple[Path, CacheReader, dict, int, np.ndarray]:
    """A copy of the image cache to alter: (its path, its reader, its manifest, its first sample with images, that
    sample's image-pad positions within it)."""
    path, _ = image_cache
    altered = tmp_path / "altered"
    shutil.copytree(path, altered)
    cache = CacheReader(altered)
    m = json.loads((altered / "manifest.json").read_text())
    victim = next(i for i in range(len(cache)) if cache.images(i)["sha256"])
    ids = cache.sample(victim)["input_ids"].numpy()
    return altered, cache, m, victim, np.flatnonzero(ids == m["media"]["image_token_id"])


def test_recompute_flags_the_image_sample_whose_stored_state_was_altered_at_a_vision_token(image_cache, tmp_path):
    altered, cache, m, victim, pads = altered_image_sample(image_cache, tmp_path)
    token = int(pads[3])  # an image pad: only the pixels make it
    name = m["arrays"]["0"]
    arr = zarr.open_array(str(altered / name), mode="r+")
    pos = int(cache.starts()[victim]) + token
    row = np.asarray(arr[pos])
    row[5] ^= 0x0040  # another bf16 value, stored with a fresh (valid) checksum
    arr[pos] = row
    rebind(altered, name, int(cache.units()[victim]))  # as a writer of that value would have recorded it
    r = recompute(altered, 3)
    assert r.recomputed == 3 and r.exact == 2
    (p,) = r.problems
    assert (p["sample"], p["array"]) == (victim, name) and f"worst at token {token} " in p["message"]


def one_image_rows(folder: Path, names: list[str]) -> Path:
    """Three rows: one naming the first image twice, one naming the second twice, one text row."""
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt_row([names[0]] * 2), TEXT_ROW,
                                                           openai_row([names[1]] * 2))))
    return rows


def one_image_cache(vl_dir, tmp_path):
    """A cache of :func:`one_image_rows`, one sample a batch: (its path, the data folder, the image names, the sample
    of each source row)."""
    data = tmp_path / "data"
    names = write_images(data / "imgs")
    rows = one_image_rows(data, names)
    result = run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", "seq_length=4096",
                               "batch.max_tokens=8192", "batch.max_samples=1", "model.dtype=fp32",
                               "model.layer_ids=[0,1]")))
    cache = CacheReader(result.path)
    return result.path, data, names, {int(r): k for k, r in enumerate(cache.source_row)}


def test_a_changed_or_missing_image_is_a_problem_of_its_own_sample_and_the_other_samples_are_still_compared(
        vl_dir, tmp_path):
    path, data, names, by_row = one_image_cache(vl_dir, tmp_path)
    assert recompute(path, 3).problems == []
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(data / names[0])  # same size, other pixels
    r = recompute(path, 3)
    assert r.recomputed == r.exact == 2  # the text row and the row of the other image
    (p,) = r.problems
    assert p["sample"] == by_row[0] and f"image 0 ({data / names[0]}) changed since the cache was written" in \
        p["message"] and "Restore the image" in p["message"]
    assert any("data.images_sha256" in n for n in r.notes)
    (data / names[1]).unlink()
    r = recompute(path, 3)
    assert r.recomputed == r.exact == 1  # the text row
    assert sorted(p["sample"] for p in r.problems) == sorted([by_row[0], by_row[2]])
    missing = next(p for p in r.problems if p["sample"] == by_row[2])
    assert f"image 0 ({data / names[1]}) cannot be read" in missing["message"]


def test_recompute_flags_stored_positions_that_differ_from_the_models_rope_index(image_cache, tmp_path):
    path, _ = image_cache
    altered = tmp_path / "altered"
    shutil.copytree(path, altered)
    cache = CacheReader(altered)
    victim = next(i for i in range(len(cache)) if cache.images(i)["sha256"])
    stored = "position_ids"
    arr = zarr.open_array(str(altered / stored), mode="r+")
    pos = int(cache.starts()[victim]) + 20
    arr[pos] = np.asarray(arr[pos]) + 1
    rebind(altered, stored, int(cache.units()[victim]))
    r = recompute(altered, 3)
    (p,) = r.problems
    assert (p["sample"], p["array"]) == (victim, stored) and "first at token 20" in p["message"]


def checkpoint_forward(vl_dir, data_dir, cache, names):
    """The oracle: ``AutoModelForImageTextToText``'s own forward (fp32, ``output_hidden_states``) on the processor's
    inputs for each image row and on the ids alone for the text row, by sample: (logits, hidden states)."""
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    _, enc = encoder(vl_dir, data_dir)
    records = {0: sharegpt_row(names), 1: TEXT_ROW, 2: openai_row(names)}
    out = {}
    for s in range(len(cache)):
        row = int(cache.source_row[s])
        inputs = processor_inputs(enc, data_dir, records[row]) if row != 1 else \
            {"input_ids": cache.sample(s)["input_ids"][None]}
        assert torch.equal(inputs["input_ids"][0], cache.sample(s)["input_ids"])  # the stored ids are its inputs
        with torch.no_grad():
            o = model(**inputs, output_hidden_states=True)
        out[s] = (o.logits[0], [h[0] for h in o.hidden_states])
    return model, out


def test_the_teacher_and_precision_checks_rerun_the_image_samples_with_their_pixels_as_the_checkpoint_does(
        vl_dir, data_dir, image_cache, monkeypatch):
    """Every position of the two image rows and the text row is compared (on main the image rows were left out),
    and what the checks measure is what the checkpoint's own forward on the processor's inputs gives."""
    from dspark_precompute.write.rerun.precision import precision_check
    from dspark_precompute.write.rerun.teacher import teacher_check

    path, names = image_cache
    cache = CacheReader(path)
    tokens = sum(len(cache.sample(s)["input_ids"]) for s in range(len(cache)))
    model, oracle = checkpoint_forward(vl_dir, data_dir, cache, names)
    head = model.get_output_embeddings().weight
    rel = []
    for s, (logits, _) in oracle.items():
        student = cache.sample(s)["target_last_hidden_states"].float() @ head.T
        rel += ((logits - student).norm(dim=-1) / logits.norm(dim=-1)).tolist()
    r = teacher_check(path, 10**9)
    assert r.problems == [] and r.notes == []
    assert r.samples == 3 and len(r.positions) == tokens and r.top1_agreement == 1.0
    assert r.rel_error_mean == pytest.approx(float(np.mean(rel)), rel=1e-3) and r.rel_error_mean < 0.005
    p = precision_check(path, 10**9)
    assert p.problems == [] and p.samples == 3 and p.positions == tokens
    # each array: (HF hidden_states index, the reader's key, its columns there: layers 0 and 1 side by side)
    where = {"layer 0": (1, "target_hidden_states", 0), "layer 1": (2, "target_hidden_states", 1),
             "final norm (post-norm)": (-1, "target_last_hidden_states", 0)}
    assert sorted(e.layer for e in p.arrays) == sorted(where)
    for e in p.arrays:
        index, key, part = where[e.layer]
        err2 = ref2 = 0.0
        for s, (_, hs) in oracle.items():
            want = hs[index]
            h = want.shape[-1]
            stored = cache.sample(s)[key].float()[:, part * h:(part + 1) * h]
            err2 += float((stored - want).pow(2).sum())
            ref2 += float(want.pow(2).sum())
        assert e.rel_rms == pytest.approx((err2 / ref2) ** 0.5, rel=1e-3) and e.rel_rms < 0.005, e.layer
    monkeypatch.setattr(ImageFeed, "inputs", lambda *a, **k: None)  # the pixels dropped: the checks must see it
    assert teacher_check(path, 10**9).problems and precision_check(path, 10**9).problems


def test_a_changed_missing_or_unfindable_image_is_a_problem_of_its_sample_for_the_teacher_and_precision_checks(
        vl_dir, tmp_path):
    """Never a silent skip: the sample whose image changed or vanished is a problem naming the image, and the
    other samples' positions are still compared; without the rows, one problem names the image samples."""
    from dspark_precompute.write.rerun.precision import precision_check
    from dspark_precompute.write.rerun.teacher import teacher_check

    path, data, names, by_row = one_image_cache(vl_dir, tmp_path)
    checks = (lambda: teacher_check(path, 10**9), lambda: precision_check(path, 10**9))
    for check in checks:
        assert check().problems == []
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(data / names[0])  # same size, other pixels
    (data / names[1]).unlink()
    for check in checks:
        r = check()
        assert r.samples == 1  # the text row's positions are still compared
        changed, missing = sorted(r.problems, key=lambda p: p["sample"] != by_row[0])
        assert changed["sample"] == by_row[0] and missing["sample"] == by_row[2]
        assert f"image 0 ({data / names[0]}) changed since the cache was written" in changed["message"]
        assert f"image 0 ({data / names[1]}) cannot be read" in missing["message"]
        assert "cannot be recomputed" in missing["message"] and "Restore the image" in missing["message"]
    (data / "rows.jsonl").rename(data / "moved.jsonl")
    for check in checks:
        r = check()
        (p,) = r.problems
        listed = ", ".join(str(s) for s in sorted([by_row[0], by_row[2]]))
        assert r.samples == 1 and f"2 sample(s) with images (samples {listed}) cannot be rerun" in p["message"]
        assert f"{data / 'rows.jsonl'}" in p["message"] and "restore the run's data" in p["message"]


def test_states_altered_at_one_image_samples_image_pads_fail_verify_teacher_and_precision(image_cache, tmp_path,
                                                                                          capsys):
    """The sign of layer 0's and the final state's values flipped at every image pad of one image sample, stored
    with valid checksums and bindings: structurally whole, and only a rerun with the pixels can tell (on main both
    checks left the image samples out and passed)."""
    from dspark_precompute.cli.cache import main

    altered, cache, m, victim, pads = altered_image_sample(image_cache, tmp_path)
    pads = int(cache.starts()[victim]) + pads
    assert len(pads) >= 8
    for name in (m["arrays"]["0"], m["arrays"]["last"]):
        arr = zarr.open_array(str(altered / name), mode="r+")
        for pos in pads:
            arr[pos] = np.asarray(arr[pos]) ^ np.uint16(0x8000)  # bf16's sign bit: -x for x
        rebind(altered, name, int(cache.units()[victim]))
    assert main(["verify", str(altered)]) == 0
    capsys.readouterr()
    assert main(["verify", str(altered), "--teacher", "100000", "--precision", "100000", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_check = {}
    for p in report["problems"]:
        by_check.setdefault(p["check"], []).append(p)
    (t,) = by_check.pop("teacher")
    assert t["array"] == m["arrays"]["last"] and "does not reproduce the target's own logits" in t["message"]
    assert t["sample"] == victim and report["teacher"]["samples"] == 3
    precision = by_check.pop("precision")
    assert {p["array"] for p in precision} >= {m["arrays"]["0"], m["arrays"]["last"]}
    assert all(p["sample"] == victim for p in precision if p["array"] == m["arrays"]["0"])
    assert m["arrays"]["1"] not in {p["array"] for p in precision}  # layer 1 was left as stored: it passes
    assert not by_check and report["precision"]["samples"] == 3


def test_images_the_processor_now_grids_otherwise_are_problems_of_their_samples_not_a_crash(vl_dir, image_cache,
                                                                                            tmp_path):
    """A checkpoint whose preprocessor_config.json now resizes to other bounds (its config and weights unchanged, so
    still the recorded target) grids the images otherwise: fed, they would not fill the stored image pads. Each image
    sample is a problem naming both grids (on main --recompute died on transformers' ValueError)."""
    from dspark_precompute.write.rerun.teacher import teacher_check

    path, _ = image_cache
    moved = tmp_path / "checkpoint"
    shutil.copytree(vl_dir, moved)
    pre = json.loads((moved / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 1024, "longest_edge": 2048}
    (moved / "preprocessor_config.json").write_text(json.dumps(pre))
    cache = CacheReader(path)
    images = [i for i in range(len(cache)) if cache.images(i)["sha256"]]
    recorded = cache.images(images[0])["grid_thw"].tolist()
    r = teacher_check(path, 10**9, model=str(moved))
    assert sorted(p["sample"] for p in r.problems) == images and r.samples == 1  # the text row is still compared
    assert all("cannot be fed again" in p["message"] and f"recorded {recorded}" in p["message"] for p in r.problems)
    r = recompute(path, 3, model=str(moved))
    fed = [p for p in r.problems if "cannot be fed again" in p["message"]]
    assert r.recomputed == 0 and len(fed) == 3  # one batch: the text row's holds the image rows too
    both = recorded * 2  # the batch's images in batch order: both image rows hold the same two images
    assert all(f"the images table recorded {both}" in p["message"] for p in fed)
