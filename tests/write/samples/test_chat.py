"""Loss masks against independent oracles: NeMo's prefix rule and HF's {% generation %} mask."""

from __future__ import annotations

import numpy as np
from helpers import chat_rows

from dspark_precompute.write.samples.chat import ChatEncoder
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import RawRow
from dspark_precompute.write.target import tiny

BIG = 1 << 20


def conv_of(row: dict, i: int = 0) -> Conversation:
    c = normalize(RawRow(i, i + 1, record=row))
    assert isinstance(c, Conversation), c
    return c


def nemo_prefix_mask(tok, conv: Conversation, seq_length: int):
    """NeMo AutoModel's rule, re-implemented from its description: raises where it aborts."""
    def ids(msgs):
        return list(tok.apply_chat_template(msgs, tools=conv.tools, tokenize=True, return_dict=True,
                                            truncation=True, max_length=seq_length)["input_ids"])
    full = ids(conv.messages)
    mask = [0] * len(full)
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        bounds = []
        for k in (i, i + 1):
            p = ids(conv.messages[:k])
            consistent = p == full[: len(p)] or (p[-1] == tok.eos_token_id and p[:-1] == full[: len(p) - 1])
            if not consistent:
                raise ValueError("Cannot build an answer-only loss mask from conversation prefixes")
            bounds.append(len(p))
        for t in range(min(bounds[0], len(full)), min(bounds[1], len(full))):
            mask[t] = 1
    return full, mask


def generation_wrapped(template: str) -> str:
    """Qwen3's template with each assistant turn (header to end-of-turn) inside {% generation %}."""
    head = '{%- elif message.role == "assistant" %}'
    tail = "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert head in template and tail in template
    return template.replace(head, head + "{% generation %}").replace(
        tail, "{{- '<|im_end|>\\n' }}{% endgeneration %}\n    {%- elif message.role == \"tool\" %}")


def test_single_turn_masks_equal_nemos_prefix_rule(qwen3_tokenizer):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, 2048)
    rows = chat_rows("alpaca_en_demo.first200")
    for i, row in enumerate(rows):
        conv = conv_of(row, i)
        ids, mask = nemo_prefix_mask(qwen3_tokenizer, conv, 2048)
        got = enc.encode(conv, i)
        assert list(got.input_ids) == ids, i
        assert list(got.loss_mask) == mask, i
    assert got.loss_mask.sum() > 0


def test_generation_template_uses_the_templates_own_assistant_mask(qwen3_tokenizer):
    wrapped = generation_wrapped(qwen3_tokenizer.chat_template)
    enc = ChatEncoder(qwen3_tokenizer, wrapped, BIG)
    assert enc.has_generation
    conv = conv_of(chat_rows("dpo_en_demo.multiturn")[5])
    got = enc.encode(conv)
    hf = qwen3_tokenizer.apply_chat_template(conv.messages, chat_template=wrapped, tokenize=True,
                                             return_dict=True, return_assistant_tokens_mask=True)
    assert list(got.loss_mask) == list(hf["assistant_masks"])


def _runs(mask_on, mask_off):
    removed = np.flatnonzero((mask_on == 1) & (mask_off == 0))
    if not len(removed):
        return []
    splits = np.flatnonzero(np.diff(removed) > 1) + 1
    return np.split(removed, splits)


def test_reasoning_masking_removes_exactly_the_rendered_reasoning(qwen3_tokenizer):
    plain = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG)
    masked = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_reasoning_content=True)
    checked = 0
    for i, row in enumerate(chat_rows("reason_tool_use_demo_50")[:20]):
        conv = conv_of(row, i)
        a, b = plain.encode(conv, i), masked.encode(conv, i)
        assert np.array_equal(a.input_ids, b.input_ids)
        rendered = plain.render(conv.messages, conv.tools)
        expected = [m["reasoning_content"].strip("\n") for m in conv.messages
                    if m["role"] == "assistant" and m.get("reasoning_content")
                    and f"<think>\n{m['reasoning_content'].strip(chr(10))}\n</think>" in rendered]
        runs = _runs(a.loss_mask, b.loss_mask)
        # NeMo's rule (a diff against a render with that reasoning cleared): for a turn that is
        # not last, Qwen3 then drops the whole <think> block, so the tags go with the text.
        texts = [qwen3_tokenizer.decode(a.input_ids[r]).replace("<think>", "").replace("</think>", "").strip()
                 for r in runs]
        assert texts == [e.strip() for e in expected], i
        checked += len(texts)
        assert b.loss_mask.sum() > 0
    assert checked > 20


def test_generation_prompt_masking_removes_each_assistant_header(qwen3_tokenizer):
    plain = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG)
    masked = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_generation_prompt=True)
    rows = chat_rows("dpo_en_demo.multiturn")[:30]
    assert len(rows) == 30
    for i, row in enumerate(rows):
        conv = conv_of(row, i)
        a, b = plain.encode(conv, i), masked.encode(conv, i)
        texts = [qwen3_tokenizer.decode(a.input_ids[r]) for r in _runs(a.loss_mask, b.loss_mask)]
        n_assistant = sum(m["role"] == "assistant" for m in conv.messages)
        assert texts == ["<|im_start|>assistant\n"] * n_assistant, i


def test_truncation_keeps_the_first_seq_length_tokens_and_their_mask(qwen3_tokenizer):
    full = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG)
    short = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, 64)
    n_trunc = 0
    for i, row in enumerate(chat_rows("dpo_en_demo.multiturn")[:40]):
        conv = conv_of(row, i)
        a, b = full.encode(conv, i), short.encode(conv, i)
        if isinstance(b, Reject):
            assert b.reason == "no_supervised_tokens" and a.loss_mask[:64].sum() == 0
            continue
        assert np.array_equal(b.input_ids, a.input_ids[:64]) and np.array_equal(b.loss_mask, a.loss_mask[:64])
        assert b.untruncated_length == len(a.input_ids)
        n_trunc += b.truncated
    assert n_trunc > 10


