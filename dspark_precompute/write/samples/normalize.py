"""Rows to conversations: the OpenAI ``messages`` and ShareGPT ``conversations`` shapes mapped onto one
shape, every problem a typed :class:`Reject` (the reject codes are the format's: contract/vocab.py).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from dspark_precompute.contract.vocab import RejectReason
from dspark_precompute.write.samples.images import (
    VIDEO_REFUSAL,
    MediaProblem,
    content_parts,
    has_media,
    split_placeholders,
    video_problem,
)
from dspark_precompute.write.samples.rows import RawRow

log = logging.getLogger(__name__)


ROLES = ("system", "user", "assistant", "tool")


SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "function_response": "tool",
}


Reason = RejectReason  # the reject codes are part of the format: contract/vocab.py owns them


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    media: bool = False  # some content is a list of parts holding images or videos (write/samples/images.py)


_MESSAGE_CAP = 2000  # a reject keeps at most this much of its message (values can be huge)


@dataclass
class Reject:
    row: int  # index in the selection, the numbering of samples/source_row
    reason: str
    message: str
    line: int | None = None  # 1-based line in a jsonl/json file
    file_row: int | None = None  # row in the source file (differs from row under a slice or shuffle)
    file: str | None = None  # the file, relative to data.path

    def __post_init__(self) -> None:
        if len(self.message) > _MESSAGE_CAP:
            self.message = self.message[:_MESSAGE_CAP] + "..."

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "file_row": self.row if self.file_row is None else self.file_row,
                "line": self.line, "file": self.file, "reason": self.reason, "message": self.message[:500]}


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any, path: str) -> tuple[str, int, int] | None:
    """The first string (value or key) holding a lone UTF-16 surrogate: (where, index, code point)."""
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and (m := _SURROGATE.search(v)):
                return where, m.start(), ord(m.group())
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                stack.append((x, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k!r}]"))
                if isinstance(k, str) and not k.isascii() and (m := _SURROGATE.search(k)):
                    return f"a key of {where}", m.start(), ord(m.group())
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _check_unicode(value: Any, path: str) -> None:
    found = _find_surrogate(value, path)
    if found:
        where, i, cp = found
        raise _RowProblem(
            Reason.INVALID_UTF8,
            f"{where} holds U+{cp:04X} at character {i}: the JSON escapes half of a UTF-16 surrogate pair "
            f"(\\u{cp:04x}) without its other half, so the text is not valid Unicode and cannot be encoded "
            f"as UTF-8. Fix the producer (it split a surrogate pair, e.g. by cutting a string), or replace "
            f"the escape with \\ufffd or the intended character",
        )


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise _RowProblem(Reason.MALFORMED_JSON, f"{what} is nested too deeply to parse") from None
    except ValueError as exc:
        raise _RowProblem(Reason.MALFORMED_JSON, f"{what} is not JSON: {exc}") from None


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} has a non-text part ({kind!r})")
        return " ".join(parts)
    raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} is a JSON {_json_type(value)}, expected text")


class _RowProblem(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class _Media:
    """A row's media as normalization meets it: the ShareGPT ``images``/``videos`` lists and placeholders used."""

    images: list[Any]
    videos: list[Any]
    used: list[int]


def _content(content: Any, where: str, media: _Media | None) -> Any:
    """Text, or (``media`` on) content parts with images where the row has them."""
    if media is None:
        return _text(content, where)
    try:
        if has_media(content):
            return content_parts(content, where)
        if isinstance(content, str) and ("<image>" in content or "<video>" in content) and (
                media.images or media.videos or "<video>" in content):
            parts = split_placeholders(content, media.images, media.videos, where, media.used)
            return parts if any(p["type"] != "text" for p in parts) else content
    except MediaProblem as exc:
        raise _RowProblem(exc.reason, str(exc)) from None
    return _text(content, where)


def _no_media_lists(rec: dict[str, Any]) -> None:
    """Refuse a row with an ``images`` or ``videos`` list when the target reads text only (its placeholders would
    be captured as the literal text ``<image>``)."""
    if rec.get("videos"):
        raise _RowProblem(Reason.VIDEO_UNSUPPORTED, f"the row has a 'videos' list: {VIDEO_REFUSAL}")
    images = rec.get("images")
    if images:
        n = len(images) if isinstance(images, list) else 1
        raise _RowProblem(Reason.NON_TEXT_CONTENT, f"the row has an 'images' list ({n}) and the target reads text "
                                                   "only; capture it through an image-text checkpoint, or drop the "
                                                   "images and their <image> placeholders")


