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
import zarr
from helpers import compose, rebind, small
from PIL import Image
from test_media import TEXT_ROW, data_dir, image_cache, openai_row, sharegpt_row, vl_dir, write_images

from dspark_precompute.read.reader import CacheReader
from dspark_precompute.write.rerun.recompute import recompute
from dspark_precompute.write.run import run
from dspark_precompute.write.samples.media import MediaInputs

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
    monkeypatch.setattr(MediaInputs, "of_batch", lambda *a, **k: None)  # the pixels dropped: the check must see it
    r = recompute(path, 3)
    assert sorted({p["sample"] for p in r.problems}) == images and r.exact == 1


def test_recompute_flags_the_image_sample_whose_stored_state_was_altered_at_a_vision_token(image_cache, tmp_path):
    path, _ = image_cache
    altered = tmp_path / "altered"
    shutil.copytree(path, altered)
    cache = CacheReader(altered)
    m = json.loads((altered / "manifest.json").read_text())
    victim = next(i for i in range(len(cache)) if cache.images(i)["sha256"])
    ids = cache.sample(victim)["input_ids"].numpy()
    token = int(np.flatnonzero(ids == m["media"]["image_token_id"])[3])  # an image pad: only the pixels make it
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


def test_a_changed_or_missing_image_is_a_problem_of_its_own_sample_and_the_other_samples_are_still_compared(
        vl_dir, tmp_path):
    data = tmp_path / "data"
    names = write_images(data / "imgs")
    rows = one_image_rows(data, names)
    result = run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", "seq_length=4096",
                               "batch.max_tokens=8192", "batch.max_samples=1", "model.dtype=fp32",
                               "model.layer_ids=[0,1]")))
    cache = CacheReader(result.path)
    by_row = {int(r): k for k, r in enumerate(cache.source_row)}
    assert recompute(result.path, 3).problems == []
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(data / names[0])  # same size, other pixels
    r = recompute(result.path, 3)
    assert r.recomputed == r.exact == 2  # the text row and the row of the other image
    (p,) = r.problems
    assert p["sample"] == by_row[0] and f"image 0 ({data / names[0]}) changed since the cache was written" in \
        p["message"] and "Restore the image" in p["message"]
    assert any("data.images_sha256" in n for n in r.notes)
    (data / names[1]).unlink()
    r = recompute(result.path, 3)
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


def test_the_teacher_and_precision_checks_leave_out_the_image_samples_they_cannot_feed_saying_so(image_cache):
    """They run the language model on the ids alone: on an image row that is another forward than the capture's
    (on main both failed the intact cache, 75% top-1). The text row's positions are still checked."""
    from dspark_precompute.write.rerun.precision import precision_check
    from dspark_precompute.write.rerun.teacher import teacher_check

    path, _ = image_cache
    cache = CacheReader(path)
    (text,) = [i for i in range(len(cache)) if not cache.images(i)["sha256"]]
    r = teacher_check(path, 10**9)
    assert r.problems == [] and r.top1_agreement == 1.0
    assert {s for s, _ in r.positions} == {text} and len(r.positions) == len(cache.sample(text)["input_ids"])
    assert any("leaves out the 2 sample(s) with images" in n and "--recompute" in n for n in r.notes)
    p = precision_check(path, 10**9)
    assert p.problems == [] and any("sample(s) with images" in n for n in p.notes)