def test_rows_with_nothing_supervised_after_truncation_are_rejected(qwen3_tokenizer):
    conv = Conversation([{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}])
    got = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, 32).encode(conv, 7)
    assert isinstance(got, Reject) and got.reason == "no_supervised_tokens" and got.row == 7


def test_the_embedded_template_rewrites_earlier_turns_and_masks_still_cover_every_turn():
    tok = tiny.build_tokenizer()
    enc = ChatEncoder(tok, tiny.CHAT_TEMPLATE, BIG)
    conv = Conversation([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "3×3?"},
        {"role": "assistant", "content": "9 ✓", "reasoning_content": "multiply"},
    ])
    full = enc.render(conv.messages, None)
    assert "<think>\nadd" not in full and "<think>\nmultiply" in full  # earlier reasoning dropped
    got = enc.encode(conv)
    runs = _runs(got.loss_mask, np.zeros_like(got.loss_mask))
    texts = [tok.decode(got.input_ids[r]) for r in runs]
    assert texts == ["<|im_start|>assistant\n4<|im_end|>\n",
                     "<|im_start|>assistant\n<think>\nmultiply\n</think>\n\n9 ✓<|im_end|>\n"]


def test_masks_with_every_option_are_unchanged_by_truncation_on_real_reasoning_rows(qwen3_tokenizer):
    kw = {"mask_reasoning_content": True, "mask_generation_prompt": True}
    full = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, **kw)
    short = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, 512, **kw)
    compared = rejected = 0
    for i, row in enumerate(chat_rows("reason_tool_use_demo_50")[:25]):
        conv = conv_of(row, i)
        a, b = full.encode(conv, i), short.encode(conv, i)
        assert not isinstance(a, Reject), (i, a)
        if isinstance(b, Reject):
            assert b.reason == "no_supervised_tokens" and a.loss_mask[:512].sum() == 0
            rejected += 1
            continue
        assert np.array_equal(b.input_ids, a.input_ids[:512]) and np.array_equal(b.loss_mask, a.loss_mask[:512]), i
        assert b.loss_mask.any()
        compared += 1
    # At 128 tokens (this test's former length) every row was rejected (Qwen3's tool preamble is longer) and
    # the loop compared nothing; at 512, 10 rows keep supervised tokens and 15 are rejected.
    assert (compared, rejected) == (10, 15)


def test_generation_prompt_masking_removes_every_header_of_rows_whose_earlier_turns_the_template_rewrites(
        qwen3_tokenizer):
    """Qwen3 drops earlier turns' <think> blocks, so a turn's header is not where the render of the earlier
    messages ends: the header was silently left supervised there (16 of these 50 rows). It is found where
    the mask rule located the turn."""
    plain = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG)
    masked = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_generation_prompt=True)
    rewritten = 0
    for i, row in enumerate(chat_rows("reason_tool_use_demo_50")):
        conv = conv_of(row, i)
        a, b = plain.encode(conv, i), masked.encode(conv, i)
        assert not isinstance(b, Reject), (i, b)
        texts = [qwen3_tokenizer.decode(a.input_ids[r]) for r in _runs(a.loss_mask, b.loss_mask)]
        assert texts == ["<|im_start|>assistant\n"] * sum(m["role"] == "assistant" for m in conv.messages), i
        full = plain.render(conv.messages, conv.tools)
        turns = [j for j in range(1, len(conv.messages)) if conv.messages[j]["role"] == "assistant"]
        rewritten += any(not full.startswith(plain.render(conv.messages[:k], conv.tools)) for k in turns)
    assert rewritten == 16  # rows where some turn's prefix render is not a prefix of the full render


# a template whose generation prompt cannot be rendered: the header of a turn cannot be known
_NO_PROMPT = tiny.CHAT_TEMPLATE + "{%- if add_generation_prompt %}{{ raise_exception('no prompt here') }}{%- endif %}"


def test_a_row_whose_header_cannot_be_rendered_is_a_mask_option_reject_never_a_supervised_header():
    """Issue 19: the failed render was swallowed (``except Exception: continue``) and the header stayed in
    the loss mask, a silent change of what the option promises."""
    tok = tiny.build_tokenizer()
    conv = Conversation([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}])
    assert not isinstance(ChatEncoder(tok, _NO_PROMPT, BIG).encode(conv), Reject)  # the template itself renders
    got = ChatEncoder(tok, _NO_PROMPT, BIG, mask_generation_prompt=True).encode(conv, 3)
    assert isinstance(got, Reject) and got.reason == "mask_option_error" and got.row == 3
    assert "data.mask_generation_prompt" in got.message and "no prompt here" in got.message


def test_a_row_whose_reasoning_cannot_be_cleared_is_a_mask_option_reject():
    tok = tiny.build_tokenizer()
    anchor = "{%- for m in messages %}"
    assert anchor in tiny.CHAT_TEMPLATE
    template = tiny.CHAT_TEMPLATE.replace(anchor, "{%- if messages[-1].reasoning_content == '' %}"
                                          "{{ raise_exception('cleared') }}{%- endif %}" + anchor, 1)
    conv = Conversation([{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4", "reasoning_content": "add"}])
    assert not isinstance(ChatEncoder(tok, template, BIG).encode(conv), Reject)
    got = ChatEncoder(tok, template, BIG, mask_reasoning_content=True).encode(conv)
    assert isinstance(got, Reject) and got.reason == "mask_option_error" and "cleared" in got.message
