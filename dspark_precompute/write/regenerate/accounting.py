"""What a regeneration did: rows in, rows regenerated, typed rejects, cut turns, token and tool mismatches.

``rows_in = regenerated + rejected``, as for capture. A reject keeps the engine's message. A
request that failed (after its retries) is a reject of this run only: the next run asks it
again; a refusal, a cut turn (with ``on_length=reject``) or an empty answer is the row's answer and
is kept.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class RegenReason(StrEnum):
    """Why a source row has no regenerated row (the ``reason`` of a regeneration reject)."""

    REQUEST_FAILED = "request_failed"
    """No usable answer after every retry (connection lost, time-out, HTTP error, garbage); asked again next run."""
    REFUSAL = "refusal"
    """The engine refused (a refusal, or finish_reason=content_filter)."""
    LENGTH = "length"
    """A turn was cut by regenerate.max_tokens and regenerate.on_length=reject."""
    EMPTY_ANSWER = "empty_answer"
    """A turn would be stored empty: no content (null, '' or whitespace), no tool calls, no kept reasoning."""


# kept in the log: the row's answer, not asked again
FINAL_REASONS = frozenset({RegenReason.REFUSAL, RegenReason.LENGTH, RegenReason.EMPTY_ANSWER})


class RowRejected(Exception):
    """Raised while a row is regenerated: it becomes a reject with this reason and the engine's message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class RegenCounts:
    """The regeneration's totals (``<output>.meta.json`` ``counts``; ``dspark-cache info`` shows them)."""

    rows_in: int = 0
    regenerated: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    turns: int = 0
    cut_turns: int = 0  # finish_reason=length, kept or rejected
    token_checked_turns: int = 0  # turns whose engine ids were checked against our rendering
    token_mismatches: int = 0
    tool_mismatches: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    asked_now: int = 0  # rows sent to the servers by this run (the rest came from the log)

    def add_reject(self, reason: str) -> None:
        self.rejected += 1
        self.reasons = dict(Counter(self.reasons) + Counter({reason: 1}))

    def add_row(self, record: dict[str, Any]) -> None:
        """Count one logged row (``store``'s record of a regenerated or finally rejected row)."""
        stats = record.get("stats") or {}
        for key in ("turns", "cut_turns", "token_checked_turns", "token_mismatches", "tool_mismatches",
                    "prompt_tokens", "completion_tokens"):
            setattr(self, key, getattr(self, key) + int(stats.get(key, 0)))
        if record.get("reject") is not None:
            self.add_reject(str(record["reject"]["reason"]))
        else:
            self.regenerated += 1

    def to_json(self) -> dict[str, Any]:
        return {k: (dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}