def _row_media(rec: dict[str, Any]) -> _Media:
    images, videos = rec.get("images") or [], rec.get("videos") or []
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise _RowProblem(Reason.IMAGE_MISSING, f"'images' is a JSON {_json_type(images)}, expected a list of paths")
    if videos and (problem := video_problem()) is not None:
        raise _RowProblem(Reason.VIDEO_UNSUPPORTED, f"the row has a 'videos' list: {problem}")
    if not isinstance(videos, list) or not all(isinstance(x, str) for x in videos):
        raise _RowProblem(Reason.VIDEO_MISSING, f"'videos' is a JSON {_json_type(videos)}, expected a list of paths")
    return _Media(images, videos, [0, 0])


def _normalize_message(m: Any, i: int, sharegpt: bool, media: _Media | None = None) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _RowProblem(Reason.MISSING_MESSAGES, f"message {i} is a JSON {_json_type(m)}, expected an object")
    if sharegpt:
        raw_role = m.get("from", m.get("role"))
        role = SHAREGPT_ROLES.get(str(raw_role).lower()) if raw_role is not None else None
        content = m.get("value", m.get("content"))
    else:
        raw_role = m.get("role")
        role = raw_role if raw_role in ROLES else None
        content = m.get("content")
    if role is None:
        raise _RowProblem(Reason.UNKNOWN_ROLE, f"message {i} has role {raw_role!r}; expected one of {list(ROLES)}")
    out = {k: v for k, v in m.items() if k not in ("from", "value")}
    out["role"] = role
    out["content"] = _content(content, f"message {i} content", media)
    if "reasoning_content" in m and m["reasoning_content"] is not None:
        out["reasoning_content"] = _text(m["reasoning_content"], f"message {i} reasoning_content")
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if isinstance(calls, str):
            calls = _loads(calls, f"message {i} tool_calls")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, f"message {i} tool_calls must be a list of objects")
        out["tool_calls"] = calls
    return out


def normalize(raw: RawRow, fmt: str = "auto", media: bool = False) -> Conversation | Reject:
    """Turn one raw row into a conversation the chat template can render, or a reject.

    ``media``: the target reads images, so image parts (and ShareGPT ``<image>`` placeholders with an
    ``images`` list) become content parts; otherwise they are non_text_content rejects.
    """
    if raw.error is not None:
        return Reject(raw.row, raw.error[0], raw.error[1], raw.line, raw.file_row, raw.file)
    rec = raw.record
    try:
        if not isinstance(rec, dict):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row is a JSON {_json_type(rec)}, expected an object "
                                                       "with 'messages' or 'conversations'")
        if fmt == "messages" or (fmt == "auto" and "messages" in rec):
            msgs, sharegpt = rec.get("messages"), False
        elif fmt == "sharegpt" or (fmt == "auto" and "conversations" in rec):
            msgs, sharegpt = rec.get("conversations"), True
        else:
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row has neither 'messages' nor 'conversations' "
                                                       f"(keys: {sorted(rec)[:8]})")
        if not isinstance(msgs, list):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"'messages' is a JSON {_json_type(msgs)}, expected an array")
        if not msgs:
            raise _RowProblem(Reason.EMPTY_CONVERSATION, "the conversation has no messages")
        _check_unicode(msgs, "conversations" if sharegpt else "messages")
        _check_unicode(rec.get("tools"), "tools")
        found = _row_media(rec) if media else None
        if not media:
            _no_media_lists(rec)  # a text target: a row that names images or videos is never captured as text
        messages = [_normalize_message(m, i, sharegpt, found) for i, m in enumerate(msgs)]
        if found is not None and found.used[0] != len(found.images):
            raise _RowProblem(Reason.IMAGE_MISSING, f"the row's 'images' list holds {len(found.images)} images but "
                                                    f"its text has {found.used[0]} <image> placeholders")
        if found is not None and found.used[1] != len(found.videos):
            raise _RowProblem(Reason.VIDEO_MISSING, f"the row's 'videos' list holds {len(found.videos)} videos but "
                                                    f"its text has {found.used[1]} <video> placeholders")
        if not any(m["role"] == "assistant" for m in messages):
            raise _RowProblem(Reason.NO_ASSISTANT_TURN, "the conversation has no assistant message to supervise")
        tools = rec.get("tools")
        if isinstance(tools, str):
            tools = _loads(tools, "'tools' (a string)") if tools.strip() else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, "'tools' must be a list of function schemas")
        return Conversation(messages=messages, tools=tools or None,
                            media=any(isinstance(m["content"], list) for m in messages))
    except _RowProblem as exc:
        return Reject(raw.row, exc.reason, str(exc), raw.line, raw.file_row, raw.file)
