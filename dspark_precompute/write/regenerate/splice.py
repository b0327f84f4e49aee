"""A conversation rewritten turn by turn: the regenerated assistant turns, the recorded tool results put back.

With ``turns=all`` each assistant turn is asked against the history regenerated so far (vLLM
speculators' way), so a later turn answers the target's own earlier words; with ``turns=last``
only the last one is asked, against the recorded history. A tool result stays where it was
recorded, and its ``tool_call_id`` follows the regenerated call at the same position, so the
template pairs them; a regenerated turn whose calls differ in number or names from the recorded
ones is counted as a tool mismatch (the recorded results may not answer it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspark_precompute.write.config.schema import Reasoning, Turns
from dspark_precompute.write.regenerate.client import Reply
from dspark_precompute.write.regenerate.request import InlineImages, history_message

Ask = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Reply]


@dataclass
class Spliced:
    """The regenerated conversation and what it took."""

    messages: list[dict[str, Any]]
    # (history sent, the stored turn, the engine's answer) per regenerated turn
    replies: list[tuple[list[dict[str, Any]], dict[str, Any], Reply]] = field(default_factory=list)
    tool_mismatches: int = 0


def regenerated_turns(messages: list[dict[str, Any]], turns: Turns) -> list[int]:
    """The indices of the assistant messages to regenerate."""
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return assistant if turns == Turns.all else assistant[-1:]


def _names(calls: list[dict[str, Any]] | None) -> list[str]:
    return [str((c.get("function") or {}).get("name")) for c in calls or []]


def assistant_message(reply: Reply, reasoning: Reasoning) -> dict[str, Any]:
    """The stored assistant message of one reply (reasoning only when asked to save it; the engine's ids when
    it returned them)."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reasoning == Reasoning.save and reply.reasoning:
        out["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        out["tool_calls"] = reply.tool_calls
    if reply.token_ids is not None:
        out["token_ids"] = list(reply.token_ids)
    return out


def empty_answer(reply: Reply, reasoning: Reasoning) -> str | None:
    """Why the stored turn of ``reply`` would be empty (None: it holds something to learn).

    A turn with tool calls, or with reasoning that ``regenerate.reasoning=save`` keeps, is an answer
    even without content; reasoning that is dropped leaves nothing, so it does not count."""
    if reply.content.strip() or reply.tool_calls or (reasoning == Reasoning.save and reply.reasoning):
        return None
    what = f"content {reply.content!r}" if reply.content else "no content"
    if reply.reasoning:
        return (f"the engine gave {what} and only reasoning, which regenerate.reasoning={reasoning} drops "
                f"(finish_reason={reply.finish_reason}); set regenerate.reasoning=save to keep it")
    return f"the engine gave {what}, no tool calls and no reasoning (finish_reason={reply.finish_reason})"


def splice(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, turns: Turns,
           reasoning: Reasoning, ask: Ask, images: InlineImages | None = None) -> Spliced:
    """Regenerate ``messages`` through ``ask`` (which may raise to abandon the row); ``images``: where the
    history's images are read from (each turn sends them again)."""
    todo = set(regenerated_turns(messages, turns))
    out = Spliced([])
    ids: dict[str, str] = {}  # recorded tool_call_id -> the regenerated call's id at the same position
    for i, m in enumerate(messages):
        if i not in todo:
            kept = dict(m)
            if m.get("role") == "tool" and m.get("tool_call_id") in ids:
                kept["tool_call_id"] = ids[m["tool_call_id"]]
            out.messages.append(kept)
            continue
        history = [history_message(x, images) for x in out.messages]
        reply = ask(history, tools)
        recorded = m.get("tool_calls") or []
        new = reply.tool_calls or []
        if _names(recorded) != _names(new):
            out.tool_mismatches += 1
        for old, call in zip(recorded, new):
            if old.get("id") is not None and call.get("id") is not None:
                ids[str(old["id"])] = str(call["id"])
        out.messages.append(assistant_message(reply, reasoning))
        out.replies.append((history, out.messages[-1], reply))
    return out
