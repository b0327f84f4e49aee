"""Image references in rows: both forms, their resolution and reading, the rejects (no checkpoint needed)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from helpers import SHARED
from PIL import Image

from dspark_precompute.write.samples.images import (
    MediaProblem,
    fitting_images,
    image_sources,
    load_image,
    resolve_source,
)
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import RawRow

VISION = SHARED / "vision"


def norm(record, media=True):
    return normalize(RawRow(0, 1, record=record), media=media)


def test_sharegpt_placeholders_become_image_parts_in_place_in_list_order():
    conv = norm({"messages": [{"role": "user", "content": "<image>a<image>b"}, {"role": "assistant", "content": "c"}],
                 "images": ["x.jpg", "y.jpg"]})
    assert isinstance(conv, Conversation) and conv.media
    assert conv.messages[0]["content"] == [{"type": "image", "image": "x.jpg"}, {"type": "text", "text": "a"},
                                           {"type": "image", "image": "y.jpg"}, {"type": "text", "text": "b"}]
    assert image_sources(conv.messages) == ["x.jpg", "y.jpg"]


def test_openai_image_parts_take_each_url_form():
    parts = [{"type": "image_url", "image_url": {"url": "a.jpg"}}, {"type": "image_url", "image_url": "b.jpg"},
             {"type": "image", "image": "c.jpg"}, {"type": "image", "url": "d.jpg"}, {"type": "text", "text": "t"}]
    conv = norm({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "c"}]})
    assert image_sources(conv.messages) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]


def test_without_an_image_text_target_image_parts_stay_non_text_content():
    row = {"messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "a"}],
           "images": ["x.jpg"]}
    # a text target never captures the placeholder as the literal text "<image>": the row names an image it
    # cannot see, so it is a reject like an image part (and an empty list names none)
    assert norm(row, media=False).reason == "non_text_content"
    assert norm({**row, "images": []}, media=False).messages[0]["content"] == "<image>hi"
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                          {"role": "assistant", "content": "a"}]}
    assert norm(parts, media=False).reason == "non_text_content"


def test_more_images_than_placeholders_is_an_image_missing_reject():
    r = norm({"messages": [{"role": "user", "content": "<image>a"}, {"role": "assistant", "content": "c"}],
              "images": ["x.jpg", "y.jpg"]})
    assert isinstance(r, Reject) and r.reason == "image_missing" and "2 images" in r.message


def test_an_image_is_read_relative_to_the_data_file_and_hashed_by_its_bytes(tmp_path):
    Image.new("RGB", (20, 10), (200, 10, 10)).save(tmp_path / "a.png")
    got = load_image("a.png", tmp_path)
    assert got.image.size == (20, 10) and got.sha256 == hashlib.sha256((tmp_path / "a.png").read_bytes()).hexdigest()
    assert resolve_source("a.png", tmp_path) == str(tmp_path / "a.png")
    assert resolve_source(f"file://{tmp_path}/a.png", None) == str(tmp_path / "a.png")


@pytest.mark.parametrize(("source", "reason"), [("http://example.com/a.jpg", "image_missing"),
                                                ("data:image/png;base64,@@@", "image_undecodable"),
                                                ("nope.png", "image_missing")])
def test_unreadable_images_raise_their_reason(tmp_path, source, reason):
    with pytest.raises(MediaProblem) as exc:
        load_image(source, tmp_path)
    assert exc.value.reason == reason


def test_an_image_over_the_pixel_limit_is_too_large_before_decoding(tmp_path):
    Image.new("RGB", (100, 100)).save(tmp_path / "a.png")
    with pytest.raises(MediaProblem) as exc:
        load_image("a.png", tmp_path, max_pixels=9999)
    assert exc.value.reason == "image_too_large" and "100x100" in str(exc.value)


def test_a_cut_inside_an_image_moves_before_its_start_marker():
    ids = np.array([1, 7, 9, 9, 9, 8, 2, 7, 9, 9, 8, 3])  # 7 start, 9 pad, 8 end
    assert fitting_images(ids, 9, 12) == (2, 12)
    assert fitting_images(ids, 9, 9) == (1, 7)


def test_the_demo_rows_in_both_published_forms_normalize_to_the_same_conversations():
    if not (VISION / "mllm_demo.json").exists():
        pytest.skip(f"vision fixtures not present at {VISION}")
    sharegpt = json.loads((VISION / "mllm_demo.json").read_text())
    openai = [json.loads(line) for line in (VISION / "mllm_demo.openai.jsonl").read_text().splitlines() if line]
    assert len(sharegpt) == len(openai) == 6
    for a, b in zip(sharegpt, openai, strict=True):
        ca, cb = norm(a), norm(b)
        assert image_sources(ca.messages) == image_sources(cb.messages) == a["images"]
        for ma, mb in zip(ca.messages, cb.messages, strict=True):
            assert ma["content"] == mb["content"]
