"""Rows with images through an image-text checkpoint's own processor, and their states through the capture.

The oracle is the checkpoint's own processor on the rendered conversation and its own forward
(``AutoModelForImageTextToText`` with ``output_hidden_states``) on the processor's inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from dspark_precompute.write.samples.chat import Encoded
from dspark_precompute.write.samples.encode import RowEncoder
from dspark_precompute.write.samples.images import image_sources, load_image, without_sources
from dspark_precompute.write.samples.media import MediaSpec
from dspark_precompute.write.samples.normalize import Reject, normalize
from dspark_precompute.write.samples.rows import RawRow
from dspark_precompute.write.target.capture import HiddenStateCapture
from dspark_precompute.write.target.tiny import save_image_text_checkpoint


def write_images(folder, sizes=((96, 64), (48, 80))):
    """Small JPEGs with seeded noise (real decodes, distinct content), as a data folder holds them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{i + 1}.jpg")
        names.append(f"imgs/{i + 1}.jpg")
    return names


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_vl")
    save_image_text_checkpoint("qwen3_vl", d)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision_data")
    write_images(d / "imgs")
    return d


def sharegpt_row(names):
    return {"messages": [{"role": "user", "content": "<image>Who are they?"},
                         {"role": "assistant", "content": "Two players."},
                         {"role": "user", "content": "And here?<image>"},
                         {"role": "assistant", "content": "A goal."}],
            "images": list(names)}


def openai_row(names):
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": names[0]}},
                                                      {"type": "text", "text": "Who are they?"}]},
                         {"role": "assistant", "content": "Two players."},
                         {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                                      {"type": "image", "image": names[1]}]},
                         {"role": "assistant", "content": "A goal."}]}


def encoder(vl_dir, data_dir, seq_length=4096, **pixels):
    tok = AutoTokenizer.from_pretrained(vl_dir)
    spec = RowEncoder(tok.chat_template, seq_length, False, False, "auto", media=MediaSpec(str(vl_dir), **pixels),
                      data_root=str(data_dir))
    return spec, spec.build(tok)


def encode(vl_dir, data_dir, record, **kw):
    spec, enc = encoder(vl_dir, data_dir, **kw)
    return spec.encode(enc, RawRow(0, 1, record=record, file="rows.jsonl"), 0), enc


def processor_inputs(enc, data_dir, record):
    """The processor's own inputs for the row: its chat template's render and the decoded images."""
    conv = normalize(RawRow(0, 1, record=record), media=True)
    text = enc.media.processor.apply_chat_template(without_sources(conv.messages), tokenize=False)
    images = [load_image(s, data_dir, None).image for s in image_sources(conv.messages)]
    return enc.media.processor(text=[text], images=images, return_tensors="pt")


