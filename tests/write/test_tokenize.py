"""Tokenizing in worker processes gives exactly what tokenizing in the main process gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import CHAT, QWEN3_TOKENIZER, compose, small

from dspark_precompute.errors import DataError, InvalidRowError
from dspark_precompute.write import tokenize as tk
from dspark_precompute.write.data import Reject
from dspark_precompute.write.plan import prepare


def tokenized(tmp_path, workers: int, *extra: str) -> tk.Tokenized:
    cfg = compose(small(tmp_path, "data.max_samples=null", f"data.num_workers={workers}", *extra))
    return tk.tokenize(prepare(cfg))


def inline_and_pooled(tmp_path, monkeypatch, workers: int, *extra: str) -> tuple[tk.Tokenized, tk.Tokenized]:
    """The same plan tokenized in this process, then with ``workers`` worker processes."""
    plan = prepare(compose(small(tmp_path, "data.max_samples=null", *extra)))
    out = []
    for n in (0, workers):
        monkeypatch.setattr(tk, "tokenizing_workers", lambda _plan, n=n: n)
        out.append(tk.tokenize(plan))
    return out[0], out[1]


def assert_same(a: tk.Tokenized, b: tk.Tokenized) -> None:
    assert a.rows_in == b.rows_in
    for field in ("sample_rows", "lengths", "untruncated", "supervised"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert [r.to_json() for r in a.rejects] == [r.to_json() for r in b.rejects]
    assert sorted(a.encoded) == sorted(b.encoded)
    for s in a.encoded:
        assert np.array_equal(a.encoded[s].input_ids, b.encoded[s].input_ids), s
        assert np.array_equal(a.encoded[s].loss_mask, b.encoded[s].loss_mask), s


@pytest.fixture
def small_pool(monkeypatch):
    """Workers start after 5 rows and take 7 rows per task, so a small file crosses every boundary."""
    monkeypatch.setattr(tk, "INLINE_ROWS", 5)
    monkeypatch.setattr(tk, "CHUNK_ROWS", 7)


def mixed_file(tmp_path):
    """Embedded-style rows with bad ones among them (after the inline head, so workers reject them)."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    lines = []
    for i in range(60):
        if i % 9 == 8:
            lines.append("{not json")
        elif i % 13 == 12:
            lines.append(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
        else:
            lines.append(json.dumps({**good, "messages": [good["messages"][0], {"role": "assistant",
                                                                                 "content": "word " * i}]}))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_workers_give_the_same_samples_rejects_and_order_as_the_main_process(tmp_path, small_pool, monkeypatch):
    inline, pooled = inline_and_pooled(tmp_path, monkeypatch, 2, f"data.path={mixed_file(tmp_path)}",
                                       "data.max_invalid_fraction=0.5")
    assert_same(inline, pooled)
    late = [r for r in pooled.rejects if r.row >= 5]
    assert late and all(r.line == r.row + 1 and r.file == "mixed.jsonl" for r in late)  # positions survive the trip


def test_workers_match_the_main_process_on_real_multi_turn_and_tool_rows_with_qwen3(tmp_path, small_pool,
                                                                                     monkeypatch):
    data = CHAT / "mix.messages.jsonl"
    if not (QWEN3_TOKENIZER / "vocab.json").exists() or not data.exists():
        pytest.skip(f"needs the Qwen3 tokenizer and {data} (../shared/data)")
    extra = (f"model.tokenizer={QWEN3_TOKENIZER}", f"data.path={data}", "data.max_samples=150", "seq_length=512")
    inline, pooled = inline_and_pooled(tmp_path, monkeypatch, 3, *extra)
    assert_same(inline, pooled)
    assert len(pooled.encoded) > 100


def test_an_invalid_row_met_by_a_worker_stops_on_invalid_error_naming_its_line(tmp_path, small_pool):
    data = mixed_file(tmp_path)
    with pytest.raises(InvalidRowError, match="line 9"):
        tokenized(tmp_path, 2, f"data.path={data}", "data.on_invalid=error")


def test_a_tokenizing_worker_that_dies_is_a_data_error_not_a_hang(tmp_path, small_pool, monkeypatch):
    monkeypatch.setenv("DSPARK_FAULT", "tokenize_row=3")  # read by the workers only (this process read it at import)
    with pytest.raises(DataError, match="tokenizing process died"):
        tokenized(tmp_path, 2, f"data.path={mixed_file(tmp_path)}", "data.max_invalid_fraction=0.5")


def test_a_small_selection_never_starts_workers(tmp_path, monkeypatch):
    def no_pool(*a, **k):
        raise AssertionError("a worker pool was started for a selection under INLINE_ROWS")
    monkeypatch.setattr(tk, "EncoderPool", no_pool)
    tok = tokenized(tmp_path, 4)
    assert tok.rows_in > 0 and not any(isinstance(e, Reject) for e in tok.encoded.values())
