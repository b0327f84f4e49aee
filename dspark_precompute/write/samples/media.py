"""A conversation with images or videos -> a sample: the chat template's render and mask, the images and videos
read, the processor's expansion, and a truncation that never splits an image or a video.

The mask comes from the same rules as text rows (the render with one pad per image or video); the processor then
repeats each image pad once per merged patch and replaces each video pad by its frames' pads (with the timestamps
and markers it inserts), and every vision token and everything inserted for a video gets mask 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.spec import (
    IMAGE_GRID,
    IMAGE_SAMPLE,
    IMAGE_SHA256,
    VIDEO_GRID,
    VIDEO_SAMPLE,
    VIDEO_SHA256,
)
from dspark_precompute.errors import DataError
from dspark_precompute.write.config.schema import DataConfig, ImageConfig, VideoConfig
from dspark_precompute.write.samples.chat import ChatEncoder, Encoded
from dspark_precompute.write.samples.files import resolve_source as resolve_data_source
from dspark_precompute.write.samples.images import (
    LoadedImage,
    LoadedVideo,
    MediaProblem,
    SampleImages,
    VisionTokens,
    content_sha256,
    expand,
    fitting_media,
    image_base,
    image_sources,
    load_image,
    load_processor,
    load_video,
    resolve_source,
    video_sources,
    without_sources,
)
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import iter_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaSpec:
    """How image rows are read: the checkpoint whose processor expands them, and the pixel limits (picklable)."""

    model_dir: str
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_input_pixels: int | None = None
    position_axes: int = 0  # the model's rotary position axes (3: Qwen's M-RoPE); 0: no multi-axis positions
    image_token_id: int = -1  # set by :func:`described` from the processor
    vision_token_ids: tuple[int, ...] = ()
    spatial_merge_size: int = 1  # patches merged per side into one image pad
    video: tuple[tuple[str, Any], ...] = ()  # data.video's keys set (VideoConfig.identity())
    video_token_id: int = -1  # set by :func:`described`: the video pad (-1: no video processor runs)

    def pixels(self) -> dict[str, int]:
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}

    def video_keys(self) -> dict[str, Any]:
        """The video processor's keys of ``data.video`` (fps, frames, pixels)."""
        keys = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "cap_pixels_per_frame")
        return {k: v for k, v in self.video if k in keys}


