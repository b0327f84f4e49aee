"""data.mask_rule=specforge against SpecForge 0.2.0's own parser (``specforge.data.parse.GeneralParser`` with its
``qwen`` template, as its ``build_eagle3_dataset`` calls it), on the real Qwen3 tokenizer and the shared fixtures.

The oracle tests need the ``interop`` packages (``pip install --no-deps specforge==0.2.0``) and ``../shared/data``;
each skips with a reason when either is absent. The reduction's own test needs neither.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from helpers import chat_rows, compose, small

from dspark_precompute.write.samples.chat import ChatEncoder, specforge_conversation
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import RawRow

BIG = 1 << 20
SYSTEM = "You are a helpful assistant."
FIXTURES = ["dpo_en_demo.multiturn", "reason_tool_use_demo_50", "alpaca_en_demo.first200"]


@pytest.fixture
def specforge_parser(qwen3_tokenizer):
    parse = pytest.importorskip("specforge.data.parse", reason="SpecForge 0.2.0 not installed (pip install "
                                "--no-deps specforge==0.2.0)")
    from specforge.data.template import TEMPLATE_REGISTRY

    return parse.GeneralParser(qwen3_tokenizer, TEMPLATE_REGISTRY.get("qwen"))


def specforge_prepares(parser, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """SpecForge's ids and mask for one row, its tools column parsed as its ``build_eagle3_dataset`` parses it."""
    tools = row.get("tools") or []
    if isinstance(tools, str):
        tools = json.loads(tools)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns about every dropped or cut turn
        ids, mask = parser.parse(json.loads(json.dumps(row["messages"])), max_length, tool=tools)
    return ids.tolist(), mask.tolist()


def assert_same_as_specforge(enc: ChatEncoder, parser, row: dict, i: int, max_length: int) -> bool:
    """Our encoding of ``row`` equals SpecForge's, or is a reject exactly where it keeps fewer than 2 tokens."""
    ids, mask = specforge_prepares(parser, row, max_length)
    got = enc.encode(normalize(RawRow(i, i + 1, record=row)), i)
    if sum(mask) < 2:  # its DSpark strategy's minimum (dflash_min_loss_tokens)
        assert isinstance(got, Reject), (i, sum(mask))
        assert got.reason == ("no_supervised_tokens" if sum(mask) == 0 else "too_few_supervised_tokens"), (i, got)
        return False
    assert not isinstance(got, Reject), (i, got)
    assert list(got.input_ids) == ids, i
    assert list(got.loss_mask) == mask, i
    return True


@pytest.mark.parametrize("max_length", [BIG, 256])
@pytest.mark.parametrize("name", FIXTURES)
def test_specforge_masks_equal_specforges_own_parser_on_the_shared_fixtures(qwen3_tokenizer, specforge_parser,
                                                                              name, max_length):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, max_length, mask_rule="specforge")
    rows = chat_rows(name)
    kept = sum(assert_same_as_specforge(enc, specforge_parser, row, i, max_length) for i, row in enumerate(rows))
    # every row compared; most are kept (at 256 tokens the long tool-use rows end before their first answer)
    assert kept >= {("dpo_en_demo.multiturn", BIG): 300, ("reason_tool_use_demo_50", BIG): 50,
                    ("alpaca_en_demo.first200", BIG): 200, ("dpo_en_demo.multiturn", 256): 250,
                    ("reason_tool_use_demo_50", 256): 5, ("alpaca_en_demo.first200", 256): 195}[name, max_length]


