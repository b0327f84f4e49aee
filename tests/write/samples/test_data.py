import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import compose, small
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dspark_precompute.errors import ConfigError, DataError, InvalidRowError
from dspark_precompute.write.config.schema import DataConfig
from dspark_precompute.write.plan.prepare import prepare
from dspark_precompute.write.run import run
from dspark_precompute.write.samples.files import DataSource, resolve_source
from dspark_precompute.write.samples.json_scan import JsonValues
from dspark_precompute.write.samples.normalize import Reject, normalize
from dspark_precompute.write.samples.rows import RawRow, read_rows, record_size
from dspark_precompute.write.samples.tokenize import tokenize


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


# -- issue 9: bounded rows, whole directories, BOMs and surrogates ---------------------------

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def good(i: int = 0) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def big_row(n_bytes: int) -> bytes:
    """A valid row of about n_bytes whose assistant message holds nearly all of it."""
    words = "the quick brown fox jumps over a lazy dog. "
    text = (words * (n_bytes // len(words) + 1))[:n_bytes]
    return json.dumps({"messages": [{"role": "user", "content": "essay?"}, {"role": "assistant", "content": text}]}
                      ).encode()


def rows_of(path, **cfg):
    return read_rows(resolve_source(str(path)), DataConfig(path=str(path), **cfg))


def run_tokenize(tmp_path, path, *extra):
    plan = prepare(compose(small(tmp_path, f"data.path={path}", "data.max_samples=null", *extra)))
    return tokenize(plan.encoding, plan.cfg.data)


# item 1: a row larger than data.max_row_bytes is a typed reject, read past in bounded memory

def test_a_row_over_max_row_bytes_is_a_row_too_large_reject_that_counts_as_invalid(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join([json.dumps(good(0)).encode(), big_row(5000), json.dumps(good(1)).encode(),
                                 json.dumps(good(2)).encode()]) + b"\n")
    tok = run_tokenize(tmp_path, data, "data.max_row_bytes=2000", "data.max_invalid_fraction=1")
    assert tok.rows_in == 4 == len(tok.lengths) + len(tok.rejects)
    (r,) = tok.rejects
    assert (r.reason, r.row, r.line, r.file, r.file_row) == ("row_too_large", 1, 2, "d.jsonl", 1)
    assert "data.max_row_bytes=2000" in r.message and "Split or trim the row" in r.message
    with pytest.raises(DataError, match=r"above data.max_invalid_fraction.*row_too_large=1\. "
                                        r"First: row 1 \(file d.jsonl, line 2\): d.jsonl:2: the line holds"):
        run_tokenize(tmp_path, data, "data.max_row_bytes=2000")
    with pytest.raises(InvalidRowError, match=r"row_too_large.*file d.jsonl, line 2"):
        run_tokenize(tmp_path, data, "data.max_row_bytes=2000", "data.on_invalid=error")
    assert len(run_tokenize(tmp_path, data, "data.max_row_bytes=6000").rejects) == 0  # under the limit: a sample


def test_max_row_bytes_is_validated_and_part_of_the_cache_identity_only_when_changed(tmp_path):
    for bad in ("0", "-5", "1.5", "true"):
        with pytest.raises(ConfigError, match="data.max_row_bytes"):
            compose(small(tmp_path, f"data.max_row_bytes={bad}"))
    default, changed = (prepare(compose(small(tmp_path, *x))) for x in ([], ["data.max_row_bytes=4096"]))
    assert "max_row_bytes" not in default.identity["data"]  # caches made before the limit keep their hash
    assert changed.identity["data"]["max_row_bytes"] == 4096 and changed.config_hash != default.config_hash


def test_oversized_rows_of_every_file_type_are_read_past_without_holding_them(tmp_path):
    """tracemalloc sees every Python allocation: reading a 30 MB row never holds it."""
    big = big_row(30_000_000)
    (tmp_path / "a.jsonl").write_bytes(json.dumps(good(0)).encode() + b"\n" + big + b"\n"
                                       + json.dumps(good(1)).encode())
    (tmp_path / "b.json").write_bytes(b"[" + json.dumps(good(2)).encode() + b",\n" + big + b",\n"
                                      + json.dumps(good(3)).encode() + b"]")
    (tmp_path / "c.json").write_bytes(big)  # one top-level object
    (tmp_path / "d.jsonl").write_bytes(b" " * 5_000_000 + b"\n" + json.dumps(good(4)).encode())  # blank, long
    del big
    tracemalloc.start()
    try:
        rows = rows_of(tmp_path, max_row_bytes=65536)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    got = [(r.file, r.line, r.error[0] if r.error else r.record["messages"][0]["content"]) for r in rows]
    assert got == [("a.jsonl", 1, "q0"), ("a.jsonl", 2, "row_too_large"), ("a.jsonl", 3, "q1"),
                   ("b.json", 1, "q2"), ("b.json", 2, "row_too_large"), ("b.json", 3, "q3"),
                   ("c.json", 1, "row_too_large"), ("d.jsonl", 2, "q4")]
    assert "30000" in rows[1].error[1] and "data.max_row_bytes=65536" in rows[1].error[1]


@pytest.mark.parametrize("field", ["reasoning_content", "tool_calls"])
def test_a_10_mb_reasoning_or_tool_arguments_string_is_row_too_large_at_the_default_limit(tmp_path, field):
    huge = "x" * 10_000_000
    msg = {"role": "assistant", "content": "a"}
    msg[field] = huge if field == "reasoning_content" else [{"function": {"name": "f", "arguments": huge}}]
    f = tmp_path / "d.jsonl"
    f.write_text(jl(good(0), {"messages": [{"role": "user", "content": "q"}, msg]}, good(1)))
    rows = rows_of(f)
    assert [r.error[0] if r.error else "ok" for r in rows] == ["ok", "row_too_large", "ok"]
    assert "data.max_row_bytes=1048576" in rows[1].error[1]


def test_record_size_counts_utf8_bytes_and_stops_early_past_the_limit():
    assert record_size({"a": "é" * 10, "b": [1, None, "xyz"]}, 1000) == 1 + 20 + 1 + 8 + 8 + 3
    assert 100 < record_size(["x" * 100] * 1000, 100) < 300  # counted only until past the limit


def test_parquet_records_over_the_limit_are_row_too_large(tmp_path):
    import pyarrow as pa  # the [test] extra has it: a missing one fails, never skips
    import pyarrow.parquet as pq

    recs = [good(0), json.loads(big_row(5000)), good(1)]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet")
    rows = rows_of(tmp_path / "d.parquet", max_row_bytes=2000)
    assert [r.error[0] if r.error else "ok" for r in rows] == ["ok", "row_too_large", "ok"]
    assert rows[1].file == "d.parquet" and rows[1].file_row == 1 and rows[2].record == good(1)
    assert "its messages and tools" in rows[1].error[1]
    # a column the template never sees (an image, say) does not count against the limit
    pq.write_table(pa.Table.from_pylist([{**good(0), "image": b"\0" * 10_000}]), tmp_path / "img.parquet")
    (row,) = rows_of(tmp_path / "img.parquet", max_row_bytes=2000)
    assert row.error is None and len(row.record["image"]) == 10_000


# item 2: a directory is read whole, in a stable order, every file named

def write_tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


def jl(*recs) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def test_a_directory_is_read_whole_recursively_in_sorted_order_and_each_file_is_logged(tmp_path, caplog):
    root = write_tree(tmp_path / "data", {
        "b.jsonl": jl(good(0), good(1)), "a.ndjson": jl(good(2)), "c.json": json.dumps([good(3), good(4)]),
        "sub/x.jsonl": jl(good(5)), "sub/deeper/y.json": json.dumps(good(6)), "a/z.jsonl": jl(good(7)),
        "sub/empty.jsonl": "", "README.md": "# card", ".gitattributes": "*", "LICENSE": "MIT",
        ".hidden/ignored.jsonl": jl(good(99)), "dataset_info.json": "{}",
    })
    with caplog.at_level(logging.INFO, logger="dspark_precompute"):
        rows = rows_of(root)
    order = [(r.file, r.file_row, r.record["messages"][0]["content"]) for r in rows]
    assert order == [("a.ndjson", 0, "q2"), ("a/z.jsonl", 0, "q7"), ("b.jsonl", 0, "q0"), ("b.jsonl", 1, "q1"),
                     ("c.json", 0, "q3"), ("c.json", 1, "q4"), ("sub/deeper/y.json", 0, "q6"),
                     ("sub/x.jsonl", 0, "q5")]
    assert [r.row for r in rows] == list(range(8))
    log = caplog.text
    for rel, n in (("a.ndjson", 1), ("b.jsonl", 2), ("c.json", 2), ("sub/empty.jsonl", 0), ("sub/x.jsonl", 1)):
        assert f"data: {rel}: {n} rows" in log
    assert "not reading 5 file(s) that are not data: .gitattributes, .hidden/, LICENSE, README.md, " \
           "dataset_info.json" in log


def test_a_directory_with_files_it_cannot_read_is_refused_naming_them(tmp_path):
    root = write_tree(tmp_path / "d", {"a.jsonl": jl(good()), "notes.txt": "x", "sub/more.csv": "a,b",
                                       "sub/c.jsonl.gz": gzip.compress(b"{}")})
    with pytest.raises(DataError) as err:
        resolve_source(str(root))
    msg = str(err.value)
    assert "3 file(s)" in msg and "notes.txt" in msg and "sub/more.csv" in msg and "sub/c.jsonl.gz" in msg
    assert "move the other files out" in msg and "Decompress" in msg
    only_docs = write_tree(tmp_path / "docs", {"README.md": "x", ".gitattributes": "y"})
    with pytest.raises(DataError, match=r"without .jsonl, .ndjson, .json or .parquet files \(it holds only"):
        resolve_source(str(only_docs))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="directory without"):
        resolve_source(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="notes.txt"):  # refused before anything loads
        prepare(compose(small(tmp_path, f"data.path={root}")))


def test_parquet_files_in_a_directory_are_read_with_the_rest(tmp_path):
    import pyarrow as pa  # the [test] extra has it: a missing one fails, never skips
    import pyarrow.parquet as pq

    root = write_tree(tmp_path / "d", {"a.jsonl": jl(good(0))})
    (root / "sub").mkdir()
    pq.write_table(pa.Table.from_pylist([good(1), good(2)]), root / "sub" / "b.parquet")
    rows = rows_of(root)
    assert [(r.file, r.record["messages"][0]["content"]) for r in rows] == [
        ("a.jsonl", "q0"), ("sub/b.parquet", "q1"), ("sub/b.parquet", "q2")]


def test_without_pyarrow_parquet_files_are_refused_by_name(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    root = write_tree(tmp_path / "d", {"a.jsonl": jl(good()), "sub/b.parquet": b"PAR1"})
    with pytest.raises(DataError, match=r"sub/b.parquet: parquet input needs pyarrow"):
        resolve_source(str(root))


def test_files_named_for_other_splits_are_left_out_with_a_log_line(tmp_path, caplog):
    root = write_tree(tmp_path / "d", {"train.jsonl": jl(good(0)), "test.jsonl": jl(good(1)),
                                       "data/train-00001-of-00002.json": json.dumps([good(2)]),
                                       "validation/part.jsonl": jl(good(3))})
    with caplog.at_level(logging.INFO, logger="dspark_precompute"):
        got = [r.record["messages"][0]["content"] for r in rows_of(root)]
    assert got == ["q2", "q0"]
    assert "split 'train': reading the 2 file(s) named for it, not test.jsonl, validation/part.jsonl" in caplog.text
    assert [r.record["messages"][0]["content"] for r in rows_of(root, split="validation[0:1]")] == ["q3"]
    with pytest.raises(DataError, match=r"no file is named for split 'dev'.*test: test.jsonl"):
        rows_of(root, split="dev")
    plain = write_tree(tmp_path / "p", {"a.jsonl": jl(good(0)), "b.jsonl": jl(good(1))})
    assert len(rows_of(plain, split="test")) == 2  # nothing named for a split: every file is the split


def test_the_data_hash_covers_every_file_read_keyed_by_relative_path(tmp_path):
    def sha(files: dict) -> str:
        root = tmp_path / "h"
        shutil.rmtree(root, ignore_errors=True)
        return resolve_source(str(write_tree(root, files))).content_sha256()

    base = {"x/train.jsonl": jl(good(0)), "y/train.jsonl": jl(good(1))}
    h0 = sha(base)
    assert sha(base) == h0
    variants = [
        {"x/train.jsonl": jl(good(1)), "y/train.jsonl": jl(good(0))},  # same names and bytes, swapped folders
        {**base, "z/more.json": "[]"},  # an added file, even with no rows
        {"x/train.jsonl": jl(good(0))},  # a removed file
        {"x/train.jsonl": jl(good(0)), "y/train.jsonl": jl(good(2))},  # a changed nested file
        {"x/train.jsonl": jl(good(0)), "y/other.jsonl": jl(good(1))},  # a renamed file
        {"x/train.jsonl": jl(good(0)) + jl(good(1)).rstrip(), "y/train.jsonl": ""},  # bytes moved between files
    ]
    hashes = [sha(v) for v in variants]
    assert len({h0, *hashes}) == len(variants) + 1
    assert sha({**base, "README.md": "not data"}) == h0  # only files read count
    single = tmp_path / "one.jsonl"  # a single file keeps the hash older caches recorded
    single.write_text(jl(good(0)))
    assert resolve_source(str(single)).content_sha256() == hashlib.sha256(
        b"one.jsonl\0" + single.read_bytes()).hexdigest()


def test_rejects_name_the_file_and_line_they_came_from(tmp_path):
    root = write_tree(tmp_path / "d", {
        "a.jsonl": jl(good(0)) + "{broken\n" + jl(good(1)),
        "sub/b.json": "[\n" + json.dumps(good(2)) + ",\n" + json.dumps({"messages": []}) + "\n]",
    })
    cfg = compose(small(tmp_path, f"data.path={root}", "data.max_samples=null", "data.max_invalid_fraction=1"))
    result = run(cfg)
    rejects = [json.loads(x) for x in (Path(result.path) / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["file_row"], r["row"], r["reason"]) for r in rejects] == [
        ("a.jsonl", 2, 1, 1, "malformed_json"), ("sub/b.json", 3, 1, 4, "empty_conversation")]
    assert set(rejects[0]) == {"row", "file_row", "line", "file", "reason", "message"}


def test_symlinks_are_followed_but_never_into_a_loop_and_broken_links_are_refused(tmp_path, caplog):
    root = write_tree(tmp_path / "d", {"a.jsonl": jl(good(0)), "sub/b.jsonl": jl(good(1))})
    other = write_tree(tmp_path / "elsewhere", {"c.jsonl": jl(good(2))})
    os.symlink(root, root / "sub" / "loop")
    os.symlink(other, root / "linked")
    os.symlink(other / "c.jsonl", root / "z.jsonl")
    with caplog.at_level(logging.WARNING, logger="dspark_precompute"):
        got = [(r.file, r.record["messages"][0]["content"]) for r in rows_of(root)]
    assert got == [("a.jsonl", "q0"), ("linked/c.jsonl", "q2"), ("sub/b.jsonl", "q1"), ("z.jsonl", "q2")]
    assert "not following sub/loop/: it links back" in caplog.text
    os.symlink(tmp_path / "missing.jsonl", root / "gone.jsonl")
    with pytest.raises(DataError, match=r"gone.jsonl \(a symbolic link to .*missing.jsonl', which does not exist"):
        resolve_source(str(root))
    os.remove(root / "gone.jsonl")
    os.symlink("p.jsonl", root / "q.jsonl")
    os.symlink("q.jsonl", root / "p.jsonl")
    with pytest.raises(DataError, match=r"p.jsonl \(a symbolic link to 'q.jsonl', which cannot be read: Too many "
                                        r"levels of symbolic links\).*q.jsonl"):
        resolve_source(str(root))


# item 3: byte-order marks, lone surrogates, and other text that is not what it seems

def test_a_utf8_byte_order_mark_is_read_in_jsonl_and_json(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + jl(good(0), good(1)).encode() + bom + jl(good(2)).encode())
    (tmp_path / "b.json").write_bytes(bom + json.dumps([good(3)]).encode())
    (tmp_path / "c.json").write_bytes(bom + json.dumps(good(4)).encode())
    for name, want in (("a.jsonl", ["q0", "q1", "q2"]), ("b.json", ["q3"]), ("c.json", ["q4"])):
        rows = rows_of(tmp_path / name)
        assert [r.error for r in rows] == [None] * len(want), name
        assert [r.record["messages"][0]["content"] for r in rows] == want


def test_a_lone_surrogate_is_an_invalid_utf8_reject_saying_where_and_how_to_fix():
    rec = json.loads('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                     '"content": "ok \\ud800 there"}]}')
    got = normalize(RawRow(0, 1, record=rec))
    assert isinstance(got, Reject) and got.reason == "invalid_utf8"
    assert "messages[1].content holds U+D800 at character 3" in got.message
    assert "UTF-16 surrogate pair" in got.message and "without its other half" in got.message
    assert "replace the escape" in got.message
    for record, where in (
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a\udfff"}]},
         "conversations[1].value holds U+DFFF"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": {"x": "\udbff"}}}]}]},
         "messages[1].tool_calls[0].function.arguments.x holds U+DBFF"),
        ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "a", "reasoning_content": "\ud800"}]},
         "messages[1].reasoning_content"),
        ({**GOOD, "tools": [{"type": "function", "function": {"name": "f\ud801"}}]}, "tools[0].function.name"),
    ):
        got = normalize(RawRow(0, 1, record=record))
        assert isinstance(got, Reject) and got.reason == "invalid_utf8" and where in got.message, got
    paired = json.loads('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, '
                        '{"role": "assistant", "content": "a"}]}')
    assert not isinstance(normalize(RawRow(0, 1, record=paired)), Reject)  # an emoji, not a lone half
    assert not isinstance(normalize(RawRow(0, 1, record={**GOOD, "meta": "\ud800"})), Reject)  # never rendered


