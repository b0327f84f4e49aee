"""Rows with images: their image references in both forms users have, the images read and hashed, and the
checkpoint's own processor expanding the placeholders into the ids the target sees.

Two row forms carry images:

- OpenAI content parts: ``{"type": "image_url", "image_url": {"url": U}}`` (or ``"image_url": U``) and
  ``{"type": "image", "image": U}`` (also ``"url"``/``"path"``), where ``U`` is a path, a ``file://`` URL or a
  ``data:image/...;base64,`` URL;
- LLaMA-Factory/ShareGPT: ``<image>`` placeholders in the text and an ``images`` list, in placeholder order.

A relative path resolves against the folder of the data file holding the row. Both forms become content parts
``{"type": "image"}`` in place (what the chat templates of Qwen2-VL .. Qwen3.6 render as their vision markers),
and the row's image sources, in order, ride along with the conversation. The processor (the checkpoint's
``AutoImageProcessor`` with its tokenizer and chat template, :func:`load_processor`) then expands each image pad
into as many pads as the image has merged patches; the loss mask is 0 on every vision token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from dspark_precompute.contract.vocab import RejectReason

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IMAGE_PART_TYPES = ("image_url", "image")
VIDEO_PART_TYPES = ("video_url", "video")
MAX_IMAGE_BYTES = 64 << 20  # an image file larger than this is an image_too_large reject, never decoded
MAX_DECODED_PIXELS = 1 << 28  # and one whose header claims more pixels (a decompression bomb) too

MAX_VIDEO_BYTES = 256 << 20  # data.video.max_bytes's default
MAX_VIDEO_FRAMES = 100_000  # data.video.max_input_frames's default

VIDEO_REFUSAL = ("video rows need a video processor, and transformers' video processors need `torchvision` "
                 "(pip install torchvision matching the installed torch, and PyAV to decode: "
                 "pip install 'dspark-precompute[video]'); without them they are refused")


def video_problem() -> str | None:
    """Why video rows cannot be read in this environment (torchvision or PyAV missing), or None."""
    import importlib.util

    missing = [name for mod, name in (("torchvision", "torchvision"), ("av", "PyAV (av)"))
               if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    return (f"video rows need {' and '.join(missing)}, absent here: transformers' video processors need "
            "`torchvision` (a build matching the installed torch, e.g. pip install torch==2.14.1 torchvision==0.29.1) "
            "and decoding needs PyAV (pip install 'dspark-precompute[video]'); without them they are refused")


class MediaProblem(Exception):
    """A row's image (or video) that cannot be used: becomes a reject with ``reason``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LoadedImage:
    """One decoded image: the PIL image (RGB), the sha256 of its bytes, and where it came from."""

    image: Any
    sha256: str
    source: str  # as the row gave it (a data: URL shortened)


@dataclass(frozen=True)
class LoadedVideo:
    """One decoded video: its frames as the video processor samples them (uint8 [F, H, W, 3]), their metadata
    (the sampled frame indices, the stream's fps: the processor's timestamps come from them), the sha256 of the
    file's bytes, and where it came from."""

    frames: Any
    metadata: Any
    sha256: str
    source: str


def _part_url(part: dict[str, Any]) -> Any:
    value = part.get(part["type"], part.get("url", part.get("path")))
    if isinstance(value, dict):
        value = value.get("url", value.get("path"))
    return value