ANSWER = "Four: two and two make four, nothing more."
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 2})}}
HOSTILE = {
    "leading assistant dropped": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": ANSWER}],
    "tool after user cuts": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ANSWER},
                             {"role": "user", "content": "and 3+3?"}, {"role": "tool", "content": "6"},
                             {"role": "assistant", "content": "Six."}],
    "assistant after assistant cuts": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ANSWER},
                                       {"role": "assistant", "content": "Also: six is 3+3, said twice here."}],
    "reasoning not rendered": [{"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": ANSWER, "reasoning_content": "2 plus 2 is 4."}],
    "tool calls as a json string": [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "content": "", "tool_calls": json.dumps([CALL])},
                                    {"role": "tool", "content": "4"}, {"role": "assistant", "content": ANSWER}],
    "tool call with extra keys": [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": None,
                                   "tool_calls": [{**CALL, "index": 0, "extra": {"x": 1}}]},
                                  {"role": "tool", "content": "4"}, {"role": "assistant", "content": ANSWER}],
    "own system prompt kept": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": ANSWER}],
    "only an answer": [{"role": "assistant", "content": ANSWER}],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_specforge_cuts_drops_and_reduces_turns_as_its_parser_does(qwen3_tokenizer, specforge_parser, case):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_rule="specforge")
    kept = assert_same_as_specforge(enc, specforge_parser, {"messages": HOSTILE[case]}, 0, BIG)
    assert kept == (case != "only an answer")


def test_the_reduction_keeps_what_specforges_parser_renders_and_nothing_else():
    conv = Conversation([
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "2+2?", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": json.dumps([
            {**CALL, "index": 0}, "not a call", {"id": "c2", "function": {"name": "f", "arguments": "{bad"}}])},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": ANSWER},
        {"role": "assistant", "content": "cut here: an assistant turn after an assistant turn"},
        {"role": "user", "content": "never reached"},
    ], None)
    got = specforge_conversation(conv)
    assert got.messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": ANSWER},
    ]
    assert got.tools is None
    bad = specforge_conversation(Conversation([{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a", "tool_calls": "{not json"}],
                                              [{"type": "function"}]))
    assert bad.messages[-1] == {"role": "assistant", "content": "a"} and bad.tools == [{"type": "function"}]
    none = specforge_conversation(Conversation([{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a", "tool_calls": None}], None))
    assert none.messages[-1] == {"role": "assistant", "content": "a", "tool_calls": None}  # kept, as SpecForge does


def test_specforge_rejects_below_two_supervised_tokens_naming_its_minimum(qwen3_tokenizer):
    enc = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, BIG, mask_rule="specforge")
    conv = Conversation([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ANSWER}])
    full = enc.encode(conv)
    assert not isinstance(full, Reject)
    first = int(np.flatnonzero(full.loss_mask)[0])
    cut = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, first + 1, mask_rule="specforge").encode(conv, 7)
    assert isinstance(cut, Reject) and cut.reason == "too_few_supervised_tokens"
    assert "SpecForge's minimum of 2 (data.mask_rule=specforge)" in cut.message
    two = ChatEncoder(qwen3_tokenizer, qwen3_tokenizer.chat_template, first + 2, mask_rule="specforge").encode(conv)
    assert not isinstance(two, Reject) and int(two.loss_mask.sum()) == 2


def test_the_specforge_rule_is_recorded_and_its_export_says_whose_masks_it_holds(tmp_path):
    from dspark_precompute import open_cache
    from dspark_precompute.read.export import export
    from dspark_precompute.write.run import run

    r = run(compose(small(tmp_path, "data.mask_rule=specforge", "data.max_samples=8", name="sf")))
    m = open_cache(r.path).manifest.to_json()
    assert m["identity"]["data"]["mask_rule"] == "specforge"
    assert m["capture"]["mask"] == {"rule": "specforge", "fallback": None, "mask_reasoning_content": False,
                                    "mask_generation_prompt": False, "default_system_prompt": SYSTEM,
                                    "min_supervised_tokens": 2}
    own = export(r.path, tmp_path / "own", to="specforge", progress=False)
    assert not any("not SpecForge's own preparation" in n for n in own.notes)
    nemo = run(compose(small(tmp_path, "data.max_samples=8", name="nemo")))
    other = export(nemo.path, tmp_path / "other", to="specforge", progress=False)
    assert any("rule (nemo_prefix), not SpecForge's own preparation; precompute with data.mask_rule=specforge" in n
               for n in other.notes)


def test_masking_reasoning_under_the_specforge_rule_is_refused_before_anything_loads(tmp_path):
    from dspark_precompute.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.mask_reasoning_content=true does nothing under "
                                          r"data.mask_rule=specforge"):
        compose(small(tmp_path, "data.mask_rule=specforge", "data.mask_reasoning_content=true"))