def test_both_row_forms_give_the_processors_expanded_ids(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    a, enc = encode(vl_dir, data_dir, sharegpt_row(names))
    b, _ = encode(vl_dir, data_dir, openai_row(names))
    assert isinstance(a, Encoded) and isinstance(b, Encoded)
    ref = processor_inputs(enc, data_dir, openai_row(names))
    assert np.array_equal(a.input_ids, ref["input_ids"][0].numpy())
    assert np.array_equal(b.input_ids, a.input_ids)
    assert np.array_equal(a.images.grid_thw, ref["image_grid_thw"].numpy())
    pads = int((a.input_ids == enc.media.vision.image).sum())
    assert pads == int(ref["image_grid_thw"].prod(-1).sum()) // 4 > 2  # one pad per merged 2x2 patch


def test_the_loss_mask_is_zero_on_vision_tokens_and_one_on_the_answers(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    e, enc = encode(vl_dir, data_dir, sharegpt_row(names))
    vision = np.isin(e.input_ids, sorted(enc.media.vision.markers))
    assert vision.sum() > 10 and not e.loss_mask[vision].any()
    tok = enc.tokenizer
    supervised = tok.decode(e.input_ids[e.loss_mask.astype(bool)].tolist())
    assert "Two players." in supervised and "A goal." in supervised and "Who are they?" not in supervised
    text_only, _ = encode(vl_dir, data_dir, {"messages": [{"role": "user", "content": "Who are they?"},
                                                          {"role": "assistant", "content": "Two players."}]})
    assert text_only.images is None and text_only.loss_mask.sum() > 0


def test_relative_file_url_and_data_url_images_are_the_same_image(vl_dir, data_dir, tmp_path):
    import base64

    names = write_images(data_dir / "imgs")
    raw = (data_dir / names[0]).read_bytes()
    forms = [names[0], f"file://{data_dir / names[0]}", "data:image/jpeg;base64," + base64.b64encode(raw).decode()]
    got = []
    for url in forms:
        row = openai_row([url, names[1]])
        e, _ = encode(vl_dir, data_dir, row)
        got.append((e.input_ids.tolist(), e.images.sha256))
    assert got[0] == got[1] == got[2]


def test_states_of_an_image_row_equal_the_checkpoints_own_forward_within_one_bf16_step(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    e, enc = encode(vl_dir, data_dir, sharegpt_row(names))
    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    ref_inputs = processor_inputs(enc, data_dir, openai_row(names))
    with torch.no_grad():
        ref = model(**ref_inputs, output_hidden_states=True).hidden_states
    n = len(ref) - 1
    ids = torch.from_numpy(e.input_ids.astype(np.int64))[None]
    with HiddenStateCapture(model, [-1, 1, n - 1], media=True) as cap:
        states, _ = cap(ids, media=enc.media.pixel_inputs(e.images, e.input_ids))
    for lid in (-1, 1, n - 1):
        stored = states[lid].to(torch.bfloat16).float()
        want = ref[lid + 1]
        step = want.abs().clamp_min(2.0 ** -126) * 2.0 ** -7  # one bf16 step at each value
        assert stored.shape == want.shape and bool(((stored - want).abs() <= step).all()), lid
    # the vision tower is what the image positions hold: without it the states there differ
    with HiddenStateCapture(model, [1]) as cap:
        text_states, _ = cap(ids)
    img = torch.from_numpy(e.input_ids == enc.media.vision.image)
    assert not torch.allclose(text_states[1][0, img], states[1][0, img])


def test_a_missing_undecodable_or_oversized_image_is_a_reject_with_its_reason(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    (data_dir / "imgs" / "bad.jpg").write_bytes(b"not a jpeg at all")
    cases = {"image_missing": [names[0], "imgs/none.jpg"], "image_undecodable": [names[0], "imgs/bad.jpg"]}
    for reason, imgs in cases.items():
        e, _ = encode(vl_dir, data_dir, sharegpt_row(imgs))
        assert isinstance(e, Reject) and e.reason == reason, e
        assert imgs[1].split("/")[1] in e.message
    big, _ = encode(vl_dir, data_dir, sharegpt_row(names), max_input_pixels=1000)
    assert isinstance(big, Reject) and big.reason == "image_too_large" and "data.image.max_input_pixels" in big.message
    few, _ = encode(vl_dir, data_dir, sharegpt_row(names[:1]))
    assert isinstance(few, Reject) and few.reason == "image_missing" and "placeholders" in few.message


def test_video_rows_are_refused_naming_torchvision_and_pyav_where_they_are_missing(vl_dir, data_dir):
    """Without torchvision (and PyAV) no video processor runs: both video forms are video_unsupported rejects
    naming what is missing; where both are installed, tests/write/samples/test_media_video.py (-m video) runs."""
    from dspark_precompute.write.samples.images import video_problem

    problem = video_problem()
    if problem is None:
        pytest.skip("torchvision and PyAV are installed here: video rows are read (pytest -m video)")
    ask = {"role": "assistant", "content": "A goal."}
    rows = [{"messages": [{"role": "user", "content": "<video>What happens?"}, ask], "videos": ["imgs/1.mp4"]},
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "imgs/1.mp4"}},
                                                       {"type": "text", "text": "What happens?"}]}, ask]}]
    for row in rows:
        e, _ = encode(vl_dir, data_dir, row)
        assert isinstance(e, Reject) and e.reason == "video_unsupported" and "torchvision" in e.message
        assert ("PyAV" in e.message) == ("PyAV" in problem)