def split_placeholders(text: str, images: list[Any], videos: list[Any], where: str,
                       used: list[int]) -> list[dict[str, Any]]:
    """A ShareGPT text with ``<image>``/``<video>`` placeholders as content parts; ``used`` counts them (images,
    videos). A ``<video>`` where no video processor can run (:func:`video_problem`) is a video_unsupported
    reject."""
    parts: list[dict[str, Any]] = []
    for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", text):
        if piece == IMAGE_PLACEHOLDER:
            if used[0] >= len(images):
                raise MediaProblem(RejectReason.IMAGE_MISSING, f"{where} has more {IMAGE_PLACEHOLDER} placeholders "
                                   f"than the row's 'images' list holds ({len(images)})")
            parts.append({"type": "image", "image": images[used[0]]})
            used[0] += 1
        elif piece == VIDEO_PLACEHOLDER:
            if (problem := video_problem()) is not None:
                raise MediaProblem(RejectReason.VIDEO_UNSUPPORTED, f"{where} holds a {VIDEO_PLACEHOLDER}: {problem}")
            if used[1] >= len(videos):
                raise MediaProblem(RejectReason.VIDEO_MISSING, f"{where} has more {VIDEO_PLACEHOLDER} placeholders "
                                   f"than the row's 'videos' list holds ({len(videos)})")
            parts.append({"type": "video", "video": videos[used[1]]})
            used[1] += 1
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def content_parts(value: list[Any], where: str) -> list[dict[str, Any]]:
    """OpenAI content parts with images as ``{"type": "image", "image": source}`` and videos as ``{"type": "video",
    "video": source}`` (where a video processor can run); other non-text parts refused."""
    out: list[dict[str, Any]] = []
    for part in value:
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            url = _part_url(part)
            if not isinstance(url, str) or not url:
                raise MediaProblem(RejectReason.IMAGE_MISSING, f"{where} has an {kind!r} part without a url")
            out.append({"type": "image", "image": url})
        elif kind in VIDEO_PART_TYPES:
            if (problem := video_problem()) is not None:
                raise MediaProblem(RejectReason.VIDEO_UNSUPPORTED, f"{where} has a {kind!r} part: {problem}")
            url = _part_url(part)
            if not isinstance(url, str) or not url:
                raise MediaProblem(RejectReason.VIDEO_MISSING, f"{where} has a {kind!r} part without a url")
            out.append({"type": "video", "video": url})
        else:
            raise MediaProblem(RejectReason.NON_TEXT_CONTENT, f"{where} has a non-text part ({kind!r})")
    return out


def has_media(value: Any) -> bool:
    """Whether message content holds an image or video part (text-only content stays a string)."""
    return isinstance(value, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                           + VIDEO_PART_TYPES for p in value)


def _short(source: str) -> str:
    return source if not source.startswith("data:") or len(source) < 80 else source[:60] + "...(data URL)"


def _read_bytes(source: str, base: Path | None) -> bytes:
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            return unquote(payload).encode("latin-1")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaProblem(RejectReason.IMAGE_UNDECODABLE, f"image {_short(source)!r}: its base64 payload "
                               f"does not decode ({exc})") from None
    parsed = urlparse(source)
    if parsed.scheme in ("http", "https"):
        raise MediaProblem(RejectReason.IMAGE_MISSING, f"image {source!r} is a web URL; this tool reads no network: "
                           "download the images and give their paths")
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(source)
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise MediaProblem(RejectReason.IMAGE_TOO_LARGE, f"image {source!r} ({path}) holds {size} bytes, more "
                               f"than {MAX_IMAGE_BYTES}; shrink it")
        return path.read_bytes()
    except OSError as exc:
        raise MediaProblem(RejectReason.IMAGE_MISSING, f"image {source!r} cannot be read at {path} ({exc.strerror}); "
                           "a relative path resolves against the folder of the data file") from None


def load_image(source: str, base: Path | None, max_pixels: int | None = None) -> LoadedImage:
    """Read, hash and decode one image; a missing, undecodable or oversized one raises :class:`MediaProblem`.

    ``max_pixels``: the most pixels (width x height) an input image may have before it is resized
    (``data.image.max_input_pixels``); the processor's own resize limits apply after.
    """
    from PIL import Image

    data = _read_bytes(source, base)
    digest = hashlib.sha256(data).hexdigest()
    try:
        with Image.open(io.BytesIO(data)) as probe:
            w, h = probe.size
            if w * h > (max_pixels or MAX_DECODED_PIXELS):
                raise MediaProblem(RejectReason.IMAGE_TOO_LARGE, f"image {_short(source)!r} is {w}x{h} pixels, "
                                   f"more than {max_pixels or MAX_DECODED_PIXELS}; shrink it or raise "
                                   "data.image.max_input_pixels")
            image = probe.convert("RGB")
    except MediaProblem:
        raise
    except Exception as exc:  # PIL raises several types for bad bytes
        raise MediaProblem(RejectReason.IMAGE_UNDECODABLE, f"image {_short(source)!r} does not decode as an image "
                           f"({type(exc).__name__}: {exc})") from None
    return LoadedImage(image, digest, _short(source))


