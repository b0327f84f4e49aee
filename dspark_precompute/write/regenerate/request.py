"""The request one assistant turn sends: messages, sampling, and the reasoning switch, as each engine takes them.

Optional settings left null are not sent at all: transformers serve answers 422 to a field it
does not know (top_k, min_p, return_token_ids), so only what the user asked for goes out.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_precompute.write.config.schema import Reasoning, RegenerateConfig


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


def history_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the next request's history sends it: role, content, tool calls and ids (no reasoning); an
    image part goes as OpenAI's ``image_url`` with the image inline (a ``data:`` URL: a server reads no local
    path unless started to, and a ``data:`` URL is what vLLM's and OpenAI's chat APIs both accept)."""
    content = m.get("content", "")
    if isinstance(content, list):
        content = [image_url_part(p["image"]) if p.get("type") == "image" else p for p in content]
    out: dict[str, Any] = {"role": m["role"], "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


_MAGIC = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG", "image/png"), (b"GIF8", "image/gif"),
          (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def image_url_part(source: str) -> dict[str, Any]:
    """An image (an absolute path or a ``data:`` URL, as a normalized row names it) as an ``image_url`` part."""
    if source.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": source}}
    data = Path(source).read_bytes()
    mime = next((t for magic, t in _MAGIC if data.startswith(magic)), "application/octet-stream")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
