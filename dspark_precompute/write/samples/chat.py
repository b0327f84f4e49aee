"""Conversations -> token ids and loss masks, with NeMo AutoModel's supervision rules.

Loss mask (``1`` = the draft is trained on this token):

* template with ``{% generation %}`` blocks: the template's own assistant mask;
* otherwise NeMo's prefix rule: assistant message ``i`` covers tokens
  ``[len(tok(render(m[:i]))), len(tok(render(m[:i+1]))))`` (role header and end-of-turn
  included), checked exactly as NeMo checks it;
* where that rule cannot work because the template rewrites earlier turns (Qwen3 drops
  ``<think>`` from assistant turns before the last user turn), the turn is located in
  the single full render instead, by aligning the turn rendered last against the full
  text. NeMo aborts the whole run there.

``mask_reasoning_content`` removes reasoning tokens the way NeMo does (diff against a
render with that message's reasoning cleared); ``mask_generation_prompt`` removes the
assistant header (the template's generation prompt). A row where either option cannot be
applied (a render it needs fails, or the header cannot be located) is a
``mask_option_error`` reject, never a row whose header or reasoning silently stays
supervised. Truncation keeps the first ``seq_length`` tokens.

``mask_rule="deepspec"`` is DeepSpec's rule instead (github.com/deepseek-ai/DeepSpec,
``deepspec/data/parser.py`` at commit afdfa7c, template ``qwen``): a conversation without a
system message gets ``You are a helpful assistant.``; each match of
``<|im_start|>assistant\n(.*?(<|im_end|>\n|$))`` in the rendered text supervises the
tokens from ``len(tok(text[:start]))`` to ``len(tok(text[:end]))``, i.e. the turn's
content, its ``<|im_end|>`` and the newline after it, never the header; a sample with
fewer than 14 supervised tokens (its ``--min-loss-tokens`` default) is a
``too_few_supervised_tokens`` reject.

``mask_rule="specforge"`` is SpecForge 0.2.0's preparation for its ``qwen`` template
(``specforge/data/parse.py`` ``GeneralParser``, ``specforge/data/template.py``): the same spans
and default system prompt, but each message first reduced as its parser reduces it (roles
``human``/``gpt`` renamed, only ``role``, ``content`` and ``tool_calls`` kept, so a message's
``reasoning_content`` is not rendered (reasoning written inline in the content is); leading
messages before the first user turn dropped; the conversation cut at a
tool turn not after an assistant or tool turn, or an assistant turn not after a user or tool
turn) and fewer than 2 supervised tokens a ``too_few_supervised_tokens`` reject (its DSpark
minimum; a sample with two supervised tokens under this rule always has two adjacent ones, the
other filter its DSpark strategy applies).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.write.samples.images import SampleImages
from dspark_precompute.write.samples.normalize import Conversation, Reason, Reject

GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")

# DeepSpec's "qwen" chat template entry (deepspec/data/parser.py, TEMPLATE_REGISTRY) and its minimum; SpecForge's
# "qwen" entry (specforge/data/template.py) is the same header, end of turn and system prompt
DEEPSPEC_ASSISTANT_HEADER = "<|im_start|>assistant\n"
DEEPSPEC_END_OF_TURN = "<|im_end|>\n"
DEEPSPEC_SYSTEM_PROMPT = "You are a helpful assistant."
DEEPSPEC_MIN_SUPERVISED = 14
_DEEPSPEC_TURN = re.compile(re.escape(DEEPSPEC_ASSISTANT_HEADER) + r"([\s\S]*?(?:"
                            + re.escape(DEEPSPEC_END_OF_TURN) + r"|$))")




def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str:
    """The template text: inline Jinja, a file (``.jinja`` or a tokenizer_config.json), or the tokenizer's."""
    if chat_template is None:
        tpl = getattr(tokenizer, "chat_template", None)
        if isinstance(tpl, dict):
            tpl = tpl.get("default", next(iter(tpl.values())))
        if not tpl:
            raise ValueError(
                "the tokenizer has no chat template; set data.chat_template to inline Jinja or a template file"
            )
        text: str = tpl
        return text
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    p = Path(chat_template).expanduser()
    if not p.is_file():
        raise ValueError(f"data.chat_template={chat_template!r} is neither Jinja nor an existing file")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        text = json.loads(text)["chat_template"]
    return text


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Encoded:
    """One tokenized sample, truncated to seq_length."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    untruncated_length: int
    images: SampleImages | None = None  # a row with images: their sources, hashes and grids (samples/images.py)
    position_ids: np.ndarray | None = None  # a row with images of a multi-axis rotary model: int32 [T, axes]

    @property
    def truncated(self) -> bool:
        return self.untruncated_length > len(self.input_ids)


class _Unmaskable(Exception):
    pass


class _MaskOptionFailed(Exception):
    """A mask option (generation prompt, reasoning) could not be applied to the row."""


def deepspec_conversation(conv: Conversation, system_prompt: str = DEEPSPEC_SYSTEM_PROMPT) -> Conversation:
    """DeepSpec's system handling: a leading system message is kept (role and content only), else its default added."""
    msgs = conv.messages
    if msgs and msgs[0].get("role") == "system":
        head = [{"role": "system", "content": msgs[0].get("content")}]
        msgs = msgs[1:]
    else:
        head = [{"role": "system", "content": system_prompt}]
    return Conversation(head + list(msgs), conv.tools)