def image_sources(messages: list[dict[str, Any]]) -> list[str]:
    """A conversation's image sources, in render order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image"]


def video_sources(messages: list[dict[str, Any]]) -> list[str]:
    """A conversation's video sources, in render order."""
    return [p["video"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "video"]


def without_sources(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with image and video parts as bare ``{"type": "image"}``/``{"type": "video"}`` (what the chat
    template renders)."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {**m, "content": [{"type": p["type"]} if p.get("type") in ("image", "video") else p
                                  for p in m["content"]]}
        out.append(m)
    return out


def _video_path(source: str, base: Path | None) -> Path:
    if source.startswith("data:"):
        raise MediaProblem(RejectReason.VIDEO_MISSING, f"video {_short(source)!r} is a data: URL; videos are read "
                           "from files: give its path")
    parsed = urlparse(source)
    if parsed.scheme in ("http", "https"):
        raise MediaProblem(RejectReason.VIDEO_MISSING, f"video {source!r} is a web URL; this tool reads no network: "
                           "download the videos and give their paths")
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(source)
    return path if path.is_absolute() or base is None else base / path


def load_video(source: str, base: Path | None, video_processor: Any, max_bytes: int | None = None,
               max_frames: int | None = None) -> LoadedVideo:
    """Read, hash and decode one video (PyAV), keeping the frames ``video_processor`` samples (its fps and
    min/max frames); a missing, undecodable or oversized one raises :class:`MediaProblem`.

    ``max_bytes`` / ``max_frames``: ``data.video.max_bytes`` / ``max_input_frames``, checked before decoding.
    """
    path = _video_path(source, base)
    limit = max_bytes or MAX_VIDEO_BYTES
    try:
        size = path.stat().st_size
        if size > limit:
            raise MediaProblem(RejectReason.VIDEO_TOO_LARGE, f"video {source!r} ({path}) holds {size} bytes, more "
                               f"than {limit}; shrink it or raise data.video.max_bytes")
        data = path.read_bytes()
    except OSError as exc:
        raise MediaProblem(RejectReason.VIDEO_MISSING, f"video {source!r} cannot be read at {path} ({exc.strerror}); "
                           "a relative path resolves against the folder of the data file") from None
    digest = hashlib.sha256(data).hexdigest()
    import av
    from transformers.video_utils import load_video as decode

    try:
        with av.open(io.BytesIO(data)) as probe:
            count = int(probe.streams.video[0].frames)
        if count > (max_frames or MAX_VIDEO_FRAMES):
            raise MediaProblem(RejectReason.VIDEO_TOO_LARGE, f"video {source!r} holds {count} frames, more than "
                               f"{max_frames or MAX_VIDEO_FRAMES}; shorten it or raise data.video.max_input_frames")
        frames, metadata = decode(str(path), backend="pyav",  # type: ignore[arg-type]
                                  sample_indices_fn=video_processor.sample_frames)
        if len(frames) == 0:
            raise ValueError("no frame decodes")
    except MediaProblem:
        raise
    except Exception as exc:  # PyAV and the sampler raise several types for bad bytes
        raise MediaProblem(RejectReason.VIDEO_UNDECODABLE, f"video {source!r} does not decode as a video "
                           f"({type(exc).__name__}: {exc})") from None
    return LoadedVideo(frames, metadata, digest, source)


# ---- the checkpoint's processor ---------------------------------------------------------------------


