"""data.mask_rule=deepspec against an independent oracle, on the real Qwen3 tokenizer and the multi-turn fixtures.

The oracle does not use DeepSpec's method (a regex, then prefix re-tokenizations): it cuts the
rendered text at its ``<|im_start|>`` markers, takes each assistant block's span from the end
of its ``assistant\\n`` header through its ``<|im_end|>\\n`` (what DeepSpec's rule covers, per
github.com/deepseek-ai/DeepSpec deepspec/data/parser.py at commit afdfa7c), and marks the
tokens inside that character span through the fast tokenizer's offsets.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from helpers import chat_rows, compose, small

from dspark_precompute.write.samples.chat import ChatEncoder
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import RawRow

BIG = 1 << 20
SYSTEM = "You are a helpful assistant."


def oracle(tok, conv: Conversation, seq_length: int) -> tuple[list[int], list[int], str]:
    msgs = conv.messages if conv.messages[0]["role"] == "system" else \
        [{"role": "system", "content": SYSTEM}, *conv.messages]
    text = tok.apply_chat_template(msgs, tools=conv.tools, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    pos = text.find("<|im_start|>")
    while pos != -1:
        nxt = text.find("<|im_start|>", pos + 1)
        block_end = len(text) if nxt == -1 else nxt
        head = "<|im_start|>assistant\n"
        if text.startswith(head, pos):
            spans.append((pos + len(head), block_end))  # content, <|im_end|> and the newline before the next turn
        pos = nxt
    mask = [int(any(a <= s and e <= b for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"])[:seq_length], mask[:seq_length], text


@pytest.mark.parametrize("name", ["dpo_en_demo.multiturn", "reason_tool_use_demo_50", "alpaca_en_demo.first200"])
def test_deepspec_masks_equal_the_assistant_content_spans_of_the_render(qwen3_tokenizer, name):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_rule="deepspec")
    end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compared = 0
    for i, row in enumerate(chat_rows(name)):
        conv = normalize(RawRow(i, i + 1, record=row))
        ids, mask, text = oracle(qwen3_tokenizer, conv, BIG)
        got = enc.encode(conv, i)
        if sum(mask) < 14:
            assert isinstance(got, Reject) and got.reason == "too_few_supervised_tokens", (name, i)
            continue
        assert not isinstance(got, Reject), (name, i, got)
        assert list(got.input_ids) == ids, (name, i)
        assert list(got.loss_mask) == mask, (name, i)
        m = np.asarray(mask)
        # no header supervised, every end of an assistant turn supervised
        starts = [t for t, x in enumerate(ids) if x == qwen3_tokenizer.convert_tokens_to_ids("<|im_start|>")]
        assert not m[starts].any() and not m[[t + 1 for t in starts]].any()
        n_assistant = text.count("<|im_start|>assistant\n")
        assert sum(int(m[t]) for t, x in enumerate(ids) if x == end) == n_assistant, (name, i)
        if conv.messages[0]["role"] != "system":
            assert text.startswith("<|im_start|>system\n" + SYSTEM) or SYSTEM in text.split("<|im_end|>")[0]
        compared += 1
    assert compared > {"dpo_en_demo.multiturn": 100, "reason_tool_use_demo_50": 45,
                       "alpaca_en_demo.first200": 150}[name]


def test_deepspec_masks_cut_at_seq_length_and_reject_below_fourteen_supervised_tokens(qwen3_tokenizer):
    full = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_rule="deepspec")
    short = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, 96, mask_rule="deepspec")
    seen = Counter()
    for i, row in enumerate(chat_rows("dpo_en_demo.multiturn")[:60]):
        conv = normalize(RawRow(i, i + 1, record=row))
        a, b = full.encode(conv, i), short.encode(conv, i)
        if isinstance(a, Reject):  # too short whole: cut, shorter still
            assert a.reason == "too_few_supervised_tokens" and isinstance(b, Reject)
            continue
        kept = int(a.loss_mask[:96].sum())
        if isinstance(b, Reject):
            seen[b.reason] += 1
            assert (b.reason, kept == 0) in (("no_supervised_tokens", True), ("too_few_supervised_tokens", False))
            assert kept < 14
            continue
        seen["kept"] += 1
        assert kept >= 14 and np.array_equal(b.loss_mask, a.loss_mask[:96])
    assert seen["kept"] and seen["too_few_supervised_tokens"], seen


def test_deepspec_keeps_a_conversations_own_system_prompt_and_adds_its_default_otherwise(qwen3_tokenizer):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_rule="deepspec")
    answer = "Four, because two and two make four; nothing else is needed here at all."
    for msgs, system in (([{"role": "user", "content": "2+2?"}], SYSTEM),
                         ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                          "Be brief.")):
        got = enc.encode(Conversation([*msgs, {"role": "assistant", "content": answer}]))
        text = qwen3_tokenizer.decode(got.input_ids)
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n") and text.count("system\n") == 1
        supervised = qwen3_tokenizer.decode(got.input_ids[got.loss_mask.astype(bool)])
        assert supervised.endswith("<|im_end|>\n") and "assistant" not in supervised and answer in supervised


def test_deepspec_rule_needs_a_chatml_template():
    from dspark_precompute.write.target import tiny

    with pytest.raises(ValueError, match="data.mask_rule=deepspec needs a ChatML template"):
        ChatEncoder(tiny.build_tokenizer(), "{% for m in messages %}{{ m.content }}{% endfor %}", 64,
                    mask_rule="deepspec")


def test_the_rule_is_in_the_cache_identity_only_when_not_nemo_and_the_manifest_records_it(tmp_path):
    from dspark_precompute import open_cache
    from dspark_precompute.read.export import export
    from dspark_precompute.write.plan.prepare import prepare
    from dspark_precompute.write.run import run

    default = prepare(compose(small(tmp_path, name="a")))
    assert "mask_rule" not in default.identity["data"]  # caches made before the option keep their hash
    r = run(compose(small(tmp_path, "data.mask_rule=deepspec", "data.max_samples=8", name="b")))
    c = open_cache(r.path)
    m = c.manifest.to_json()
    assert m["identity"]["data"]["mask_rule"] == "deepspec"
    assert m["capture"]["mask"] == {"rule": "deepspec", "fallback": None, "mask_reasoning_content": False,
                                    "mask_generation_prompt": False, "default_system_prompt": SYSTEM,
                                    "min_supervised_tokens": 14}
    assert m["config_hash"] != default.config_hash
    out = export(r.path, tmp_path / "ds", to="deepspec", progress=False)
    ds = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert (ds["mask_rule"], ds["chat_template"], ds["min_loss_tokens"]) == ("deepspec", "qwen", 14)
    assert not any("not DeepSpec's own preparation" in n for n in out.notes)
    assert len(c) == r.samples > 0
    for i in range(len(c)):
        assert int(c.read_raw(i, [], last=False)["loss_mask"].sum()) >= 14
