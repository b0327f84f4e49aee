import json

import numpy as np

from dspark_precompute.config import DataConfig
from dspark_precompute.data import DataSource, RawRow, Reject, normalize, read_rows


def reason(record) -> str:
    got = normalize(RawRow(0, 1, record=record))
    assert isinstance(got, Reject), got
    return got.reason


def test_each_kind_of_bad_row_gets_its_reason_code():
    assert reason([1, 2]) == "missing_messages"
    assert reason({"text": "hi"}) == "missing_messages"
    assert reason({"messages": "hi"}) == "missing_messages"
    assert reason({"messages": []}) == "empty_conversation"
    assert reason({"messages": [{"role": "user", "content": "hi"}]}) == "no_assistant_turn"
    assert reason({"messages": [{"role": "wizard", "content": "hi"}]}) == "unknown_role"
    assert reason({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                                {"role": "assistant", "content": "a"}]}) == "non_text_content"
    assert reason({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}) \
        == "non_text_content"
    assert reason({"messages": [{"role": "assistant", "content": "a"}], "tools": "{not json"}) == "malformed_json"


def test_sharegpt_rows_map_roles_and_text_parts_are_joined():
    conv = normalize(RawRow(0, 1, record={"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
        {"from": "observation", "value": "o"}]}))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool"]
    conv = normalize(RawRow(0, 1, record={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": '[{"function": {"name": "f", "arguments": {}}}]'}],
        "tools": '[{"type": "function", "function": {"name": "f"}}]'}))
    assert conv.messages[0]["content"] == "a b" and conv.messages[1]["content"] == ""
    assert conv.messages[1]["tool_calls"][0]["function"]["name"] == "f" and conv.tools[0]["function"]["name"] == "f"


def test_jsonl_reading_turns_broken_lines_into_rejects_and_keeps_row_numbers(tmp_path):
    f = tmp_path / "d.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    f.write_bytes(b"\n".join([good.encode(), b"{broken", b"", b'{"messages": "\xff\xfe"}', good.encode()]) + b"\n")
    rows = read_rows(DataSource(str(f), [f], "jsonl"), DataConfig(path=str(f)))
    assert [r.row for r in rows] == [0, 1, 2, 3]  # the blank line is not a row
    assert [r.line for r in rows] == [1, 2, 4, 5]
    assert rows[1].error[0] == "malformed_json" and rows[2].error[0] == "invalid_utf8"
    assert isinstance(normalize(rows[1]), Reject) and not isinstance(normalize(rows[3]), Reject)


def test_selection_is_split_slice_after_a_datasets_compatible_shuffle(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(20)))
    src = DataSource(str(f), [f], "jsonl")
    assert [r.record["i"] for r in read_rows(src, DataConfig(path=str(f), split="train[5:8]"))] == [5, 6, 7]
    shuffled = [r.record["i"] for r in read_rows(src, DataConfig(path=str(f), shuffle_seed=42, max_samples=5))]
    assert shuffled == list(np.random.default_rng(42).permutation(20)[:5])