def test_files_that_are_not_utf8_text_are_refused_saying_what_they_are(tmp_path):
    text = jl(good(0), good(1))
    cases = {"u16.jsonl": (text.encode("utf-16"), "UTF-16 (little-endian byte-order mark)"),
             "u16nobom.jsonl": (text.encode("utf-16-le"), "mostly NUL bytes"),
             "u32.json": (json.dumps([good()]).encode("utf-32"), "UTF-32"),
             "z.jsonl": (gzip.compress(text.encode()), "gzip-compressed")}
    for name, (content, what) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=re.escape(what)):
            resolve_source(str(tmp_path / name))
        with pytest.raises(DataError, match=re.escape(what)):  # the readers check too
            read_rows(DataSource(str(tmp_path / name), [tmp_path / name], "jsonl" if "jsonl" in name else "json"),
                      DataConfig())
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(good()).encode() + b"\n" + json.dumps({"messages": "caf\u00e9"},
                                                                          ensure_ascii=False).encode("latin-1"))
    rows = rows_of(latin1)
    assert rows[0].error is None and rows[1].error[0] == "invalid_utf8"
    assert "byte 0xe9" in rows[1].error[1] and "iconv" in rows[1].error[1]


def test_a_saved_dataset_or_hub_id_without_datasets_installed_is_refused_before_reading(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "datasets" else real(name, *a, **k))
    saved = write_tree(tmp_path / "saved", {"state.json": "{}", "dataset_info.json": "{}", "data-00000.arrow": "x"})
    with pytest.raises(DataError, match="a dataset saved with save_to_disk: reading it needs the `datasets`"):
        resolve_source(str(saved))
    with pytest.raises(DataError, match="hub dataset id: reading it needs the `datasets` package"):
        resolve_source("someone/chat-data")


