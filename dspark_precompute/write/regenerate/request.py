"""The request one assistant turn sends: messages, sampling, and the reasoning switch, as each engine takes them.

Optional settings left null are not sent at all: transformers serve answers 422 to a field it
does not know (top_k, min_p, return_token_ids), so only what the user asked for goes out.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_precompute.write.config.schema import Reasoning, RegenerateConfig
from dspark_precompute.write.samples.images import read_content


@dataclass(frozen=True)
class Sampling:
    """The request body's settings for every turn, built once from the config."""

    body: dict[str, Any]  # top-level OpenAI arguments
    extra: dict[str, Any]  # extra_body: the engine extensions (top_k, min_p, chat_template_kwargs, ...)
    reasoning: Reasoning

    @classmethod
    def of(cls, r: RegenerateConfig) -> Sampling:
        body: dict[str, Any] = {"temperature": float(r.temperature), "max_tokens": int(r.max_tokens)}
        if r.top_p is not None:
            body["top_p"] = float(r.top_p)
        if r.seed is not None:
            body["seed"] = int(r.seed)
        extra: dict[str, Any] = {}
        if r.top_k is not None:
            extra["top_k"] = int(r.top_k)
        if r.min_p is not None:
            extra["min_p"] = float(r.min_p)
        if r.return_token_ids:
            extra["return_token_ids"] = True
        if r.reasoning == Reasoning.disable:
            # vLLM, SGLang and transformers serve all read it at the top level of the body
            extra["chat_template_kwargs"] = {"enable_thinking": False}
        return cls(body, extra, Reasoning(r.reasoning))

    def kwargs(self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The keyword arguments of ``client.chat.completions.create`` for one turn."""
        out: dict[str, Any] = {"model": model, "messages": messages, **self.body}
        if tools:
            out["tools"] = tools
        if self.extra:
            out["extra_body"] = dict(self.extra)
        return out


def history_message(m: dict[str, Any], images: InlineImages | None = None) -> dict[str, Any]:
    """A message as the next request's history sends it: role, content, tool calls and ids (no reasoning); an
    image part goes as OpenAI's ``image_url`` with the image inline (a ``data:`` URL: a server reads no local
    path unless started to, and a ``data:`` URL is what vLLM's and OpenAI's chat APIs both accept), its bytes
    from ``images`` where it holds them; a video part goes as vLLM's ``video_url`` the same way (a ``data:video/...``
    URL of the file's bytes)."""
    content = m.get("content", "")
    if isinstance(content, list):
        part = image_url_part if images is None else images.part
        video = video_url_part if images is None else images.video_part
        content = [part(p["image"]) if p.get("type") == "image" else video(p["video"]) if p.get("type") == "video"
                   else p for p in content]
    out: dict[str, Any] = {"role": m["role"], "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


_MAGIC = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG", "image/png"), (b"GIF8", "image/gif"),
          (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def image_url_part(source: str, data: bytes | None = None) -> dict[str, Any]:
    """An image (an absolute path or a ``data:`` URL, as a normalized row names it) as an ``image_url`` part;
    ``data``: the file's bytes, already read."""
    if source.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": source}}
    data = Path(source).read_bytes() if data is None else data
    mime = next((t for magic, t in _MAGIC if data.startswith(magic)), "application/octet-stream")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


_VIDEO_MAGIC = ((4, b"ftyp", "video/mp4"), (8, b"AVI ", "video/x-msvideo"), (0, b"\x1a\x45\xdf\xa3", "video/webm"))


def video_url_part(source: str, data: bytes | None = None) -> dict[str, Any]:
    """A video (an absolute path, as a normalized row names it) as a ``video_url`` part with the file inline (what
    vLLM's OpenAI-compatible chat API takes for a video); ``data``: the file's bytes, already read."""
    data = Path(source).read_bytes() if data is None else data
    mime = next((t for at, magic, t in _VIDEO_MAGIC if data[at:at + len(magic)] == magic), "application/octet-stream")
    return {"type": "video_url", "video_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


INLINE_BYTES = 256 << 20  # the most image bytes one regeneration keeps between hashing them and sending them


class InlineImages:
    """The images of one regeneration: each file read and hashed once (:meth:`sha256`; the selection and the pending
    rows both need the hash), its bytes kept for the requests that send it (:meth:`part`, every turn of a row
    sends its history's images again), the least recently used dropped past ``budget`` bytes and read again if
    asked. ``data:`` URLs are inside the row itself: decoded and hashed where they are met, never kept. Shared by
    the request threads."""

    def __init__(self, budget: int = INLINE_BYTES):
        self.budget, self.held = budget, 0
        self._sha: dict[str, str] = {}
        self._bytes: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def sha256(self, where: str) -> str:
        """The sha256 of the image at ``where`` (an absolute path or a ``data:`` URL), or ``missing:<reason>``."""
        if where in self._sha:
            return self._sha[where]
        data, digest = read_content(where)
        if not where.startswith("data:"):
            self._sha[where] = digest
            if data is not None:
                self._keep(where, data)
        return digest

    def part(self, source: str) -> dict[str, Any]:
        """:func:`image_url_part` of ``source``, from the bytes kept where they still are."""
        if source.startswith("data:"):
            return image_url_part(source)
        return image_url_part(source, self._data(source))

    def video_part(self, source: str) -> dict[str, Any]:
        """:func:`video_url_part` of ``source``, from the bytes kept where they still are."""
        return video_url_part(source, self._data(source))

    def _data(self, source: str) -> bytes:
        """A file's bytes: the ones kept (marked most recent), else read now and kept."""
        with self._lock:
            data = self._bytes.get(source)
            if data is not None:
                self._bytes.move_to_end(source)
        if data is None:
            data = Path(source).read_bytes()
            self._keep(source, data)
        return data

    def _keep(self, where: str, data: bytes) -> None:
        if len(data) > self.budget:
            return
        with self._lock:
            if where in self._bytes:
                return
            self._bytes[where] = data
            self.held += len(data)
            while self.held > self.budget:
                _, old = self._bytes.popitem(last=False)
                self.held -= len(old)