def test_pixel_limits_change_the_grid(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    small, _ = encode(vl_dir, data_dir, sharegpt_row(names), max_pixels=32 * 32 * 4)
    large, _ = encode(vl_dir, data_dir, sharegpt_row(names))
    assert small.images.grid_thw.prod(-1).sum() < large.images.grid_thw.prod(-1).sum()


def test_truncation_never_cuts_inside_an_image(vl_dir, data_dir):
    names = write_images(data_dir / "imgs")
    full, enc = encode(vl_dir, data_dir, sharegpt_row(names))
    image = enc.media.vision.image
    second = int(np.flatnonzero(full.input_ids == image)[-1])  # inside the second image
    cut, _ = encode(vl_dir, data_dir, sharegpt_row(names), seq_length=second)
    assert isinstance(cut, Encoded) and len(cut.images.sources) == 1
    assert int((cut.input_ids == image).sum()) == int(full.images.grid_thw[0].prod()) // 4
    assert json.dumps(cut.images.sources)  # absolute paths: the forward reads them again


TEXT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


def image_run(vl_dir, data_dir, tmp_path, *extra, records=None):
    """A run over two image rows (both forms) and a text row (or ``records(names)``), seq_length 4096 (nothing
    cut)."""
    from helpers import compose, small

    from dspark_precompute.write.run import run

    names = write_images(data_dir / "imgs")
    rows = data_dir / "rows.jsonl"
    records = records(names) if records else (sharegpt_row(names), TEXT_ROW, openai_row(names))
    rows.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cfg = compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", "seq_length=4096",
                        "batch.max_tokens=8192", "model.dtype=fp32", "model.layer_ids=[0,1]", *extra))
    return run(cfg), names