_SPECFORGE_ROLES = {"human": "user", "gpt": "assistant"}
_SPECFORGE_AFTER = {"tool": ("assistant", "tool"), "assistant": ("user", "tool")}  # a turn -> the turns it may follow


_DROP = object()  # a tool_calls string that is not JSON: SpecForge drops the key


def _specforge_tool_calls(calls: Any) -> Any:
    """SpecForge's ``_sanitize_message`` for ``tool_calls``: a JSON string parsed, each call reduced to id, type and
    function name and arguments (arguments parsed from a string, ``{}`` where that fails)."""
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError:
            return _DROP
    if not isinstance(calls, list):
        return calls  # kept as it is (None included), as SpecForge keeps it
    out = []
    for tc in calls:
        if not isinstance(tc, dict):
            continue
        clean: dict[str, Any] = {"id": tc.get("id", ""), "type": tc.get("type", "function")}
        func = tc.get("function", {})
        if isinstance(func, dict):
            args = func.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {}
            clean["function"] = {"name": func.get("name", ""), "arguments": args}
        out.append(clean)
    return out


def _specforge_message(msg: dict[str, Any]) -> dict[str, Any]:
    """One message as SpecForge's parser renders it: role renamed, content never None, only role/content/tool_calls."""
    role = msg.get("role", msg.get("from", ""))
    out = {"role": _SPECFORGE_ROLES.get(role, role), "content": msg.get("content") or msg.get("value") or ""}
    if "tool_calls" in msg:
        calls = _specforge_tool_calls(msg["tool_calls"])
        if calls is not _DROP:
            out["tool_calls"] = calls
    return out


def specforge_conversation(conv: Conversation, system_prompt: str = DEEPSPEC_SYSTEM_PROMPT) -> Conversation:
    """SpecForge 0.2.0's ``GeneralParser.parse`` before it renders: its messages, DeepSpec's system handling (the
    same in both), then from the first user turn on, cut at the first turn in an order its parser refuses."""
    reduced = Conversation([_specforge_message(m) for m in conv.messages], conv.tools or None)
    head, *msgs = deepspec_conversation(reduced, system_prompt).messages
    while msgs and msgs[0]["role"] != "user":
        msgs = msgs[1:]
    kept = msgs[:1]
    for prev, m in zip(msgs, msgs[1:]):
        if m["role"] in _SPECFORGE_AFTER and prev["role"] not in _SPECFORGE_AFTER[m["role"]]:
            break
        kept.append(m)
    return Conversation([head, *kept], reduced.tools)


@dataclass(frozen=True)
class SpanRule:
    """A trainer's own ChatML preparation: how it reduces a conversation, the assistant content spans, a default
    system prompt, a minimum of supervised tokens."""

    trainer: str  # whose preparation (named in rejects and errors)
    reduce: Callable[[Conversation, str], Conversation]
    system_prompt: str
    min_supervised: int


SPAN_RULES: dict[str, SpanRule] = {
    "deepspec": SpanRule("DeepSpec", deepspec_conversation, DEEPSPEC_SYSTEM_PROMPT, DEEPSPEC_MIN_SUPERVISED),
    "specforge": SpanRule("SpecForge", specforge_conversation, DEEPSPEC_SYSTEM_PROMPT, 2),
}


def mask_rule_problem(template: str, rule: str) -> str | None:
    """Why ``data.mask_rule=rule`` cannot work with this template (None when it can)."""
    if rule in SPAN_RULES and DEEPSPEC_ASSISTANT_HEADER.rstrip("\n") not in template:
        return (f"data.mask_rule={rule} needs a ChatML template (<|im_start|>assistant ... <|im_end|>, "
                f"{SPAN_RULES[rule].trainer}'s 'qwen' entry, the only one this tool reproduces); this template has no "
                "<|im_start|>assistant header. Use data.mask_rule=nemo or a Qwen-style data.chat_template")
    return None


