"""Rows with videos through an image-text checkpoint's own processor and video processor, and their states through
the capture (``pytest -m video``: transformers' video processors need torchvision matching torch, and decoding
needs PyAV; scripts/video_lane.sh builds that venv).

The oracle is the checkpoint's own processor on the rendered conversation with the decoded video (every frame,
the processor sampling them itself) and its own forward (``AutoModelForImageTextToText`` with
``output_hidden_states``) on the processor's inputs. The videos are the real LLaMA-Factory demo files
(../shared/data/vision/mllm_demo_data): 1.mp4, 2.avi and 3.mp4.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.video

if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("av") is None:
    pytest.skip("video rows need torchvision (matching torch) and PyAV: run scripts/video_lane.sh",
                allow_module_level=True)

import torch  # noqa: E402
from helpers import SHARED, assert_same_cache, compose, small, stopped_after_units  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoTokenizer  # noqa: E402

from dspark_precompute.write.samples.chat import Encoded  # noqa: E402
from dspark_precompute.write.samples.encode import RowEncoder  # noqa: E402
from dspark_precompute.write.samples.images import without_sources  # noqa: E402
from dspark_precompute.write.samples.media import MediaSpec, described  # noqa: E402
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize  # noqa: E402
from dspark_precompute.write.samples.rows import RawRow  # noqa: E402
from dspark_precompute.write.target.tiny import save_image_text_checkpoint  # noqa: E402

DEMO = SHARED / "vision" / "mllm_demo_data"
VIDEOS = ("1.mp4", "2.avi", "3.mp4")
UNITS = ("storage.chunk_tokens=64", "storage.unit_tokens=256", "seq_length=256", "batch.max_tokens=1024")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_vl")
    save_image_text_checkpoint("qwen3_vl", d)
    return d


@pytest.fixture()
def data_dir(tmp_path):
    """The demo videos copied (writable) into ``vids/``, beside where the rows file goes."""
    if not all((DEMO / v).is_file() for v in VIDEOS):
        pytest.skip(f"{DEMO} is absent: the shared demo videos")
    (tmp_path / "vids").mkdir()
    for v in VIDEOS:
        shutil.copyfile(DEMO / v, tmp_path / "vids" / v)
    return tmp_path


def sharegpt_row(video="vids/1.mp4", answer="A baby is reading."):
    return {"messages": [{"role": "user", "content": "<video>Why is this video funny?"},
                         {"role": "assistant", "content": answer}], "videos": [video]}


def openai_row(video="vids/1.mp4", answer="A baby is reading."):
    return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}},
                                                      {"type": "text", "text": "Why is this video funny?"}]},
                         {"role": "assistant", "content": answer}]}


TEXT_ROW = {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]}


def encoder(vl_dir, data_dir, seq_length=4096, **kw):
    tok = AutoTokenizer.from_pretrained(vl_dir)
    spec = described(MediaSpec(str(vl_dir), **kw), tok, tok.chat_template)
    enc = RowEncoder(tok.chat_template, seq_length, False, False, "auto", media=spec, data_root=str(data_dir))
    return enc, enc.build(tok)


def encode(vl_dir, data_dir, record, **kw):
    spec, enc = encoder(vl_dir, data_dir, **kw)
    return spec.encode(enc, RawRow(0, 1, record=record, file="rows.jsonl"), 0), enc


def processor_inputs(processor, data_dir, record):
    """The processor's own inputs for the row: its chat template's render and each video decoded whole (every
    frame; the video processor samples them itself, from the metadata)."""
    from transformers.video_utils import load_video

    conv = normalize(RawRow(0, 1, record=record), media=True)
    assert isinstance(conv, Conversation)
    text = processor.apply_chat_template(without_sources(conv.messages), tokenize=False)
    names = [p["video"] for m in conv.messages if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "video"]
    decoded = [load_video(str(data_dir / n), backend="pyav") for n in names]
    return processor(text=[text], videos=[f for f, _ in decoded],
                     videos_kwargs={"video_metadata": [m for _, m in decoded]}, return_tensors="pt")


def video_run(vl_dir, data_dir, records, *extra, name="cache"):
    from dspark_precompute.write.run import run

    rows = data_dir / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run(compose(small(data_dir, f"model.path={vl_dir}", f"data.path={rows}", "seq_length=4096",
                             "batch.max_tokens=8192", "model.dtype=fp32", "model.layer_ids=[0,1]", *extra,
                             name=name)))


def test_both_video_row_forms_give_the_processors_own_ids_and_mask_zero_over_each_whole_video(vl_dir, data_dir):
    """The processor inserts per frame pair a timestamp text and markers around the frame's pads: the stored ids are
    the processor's, and the loss mask is 0 from the video's start marker to its end marker."""
    a, enc = encode(vl_dir, data_dir, sharegpt_row())
    b, _ = encode(vl_dir, data_dir, openai_row())
    assert isinstance(a, Encoded) and isinstance(b, Encoded)
    processor = enc.media.processor
    ref = processor_inputs(processor, data_dir, openai_row())
    assert np.array_equal(a.input_ids, ref["input_ids"][0].numpy()) and np.array_equal(b.input_ids, a.input_ids)
    assert np.array_equal(a.images.video_grid_thw, ref["video_grid_thw"].numpy()) and a.images.sources == ()
    vt = enc.media.vision
    pads = a.input_ids == vt.video
    assert int(pads.sum()) == int(ref["video_grid_thw"].prod(-1).sum()) // 4 > 8
    text = enc.tokenizer.decode(a.input_ids.tolist())
    assert "seconds>" in text  # the timestamps the processor inserts: not just the pad repeated
    first = int(np.flatnonzero(np.isin(a.input_ids, sorted(vt.starts)))[0])
    last = int(np.flatnonzero(np.isin(a.input_ids, sorted(vt.ends)))[-1])
    assert not a.loss_mask[first:last + 1].any()
    supervised = enc.tokenizer.decode(a.input_ids[a.loss_mask.astype(bool)].tolist())
    assert "A baby is reading." in supervised and "seconds" not in supervised and "funny" not in supervised
    assert np.array_equal(ref["mm_token_type_ids"][0].numpy(), 2 * pads)  # 2 on video pads (transformers 5.24)


def test_a_row_with_an_image_and_two_videos_gives_the_processors_ids(vl_dir, data_dir):
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(
        data_dir / "vids" / "a.jpg")
    row = {"messages": [{"role": "user", "content": "<video>and<image>then<video>?"},
                        {"role": "assistant", "content": "Both."}],
           "videos": ["vids/2.avi", "vids/3.mp4"], "images": ["vids/a.jpg"]}
    e, enc = encode(vl_dir, data_dir, row)
    assert isinstance(e, Encoded), getattr(e, "message", None)
    from transformers.video_utils import load_video

    processor = enc.media.processor
    conv = normalize(RawRow(0, 1, record=row), media=True)
    text = processor.apply_chat_template(without_sources(conv.messages), tokenize=False)
    decoded = [load_video(str(data_dir / "vids" / n), backend="pyav") for n in ("2.avi", "3.mp4")]
    ref = processor(text=[text], images=[Image.open(data_dir / "vids" / "a.jpg").convert("RGB")],
                    videos=[f for f, _ in decoded], videos_kwargs={"video_metadata": [m for _, m in decoded]},
                    return_tensors="pt")
    assert np.array_equal(e.input_ids, ref["input_ids"][0].numpy())
    assert len(e.images.sources) == 1 and len(e.images.video_sources) == 2
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    pos, _ = model.model.get_rope_index(input_ids=ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                        image_grid_thw=ref["image_grid_thw"], video_grid_thw=ref["video_grid_thw"],
                                        attention_mask=ref["attention_mask"])
    assert np.array_equal(e.position_ids, pos[:, 0, :].T.numpy())


def test_a_truncation_never_splits_a_video(vl_dir, data_dir):
    row = {"messages": [{"role": "user", "content": "<video>What?"}, {"role": "assistant", "content": "A baby."},
                        {"role": "user", "content": "<video>And now?"}, {"role": "assistant", "content": "Cooking."}],
           "videos": ["vids/1.mp4", "vids/2.avi"]}
    whole, enc = encode(vl_dir, data_dir, row)
    vt = enc.media.vision
    second = int(np.flatnonzero(np.isin(whole.input_ids, sorted(vt.starts)))[5])  # 1.mp4: 1 + 4 frame groups
    cut, _ = encode(vl_dir, data_dir, row, seq_length=second + 10)
    assert isinstance(cut, Encoded) and len(cut.images.video_sources) == 1
    assert len(cut.input_ids) == second and (cut.input_ids == vt.video).sum() == (whole.input_ids[:second] ==
                                                                                   vt.video).sum()


def test_video_limits_are_config_keys_that_change_the_grid_and_enter_the_identity(vl_dir, data_dir):
    from dspark_precompute.write.plan.prepare import prepare

    few, _ = encode(vl_dir, data_dir, sharegpt_row(), video=(("max_frames", 4),))
    many, _ = encode(vl_dir, data_dir, sharegpt_row())
    assert few.images.video_grid_thw[0, 0] == 2 < many.images.video_grid_thw[0, 0]  # 4 frames: 2 frame pairs
    small_px, _ = encode(vl_dir, data_dir, sharegpt_row(), video=(("max_pixels", 8 * 32 * 32),))
    assert small_px.images.video_grid_thw[0, 1:].prod() < many.images.video_grid_thw[0, 1:].prod()
    capped, _ = encode(vl_dir, data_dir, sharegpt_row(), video=(("cap_pixels_per_frame", True),))
    assert isinstance(capped, Encoded) and capped.images.video_grid_thw[0, 0] == many.images.video_grid_thw[0, 0]
    rows = data_dir / "rows.jsonl"
    rows.write_text(json.dumps(sharegpt_row()) + "\n")
    base = small(data_dir, f"model.path={vl_dir}", f"data.path={rows}")
    a, b = prepare(compose(base)), prepare(compose([*base, "data.video.max_frames=4"]))
    assert b.identity["data"]["video"] == {"max_frames": 4} and "video" not in a.identity["data"]
    assert a.config_hash != b.config_hash and a.identity["data"]["images_sha256"]


def test_a_missing_corrupt_or_oversized_video_is_a_reject_with_its_reason_and_the_run_goes_on(vl_dir, data_dir):
    from dspark_precompute.read.reader import CacheReader

    data = (data_dir / "vids" / "1.mp4").read_bytes()
    (data_dir / "vids" / "cut.mp4").write_bytes(data[: len(data) // 3])  # a truncated mp4
    records = [sharegpt_row(), sharegpt_row("vids/none.mp4"), openai_row("vids/cut.mp4"), TEXT_ROW,
               sharegpt_row("https://example.com/v.mp4")]
    result = video_run(vl_dir, data_dir, records, "data.max_invalid_fraction=1.0")
    rejects = [json.loads(x) for x in (Path(result.path) / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in rejects] == [(1, "video_missing"), (2, "video_undecodable"),
                                                          (4, "video_missing")]
    assert "none.mp4" in rejects[0]["message"] and "web URL" in rejects[2]["message"]
    assert len(CacheReader(result.path)) == 2
    big, _ = encode(vl_dir, data_dir, sharegpt_row(), video=(("max_bytes", 1000),))
    assert isinstance(big, Reject) and big.reason == "video_too_large" and "data.video.max_bytes" in big.message


@pytest.fixture()
def video_cache(vl_dir, data_dir):
    records = [sharegpt_row(), TEXT_ROW, openai_row("vids/2.avi", "She is cooking."), sharegpt_row("vids/3.mp4")]
    return video_run(vl_dir, data_dir, records), records


def test_a_video_run_stores_the_processors_ids_the_full_checkpoints_states_and_positions_and_verifies(
        vl_dir, data_dir, video_cache):
    """Stored states within one bf16 step of AutoModelForImageTextToText's own forward on the processor's inputs
    (fp32), positions equal to its get_rope_index with the video grids, the videos/* tables, verify clean and
    verify --recompute exact."""
    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.read.verify import verify_cache
    from dspark_precompute.write.rerun.recompute import recompute

    result, records = video_cache
    cache = CacheReader(result.path)
    manifest = json.loads((Path(result.path) / "manifest.json").read_text())
    assert manifest["media"]["videos"] == 3 == manifest["media"]["samples_with_videos"]
    assert manifest["media"]["images"] == 0 and manifest["capture"]["target_part"]["loaded"] == "model"
    _, enc = encoder(vl_dir, data_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    rows = {int(r): k for k, r in enumerate(cache.source_row)}
    for row in (0, 2, 3):
        got = cache.sample(rows[row])
        ref_inputs = processor_inputs(enc.media.processor, data_dir, records[row])
        assert np.array_equal(got["input_ids"].numpy(), ref_inputs["input_ids"][0].numpy()), row
        with torch.no_grad():
            ref = model(**ref_inputs, output_hidden_states=True).hidden_states
            pos, _ = model.model.get_rope_index(input_ids=ref_inputs["input_ids"],
                                                mm_token_type_ids=ref_inputs["mm_token_type_ids"],
                                                video_grid_thw=ref_inputs["video_grid_thw"],
                                                attention_mask=ref_inputs["attention_mask"])
        want = torch.cat([ref[1][0], ref[2][0]], dim=-1)
        stored = got["target_hidden_states"].float()
        step = want.abs().clamp_min(2.0 ** -126) * 2.0 ** -7  # one bf16 step at each value
        assert stored.shape == want.shape and bool(((stored - want).abs() <= step).all()), row
        assert np.array_equal(got["position_ids"].numpy(), pos[:, 0, :].T.numpy()), row
        assert np.array_equal(cache.videos(rows[row])["grid_thw"], ref_inputs["video_grid_thw"].numpy())
    assert cache.videos(rows[1])["grid_thw"].shape == (0, 3)
    report = verify_cache(result.path)
    assert report.ok, report.format()
    rc = recompute(result.path, 4)
    assert not rc.problems and rc.recomputed == 4 and rc.exact == 4, (rc.problems, rc.notes)


def test_verify_catches_a_video_grid_that_disagrees_with_the_pad_count(vl_dir, data_dir, video_cache):
    import zarr

    from dspark_precompute.read.verify import verify_cache

    result, _ = video_cache
    grid = zarr.open_array(str(Path(result.path) / "videos" / "grid_thw"), mode="r+")
    g = grid[:]
    g[0, 0] += 1
    grid[:] = g
    report = verify_cache(result.path)
    assert not report.ok and "video pad tokens" in report.format(), report.format()


def test_every_export_refuses_the_video_rows_m_rope_moved_and_skip_image_rows_carries_the_text_row(
        vl_dir, data_dir, video_cache, tmp_path):
    """The video rows' positions are not 0, 1, 2, ... (M-RoPE over the frames): refused like image rows."""
    from dspark_precompute.errors import ExportError
    from dspark_precompute.read.export import EXPORT_MARKER, export

    result, _ = video_cache
    for to in ("nemo", "deepspec", "specforge", "speculators"):
        with pytest.raises(ExportError, match=r"3 of 4 samples with images or videos whose positions are not 0, 1"):
            export(result.path, tmp_path / to, to=to)
    export(result.path, tmp_path / "out", to="nemo", skip_image_rows=True)
    marker = json.loads((tmp_path / "out" / EXPORT_MARKER).read_text())
    assert marker["num_samples"] == 1 and marker["dropped_samples"] == {"holds_images": 3}


def test_a_video_run_stopped_after_a_unit_resumes_to_the_uninterrupted_cache(vl_dir, data_dir, monkeypatch):
    from dspark_precompute.contract.commits import committed_units
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.write.run import run

    records = [sharegpt_row(v, f"Answer {k}.") if k % 2 == 0 else TEXT_ROW
               for k, v in enumerate(("vids/1.mp4", "", "vids/2.avi", "", "vids/3.mp4"))]
    rows = data_dir / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in records))
    ref = run(compose(small(data_dir, f"model.path={vl_dir}", f"data.path={rows}", *UNITS, name="ref")))
    overrides = small(data_dir, f"model.path={vl_dir}", f"data.path={rows}", *UNITS, name="c")
    stopped_after_units(overrides, monkeypatch, 1)
    done = committed_units(CacheStore(data_dir / "c"))
    m = json.loads((data_dir / "c" / "manifest.json").read_text())
    assert 0 < len(done) < m["layout"]["num_units"]
    result = run(compose(overrides))
    assert result.complete and result.resumed_units == len(done)
    assert_same_cache(str(ref.path), str(data_dir / "c"))


def test_a_changed_video_refuses_the_resume_naming_the_media_hash(vl_dir, data_dir, monkeypatch):
    from dspark_precompute.errors import IncompatibleCacheError
    from dspark_precompute.write.run import run

    records = [sharegpt_row("vids/1.mp4", "One."), TEXT_ROW, sharegpt_row("vids/3.mp4", "Three.")]
    rows = data_dir / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = small(data_dir, f"model.path={vl_dir}", f"data.path={rows}", *UNITS, name="c")
    stopped_after_units(overrides, monkeypatch, 1)
    shutil.copyfile(data_dir / "vids" / "2.avi", data_dir / "vids" / "3.mp4")  # another video under its name
    with pytest.raises(IncompatibleCacheError, match="images_sha256"):
        run(compose(overrides))


def test_the_teacher_and_precision_checks_rerun_every_video_sample_and_a_changed_video_is_its_samples_problem(
        vl_dir, data_dir, video_cache):
    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.rerun.precision import precision_check
    from dspark_precompute.write.rerun.recompute import ImageFeed, recompute
    from dspark_precompute.write.rerun.teacher import teacher_check

    result, _ = video_cache
    cache = CacheReader(result.path)
    tokens = sum(len(cache.sample(s)["input_ids"]) for s in range(len(cache)))
    r = teacher_check(result.path, 10**9)
    # a tiny random model's near-ties: one bf16-stored position of 481 may flip its argmax (the check passes)
    assert r.problems == [] and r.samples == 4 and len(r.positions) == tokens and r.top1_agreement >= 0.99
    assert r.rel_error_mean < 0.005
    p = precision_check(result.path, 10**9)
    assert p.problems == [] and p.samples == 4 and p.positions == tokens
    assert all(e.rel_rms < 0.005 for e in p.arrays)
    with pytest.MonkeyPatch.context() as mp:  # the videos' pixels left out: the checks must see it
        mp.setattr(ImageFeed, "inputs", lambda *a, **k: None)
        assert teacher_check(result.path, 10**9).problems and precision_check(result.path, 10**9).problems
    shutil.copyfile(data_dir / "vids" / "1.mp4", data_dir / "vids" / "3.mp4")  # another video under its name
    rc = recompute(result.path, 4)
    rows = {int(r): k for k, r in enumerate(cache.source_row)}
    by = {p["sample"]: p["message"] for p in rc.problems}  # the four rows were one forward batch: none reruns
    assert sorted(by) == [0, 1, 2, 3] and rc.recomputed == 0
    assert "video 0" in by[rows[3]] and "changed since the cache was written" in by[rows[3]]
    assert all(f"holds sample {rows[3]}" in m for s, m in by.items() if s != rows[3])


def test_rows_with_videos_are_asked_with_each_video_inline_as_a_video_url_and_the_regenerated_rows_capture(
        vl_dir, data_dir):
    """regenerate=server sends a video as vLLM's OpenAI API takes it (a video_url part, the file's bytes in a
    data:video/mp4 URL; tested against the fake server only: no vLLM with torchvision runs here)."""
    import base64

    from fake_openai import Fake
    from test_regenerate import config, output_rows

    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.plan.regenerated import regenerate_stage
    from dspark_precompute.write.run import run

    rows = data_dir / "chat.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt_row(), TEXT_ROW, openai_row("vids/3.mp4"))))
    with Fake() as f:
        done, capture = regenerate_stage(config(data_dir, [f.url], rows, f"model.path={vl_dir}"))
        sent = [p["video_url"]["url"] for b in f.requests for m in b["messages"] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "video_url"]
    assert done.counts.regenerated == 3 and len(sent) == 2
    assert all(u.startswith("data:video/mp4;base64,") for u in sent)
    assert sorted(base64.b64decode(u.split(",", 1)[1]) for u in sent) == sorted(
        (data_dir / "vids" / v).read_bytes() for v in ("1.mp4", "3.mp4"))
    named = [p["video"] for r in output_rows(data_dir) for m in r["messages"] if isinstance(m["content"], list)
             for p in m["content"] if p["type"] == "video"]
    assert [Path(v).name for v in named] == ["1.mp4", "3.mp4"] and all(Path(v).is_absolute() for v in named)
    result = run(compose([*small(data_dir, f"model.path={vl_dir}", "seq_length=1024"),
                          f"data.path={capture.data.path}"]))
    assert result.complete and len(CacheReader(result.path).videos(0)["sha256"]) == 1


def test_a_video_row_through_a_tiny_qwen3_5_equals_its_own_forward_ids_mask_and_rope_index(
        data_dir, tmp_path_factory):
    """Qwen3.5 (Qwen3.6's architecture: Gated DeltaNet and attention layers) ships Qwen3-VL's processor."""
    from dspark_precompute.write.target.capture import HiddenStateCapture

    d = tmp_path_factory.mktemp("tiny_qwen3_5")
    save_image_text_checkpoint("qwen3_5", d)
    e, enc = encode(d, data_dir, sharegpt_row("vids/2.avi"))
    assert isinstance(e, Encoded), getattr(e, "message", None)
    ref_inputs = processor_inputs(enc.media.processor, data_dir, sharegpt_row("vids/2.avi"))
    assert np.array_equal(e.input_ids, ref_inputs["input_ids"][0].numpy())
    vt = enc.media.vision
    first = int(np.flatnonzero(np.isin(e.input_ids, sorted(vt.starts)))[0])
    last = int(np.flatnonzero(np.isin(e.input_ids, sorted(vt.ends)))[-1])
    assert not e.loss_mask[first:last + 1].any() and e.loss_mask.sum() > 0
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(**ref_inputs, output_hidden_states=True).hidden_states
        pos, _ = model.model.get_rope_index(input_ids=ref_inputs["input_ids"],
                                            mm_token_type_ids=ref_inputs["mm_token_type_ids"],
                                            video_grid_thw=ref_inputs["video_grid_thw"],
                                            attention_mask=ref_inputs["attention_mask"])
    assert np.array_equal(e.position_ids, pos[:, 0, :].T.numpy())
    n = len(ref) - 1
    ids = torch.from_numpy(e.input_ids.astype(np.int64))[None]
    with HiddenStateCapture(model, [0, n - 1], media=True) as cap:
        states, _ = cap(ids, media=enc.media.pixel_inputs(e.images, e.input_ids))
    for lid in (0, n - 1):
        stored, want = states[lid].to(torch.bfloat16).float(), ref[lid + 1]
        step = want.abs().clamp_min(2.0 ** -126) * 2.0 ** -7  # one bf16 step at each value
        assert stored.shape == want.shape and bool(((stored - want).abs() <= step).all()), lid


def test_a_dry_run_of_rows_with_videos_counts_the_tables_files_and_positions_a_real_run_writes(vl_dir, data_dir):
    """The oracle: the real run's cache (its files on disk, the videos/* tables' shapes, position_ids' chunks)."""
    import dataclasses

    from test_dry_run import assert_inventory_matches, assert_plan_matches

    from dspark_precompute.write.dryrun import dry_run
    from dspark_precompute.write.run import run

    rows = data_dir / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt_row(), TEXT_ROW, openai_row("vids/2.avi"))))
    cfg = compose(small(data_dir, f"model.path={vl_dir}", f"data.path={rows}", "seq_length=4096",
                        "batch.max_tokens=8192", "model.layer_ids=[0,1]"))
    result = run(cfg)
    plan = dry_run(dataclasses.replace(cfg, dry_run=True))
    assert_plan_matches(plan, result.path)
    assert_inventory_matches(plan, result)
    assert plan.images == 0 and plan.videos == 2 and plan.image_table_bytes == 2 * (8 + 3 * 4 + 32)
    assert "(0 images, 2 videos)" in dict(plan.rows())["other files"]


def test_a_processor_whose_video_expansion_is_not_the_videos_pads_and_inserted_tokens_is_a_template_error(
        vl_dir, data_dir):
    """The render check allows inside a video's span only its grid's pads and what the processor inserts between
    them: a pad short, or an image pad inside it, and the row is a template_error reject."""
    spec, enc = encoder(vl_dir, data_dir)
    processor = enc.media.processor
    vt = enc.media.vision
    own = type(processor).__call__
    for bad in ("one pad short", "an image pad inside"):
        def altered(self, *a, _bad=bad, **k):
            out = own(self, *a, **k)
            ids = out["input_ids"]
            at = int((ids[0] == vt.video).nonzero()[0])
            if _bad == "one pad short":
                out["input_ids"] = torch.cat([ids[:, :at], ids[:, at + 1:]], dim=1)
            else:
                ids[0, at] = vt.image
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(processor), "__call__", altered)
            e = spec.encode(enc, RawRow(0, 1, record=sharegpt_row(), file="rows.jsonl"), 0)
        assert isinstance(e, Reject) and e.reason == "template_error" and "video pads" in e.message, bad
    assert isinstance(spec.encode(enc, RawRow(0, 1, record=sharegpt_row(), file="rows.jsonl"), 0), Encoded)
