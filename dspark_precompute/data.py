"""Input rows -> normalized conversations, with every bad row turned into a typed reject.

Reads local ``.jsonl``/``.json`` natively, parquet through pyarrow and Hugging Face
datasets (a saved dataset directory or a hub id) through ``datasets`` when installed.
Row selection is: optional seeded shuffle -> split slice -> ``max_samples``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.config import EMBEDDED, DataConfig
from dspark_precompute.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "function_response": "tool",
}


class Reason:
    """Reason codes recorded in the rejects file (stable strings, part of the format)."""

    MALFORMED_JSON = "malformed_json"
    INVALID_UTF8 = "invalid_utf8"
    MISSING_MESSAGES = "missing_messages"
    UNKNOWN_ROLE = "unknown_role"
    NON_TEXT_CONTENT = "non_text_content"
    EMPTY_CONVERSATION = "empty_conversation"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    TEMPLATE_ERROR = "template_error"
    UNMASKABLE = "unmaskable_template"
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"


@dataclass
class RawRow:
    """One input row as read: its position in the source and either a record or a read error."""

    row: int  # 0-based index in the source (line number - 1 for jsonl, blank lines skipped)
    line: int | None  # 1-based line number for jsonl sources
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, message) when the row could not be parsed


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class Reject:
    row: int  # index in the selection, the numbering of samples/source_row
    reason: str
    message: str
    line: int | None = None  # 1-based line in a jsonl source
    file_row: int | None = None  # row in the source file (differs from row under a slice or shuffle)

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "file_row": self.row if self.file_row is None else self.file_row,
                "line": self.line, "reason": self.reason, "message": self.message[:300]}


@dataclass
class DataSource:
    """Resolved identity of the data: the files read and the sha256 of their bytes."""

    path: str
    files: list[Path] = field(default_factory=list)
    kind: str = "jsonl"

    def content_sha256(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        if not self.files:  # hub dataset: identity is its id (revision pinning is the user's job)
            h.update(self.path.encode())
        return h.hexdigest()


def embedded_data_path() -> Path:
    return Path(str(resources.files("dspark_precompute") / "assets" / "embedded_chat.jsonl"))


def resolve_source(path: str) -> DataSource:
    """Find the files behind ``data.path`` without reading rows."""
    if path == EMBEDDED:
        return DataSource(path=EMBEDDED, files=[embedded_data_path()], kind="jsonl")
    p = Path(path).expanduser()
    if p.is_file():
        suffix = p.suffix.lower()
        kind = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if kind is None:
            raise DataError(f"data.path={path!r}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
        return DataSource(path=str(p), files=[p], kind=kind)
    if p.is_dir():
        parquet = sorted(p.rglob("*.parquet"))
        if parquet:
            return DataSource(path=str(p), files=parquet, kind="parquet")
        arrow = sorted(p.rglob("*.arrow"))
        if arrow:
            return DataSource(path=str(p), files=arrow, kind="hf_disk")
        jsonl = sorted(p.glob("*.jsonl"))
        if jsonl:
            return DataSource(path=str(p), files=jsonl, kind="jsonl")
        raise DataError(f"data.path={path!r} is a directory without .jsonl, .parquet or .arrow files")
    return DataSource(path=path, files=[], kind="hub")


def _read_jsonl(files: list[Path]) -> Iterator[RawRow]:
    row = 0
    for f in files:
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield RawRow(row, lineno, error=(Reason.INVALID_UTF8, f"{f.name}:{lineno}: {exc}"))
                    row += 1
                    continue
                try:
                    yield RawRow(row, lineno, record=json.loads(text))
                except json.JSONDecodeError as exc:
                    yield RawRow(row, lineno, error=(Reason.MALFORMED_JSON, f"{f.name}:{lineno}: {exc}"))
                row += 1


def _read_json(files: list[Path]) -> Iterator[RawRow]:
    row = 0
    for f in files:
        try:
            obj = json.loads(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{f}: not a valid UTF-8 JSON document ({exc}); use JSONL for row-level skipping")
        for rec in obj if isinstance(obj, list) else [obj]:
            yield RawRow(row, None, record=rec)
            row += 1


def _read_with_datasets(source: DataSource, split: str) -> Iterator[RawRow]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        if source.kind == "parquet":
            yield from _read_parquet(source.files)
            return
        raise DataError(
            f"data.path={source.path!r} needs the `datasets` package (pip install datasets)"
        ) from None
    if source.kind == "hf_disk":
        ds = datasets.load_from_disk(source.path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    elif source.kind == "parquet":
        ds = datasets.load_dataset("parquet", data_files=[str(f) for f in source.files], split="train")
    else:
        ds = datasets.load_dataset(source.path, split=split)
    for i, rec in enumerate(ds):
        yield RawRow(i, None, record=rec)


def _read_parquet(files: list[Path]) -> Iterator[RawRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("parquet input needs pyarrow (pip install pyarrow)") from None
    row = 0
    for f in files:
        for rec in pq.read_table(f).to_pylist():
            yield RawRow(row, None, record=rec)
            row += 1


def iter_rows(source: DataSource, cfg: DataConfig) -> Iterator[RawRow]:
    """Rows of the selection in selection order (split slice, shuffle, max_samples).

    Streams the file when no shuffle is asked for, so memory does not grow with the data.
    """
    import itertools

    split, sl = cfg.split_slice()
    if source.kind == "jsonl":
        rows: Iterator[RawRow] = _read_jsonl(source.files)
    elif source.kind == "json":
        rows = _read_json(source.files)
    else:
        if source.kind == "parquet" and len(source.files) > 1:
            # a dataset snapshot holds every split (data/train-*.parquet, data/test-*.parquet)
            named = [f for f in source.files if f.name.startswith(f"{split}-") or f.name.startswith(f"{split}.")
                     or f.parent.name == split]
            if named:
                source = DataSource(source.path, named, source.kind)
        rows = _read_with_datasets(source, split)
    streaming = cfg.shuffle_seed is None and (sl.start or 0) >= 0 and (sl.stop is None or sl.stop >= 0)
    if streaming:
        stop = sl.stop
        if cfg.max_samples is not None:
            stop = (sl.start or 0) + cfg.max_samples if stop is None else min(stop, (sl.start or 0) + cfg.max_samples)
        yield from itertools.islice(rows, sl.start, stop)
        return
    listed = list(rows)
    if cfg.shuffle_seed is not None:  # same permutation as datasets.Dataset.shuffle(seed=...)
        order = np.random.default_rng(cfg.shuffle_seed).permutation(len(listed))
        listed = [listed[i] for i in order]
    listed = listed[sl]
    if cfg.max_samples is not None:
        listed = listed[: cfg.max_samples]
    yield from listed


def read_rows(source: DataSource, cfg: DataConfig) -> list[RawRow]:
    """All rows of the selection, in selection order (see :func:`iter_rows`)."""
    return list(iter_rows(source, cfg))


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
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} has a non-text part ({kind!r})")
        return " ".join(parts)
    raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} is a {type(value).__name__}, expected text")


class _RowProblem(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _normalize_message(m: Any, i: int, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _RowProblem(Reason.MISSING_MESSAGES, f"message {i} is a {type(m).__name__}, expected an object")
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
    out["content"] = _text(content, f"message {i} content")
    if "reasoning_content" in m and m["reasoning_content"] is not None:
        out["reasoning_content"] = _text(m["reasoning_content"], f"message {i} reasoning_content")
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if isinstance(calls, str):
            try:
                calls = json.loads(calls)
            except json.JSONDecodeError as exc:
                raise _RowProblem(Reason.MALFORMED_JSON, f"message {i} tool_calls is not JSON: {exc}")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, f"message {i} tool_calls must be a list of objects")
        out["tool_calls"] = calls
    return out


def normalize(raw: RawRow, fmt: str = "auto") -> Conversation | Reject:
    """Turn one raw row into a conversation the chat template can render, or a reject."""
    if raw.error is not None:
        return Reject(raw.row, raw.error[0], raw.error[1], raw.line)
    rec = raw.record
    try:
        if not isinstance(rec, dict):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row is a JSON {type(rec).__name__}, expected an object")
        if fmt == "messages" or (fmt == "auto" and "messages" in rec):
            msgs, sharegpt = rec.get("messages"), False
        elif fmt == "sharegpt" or (fmt == "auto" and "conversations" in rec):
            msgs, sharegpt = rec.get("conversations"), True
        else:
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row has neither 'messages' nor 'conversations' "
                                                       f"(keys: {sorted(rec)[:8]})")
        if not isinstance(msgs, list):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"'messages' is a {type(msgs).__name__}, expected a list")
        if not msgs:
            raise _RowProblem(Reason.EMPTY_CONVERSATION, "the conversation has no messages")
        messages = [_normalize_message(m, i, sharegpt) for i, m in enumerate(msgs)]
        if not any(m["role"] == "assistant" for m in messages):
            raise _RowProblem(Reason.NO_ASSISTANT_TURN, "the conversation has no assistant message to supervise")
        tools = rec.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools) if tools.strip() else None
            except json.JSONDecodeError as exc:
                raise _RowProblem(Reason.MALFORMED_JSON, f"'tools' is a string but not JSON: {exc}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, "'tools' must be a list of function schemas")
        return Conversation(messages=messages, tools=tools or None)
    except _RowProblem as exc:
        return Reject(raw.row, exc.reason, str(exc), raw.line)