class _TurnBoundaries:
    """Where ``messages[:k]`` ends in one row's full render, memoized per ``k``: in tokens by NeMo's prefix rule
    (:meth:`token`), else in characters by aligning the prefix's render against the full one (:meth:`char`)."""

    def __init__(self, encoder: ChatEncoder, conv: Conversation, full: str, ids: list[int],
                 offsets: list[tuple[int, int]]) -> None:
        self.encoder, self.msgs, self.tools, self.full, self.ids = encoder, conv.messages, conv.tools, full, ids
        self.starts = [o[0] for o in offsets]
        self.added_starts = {o[0] for o, t in zip(offsets, ids) if t in encoder.added_ids}
        self._tokens: dict[int, int | None] = {len(self.msgs): len(ids)}
        self._chars: dict[int, int] = {}

    def token(self, k: int) -> int | None:
        """NeMo's prefix length of messages[:k] in tokens, or None where the rule breaks."""
        if k in self._tokens:
            return self._tokens[k]
        enc, full, ids, S = self.encoder, self.full, self.ids, self.encoder.seq_length
        try:
            prefix = enc.render(self.msgs[:k], self.tools)
        except Exception:
            self._tokens[k] = None
            return None
        if full.startswith(prefix) and (len(prefix) == len(full) or len(prefix) in self.added_starts):
            # Added tokens split the text before BPE runs, so tokenizing the prefix alone
            # gives exactly the full tokenization's first tokens.
            self._tokens[k] = bisect.bisect_left(self.starts, len(prefix))
            return self._tokens[k]
        pids, _ = enc.tokenize(prefix)
        ref = ids[:S]
        p = pids[:S]
        ok = len(p) <= len(ref) and (
            p == ref[: len(p)]
            or (len(p) > 1 and enc.eos_token_id is not None and p[-1] == enc.eos_token_id
                and p[:-1] == ref[: len(p) - 1])
        )
        self._tokens[k] = len(pids) if ok else None
        return self._tokens[k]

    def char(self, k: int, lo: int) -> int:
        """Where messages[:k] ends inside the full render, without the prefix rule."""
        if k not in self._chars:
            t = self.token(k)
            self._chars[k] = (self.starts[t] if t < len(self.ids) else len(self.full)) if t is not None else \
                self.encoder._align_end(self.msgs, self.tools, self.full, k, lo)
        return self._chars[k]