class MediaEncoder:
    """Encodes conversations with images and videos with a :class:`ChatEncoder` and the checkpoint's processor."""

    def __init__(self, chat: ChatEncoder, spec: MediaSpec):
        self.chat, self.spec = chat, spec
        self.processor = load_processor(Path(spec.model_dir), chat.tokenizer, chat.template, spec.pixels(),
                                        spec.video_keys())
        self.vision = VisionTokens.of(self.processor)

    def images(self, conv: Conversation, base: Path | None) -> list[LoadedImage]:
        """The conversation's images, read and decoded (a bad one raises :class:`MediaProblem`)."""
        return [load_image(s, base, self.spec.max_input_pixels) for s in image_sources(conv.messages)]

    def video(self, source: str, base: Path | None) -> LoadedVideo:
        """One video, read, hashed and decoded to the frames the video processor samples."""
        vp = getattr(self.processor, "video_processor", None)
        if vp is None:
            from dspark_precompute.contract.vocab import RejectReason
            from dspark_precompute.write.samples.images import video_problem

            raise MediaProblem(RejectReason.VIDEO_UNSUPPORTED, f"video {source!r}: " + (
                video_problem() or f"the checkpoint {self.spec.model_dir} has no video processor "
                                   "(video_preprocessor_config.json)"))
        keys = dict(self.spec.video)
        return load_video(source, base, vp, keys.get("max_bytes"), keys.get("max_input_frames"))

    def videos(self, conv: Conversation, base: Path | None) -> list[LoadedVideo]:
        """The conversation's videos, read and decoded (a bad one raises :class:`MediaProblem`)."""
        return [self.video(s, base) for s in video_sources(conv.messages)]

    def encode(self, conv: Conversation, base: Path | None, row: int = -1) -> Encoded | Reject:
        """The sample of a conversation with images (relative paths resolve against ``base``), or a reject."""
        try:
            loaded = self.images(conv, base)
            clips = self.videos(conv, base)
        except MediaProblem as exc:
            return Reject(row, exc.reason, str(exc))
        bare = Conversation(without_sources(conv.messages), conv.tools, media=True)
        out = self.chat.render_with_mask(bare, row)
        if isinstance(out, Reject):
            return out
        full, ids, mask = out
        try:
            ex = expand(self.processor, full, ids, mask, loaded, clips)
        except MediaProblem as exc:
            return Reject(row, exc.reason, str(exc))
        n_img, n_vid, cut = fitting_media(ex.spans, self.chat.seq_length)
        enc = self.chat.finish(ex.input_ids, ex.loss_mask, len(ex.input_ids), row, cut)
        if isinstance(enc, Reject):
            return enc
        sources = tuple(resolve_source(s, base) for s in image_sources(conv.messages))[:n_img]
        vsources = tuple(resolve_source(s, base) for s in video_sources(conv.messages))[:n_vid]
        enc.images = SampleImages(sources, tuple(i.sha256 for i in loaded[:n_img]), ex.image_grid_thw[:n_img],
                                  vsources, tuple(v.sha256 for v in clips[:n_vid]), ex.video_grid_thw[:n_vid])
        if self.spec.position_axes:
            enc.position_ids = rope_positions(self.spec.model_dir, enc.input_ids, self.vision.image,
                                              enc.images.grid_thw, self.vision.video, enc.images.video_grid_thw)
        return enc

    def pixel_inputs(self, images: SampleImages, input_ids: Any) -> dict[str, Any]:
        """The forward's image and video inputs of a sample (``pixel_values``, ``image_grid_thw``,
        ``pixel_values_videos``, ``video_grid_thw``, ``mm_token_type_ids``: 1 on image pads and 2 on video pads, as
        the processor gives them), from its images and videos read again.

        A sample keeps references, not pixels (a row's pixel values weigh megabytes); an image that changed since
        tokenizing gives another grid and is refused here.
        """
        import torch

        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
        got: dict[str, Any] = {"mm_token_type_ids": token_types(ids, self.vision.image, self.vision.video)}
        if images.sources:
            loaded = [load_image(s, None, self.spec.max_input_pixels) for s in images.sources]
            if tuple(i.sha256 for i in loaded) != images.sha256:
                raise MediaProblem("image_changed", f"an image of {list(images.sources)} changed since the row was "
                                   "tokenized; rerun from the start")
            out = self.processor.image_processor(images=[i.image for i in loaded], return_tensors="pt")
            got.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        if images.video_sources:
            clips = [self.video(s, None) for s in images.video_sources]
            if tuple(v.sha256 for v in clips) != images.video_sha256:
                raise MediaProblem("video_changed", f"a video of {list(images.video_sources)} changed since the row "
                                   "was tokenized; rerun from the start")
            out = self.processor.video_processor(videos=[v.frames for v in clips],
                                                 video_metadata=[v.metadata for v in clips], do_sample_frames=False,
                                                 return_tensors="pt")
            if not np.array_equal(out["video_grid_thw"].numpy(), np.asarray(images.video_grid_thw).reshape(-1, 3)):
                raise MediaProblem("video_changed", f"a video of {list(images.video_sources)} gives other grids than "
                                   "when the row was tokenized; rerun from the start")
            got.update(pixel_values_videos=out["pixel_values_videos"], video_grid_thw=out["video_grid_thw"])
        return got