def video_processor_of(model_dir: Path, video: dict[str, Any] | None = None) -> Any | None:
    """The checkpoint's ``AutoVideoProcessor`` with ``video`` (``fps``, ``min_frames``, ``max_frames``,
    ``min_pixels``/``max_pixels`` as its ``size`` bounds, ``cap_pixels_per_frame``) over its own settings; None
    where none can run (no torchvision or PyAV: :func:`video_problem`, or the checkpoint has no
    ``video_preprocessor_config.json``)."""
    if video_problem() is not None or not (model_dir / "video_preprocessor_config.json").is_file():
        return None
    from transformers import AutoVideoProcessor

    v = {k: x for k, x in (video or {}).items() if x is not None}
    kwargs: dict[str, Any] = {k: v[k] for k in ("fps", "min_frames", "max_frames", "cap_pixels_per_frame") if k in v}
    if "min_pixels" in v or "max_pixels" in v:
        own = AutoVideoProcessor.from_pretrained(model_dir).size  # type: ignore[no-untyped-call]
        kwargs["size"] = {"shortest_edge": v.get("min_pixels", own.shortest_edge),
                          "longest_edge": v.get("max_pixels", own.longest_edge)}
    return AutoVideoProcessor.from_pretrained(model_dir, **kwargs)  # type: ignore[no-untyped-call]


def load_processor(model_dir: Path, tokenizer: Any, chat_template: str, pixels: dict[str, int] | None = None,
                   video: dict[str, Any] | None = None) -> Any:
    """The checkpoint's processor: its ``AutoImageProcessor`` (the PIL one without torchvision), its video
    processor where one can run (:func:`video_processor_of`), the tokenizer and chat template, in the processor
    class ``processor_config.json`` names.

    transformers builds video processors with torchvision only; without it the processor is built without one
    (video rows are then refused, :func:`video_problem`). ``pixels``: the image processor's
    ``min_pixels``/``max_pixels`` (``data.image``), None keeps the checkpoint's; ``video``: ``data.video``'s
    processor keys.
    """
    import json

    import transformers
    from transformers import AutoImageProcessor

    kwargs = {k: v for k, v in (pixels or {}).items() if v is not None}
    image_processor = AutoImageProcessor.from_pretrained(model_dir, **kwargs)  # type: ignore[no-untyped-call]
    name = "Qwen3VLProcessor"
    cfg = model_dir / "processor_config.json"
    if cfg.is_file():
        name = json.loads(cfg.read_text()).get("processor_class", name)
    base = getattr(transformers, name, None)
    if base is None:
        raise MediaProblem(RejectReason.TEMPLATE_ERROR, f"processor_class {name!r} of {model_dir} is not in this "
                           "transformers")

    class _ImagesOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    attrs = base.get_attributes()
    parts = {"image_processor": image_processor, "tokenizer": tokenizer,
             "video_processor": video_processor_of(model_dir, video) if "video_processor" in attrs else None}
    return _ImagesOnly(**{a: parts.get(a) for a in attrs}, chat_template=chat_template)


@dataclass(frozen=True)
class VisionTokens:
    """A processor's vision token ids: the image and video pads that expand, and the markers around them."""

    image: int
    markers: frozenset[int]  # every vision token id (pads, start/end): loss mask 0
    video: int = -1  # the video pad (-1: the processor has none)
    starts: frozenset[int] = frozenset()  # the start markers (<|vision_start|>)
    ends: frozenset[int] = frozenset()  # the end markers (<|vision_end|>)

    @classmethod
    def of(cls, processor: Any) -> VisionTokens:
        tok = processor.tokenizer

        def known(name: Any) -> int | None:
            if not isinstance(name, str):
                return None
            i = tok.convert_tokens_to_ids(name)
            return int(i) if isinstance(i, int) and i != tok.unk_token_id else None

        image = int(getattr(processor, "image_token_id", None) or tok.convert_tokens_to_ids(processor.image_token))
        video = getattr(processor, "video_token_id", None)
        video = int(video) if isinstance(video, int) else known(getattr(processor, "video_token", None))
        if video is None:
            video = known("<|video_pad|>")
        starts = {known(getattr(o, "vision_start_token", None)) for o in (processor, tok)} | {known("<|vision_start|>")}
        ends = {known(getattr(o, "vision_end_token", None)) for o in (processor, tok)} | {known("<|vision_end|>")}
        starts.discard(None)
        ends.discard(None)
        ids = {i for i in (*starts, *ends, video, image) if i is not None}
        return cls(image, frozenset(ids), -1 if video is None else video, frozenset(starts),  # type: ignore[arg-type]
                   frozenset(ends))  # type: ignore[arg-type]