class ChatEncoder:
    """Renders conversations with one template and builds NeMo-compatible loss masks."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        seq_length: int,
        mask_reasoning_content: bool = False,
        mask_generation_prompt: bool = False,
        *,
        mask_rule: str = "nemo",
    ):
        if mask_rule != "nemo" and mask_rule not in SPAN_RULES:
            raise ValueError(f"mask_rule={mask_rule!r} must be one of {['nemo', *SPAN_RULES]}")
        problem = mask_rule_problem(chat_template, mask_rule)
        if problem:
            raise ValueError(problem)
        self.mask_rule = mask_rule
        self.span_rule = SPAN_RULES.get(mask_rule)
        self.tokenizer = tokenizer
        self.template = chat_template
        self.seq_length = int(seq_length)
        self.mask_reasoning_content = mask_reasoning_content
        self.mask_generation_prompt = mask_generation_prompt
        self.has_generation = bool(GENERATION_RE.search(chat_template))
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.added_ids = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self.media: Any = None  # a MediaEncoder (samples/media.py) when the target reads images

    # -- primitives -------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = False) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return text

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    # -- public -----------------------------------------------------------------------
    def encode(self, conv: Conversation, row: int = -1) -> Encoded | Reject:
        out = self.render_with_mask(conv, row)
        if isinstance(out, Reject):
            return out
        _full, ids, mask = out
        return self.finish(ids, mask, len(ids), row)

    def render_with_mask(self, conv: Conversation, row: int = -1) -> tuple[str, list[int], list[int]] | Reject:
        """The full render, its ids and its loss mask (untruncated), or a reject."""
        rule = self.span_rule
        if rule is not None:
            conv = rule.reduce(conv, rule.system_prompt)
        try:
            full = self.render(conv.messages, conv.tools)
        except Exception as exc:  # jinja raises many types; the row is what is wrong
            return Reject(row, Reason.TEMPLATE_ERROR, f"chat template failed: {type(exc).__name__}: {exc}")
        if not full:
            return Reject(row, Reason.TEMPLATE_ERROR, "chat template rendered an empty string")
        try:
            ids, offsets = self.tokenize(full)
            turn_starts: dict[int, int] = {}  # assistant message -> where its turn starts in the full render
            if rule is not None:
                mask = self._span_mask(full, len(ids))
            elif self.has_generation:
                mask = self._generation_mask(conv, ids)
            else:
                mask = self._assistant_mask(conv, full, ids, offsets, turn_starts)
            if self.mask_generation_prompt and rule is None:  # a span rule never supervises a header
                self._remove_generation_prompts(conv, full, offsets, mask, turn_starts)
            if self.mask_reasoning_content:
                self._remove_reasoning(conv, full, ids, mask)
        except _Unmaskable as exc:
            return Reject(row, Reason.UNMASKABLE, str(exc))
        except _MaskOptionFailed as exc:
            return Reject(row, Reason.MASK_OPTION_ERROR, str(exc))
        except Exception as exc:
            return Reject(row, Reason.TEMPLATE_ERROR, f"rendering a part of the conversation failed: {exc}")
        return full, ids, mask

    def finish(self, ids: Any, mask: Any, n: int, row: int = -1, cut: int | None = None) -> Encoded | Reject:
        """The sample truncated at ``cut`` (default seq_length), or a reject when nothing is left to supervise."""
        rule = self.span_rule
        cut = self.seq_length if cut is None else cut
        ids_arr = np.asarray(ids[:cut], dtype=np.int32)
        mask_arr = np.asarray(mask[:cut], dtype=np.uint8)
        if not mask_arr.any():
            return Reject(
                row, Reason.NO_SUPERVISED_TOKENS,
                f"no supervised token within the first {cut} of {n} tokens",
            )
        if rule is not None and int(mask_arr.sum()) < rule.min_supervised:
            return Reject(
                row, Reason.TOO_FEW_SUPERVISED_TOKENS,
                f"{int(mask_arr.sum())} supervised tokens within the first {cut} of {n}, fewer than "
                f"{rule.trainer}'s minimum of {rule.min_supervised} (data.mask_rule={self.mask_rule})",
            )
        return Encoded(ids_arr, mask_arr, n)

    # -- masks ------------------------------------------------------------------------
    def _span_mask(self, full: str, n: int) -> list[int]:
        """DeepSpec's and SpecForge's spans: each turn's content to its end of turn, as token counts of the text
        before each end."""
        mask = [0] * n
        for m in _DEEPSPEC_TURN.finditer(full):
            s = len(self.tokenizer.encode(full[: m.start(1)], add_special_tokens=False))
            if s >= min(n, self.seq_length):
                break  # this turn and every later one lie past seq_length (DeepSpec truncates the same way)
            e = len(self.tokenizer.encode(full[: m.end(1)], add_special_tokens=False))
            for t in range(s, min(e, n)):
                mask[t] = 1
        return mask

    def _generation_mask(self, conv: Conversation, ids: list[int]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            conv.messages, tools=conv.tools, chat_template=self.template, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True,
        )
        if list(out["input_ids"]) != ids:
            raise _Unmaskable("the template's tokenization differs from a plain tokenization of its render")
        return [int(bool(m)) for m in out["assistant_masks"]]

    def _assistant_mask(self, conv: Conversation, full: str, ids: list[int], offsets: list[tuple[int, int]],
                        turn_starts: dict[int, int] | None = None) -> list[int]:
        msgs = conv.messages
        bounds = _TurnBoundaries(self, conv, full, ids, offsets)
        starts, S = bounds.starts, self.seq_length
        mask = [0] * len(ids)
        prev_end = 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            if prev_end and bisect.bisect_left(starts, prev_end) >= S:
                # Turns follow each other in the render (the char search below relies on it as
                # well), so this turn and every later one lie past seq_length: their masks are
                # cut off anyway, and rendering their prefixes would cost O(messages^2).
                break
            s, e = bounds.token(i), bounds.token(i + 1)
            if s is not None and e is not None:
                for t in range(s, min(e, len(ids))):
                    mask[t] = 1
                prev_end = starts[e] if e < len(ids) else len(full)
                if turn_starts is not None:
                    turn_starts[i] = starts[s] if s < len(ids) else len(full)
                continue
            cs = 0 if i == 0 else bounds.char(i, prev_end)
            if turn_starts is not None:
                turn_starts[i] = cs
            ce = bounds.char(i + 1, cs)
            lo, hi = bisect.bisect_left(starts, cs), bisect.bisect_left(starts, ce)
            for t in range(lo, hi):
                mask[t] = 1
            prev_end = ce
        return mask

    def _align_end(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, full: str, k: int,
                   lo: int) -> int:
        """End of ``messages[:k]`` in ``full`` when rendering the prefix alone rewrites some turns.

        The prefix render ends with the same text as the full render at the true boundary
        (the last turn's content and end-of-turn marker); look for the end position with the
        longest shared tail, at or after ``lo`` and no later than the next prefix that does
        render consistently. Ties go to the earliest position.
        """
        prefix = self.render(msgs[:k], tools)
        hi = len(full)
        for j in range(k + 1, len(msgs)):
            try:
                nxt = self.render(msgs[:j], tools)
            except Exception:
                continue
            if full.startswith(nxt):
                hi = len(nxt)
                break
        tail = prefix[-min(len(prefix), 8):]
        best_end, best_len = None, 0
        pos = full.find(tail, lo, hi)
        while pos != -1:
            end = pos + len(tail)
            n = 0
            while n < len(prefix) and n < end and full[end - 1 - n] == prefix[-1 - n]:
                n += 1
            if n > best_len:
                best_end, best_len = end, n
            pos = full.find(tail, pos + 1, hi)
        if best_end is None:
            raise _Unmaskable(f"the end of message {k - 1} cannot be located in the full render")
        return best_end

    def _remove_generation_prompts(self, conv: Conversation, full: str, offsets: list[tuple[int, int]], mask: list[int],
                                   turn_starts: dict[int, int] | None = None) -> None:
        starts = [o[0] for o in offsets]
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant" or i == 0:
                continue
            try:
                plain = self.render(conv.messages[:i], conv.tools)
                if full.startswith(plain) and bisect.bisect_left(starts, len(plain)) >= self.seq_length:
                    break  # this header and every later one lie past seq_length
                prompted = self.render(conv.messages[:i], conv.tools, add_generation_prompt=True)
            except Exception as exc:  # the header of this turn cannot be known: it would stay supervised
                raise _MaskOptionFailed(f"data.mask_generation_prompt: rendering messages[:{i}] to find assistant "
                                        f"message {i}'s header failed: {type(exc).__name__}: {exc}") from exc
            if len(prompted) == len(plain):
                continue  # the template has no generation prompt: no header to remove
            header = prompted[len(plain):]
            # The header sits right where the render of the earlier messages ends; where the template
            # rewrites earlier turns (Qwen3 drops their <think> blocks), where the mask rule located the turn.
            pos = len(plain) if full.startswith(plain) else (turn_starts or {}).get(i, -1)
            if not (prompted.startswith(plain) and pos >= 0 and full.startswith(header, pos)):
                raise _MaskOptionFailed(f"data.mask_generation_prompt: assistant message {i}'s header "
                                        f"{header[:40]!r} is not where the render of the earlier messages ends, so it "
                                        "cannot be removed from the loss mask")
            lo, hi = bisect.bisect_left(starts, pos), bisect.bisect_left(starts, pos + len(header))
            for t in range(lo, hi):
                mask[t] = 0

    def _remove_reasoning(self, conv: Conversation, full: str, ids: list[int], mask: list[int]) -> None:
        starts: list[int] | None = None
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant" or not m.get("reasoning_content"):
                continue
            if len(ids) > self.seq_length:
                # A turn that starts past seq_length cannot change the kept mask, nor can any later
                # one: stop before rendering the whole row once per remaining reasoning turn.
                try:
                    plain = self.render(conv.messages[:i], conv.tools)
                except Exception:
                    plain = ""
                if plain and full.startswith(plain):
                    if starts is None:
                        starts = [o[0] for o in self.tokenize(full)[1]]
                    if bisect.bisect_left(starts, len(plain)) >= self.seq_length:
                        break
            cleared = list(conv.messages)
            cleared[i] = {**m, "reasoning_content": ""}
            try:
                text = self.render(cleared, conv.tools)
            except Exception as exc:  # this turn's reasoning cannot be located: it would stay supervised
                raise _MaskOptionFailed(f"data.mask_reasoning_content: rendering the conversation with message {i}'s "
                                        f"reasoning cleared failed: {type(exc).__name__}: {exc}") from exc
            if text == full:  # the template does not render this reasoning (Qwen3: turns before the last query)
                continue
            other, _ = self.tokenize(text)
            p = 0
            while p < min(len(ids), len(other)) and ids[p] == other[p]:
                p += 1
            q = 0
            while q < min(len(ids), len(other)) - p and ids[-1 - q] == other[-1 - q]:
                q += 1
            for t in range(p, len(ids) - q):
                mask[t] = 0