@dataclass
class MediaInputs:
    """The forward's image inputs: the samples with images (their references, from tokenizing) and the encoder
    whose processor turns them into pixels, one batch at a time (a row's pixels are never kept)."""

    images: dict[int, SampleImages]
    encoder: MediaEncoder

    def of_batch(self, batch: Any, ids_of: Any, width: int) -> dict[str, Any] | None:
        """The forward inputs of a right-padded batch (``width`` tokens a row) of text and image samples: the image
        rows' pixels and grids concatenated in batch order (the model scatters its image features over the image
        pads row after row), ``mm_token_type_ids`` one padded row per sample (0 on text rows and padding); None
        when no sample holds an image."""
        import torch

        rows = [(r, self.of(int(s), ids_of[int(s)])) for r, s in enumerate(batch)]
        mine = [(r, x) for r, x in rows if x is not None]
        if not mine:
            return None
        types = torch.zeros((len(rows), width), dtype=torch.int64)
        for r, x in mine:
            types[r, :x["mm_token_type_ids"].shape[1]] = x["mm_token_type_ids"][0]
        out: dict[str, Any] = {"mm_token_type_ids": types}
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            parts = [x[key] for _, x in mine if key in x]
            if parts:
                out[key] = torch.cat(parts)
        return out

    def of(self, sample: int, input_ids: Any) -> dict[str, Any] | None:
        """Sample ``sample``'s forward inputs beside its ids; None for a text sample."""
        refs = self.images.get(int(sample))
        if refs is None:
            return None
        try:
            return self.encoder.pixel_inputs(refs, input_ids)
        except MediaProblem as exc:
            raise DataError(f"sample {sample}: {exc}") from None


@cache
def _rope_model(model_dir: str) -> Any | None:
    """The checkpoint's inner ``model`` built on the meta device from its config (no weights, no memory), kept once
    per process: its ``get_rope_index`` is the multi-axis position rule the full model's forward applies. None when
    the model has none (one position axis: the language model's own arange)."""
    import json

    import torch
    from transformers import AutoConfig

    from dspark_precompute.write.target.image_text import checkpoint_class, image_text_class_name

    name = image_text_class_name(json.loads((Path(model_dir) / "config.json").read_text()))
    if name is None:
        return None
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        inner = getattr(checkpoint_class(name)(config), "model", None)
    return inner if callable(getattr(inner, "get_rope_index", None)) else None


def token_types(ids: Any, image: int, video: int = -1) -> Any:
    """``mm_token_type_ids`` as transformers' processors give them: 1 on image pads, 2 on video pads, else 0."""
    import torch

    types = (ids == image).to(torch.int64)
    if video >= 0:
        types = types + 2 * (ids == video).to(torch.int64)
    return types


def rope_positions(model_dir: str, input_ids: Any, image: int, grid_thw: Any, video: int = -1,
                   video_grid_thw: Any = None) -> np.ndarray | None:
    """The positions (int32 [T, axes]) the full model's forward gives its language model for these ids and the
    grids of the images and videos they hold (``mm_token_type_ids`` 1 on image pads and 2 on video pads, as
    :meth:`MediaEncoder.pixel_inputs` passes them); None when the model has no multi-axis positions."""
    import torch

    model = _rope_model(model_dir)
    if model is None:
        return None
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
    grid = torch.as_tensor(np.asarray(grid_thw, dtype=np.int64)).reshape(-1, 3)
    vgrid = torch.as_tensor(np.asarray(video_grid_thw if video_grid_thw is not None else np.zeros((0, 3)),
                                       dtype=np.int64)).reshape(-1, 3)
    kwargs = {"video_grid_thw": vgrid} if len(vgrid) else {}
    pos, _ = model.get_rope_index(input_ids=ids, mm_token_type_ids=token_types(ids, image, video),
                                  image_grid_thw=grid if len(grid) else None, attention_mask=torch.ones_like(ids),
                                  **kwargs)
    return np.ascontiguousarray(pos[:, 0, :].T.numpy().astype(np.int32))


def described(spec: MediaSpec, tokenizer: Any, template: str) -> MediaSpec:
    """``spec`` with what the manifest records of it: the vision token ids (from the processor), the patches merged
    per side, and the position axes of the model's ``get_rope_index`` (0 without one), probed on one text token."""
    processor = load_processor(Path(spec.model_dir), tokenizer, template, spec.pixels(), spec.video_keys())
    vision = VisionTokens.of(processor)
    merge = int(getattr(processor.image_processor, "merge_size", None) or 1)
    probe = rope_positions(spec.model_dir, [0], vision.image, np.zeros((0, 3), dtype=np.int64))  # one text token
    video = vision.video if getattr(processor, "video_processor", None) is not None else -1
    return replace(spec, position_axes=0 if probe is None else int(probe.shape[1]), image_token_id=vision.image,
                   vision_token_ids=tuple(sorted(vision.markers)), spatial_merge_size=merge, video_token_id=video)


