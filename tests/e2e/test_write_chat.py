"""Loss masks over whole conversation sets and long rows.

NeMo's rule where it works, linear work per turn, a failed mask option stopping a run.

The e2e part of tests/write/samples/test_chat.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import chat_rows
from test_chat import _NO_PROMPT, BIG, conv_of, generation_wrapped, nemo_prefix_mask

from dspark_precompute.write.samples.chat import ChatEncoder
from dspark_precompute.write.samples.normalize import Conversation, Reject
from dspark_precompute.write.target import tiny


def test_multi_turn_masks_equal_nemo_where_its_rule_works_and_never_abort(qwen3_tokenizer):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG)
    oracle = ChatEncoder(qwen3_tokenizer, generation_wrapped(qwen3_tokenizer.chat_template), BIG)
    nemo_aborts = 0
    for name in ("dpo_en_demo.multiturn", "reason_tool_use_demo_50"):
        for i, row in enumerate(chat_rows(name)):
            conv = conv_of(row, i)
            got = enc.encode(conv, i)
            assert not isinstance(got, Reject), (name, i, got)
            want = oracle.encode(conv, i)  # HF's assistant mask of a template that renders identically
            assert np.array_equal(got.input_ids, want.input_ids), (name, i)
            assert np.array_equal(got.loss_mask, want.loss_mask), (name, i)
            try:
                _, nemo = nemo_prefix_mask(qwen3_tokenizer, conv, BIG)
            except ValueError:
                nemo_aborts += 1
                continue
            assert list(got.loss_mask) == nemo, (name, i)
    assert nemo_aborts > 100  # the rows NeMo cannot do at all are the point of this test


def _many_turns(n: int, reasoning: bool) -> Conversation:
    msgs = [{"role": "system", "content": "Be brief."}]
    for t in range(n):
        msgs.append({"role": "user", "content": f"question {t}: what is {t}+{t}?"})
        msgs.append({"role": "assistant", "content": f"the answer is {2 * t}.",
                     **({"reasoning_content": f"add {t} and {t}"} if reasoning else {})})
    return Conversation(msgs)


@pytest.mark.parametrize("reasoning", [False, True])
def test_turns_past_seq_length_do_not_change_the_kept_mask(reasoning):
    tok = tiny.build_tokenizer()
    conv = _many_turns(120, reasoning)
    for kw in ({}, {"mask_reasoning_content": True, "mask_generation_prompt": True}):
        full = ChatEncoder(tok, tiny.CHAT_TEMPLATE, BIG, **kw).encode(conv)
        for s in (40, 100, 256, 1000):
            cut = ChatEncoder(tok, tiny.CHAT_TEMPLATE, s, **kw).encode(conv)
            if isinstance(cut, Reject):
                assert s == 40 and cut.reason == "no_supervised_tokens" and not full.loss_mask[:s].any()
                continue
            assert np.array_equal(cut.input_ids, full.input_ids[:s]), (kw, s)
            assert np.array_equal(cut.loss_mask, full.loss_mask[:s]), (kw, s)
            assert cut.untruncated_length == len(full.input_ids)


class _CountingTokenizer:
    """The tokenizer, counting the characters it renders and tokenizes (the encoder's work)."""

    def __init__(self, tok):
        self._tok, self.chars = tok, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, text, *a, **k):
        self.chars += len(text)
        return self._tok(text, *a, **k)

    def apply_chat_template(self, *a, **k):
        out = self._tok.apply_chat_template(*a, **k)
        text = out if isinstance(out, str) else self._tok.apply_chat_template(*a, **{**k, "tokenize": False})
        self.chars += len(text)
        return out


def test_the_work_of_a_long_row_grows_linearly_with_its_turns():
    """The mask loops rendered every turn's prefix and re-tokenized the whole row per reasoning turn:
    O(turns^2) characters (about 40 s for a 120 KB row). Turns past seq_length now cost one pass over
    the row, so ten times the turns cost about ten times the work, not a hundred (counted in characters
    rendered and tokenized, not timed: this machine is shared)."""
    tok = tiny.build_tokenizer()
    for kw in ({}, {"mask_reasoning_content": True, "mask_generation_prompt": True}):
        work = []
        for turns in (100, 1000):
            counting = _CountingTokenizer(tok)
            got = ChatEncoder(counting, tiny.CHAT_TEMPLATE, 2048, **kw).encode(_many_turns(turns, bool(kw)))
            assert not isinstance(got, Reject) and got.truncated
            work.append(counting.chars)
        assert work[1] <= 15 * work[0], (kw, work)


def test_under_on_invalid_error_a_mask_option_failure_stops_the_run(tmp_path):
    from helpers import compose, small

    from dspark_precompute.errors import InvalidRowError
    from dspark_precompute.write.dryrun import dry_run

    tpl = tmp_path / "no_prompt.jinja"
    tpl.write_text(_NO_PROMPT)
    cfg = compose(small(tmp_path, f"data.chat_template={tpl}", "data.mask_generation_prompt=true",
                        "data.on_invalid=error", "dry_run=true"))
    with pytest.raises(InvalidRowError, match="mask_option_error"):
        dry_run(cfg)