def test_lines_ending_in_a_bare_carriage_return_get_a_hint(tmp_path):
    f = tmp_path / "mac.jsonl"
    f.write_bytes(json.dumps(good(0)).encode() + b"\r" + json.dumps(good(1)).encode() + b"\r")
    (row,) = rows_of(f)
    assert row.error[0] == "malformed_json" and "more than one JSON value" in row.error[1]
    assert "bare \\r" in row.error[1]


def test_crlf_line_ends_and_a_last_line_without_newline_keep_rows_and_line_numbers(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\r\n".join([json.dumps(good(0)).encode(), b"", json.dumps(good(1)).encode(), b"  \t",
                                json.dumps(good(2)).encode()]))
    rows = rows_of(f)
    assert [(r.line, r.error, r.record["messages"][0]["content"]) for r in rows] == [
        (1, None, "q0"), (3, None, "q1"), (5, None, "q2")]


def test_deep_nesting_huge_numbers_and_scalar_rows_are_rejects_not_crashes(tmp_path):
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\n".join([deep, b'{"messages": [], "n": ' + b"7" * 5000 + b"}", b"3", b'"text"', b"null",
                              b"[]", json.dumps(good()).encode()]))
    rows = rows_of(f, max_row_bytes=1 << 20)
    assert rows[0].error[0] == "malformed_json" and "nested deeper" in rows[0].error[1]
    assert rows[1].error[0] == "malformed_json" and "5000 digits" in rows[1].error[1]
    got = [normalize(r) for r in rows[2:]]
    assert [g.message.split(",")[0] for g in got[:4]] == [
        "row is a JSON number", "row is a JSON string", "row is a JSON null", "row is a JSON array"]
    assert all(g.reason == "missing_messages" for g in got[:4]) and not isinstance(got[4], Reject)
    nested_args = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                 "tool_calls": "[" * 5000 + "]" * 5000}]}
    got = normalize(RawRow(0, 1, record=nested_args))
    assert got.reason == "malformed_json" and "nested too deeply" in got.message


