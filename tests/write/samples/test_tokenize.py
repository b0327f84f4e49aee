"""Tokenizing in worker processes gives exactly what tokenizing in the main process gives."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import CHAT, QWEN3_TOKENIZER, compose, small

from dspark_precompute import faults
from dspark_precompute.errors import DataError, InvalidRowError
from dspark_precompute.write.plan.prepare import prepare
from dspark_precompute.write.samples import tokenize as tk
from dspark_precompute.write.samples.normalize import Reject


def tokenized(tmp_path, workers: int, *extra: str) -> tk.Tokenized:
    cfg = compose(small(tmp_path, "data.max_samples=null", f"data.num_workers={workers}", *extra))
    plan = prepare(cfg)
    return tk.tokenize(plan.encoding, plan.cfg.data)


def inline_and_pooled(tmp_path, monkeypatch, workers: int, *extra: str) -> tuple[tk.Tokenized, tk.Tokenized]:
    """The same plan tokenized in this process, then with ``workers`` worker processes."""
    plan = prepare(compose(small(tmp_path, "data.max_samples=null", *extra)))
    out = []
    for n in (0, workers):
        monkeypatch.setattr(tk, "tokenizing_workers", lambda _data, n=n: n)
        out.append(tk.tokenize(plan.encoding, plan.cfg.data))
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
    """Workers start after 5 rows, take over at the sixth and take 7 rows per task, so a small file crosses every
    boundary."""
    monkeypatch.setattr(tk, "START_ROWS", 5)
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
    faults.reload()  # this process's plan: none (read before the variable is set); the workers read theirs
    monkeypatch.setenv("DSPARK_FAULT", "tokenize_row=3")
    with pytest.raises(DataError, match="tokenizing process died"):
        tokenized(tmp_path, 2, f"data.path={mixed_file(tmp_path)}", "data.max_invalid_fraction=0.5")


def test_a_small_selection_never_starts_workers(tmp_path, monkeypatch):
    def no_pool(*a, **k):
        raise AssertionError("a worker pool was started for a selection under START_ROWS")
    monkeypatch.setattr(tk, "EncoderPool", no_pool)
    tok = tokenized(tmp_path, 4)
    assert tok.rows_in > 0 and not any(isinstance(e, Reject) for e in tok.encoded.values())


class _SlowPool:
    """A pool that reports ready only after ``boot`` checks, and encodes in this process like a worker would."""

    boot = 10
    made: list[_SlowPool] = []

    def __init__(self, spec, tokenizer, n):
        self.spec, self.encoder, self.checks, self.closed = spec, spec.build(tokenizer), 0, False
        self.made.append(self)

    def ready(self):
        self.checks += 1
        return self.checks > self.boot

    def map(self, chunks):
        for chunk in chunks:
            for sel, raw in chunk:
                yield sel, self.spec.encode(self.encoder, raw, sel)

    def close(self):
        self.closed = True


def _encode_all(plan, workers):
    from dspark_precompute.write.samples.files import resolve_source
    from dspark_precompute.write.samples.rows import iter_rows
    rows = enumerate(iter_rows(resolve_source(plan.cfg.data.path), plan.cfg.data))
    return list(tk.encode_selection(plan.encoding, plan.cfg.data, rows, workers=workers))


def test_rows_are_encoded_here_while_the_workers_start_and_the_pool_takes_over_once_ready(tmp_path, monkeypatch):
    plan = prepare(compose(small(tmp_path, "data.max_samples=null")))
    inline = _encode_all(plan, 0)
    monkeypatch.setattr(tk, "START_ROWS", 5)
    monkeypatch.setattr(tk, "EncoderPool", _SlowPool)
    _SlowPool.made.clear()
    mixed = _encode_all(plan, 2)
    here = [raw is not None for _sel, raw, _item in mixed]
    assert here == [True] * (5 + _SlowPool.boot) + [False] * (len(inline) - 5 - _SlowPool.boot)  # no wait, no gap
    assert [sel for sel, _, _ in mixed] == [sel for sel, _, _ in inline]
    for (_, _, a), (_, _, b) in zip(inline, mixed, strict=True):
        if isinstance(a, Reject):
            assert a.to_json() == b.to_json()
        else:
            assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert len(_SlowPool.made) == 1 and _SlowPool.made[0].closed


def test_a_selection_that_ends_before_the_workers_are_ready_is_encoded_here_and_the_pool_is_stopped(tmp_path,
                                                                                                     monkeypatch):
    plan = prepare(compose(small(tmp_path, "data.max_samples=null")))
    monkeypatch.setattr(tk, "START_ROWS", 5)
    monkeypatch.setattr(tk, "EncoderPool", _SlowPool)
    monkeypatch.setattr(_SlowPool, "boot", 10_000)
    _SlowPool.made.clear()
    out = _encode_all(plan, 2)
    assert len(out) > 5 and all(raw is not None for _sel, raw, _item in out)
    assert _SlowPool.made[0].closed


@pytest.mark.parametrize("action,message", [("raise", "tokenizing failed in a worker process: RuntimeError: "
                                                       "injected fault at tokenize_start"),
                                            ("kill", "tokenizing process died")])
def test_a_worker_that_fails_to_start_is_a_data_error_not_a_hang(tmp_path, small_pool, monkeypatch, action, message):
    faults.reload()  # this process's plan: none (read before the variable is set); the workers read theirs
    monkeypatch.setenv("DSPARK_FAULT", f"tokenize_start=1:{action}")
    with pytest.raises(DataError, match=message):
        tokenized(tmp_path, 2)


def test_real_workers_take_over_once_ready_and_give_the_same_rows(tmp_path, monkeypatch):
    from dspark_precompute.write.samples import encode

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = tmp_path / "many.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [good["messages"][0], {"role": "assistant",
                                                                             "content": "word " * (i % 50)}]})
                              for i in range(400)) + "\n")
    plan = prepare(compose(small(tmp_path, "data.max_samples=null", f"data.path={data}")))
    inline = _encode_all(plan, 0)
    monkeypatch.setattr(tk, "START_ROWS", 5)
    slow = encode.RowEncoder.encode

    def slowly(self, encoder, raw, sel):  # this process only: the workers import their own copy
        time.sleep(0.1)  # so the workers start (seconds) before the 400 rows are done here
        return slow(self, encoder, raw, sel)

    monkeypatch.setattr(encode.RowEncoder, "encode", slowly)
    pooled = _encode_all(plan, 2)
    from_workers = sum(raw is None for _sel, raw, _item in pooled)
    assert 0 < from_workers < 400 - 5
    assert [raw is None for _s, raw, _i in pooled] == sorted(raw is None for _s, raw, _i in pooled)  # one hand-over
    assert [sel for sel, _, _ in pooled] == [sel for sel, _, _ in inline]
    for (_, _, a), (_, _, b) in zip(inline, pooled, strict=True):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


def test_a_pool_closed_while_its_workers_start_leaves_no_process_or_thread(tmp_path):
    from dspark_precompute.write.samples import encode

    plan = prepare(compose(small(tmp_path)))
    d = plan.cfg.data
    spec = encode.RowEncoder(plan.template, plan.cfg.seq_length, d.mask_reasoning_content,
                             d.mask_generation_prompt, d.format)
    for wait in (0.0, 0.3):
        pool = encode.EncoderPool(spec, plan.tokenizer, 2)
        time.sleep(wait)
        pool.close()
        assert not pool._starter.is_alive()
        assert not any(p.is_alive() for p in pool.procs)