def test_a_run_over_rows_with_images_stores_the_expanded_ids_and_the_full_checkpoints_states(vl_dir, data_dir,
                                                                                             tmp_path):
    """The oracle: the processor's own ids on the rendered conversation, and AutoModelForImageTextToText's own
    forward on the processor's inputs (output_hidden_states); the mask is 0 on every vision token."""
    from dspark_precompute.read.reader import CacheReader

    result, names = image_run(vl_dir, data_dir, tmp_path)
    cache = CacheReader(result.path)
    assert len(cache) == 3
    manifest = json.loads((Path(result.path) / "manifest.json").read_text())
    assert manifest["capture"]["target_part"]["loaded"] == "model"  # the vision tower was loaded and ran
    _, enc = encoder(vl_dir, data_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    rows = {int(r): k for k, r in enumerate(cache.source_row)}
    vision = {enc.media.vision.image, *enc.media.vision.markers}
    for row, record in ((0, sharegpt_row(names)), (2, openai_row(names))):
        got = cache.sample(rows[row])
        ref_inputs = processor_inputs(enc, data_dir, record)
        ids = ref_inputs["input_ids"][0].numpy()
        assert np.array_equal(got["input_ids"].numpy(), ids), row
        is_vision = np.isin(ids, sorted(vision))
        assert is_vision.sum() > 8 and not got["loss_mask"].numpy()[is_vision].any()
        assert got["loss_mask"].numpy().sum() > 0
        with torch.no_grad():
            ref = model(**ref_inputs, output_hidden_states=True).hidden_states
        want = torch.cat([ref[1][0], ref[2][0]], dim=-1)  # layers 0 and 1's outputs
        stored = got["target_hidden_states"].float()
        step = want.abs().clamp_min(2.0 ** -126) * 2.0 ** -7  # one bf16 step at each value
        assert stored.shape == want.shape and bool(((stored - want).abs() <= step).all()), row
        want_last = ref[-1][0]  # the post-norm state
        got_last = got["target_last_hidden_states"].float()
        assert bool(((got_last - want_last).abs() <= want_last.abs().clamp_min(2.0 ** -126) * 2.0 ** -7).all())
    text = cache.sample(rows[1])
    assert not np.isin(text["input_ids"].numpy(), sorted(vision)).any()


def image_rows(data_dir, names, n=9):
    """``n`` rows alternating the two image forms with text rows, each with its own wording."""
    rows = data_dir / "rows.jsonl"
    out = []
    for k in range(n):
        r = json.loads(json.dumps(sharegpt_row(names) if k % 3 == 0 else openai_row(names) if k % 3 == 1
                                  else TEXT_ROW))
        r["messages"][-1]["content"] += f" ({k})"
        out.append(r)
    rows.write_text("".join(json.dumps(r) + "\n" for r in out))
    return rows


IMAGE_UNITS = ("storage.chunk_tokens=64", "storage.unit_tokens=256", "seq_length=256", "batch.max_tokens=1024")


def test_an_image_run_stopped_after_a_unit_resumes_to_the_uninterrupted_cache(vl_dir, data_dir, tmp_path,
                                                                             monkeypatch):
    from helpers import assert_same_cache, compose, small, stopped_after_units

    from dspark_precompute.contract.commits import committed_units
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.write.run import run

    rows = image_rows(data_dir, write_images(data_dir / "imgs"))
    ref = run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", *IMAGE_UNITS, name="ref")))
    overrides = small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", *IMAGE_UNITS, name="c")
    stopped_after_units(overrides, monkeypatch, 2)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    done = committed_units(CacheStore(tmp_path / "c"))
    assert 0 < len(done) < m["layout"]["num_units"]
    result = run(compose(overrides))
    assert result.complete and result.resumed_units == len(done)
    assert_same_cache(str(ref.path), str(tmp_path / "c"))


def test_a_changed_image_refuses_the_resume_naming_the_images_hash(vl_dir, data_dir, tmp_path, monkeypatch):
    from helpers import compose, small, stopped_after_units

    from dspark_precompute.errors import IncompatibleCacheError
    from dspark_precompute.write.run import run

    names = write_images(data_dir / "imgs")
    rows = image_rows(data_dir, names)
    overrides = small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", *IMAGE_UNITS, name="c")
    stopped_after_units(overrides, monkeypatch, 1)
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(data_dir / names[0])  # same size, other pixels
    with pytest.raises(IncompatibleCacheError, match="images_sha256"):
        run(compose(overrides))


def test_rows_with_images_count_the_vision_tower_in_the_fit_whole_on_every_rank_when_sharded(
        vl_dir, data_dir, tmp_path, monkeypatch):
    from helpers import compose, refuse_building_weights, small

    from dspark_precompute.errors import ConfigError
    from dspark_precompute.write.plan.prepare import prepare
    from dspark_precompute.write.target.load import rank_weight_bytes, vision_bytes, weight_bytes

    refuse_building_weights(monkeypatch)
    rows = image_rows(data_dir, write_images(data_dir / "imgs"))
    text = data_dir / "text.jsonl"
    text.write_text(json.dumps(TEXT_ROW) + "\n")
    with_images = prepare(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}")))
    text_only = prepare(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={text}")))
    assert with_images.media is not None and text_only.media is None
    assert with_images.target.capture_part()["loaded"] == "model"
    assert text_only.target.capture_part()["loaded"] == "model.language_model"
    full = weight_bytes(with_images.cfg.model, with_images.target, torch.float32)
    lm = weight_bytes(text_only.cfg.model, text_only.target, torch.float32)
    from safetensors import safe_open

    vision = 0
    for f in vl_dir.glob("*.safetensors"):  # the oracle: the checkpoint's own tensors outside the language model
        with safe_open(str(f), "np") as fh:
            vision += sum(int(np.prod(fh.get_slice(k).get_shape())) for k in fh.keys()
                          if "language_model" not in k and not k.startswith("lm_head"))
    assert vision > 0 and full - lm == vision * 4  # fp32
    sharded = prepare(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", "parallel.fsdp=2")),
                      world=2)
    assert vision_bytes(sharded.target, torch.float32) == vision * 4
    assert rank_weight_bytes(full, sharded.cfg.parallel, vision * 4) == -(-lm // 2) + vision * 4
    assert vision_bytes(text_only.target, torch.float32) == 0  # a text-only load holds no vision tower
    monkeypatch.setattr("dspark_precompute.write.target.load._host_available", lambda: 1)
    with pytest.raises(ConfigError, match=r"1/2 of 0\.0 GiB, and the vision tower's 0\.0 GiB whole"):
        prepare(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}", "parallel.fsdp=2")), world=2)


def test_rows_with_images_without_pillow_are_refused_naming_the_vision_extra(vl_dir, data_dir, tmp_path,
                                                                            monkeypatch):
    import importlib.util

    from helpers import compose, refuse_building_weights, small

    from dspark_precompute.errors import ConfigError
    from dspark_precompute.write.plan.prepare import prepare

    refuse_building_weights(monkeypatch)
    rows = image_rows(data_dir, write_images(data_dir / "imgs"))
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else find(name, *a))
    with pytest.raises(ConfigError, match=r"dspark-precompute\[vision\]"):
        prepare(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}")))


def test_the_shared_demo_rows_in_both_published_forms_capture_to_the_same_cache_and_videos_are_rejects(
        vl_dir, tmp_path):
    """The real LLaMA-Factory demo rows (../shared/data/vision), as published and in OpenAI form: the same ids and
    states for every row; the video demo's rows are video_unsupported rejects naming torchvision."""
    from helpers import SHARED, compose, small

    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.run import run

    vision = SHARED / "vision"
    if not (vision / "mllm_demo.json").is_file():
        pytest.skip(f"{vision} is absent: the shared vision rows")
    caches = []
    for k, name in enumerate(("mllm_demo.json", "mllm_demo.openai.jsonl")):
        result = run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={vision / name}",
                                   "seq_length=4096", "batch.max_tokens=8192", name=f"c{k}")))
        caches.append(CacheReader(result.path))
    a, b = caches
    assert len(a) == len(b) == 6
    pad = encoder(vl_dir, vision)[1].media.vision.image
    for i in range(6):
        x, y = a.sample(i), b.sample(i)
        pads = x["input_ids"] == pad
        assert int(pads.sum()) > 0 and not x["loss_mask"][pads].any()  # every row holds an image, never supervised
        for key in x:
            assert torch.equal(x[key], y[key]), (i, key)
    from dspark_precompute.errors import DataError
    from dspark_precompute.write.samples.images import video_problem

    if video_problem() is None:
        return  # video rows are read here: tests/write/samples/test_media_video.py runs the video demo
    with pytest.raises(DataError, match=r"no row .* became a sample \(video_unsupported=3\).*torchvision"):
        run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={vision / 'mllm_video_demo.json'}",
                          "data.max_invalid_fraction=1.0", name="video")))


