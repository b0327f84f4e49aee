"""Exact token boundaries: the engine's own ids checked against our rendering of the regenerated conversation.

Where the engine returns the ids it read and wrote (vLLM ``return_token_ids``), those are the
target's tokens. The capture renders the stored conversation with the chat template and
tokenizes it; a turn whose engine ids are not a prefix of that rendering's tokens (a template
that renders history otherwise, text that re-tokenizes differently) is counted and reported,
never silently re-tokenized away.
"""

from __future__ import annotations

from typing import Any

from dspark_precompute.write.regenerate.client import Reply


def engine_ids(reply: Reply) -> list[int] | None:
    """The prompt and completion ids the engine returned, or None when it returned none."""
    if reply.prompt_token_ids is None or reply.token_ids is None:
        return None
    return [int(t) for t in reply.prompt_token_ids] + [int(t) for t in reply.token_ids]


def our_ids(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> (
        list[int]):
    """Our template's tokens of ``messages`` (the history and the regenerated turn), as the capture renders them."""
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def mismatch(tokenizer: Any, template: str, history: list[dict[str, Any]], turn: dict[str, Any], reply: Reply,
             tools: list[dict[str, Any]] | None) -> str | None:
    """Why the engine's ids of one turn (stored as ``turn``) differ from our rendering (where they first differ),
    or None."""
    theirs = engine_ids(reply)
    if theirs is None:
        return None
    ours = our_ids(tokenizer, template, [*history, turn], tools)
    if ours[:len(theirs)] == theirs:
        return None
    at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"token {at}: engine {theirs[at:at + 4]} vs our template {ours[at:at + 4]} "
            f"({len(theirs)} engine ids, {len(ours)} ours)")
