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
from dataclasses import dataclass
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

VIDEO_REFUSAL = ("video rows need a video processor, and transformers' video processors need `torchvision` "
                 "(pip install torchvision matching the installed torch); without it they are refused")


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


def _part_url(part: dict[str, Any]) -> Any:
    value = part.get(part["type"], part.get("url", part.get("path")))
    if isinstance(value, dict):
        value = value.get("url", value.get("path"))
    return value


def split_placeholders(text: str, images: list[Any], videos: list[Any], where: str,
                       used: list[int]) -> list[dict[str, Any]]:
    """A ShareGPT text with ``<image>``/``<video>`` placeholders as content parts; ``used`` counts them."""
    parts: list[dict[str, Any]] = []
    for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", text):
        if piece == IMAGE_PLACEHOLDER:
            if used[0] >= len(images):
                raise MediaProblem(RejectReason.IMAGE_MISSING, f"{where} has more {IMAGE_PLACEHOLDER} placeholders "
                                   f"than the row's 'images' list holds ({len(images)})")
            parts.append({"type": "image", "image": images[used[0]]})
            used[0] += 1
        elif piece == VIDEO_PLACEHOLDER:
            raise MediaProblem(RejectReason.VIDEO_UNSUPPORTED, f"{where} holds a {VIDEO_PLACEHOLDER}: {VIDEO_REFUSAL}")
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def content_parts(value: list[Any], where: str) -> list[dict[str, Any]]:
    """OpenAI content parts with images as ``{"type": "image", "image": source}``; other non-text parts refused."""
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
            raise MediaProblem(RejectReason.VIDEO_UNSUPPORTED, f"{where} has a {kind!r} part: {VIDEO_REFUSAL}")
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


def without_sources(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with image parts as bare ``{"type": "image"}`` (what the chat template renders)."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
        out.append(m)
    return out


# ---- the checkpoint's processor ---------------------------------------------------------------------


def load_processor(model_dir: Path, tokenizer: Any, chat_template: str, pixels: dict[str, int] | None = None
                   ) -> Any:
    """The checkpoint's processor for images: its ``AutoImageProcessor`` (the PIL one without torchvision), the
    tokenizer and chat template, in the processor class ``processor_config.json`` names.

    The processor classes of the Qwen-VL families want a video processor too, and transformers builds those with
    torchvision only; the processor is built here without one (video rows are refused, :data:`VIDEO_REFUSAL`).
    ``pixels``: the image processor's ``min_pixels``/``max_pixels`` (``data.image``), None keeps the checkpoint's.
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
    parts = {"image_processor": image_processor, "tokenizer": tokenizer}
    return _ImagesOnly(**{a: parts.get(a) for a in attrs}, chat_template=chat_template)


@dataclass(frozen=True)
class VisionTokens:
    """A processor's vision token ids: the image pad that expands, and the markers around it."""

    image: int
    markers: frozenset[int]  # every vision token id (pads, start/end): loss mask 0

    @classmethod
    def of(cls, processor: Any) -> VisionTokens:
        tok = processor.tokenizer
        image = int(getattr(processor, "image_token_id", None) or tok.convert_tokens_to_ids(processor.image_token))
        names = [getattr(processor, a, None) for a in ("image_token", "video_token", "vision_start_token",
                                                       "vision_end_token")]
        names += [getattr(tok, a, None) for a in ("vision_start_token", "vision_end_token")]
        ids = {int(tok.convert_tokens_to_ids(n)) for n in names if isinstance(n, str)}
        for t in ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>"):
            i = tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i != tok.unk_token_id:
                ids.add(i)
        return cls(image, frozenset(ids | {image}))


@dataclass
class Expanded:
    """A row's ids after the processor's expansion, with its mask and image tables."""

    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # uint8 [T]
    image_grid_thw: np.ndarray  # int64 [n_images, 3]
    pixel_values: Any  # the processor's tensor, for the forward


def expand(processor: Any, text: str, ids: list[int], mask: list[int], images: list[LoadedImage]) -> Expanded:
    """The processor's own ids for ``text`` with ``images``; the template's ``mask`` carried over, 0 on vision tokens.

    ``ids``/``mask`` are the unexpanded render's (one pad per image); the processor's ids must equal them with each
    pad repeated, else the row is a template_error reject (a template and processor that disagree).
    """
    out = processor(text=[text], images=[i.image for i in images], return_tensors="pt")
    got = out["input_ids"][0].numpy().astype(np.int64)
    vt = VisionTokens.of(processor)
    new_ids: list[int] = []
    new_mask: list[int] = []
    i = 0
    for t, m in zip(ids, mask, strict=True):
        if t == vt.image:
            run = 1
            while len(new_ids) + run < len(got) and got[len(new_ids) + run] == vt.image:
                run += 1
            new_ids.extend([t] * run)
            new_mask.extend([0] * run)
            i += 1
        else:
            new_ids.append(t)
            new_mask.append(0 if t in vt.markers else m)
    if i != len(images) or not np.array_equal(np.asarray(new_ids, dtype=np.int64), got):
        raise MediaProblem(RejectReason.TEMPLATE_ERROR, f"the processor's ids ({len(got)} tokens) are not the chat "
                           f"template's render ({len(ids)} tokens, {i} image pads for {len(images)} images) with "
                           "each image pad expanded; the chat template and processor disagree")
    return Expanded(got, np.asarray(new_mask, dtype=np.uint8), out["image_grid_thw"].numpy().astype(np.int64),
                    out["pixel_values"])


def image_spans(ids: np.ndarray, image: int) -> list[tuple[int, int]]:
    """[start, stop) of each run of image pads."""
    pad = np.concatenate([[False], ids == image, [False]])
    edges = np.flatnonzero(np.diff(pad.astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def fitting_images(ids: np.ndarray, image: int, seq_length: int) -> tuple[int, int]:
    """(images wholly inside the first ``seq_length`` tokens, where to cut): a cut never splits an image."""
    cut, n = seq_length, 0
    for a, b in image_spans(ids, image):
        if b <= seq_length:
            n += 1
        else:
            cut = min(cut, max(0, a - 1))  # before the image's start marker
            break
    return n, cut


@dataclass(frozen=True)
class SampleImages:
    """What a sample keeps of its images: where to read them again for the forward, their hashes, their grids."""

    sources: tuple[str, ...]  # resolved: an absolute path or the data: URL
    sha256: tuple[str, ...]
    grid_thw: np.ndarray  # int64 [n_images, 3]


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