def test_a_text_target_rejects_rows_naming_images_or_videos_instead_of_capturing_their_placeholders_as_text():
    row = sharegpt_row(["a.jpg", "b.jpg"])
    got = normalize(RawRow(0, 1, record=row))
    assert isinstance(got, Reject) and got.reason == "non_text_content" and "'images' list (2)" in got.message
    video = {"messages": row["messages"], "videos": ["a.mp4"]}
    got = normalize(RawRow(0, 1, record=video))
    assert isinstance(got, Reject) and got.reason == "video_unsupported" and "torchvision" in got.message
    empty = normalize(RawRow(0, 1, record={**row, "images": []}))
    assert not isinstance(empty, Reject)  # an empty list names no image


@pytest.fixture(scope="module")
def image_cache(vl_dir, data_dir, tmp_path_factory):
    """One finished run over two image rows and a text row (image_run), shared by the read-side tests below."""
    result, names = image_run(vl_dir, data_dir, tmp_path_factory.mktemp("image_cache"))
    return Path(result.path), names


def copied(cache, tmp_path):
    import shutil

    shutil.copytree(cache, tmp_path / "copy")
    return tmp_path / "copy"


def test_stored_positions_are_those_the_full_models_forward_gave_its_rotary_and_the_grids_the_processors(
        vl_dir, data_dir, image_cache):
    """The oracle: the positions transformers' own forward hands the language model's rotary embedding (a forward
    pre-hook), on the processor's inputs for image rows and on the ids alone for the text row; the grids and
    hashes: the processor's image_grid_thw and the images' bytes."""
    import hashlib

    from dspark_precompute.read.reader import CacheReader

    path, names = image_cache
    cache = CacheReader(path)
    manifest = json.loads((path / "manifest.json").read_text())
    _, enc = encoder(vl_dir, data_dir)
    vision = enc.media.vision
    assert manifest["media"] == {"image_token_id": vision.image, "vision_token_ids": sorted(vision.markers),
                                 "position_axes": 3, "samples_with_images": 2, "images": 4,
                                 "spatial_merge_size": 2}
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    seen = {}
    model.model.language_model.rotary_emb.register_forward_pre_hook(lambda m, args: seen.update(pos=args[1]))
    rows = {int(r): k for k, r in enumerate(cache.source_row)}
    for row, record in ((0, sharegpt_row(names)), (2, openai_row(names)), (1, TEXT_ROW)):
        got = cache.sample(rows[row])
        if row == 1:
            inputs = {"input_ids": got["input_ids"][None]}
        else:
            inputs = processor_inputs(enc, data_dir, record)
            images = cache.images(rows[row])
            assert np.array_equal(images["grid_thw"], inputs["image_grid_thw"].numpy())
            assert images["sha256"] == [hashlib.sha256((data_dir / n).read_bytes()).hexdigest() for n in names]
        with torch.no_grad():
            model(**inputs)
        want = seen["pos"][:, 0, :].T  # [T, 3]
        assert got["position_ids"].shape == want.shape and torch.equal(got["position_ids"], want), row
        assert (row == 1) == bool((want == torch.arange(len(want))[:, None]).all())  # images shift the positions
    assert cache.images(rows[1])["grid_thw"].shape == (0, 3)