def _table(images: dict[int, SampleImages], video: bool, names: tuple[str, str, str]) -> dict[str, np.ndarray]:
    def pick(im: SampleImages) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray]:
        return (im.video_sources, im.video_sha256, im.video_grid_thw) if video else (im.sources, im.sha256,
                                                                                   im.grid_thw)

    order = sorted(s for s, im in images.items() if pick(im)[0])
    sample = [s for s in order for _ in pick(images[s])[0]]
    grids = [np.asarray(pick(images[s])[2], dtype=np.int64).reshape(-1, 3) for s in order]
    shas = [bytes.fromhex(h) for s in order for h in pick(images[s])[1]]
    return {names[0]: np.asarray(sample, dtype=np.int64),
            names[1]: (np.concatenate(grids) if grids else np.zeros((0, 3))).astype(np.int32),
            names[2]: np.frombuffer(b"".join(shas), dtype=np.uint8).reshape(-1, 32).copy()}


def image_tables(images: dict[int, SampleImages]) -> dict[str, np.ndarray]:
    """The per-image tables of an image cache, in sample order: each image's sample, grid and content sha256; and
    the per-video tables (``videos/*``, the same columns) when a sample keeps a video."""
    out = _table(images, False, (IMAGE_SAMPLE, IMAGE_GRID, IMAGE_SHA256))
    if any(im.video_sources for im in images.values()):
        out.update(_table(images, True, (VIDEO_SAMPLE, VIDEO_GRID, VIDEO_SHA256)))
    return out


def media_inputs(encoder: ChatEncoder, encoded: dict[int, Encoded]) -> MediaInputs | None:
    """The image inputs of the tokenized samples ``encoded`` (None when none holds an image)."""
    images = {s: e.images for s, e in encoded.items() if e.images is not None and e.images.any}
    if not images or encoder.media is None:
        return None
    return MediaInputs(images, encoder.media)


def media_spec_for(model_dir: Path | None, image: ImageConfig, video: VideoConfig | None = None
                   ) -> MediaSpec | None:
    """The media spec of an image-text checkpoint (``vision_config``, ``preprocessor_config.json``), else None."""
    import json

    if model_dir is None or not (model_dir / "preprocessor_config.json").is_file():
        return None
    try:
        cdict = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cdict, dict) or not isinstance(cdict.get("vision_config"), dict):
        return None
    return MediaSpec(str(model_dir), image.min_pixels, image.max_pixels, image.max_input_pixels,
                     video=tuple(sorted((video or VideoConfig()).identity().items())))


def images_sha256(data: DataConfig, root: str | None) -> str:
    """One sha256 over every image and video the selection's rows name (source and content hash, in row order);
    "" when none.

    Part of the data identity: a changed (or vanished) image or video refuses a resume like a changed row. Each
    file is read once (a source named twice is hashed once). A row's videos follow its images, each line marked
    ``video``, so a cache of images alone keeps the hash it had before videos were read.
    """
    import hashlib

    digest, seen, count = hashlib.sha256(), dict[str, str](), 0
    for raw in iter_rows(resolve_data_source(data.path), data):
        conv = normalize(raw, data.format, media=True)
        if not isinstance(conv, Conversation) or not conv.media:
            continue
        base = image_base(root, raw.file)
        for source in image_sources(conv.messages):
            where = resolve_source(source, base)
            if where not in seen:
                seen[where] = content_sha256(where)
            digest.update(f"{raw.row}\t{where if not where.startswith('data:') else 'data:'}\t{seen[where]}\n"
                          .encode())
            count += 1
        for source in video_sources(conv.messages):
            where = resolve_source(source, base)
            if where not in seen:
                seen[where] = content_sha256(where)
            digest.update(f"video\t{raw.row}\t{where}\t{seen[where]}\n".encode())
            count += 1
    return digest.hexdigest() if count else ""