def test_reject_messages_are_capped_so_huge_values_do_not_pile_up(tmp_path):
    got = normalize(RawRow(0, 1, record={"messages": [{"role": "x" * 5_000_000, "content": "q"}]}))
    assert got.reason == "unknown_role" and len(got.message) < 2100
    assert len(json.dumps(got.to_json())) < 1000


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
    | st.sampled_from(['"', "\\", "]}", "[{,"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(_json, max_size=6), as_array=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       ascii_only=st.booleans(), chunk=st.integers(1, 64), limit=st.integers(1, 200))
def test_the_json_scanner_finds_exactly_the_values_json_loads_finds(values, as_array, indent, ascii_only, chunk,
                                                                     limit):
    enc = [json.dumps(v, indent=indent, ensure_ascii=ascii_only).encode() for v in values]
    if as_array:
        doc = json.dumps(values, indent=indent, ensure_ascii=ascii_only).encode()
    else:  # JSON lines saved as .json (a first value that is an array would be the top-level array)
        assume(not values or not isinstance(values[0], list))
        doc = b"\n".join(enc)
    got = list(JsonValues(io.BytesIO(doc), "t.json", limit, chunk=chunk))
    if not as_array and not values:
        assert got == []
        return
    assert len(got) == len(values)
    for k, ((line, data, size), v, e) in enumerate(zip(got, values, enc, strict=True)):
        if data is None:
            assert size > limit
        else:
            assert size <= limit and json.loads(data) == v
        if indent is None or not as_array:
            assert size == len(e)
        if not as_array:
            assert line == 1 + sum(x.count(b"\n") + 1 for x in enc[:k])


def test_the_json_scanner_refuses_broken_structure_naming_file_and_line():
    for doc, what in ((b'[{"a": 1}\n{"b": 2}]', "expected ',' or ']'"), (b'[{"a": "x', "ends inside a string"),
                      (b'[{"a": [1, 2}', "ends inside the value that starts at line 1"),
                      (b'[1, 2] 3', "more data after the top-level array")):
        with pytest.raises(DataError, match=re.escape(what)) as err:
            list(JsonValues(io.BytesIO(doc), "sub/f.json", 1000, chunk=3))
        assert "sub/f.json: not valid JSON near line" in str(err.value)