def test_verify_catches_a_flipped_byte_in_position_ids_and_a_grid_that_disagrees_with_the_pad_count(
        image_cache, tmp_path):
    import zarr

    from dspark_precompute.read.verify import verify_cache

    path, _ = image_cache
    assert verify_cache(path).ok
    flipped = copied(path, tmp_path / "a")
    shard = flipped / "position_ids" / "c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    report = verify_cache(flipped)
    assert not report.ok and any(p.array == "position_ids" for p in report.problems), report.format()
    wrong = copied(path, tmp_path / "b")
    grids = zarr.open_array(str(wrong / "images" / "grid_thw"), mode="r+")
    grids[0, 1] = int(grids[0, 1]) + 2
    report = verify_cache(wrong)
    assert not report.ok and "image pad tokens" in report.format(), report.format()


# where each trainer builds its draft's positions from the ids alone (torch.arange(seq_len)): the refusal names it
ARANGE_IN = {"nemo": "draft_qwen3.py", "deepspec": "Qwen3DSparkModel.forward",
             "specforge": "_forward_draft_blocks", "speculators": r"BaseDataset.__getitem__"}


def test_every_export_refuses_the_image_rows_m_rope_moved_naming_where_its_trainer_builds_arange_positions(
        image_cache, tmp_path):
    """The image rows' stored positions differ from 0, 1, 2, ... (the positions test above checks them against the
    model's own forward); every trainer's offline path builds those 1-D ones, so each export refuses, and
    --skip-image-rows exports the text row only."""
    from dspark_precompute.cli.cache import main
    from dspark_precompute.errors import ExportError
    from dspark_precompute.read.export import EXPORT_MARKER, export

    path, _ = image_cache
    for to, where in ARANGE_IN.items():
        with pytest.raises(ExportError, match=r"2 of 3 samples with images or videos whose positions are not 0, 1, "
                                              r"2, .*position_ids of 3 axes.*" + where + r".*--skip-image-rows"):
            export(path, tmp_path / to, to=to)
        assert not (tmp_path / to).exists()
    assert main(["export", str(path), str(tmp_path / "out"), "--to", "nemo", "--skip-image-rows"]) == 0
    marker = json.loads((tmp_path / "out" / EXPORT_MARKER).read_text())
    assert marker["num_samples"] == 1 and marker["dropped_samples"] == {"holds_images": 2}
    assert marker["samples_with_images"] == 0


@pytest.fixture(scope="module")
def one_axis_image_cache(vl_dir, data_dir, tmp_path_factory):
    """An image cache of a target with one position axis (the language model's own 0, 1, 2, ...: no position_ids
    stored), with the pre-norm state for speculators. MiniMax M3 is such a target, but its image processor needs
    torchvision, absent here; so the tiny Qwen3-VL runs with its multi-axis position rule hidden from the run."""
    from dspark_precompute.write.samples import media

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(media, "_rope_model", lambda model_dir: None)
        result, _ = image_run(vl_dir, data_dir, tmp_path_factory.mktemp("one_axis"), "capture.last_state=both")
    return Path(result.path)


def test_image_rows_of_a_one_axis_target_reach_specforge_and_speculators_own_loaders_as_the_cache_holds_them(
        one_axis_image_cache, tmp_path):
    """Their positions are the 1-D ones every trainer builds, so every export carries them (the marker counts
    them); SpecForge's DSpark loader and speculators' ArrowDataset read each sample's ids, mask and states bit for
    bit as our reader gives them, vision pads included."""
    pytest.importorskip("specforge.runtime.data_plane.offline_reader", reason="needs SpecForge 0.2.0")
    pytest.importorskip("speculators.train.data", reason="needs vLLM speculators 0.9.0")
    from speculators.train.data import ArrowDataset
    from test_export_interop import bits, specforge_batches

    from dspark_precompute.read.export import EXPORT_MARKER, export
    from dspark_precompute.read.reader import CacheReader

    c = CacheReader(one_axis_image_cache)
    manifest = json.loads((one_axis_image_cache / "manifest.json").read_text())
    assert not c.has_positions and manifest["media"]["position_axes"] == 0 and len(c.image_rows()) == 2
    for to in ("nemo", "deepspec", "specforge", "speculators"):
        r = export(one_axis_image_cache, tmp_path / to, to=to, progress=False)
        marker = json.loads((tmp_path / to / EXPORT_MARKER).read_text())
        assert r.num_samples == 3 and r.dropped == {} and marker["samples_with_images"] == 2, to
    image = manifest["media"]["image_token_id"]
    batches = specforge_batches(tmp_path / "specforge", c.seq_length)
    spec = ArrowDataset(c.seq_length, str(tmp_path / "speculators"), on_missing="raise")
    assert len(batches) == len(spec) == 3
    for j in range(3):
        want = c.read_raw(j, [0, 1])
        ids = want["input_ids"].astype(np.int64)
        pads = int((ids == image).sum())  # one per merged 2x2 patch of the sample's images; none in the text row
        assert pads == int(c.images(j)["grid_thw"].prod(-1).sum()) // 4 and (pads > 0) == (j in c.image_rows())
        b, got = batches[j], spec[j]
        for loaded in (b["input_ids"][0], got["input_ids"]):
            assert np.array_equal(loaded.numpy(), ids)
        for loaded in (b["loss_mask"][0], got["loss_mask"]):
            assert np.array_equal(loaded.numpy(), want["loss_mask"].astype(np.int64))
        assert np.array_equal(bits(b["hidden_states"][0]), want["target_hidden_states"])
        assert np.array_equal(bits(b["target_last_hidden_states"][0]), want["target_last_hidden_states"])
        assert np.array_equal(bits(got["hidden_states"]), want["target_hidden_states"])
        pre = c.read_raw(j, [], last=False, pre_norm=True)["target_pre_norm_hidden_states"]
        assert np.array_equal(bits(got["verifier_last_hidden_states"]), pre)
        assert torch.equal(got["position_ids"], torch.arange(len(ids)))  # the one-axis target's own positions


