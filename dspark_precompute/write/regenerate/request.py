"""The request one assistant turn sends: messages, sampling, and the reasoning switch, as each engine takes them.

Optional settings left null are not sent at all: transformers serve answers 422 to a field it
does not know (top_k, min_p, return_token_ids), so only what the user asked for goes out.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """A message as the next request's history sends it: role, content, tool calls and ids (no reasoning)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content", "")}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out