@dataclass
class Expanded:
    """A row's ids after the processor's expansion, with its mask, its image and video tables, and where each
    image or video lies."""

    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # uint8 [T]
    image_grid_thw: np.ndarray  # int64 [n_images, 3]
    pixel_values: Any  # the processor's tensor, for the forward
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    pixel_values_videos: Any = None
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # ("image"|"video", first, stop) in order


def _video_span(got: np.ndarray, j: int, vt: VisionTokens, pads: int) -> int:
    """Where the processor's expansion of the video pad at ``got[j]`` stops: after its ``pads`` video pads and
    the markers that close what it opened (Qwen3-VL inserts per frame a timestamp text, a start marker, the
    frame's pads and an end marker); -1 when the ids there are not such an expansion."""
    seen = depth = 0
    k = j
    while k < len(got):
        t = int(got[k])
        if t == vt.image:
            return -1
        if t == vt.video:
            seen += 1
        elif t in vt.starts:
            depth += 1
        elif t in vt.ends:
            if depth == 0:
                break
            depth -= 1
        k += 1
        if seen == pads and depth == 0:
            break
    return k if seen == pads and depth == 0 else -1


def expand(processor: Any, text: str, ids: list[int], mask: list[int], images: list[LoadedImage],
           videos: list[LoadedVideo] | None = None) -> Expanded:
    """The processor's own ids for ``text`` with ``images`` and ``videos``; the template's ``mask`` carried over,
    0 on vision tokens and on everything the processor inserts for a video.

    ``ids``/``mask`` are the unexpanded render's (one pad per image or video); the processor's ids must equal them
    with each image pad repeated and each video pad replaced by an expansion holding the video's pads (its grid's
    patches over the merge) and, between them, only what the processor inserts (timestamps, markers); else the row
    is a template_error reject (a template and processor that disagree).
    """
    videos = videos or []
    kwargs: dict[str, Any] = {}
    if videos:
        kwargs = {"videos": [v.frames for v in videos],
                  "videos_kwargs": {"video_metadata": [v.metadata for v in videos], "do_sample_frames": False}}
    out = processor(text=[text], images=[i.image for i in images] or None, return_tensors="pt", **kwargs)
    got = out["input_ids"][0].numpy().astype(np.int64)
    vt = VisionTokens.of(processor)
    vgrid = out["video_grid_thw"].numpy().astype(np.int64).reshape(-1, 3) if videos else np.zeros((0, 3), np.int64)
    merge = int(getattr(getattr(processor, "video_processor", None), "merge_size", None) or 1)
    new_mask: list[int] = []
    spans: list[tuple[str, int, int]] = []
    j = n_img = n_vid = 0
    ok = True
    for t, m in zip(ids, mask, strict=True):
        if j >= len(got):
            ok = False
            break
        if t == vt.image and got[j] == vt.image:
            run = 1
            while j + run < len(got) and got[j + run] == vt.image:
                run += 1
            spans.append(("image", j, j + run))
            new_mask.extend([0] * run)
            j += run
            n_img += 1
        elif t == vt.video and t >= 0:
            if n_vid >= len(vgrid) or (stop := _video_span(got, j, vt, int(np.prod(vgrid[n_vid])) // merge ** 2)) < 0:
                ok = False
                break
            spans.append(("video", j, stop))
            new_mask.extend([0] * (stop - j))
            j = stop
            n_vid += 1
        elif got[j] == t:
            new_mask.append(0 if t in vt.markers else m)
            j += 1
        else:
            ok = False
            break
    if not ok or j != len(got) or n_img != len(images) or n_vid != len(videos):
        raise MediaProblem(RejectReason.TEMPLATE_ERROR, f"the processor's ids ({len(got)} tokens) are not the chat "
                           f"template's render ({len(ids)} tokens, {n_img} image pads for {len(images)} images, "
                           f"{n_vid} video pads for {len(videos)} videos) with each image pad and video pad "
                           "expanded; the chat template and processor disagree")
    grid = out["image_grid_thw"].numpy().astype(np.int64) if images else np.zeros((0, 3), dtype=np.int64)
    return Expanded(got, np.asarray(new_mask, dtype=np.uint8), grid, out.get("pixel_values"), vgrid,
                    out.get("pixel_values_videos"), spans)


def image_spans(ids: np.ndarray, image: int) -> list[tuple[int, int]]:
    """[start, stop) of each run of image pads."""
    pad = np.concatenate([[False], ids == image, [False]])
    edges = np.flatnonzero(np.diff(pad.astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def fitting_images(ids: np.ndarray, image: int, seq_length: int) -> tuple[int, int]:
    """(images wholly inside the first ``seq_length`` tokens, where to cut): a cut never splits an image."""
    n, _, cut = fitting_media([("image", a, b) for a, b in image_spans(ids, image)], seq_length)
    return n, cut


def fitting_media(spans: list[tuple[str, int, int]], seq_length: int) -> tuple[int, int, int]:
    """(images, videos wholly inside the first ``seq_length`` tokens, where to cut): a cut never splits an image
    or a video; it falls before the start marker of the first that does not fit."""
    cut, n_img, n_vid = seq_length, 0, 0
    for kind, a, b in spans:
        if b <= seq_length:
            n_img, n_vid = (n_img + 1, n_vid) if kind == "image" else (n_img, n_vid + 1)
        else:
            cut = min(cut, max(0, a - 1))  # before its start marker
            break
    return n_img, n_vid, cut


@dataclass(frozen=True)
class SampleImages:
    """What a sample keeps of its images and videos: where to read them again for the forward, their hashes,
    their grids."""

    sources: tuple[str, ...]  # resolved: an absolute path or the data: URL
    sha256: tuple[str, ...]
    grid_thw: np.ndarray  # int64 [n_images, 3]
    video_sources: tuple[str, ...] = ()  # resolved absolute paths
    video_sha256: tuple[str, ...] = ()
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))

    @property
    def any(self) -> bool:
        """Whether the sample keeps an image or a video."""
        return bool(self.sources or self.video_sources)


def resolve_source(source: str, base: Path | None) -> str:
    """``source`` as an absolute path (``file://`` and relative paths resolved against ``base``); data: URLs kept."""
    if source.startswith("data:"):
        return source
    parsed = urlparse(source)
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(source)
    return str(path if path.is_absolute() or base is None else (base / path).resolve())


def data_root(path: str) -> str:
    """The folder relative image paths start from: ``data.path``'s own folder (a file) or ``data.path`` (a folder)."""
    p = Path(path).expanduser()
    return str((p if p.is_dir() else p.parent).resolve())


def image_base(root: str | None, file: str | None) -> Path | None:
    """The folder a row's relative image paths resolve against: that of the data file holding it."""
    if root is None:
        return None
    return Path(root) / Path(file).parent if file else Path(root)


def read_content(where: str) -> tuple[bytes | None, str]:
    """An image's bytes and their sha256, or (None, ``missing:<reason>``): one read serves both (regeneration keeps
    the bytes it hashed to send them)."""
    try:
        data = _read_bytes(where, None)
    except MediaProblem as exc:
        return None, f"missing:{exc.reason}"
    return data, hashlib.sha256(data).hexdigest()


def content_sha256(where: str) -> str:
    """The sha256 of an image's bytes, or ``missing:<reason>`` (the row becomes a reject; its absence is identity)."""
    return read_content(where)[1]