def test_an_m_rope_image_row_cut_before_its_image_moved_a_position_is_exported_and_one_cut_after_is_refused(
        vl_dir, data_dir, tmp_path):
    """A row answered before its image: cut at its first image pad, its positions are still 0, 1, 2, ... on every
    axis (what SpecForge builds), so SpecForge's own loader gets it as our reader gives it; two tokens further
    the image has moved them and the export refuses."""
    from test_export_interop import bits, specforge_batches

    from dspark_precompute.errors import ExportError
    from dspark_precompute.read.export import EXPORT_MARKER, export
    from dspark_precompute.read.reader import CacheReader

    def late_image(names):
        return [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                              {"role": "user", "content": "<image>And here?"},
                              {"role": "assistant", "content": "A goal."}], "images": names[:1]}]

    result, _ = image_run(vl_dir, data_dir, tmp_path, records=late_image)
    c = CacheReader(result.path)
    raw = c.read_raw(0, [0, 1])
    first = int(np.flatnonzero(raw["input_ids"] == c.manifest.media.image_token_id)[0])
    pos = raw["position_ids"]
    assert (pos[:first + 1] == np.arange(first + 1)[:, None]).all() and (pos[first + 1] != first + 1).any()
    r = export(result.path, tmp_path / "sf", to="specforge", max_length=first, progress=False)
    assert r.num_samples == 1 and json.loads((tmp_path / "sf" / EXPORT_MARKER).read_text())["samples_with_images"] == 1
    (b,) = specforge_batches(tmp_path / "sf", first)
    assert np.array_equal(b["input_ids"][0].numpy(), raw["input_ids"][:first].astype(np.int64))
    assert np.array_equal(b["loss_mask"][0].numpy(), raw["loss_mask"][:first].astype(np.int64))
    assert np.array_equal(bits(b["hidden_states"][0]), raw["target_hidden_states"][:first])
    with pytest.raises(ExportError, match="1 of 1 samples with images or videos whose positions are not 0, 1, 2"):
        export(result.path, tmp_path / "sf2", to="specforge", max_length=first + 2, progress=False)


def test_a_text_run_on_an_image_text_checkpoint_writes_no_media_section_positions_or_image_tables(vl_dir, data_dir,
                                                                                               tmp_path):
    """Text caches keep the manifest (and so the config hash) they had before image caches existed."""
    from helpers import compose, small

    from dspark_precompute.contract.manifest import config_hash
    from dspark_precompute.write.run import run

    rows = data_dir / "text_only.jsonl"
    rows.write_text(json.dumps(TEXT_ROW) + "\n")
    result = run(compose(small(tmp_path, f"model.path={vl_dir}", f"data.path={rows}")))
    manifest = json.loads((Path(result.path) / "manifest.json").read_text())
    assert "media" not in manifest and manifest["config_hash"] == config_hash(manifest["identity"])
    assert not any("media" in k or "position" in k for k in json.dumps(manifest["identity"]).split('"'))
    assert not (Path(result.path) / "position_ids").exists() and not (Path(result.path) / "images").exists()


CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_image_rows_through_qwen3_5_checkpoints_equal_their_own_forward_ids_mask_and_rope_index(
        model_type, data_dir, tmp_path):
    """Qwen3.5 and Qwen3.5-MoE (Qwen3.6's architecture: Gated DeltaNet and attention layers, 3:1), tiny and laid
    out as the hub ships them. The oracle: the processor's own inputs, the checkpoint's own forward
    (AutoModelForImageTextToText, output_hidden_states) and its own ``get_rope_index`` on those inputs."""
    from helpers import compose, small

    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.run import run

    ckpt = tmp_path / model_type
    save_image_text_checkpoint(model_type, ckpt)
    names = write_images(data_dir / "imgs")
    rows = data_dir / f"{model_type}.jsonl"
    rows.write_text(json.dumps(sharegpt_row(names)) + "\n")
    layers = [0, 3]  # a linear-attention (Gated DeltaNet) layer and the full-attention one
    result = run(compose(small(tmp_path, f"model.path={ckpt}", f"data.path={rows}", "seq_length=4096",
                               "batch.max_tokens=8192", "model.dtype=fp32", f"model.layer_ids={layers}")))
    manifest = json.loads((Path(result.path) / "manifest.json").read_text())
    assert manifest["capture"]["target_part"]["loaded"] == "model"
    assert manifest["capture"]["target_part"]["checkpoint_class"] == CLASSES[model_type]
    got = CacheReader(result.path).sample(0)
    _, enc = encoder(ckpt, data_dir)
    inputs = processor_inputs(enc, data_dir, openai_row(names))
    ids = inputs["input_ids"][0].numpy()
    assert np.array_equal(got["input_ids"].numpy(), ids)
    vision = np.isin(ids, sorted(enc.media.vision.markers))
    assert vision.sum() > 8 and not got["loss_mask"].numpy()[vision].any() and got["loss_mask"].numpy().sum() > 0
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert type(model).__name__ == CLASSES[model_type]  # transformers defines the class itself
    with torch.no_grad():
        ref = model(**inputs, output_hidden_states=True).hidden_states
    for stored, want in ((got["target_hidden_states"].float(), torch.cat([ref[k + 1][0] for k in layers], -1)),
                         (got["target_last_hidden_states"].float(), ref[-1][0])):
        step = want.abs().clamp_min(2.0 ** -126) * 2.0 ** -7  # one bf16 step at each value
        assert stored.shape == want.shape and bool(((stored - want).abs() <= step).all())
    pos, _ = model.model.get_rope_index(input_ids=inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                        image_grid_thw=inputs["image_grid_thw"],
                                        attention_mask=inputs["attention_mask"])
    want_pos = pos[:, 0, :].T
    assert not torch.equal(want_pos, torch.arange(len(ids))[:, None].expand(-1, 3))  # the images shift them
    assert torch.equal(got["position_ids"].long(), want_pos)


def test_image_rows_batched_together_match_one_row_per_forward_within_the_documented_tolerance(
        data_dir, tmp_path, monkeypatch):
    """The hybrid Qwen3.5 (Gated DeltaNet and attention), fp32: image and text rows right-padded into one forward
    against one row per forward (how image rows ran before), every stored array; 1e-5 (docs/targets.md)."""
    from helpers import compose, small

    from dspark_precompute import open_cache
    from dspark_precompute.write.run import run

    ckpt = tmp_path / "qwen3_5"
    save_image_text_checkpoint("qwen3_5", ckpt)
    rows = image_rows(data_dir, write_images(data_dir / "imgs"), n=6)
    images_per_forward = []
    call = HiddenStateCapture.__call__

    def counted(self, ids, mask=None, media=None):
        images_per_forward.append(0 if media is None else len(media["image_grid_thw"]))
        return call(self, ids, mask, media)

    monkeypatch.setattr(HiddenStateCapture, "__call__", counted)
    caches = []
    for n in (1, 6):
        cfg = compose(small(tmp_path, f"model.path={ckpt}", f"data.path={rows}", "seq_length=4096",
                            "batch.max_tokens=8192", "model.dtype=fp32", "storage.dtype=fp32",
                            "model.layer_ids=[0,3]", f"batch.max_samples={n}", name=f"c{n}"))
        run(cfg)
        caches.append(open_cache(cfg.storage.path))
    assert images_per_forward[6:] == [8]  # the second run: 4 image rows (2 images each) and 2 text rows, together
    a, b = caches
    worst = 0.0
    assert len(a) == len(b) == 6
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys() and torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["position_ids"], y["position_ids"])
        for key in ("target_hidden_states", "target_last_hidden_states"):
            worst = max(worst, float((x[key] - y[key]).abs().max()))
    assert worst <= 1e-5
