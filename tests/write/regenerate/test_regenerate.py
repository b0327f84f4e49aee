"""The regeneration stage against a misbehaving server of our own: retries, resume by content, splice, rejects.

The fake server (``fake_openai``) answers each history with ``answer(history)``, the oracle every
regenerated turn is checked against; it fails, stalls, dies or refuses where a test tells it to.

Modules: ``write/regenerate/accounting.py`` (the reject reasons and counts), ``write/regenerate/request.py``
(the sampling sent), ``write/regenerate/boundaries.py`` (engine ids against ours), the client, splice and stage.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from fake_openai import Fake, answer, completion
from helpers import compose

from dspark_precompute.errors import ConfigError, RegenerateError, RegenerateResumeError
from dspark_precompute.write.plan.regenerated import regenerate_stage
from dspark_precompute.write.regenerate.stage import regenerate, sibling
from dspark_precompute.write.regenerate.store import ResumeStore


def rows_file(tmp_path: Path, n: int = 5, extra: list[dict] | None = None) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"recorded answer {i}"}]} for i in range(n)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + (extra or [])))
    return path


def config(tmp_path: Path, urls: list[str], data: Path, *extra: str):
    return compose([f"data.path={data}", f"storage.path={tmp_path / 'cache'}", "regenerate=server",
                    f"regenerate.base_urls=[{','.join(urls)}]", "regenerate.retry_backoff=0.01",
                    "regenerate.concurrency=2", *extra])


def output_rows(tmp_path: Path) -> list[dict]:
    text = (tmp_path / "cache.regenerated.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def assert_regenerated(rows: list[dict], source: list[dict]) -> None:
    """One row per source row, in source order, each assistant turn the server's answer to its history."""
    assert len(rows) == len(source)
    for row, src in zip(rows, source, strict=True):
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in src["messages"]]
        for i, m in enumerate(row["messages"]):
            if m["role"] == "assistant":
                assert m["content"] == answer(row["messages"][:i])
            else:
                assert m["content"] == src["messages"][i]["content"]


def test_a_regeneration_that_lost_rows_refuses_to_capture_and_the_same_command_asks_only_those(tmp_path):
    data = rows_file(tmp_path, 6)
    failing = {"question 2", "question 4"}
    with Fake(lambda n, b: (500, b'{"error": "boom"}') if b["messages"][-1]["content"] in failing else None) as f:
        with pytest.raises(RegenerateError, match="2 of 6 row.*Run the same command again"):
            regenerate_stage(config(tmp_path, [f.url], data, "regenerate.max_retries=1"))
        assert len(f.requests) == 4 + 2 * 2  # each failing row: the request and its retry
    rejects = [json.loads(x) for x in sibling(tmp_path / "cache.regenerated.jsonl", ".rejects.jsonl").read_text()
               .splitlines()]
    assert [(r["row"], r["reason"]) for r in rejects] == [(2, "request_failed"), (4, "request_failed")]
    assert "HTTP 500" in rejects[0]["message"] and "boom" in rejects[0]["message"]
    with Fake() as healthy:
        done, capture = regenerate_stage(config(tmp_path, [healthy.url], data))
        assert sorted(b["messages"][-1]["content"] for b in healthy.requests) == sorted(failing)
    source = [json.loads(line) for line in data.read_text().splitlines()]
    assert_regenerated(output_rows(tmp_path), source)
    assert done.counts.rows_in == done.counts.regenerated == 6 and done.counts.asked_now == 2
    assert capture.data.path == str(tmp_path / "cache.regenerated.jsonl") and capture.regenerate.engine == "none"


def test_500s_429s_garbage_and_a_stalled_answer_are_retried_until_the_row_is_answered(tmp_path):
    release = threading.Event()
    script = {1: (500, b"{}"), 2: (429, b"{}"), 3: (200, b"{not json"), 4: "stall"}

    def behave(n, body):
        what = script.get(n)
        if what == "stall":
            release.wait(30)  # the client times out first and asks again
            return "close"
        return what

    with Fake(behave) as f:
        try:
            done = regenerate(config(tmp_path, [f.url], rows_file(tmp_path, 1), "regenerate.timeout=0.5"),
                              tmp_path / "out.jsonl")
        finally:
            release.set()
    assert len(f.requests) == 5 and done.counts.regenerated == 1 and not done.failed


def test_a_server_that_dies_hands_its_rows_to_the_other_one(tmp_path):
    data = rows_file(tmp_path, 8)
    with Fake(lambda n, b: "close" if n > 1 else None) as dying, Fake() as healthy:
        done = regenerate(config(tmp_path, [dying.url, healthy.url], data, "regenerate.max_retries=1"),
                          tmp_path / "cache.regenerated.jsonl")
    assert done.counts.regenerated == 8 and not done.failed
    assert_regenerated(output_rows(tmp_path), [json.loads(x) for x in data.read_text().splitlines()])


def test_refusals_and_cut_turns_are_typed_rejects_and_rows_in_is_regenerated_plus_rejects(tmp_path):
    def behave(n, body):
        last = body["messages"][-1]["content"]
        if last == "question 1":
            return 200, completion(body, content=None, refusal="I cannot help with that")
        if last == "question 3":
            return 200, completion(body, finish="length")
        return None

    data = rows_file(tmp_path, 5, extra=[{"messages": [{"role": "user", "content": "no answer"}]}])
    with Fake(behave) as f:
        done = regenerate(config(tmp_path, [f.url], data, "regenerate.on_length=reject"), tmp_path / "o.jsonl")
    c = done.counts
    assert (c.rows_in, c.regenerated, c.rejected) == (6, 3, 3) and c.rows_in == c.regenerated + c.rejected
    assert c.reasons == {"refusal": 1, "length": 1, "no_assistant_turn": 1} and c.cut_turns == 1
    rejects = [json.loads(x) for x in sibling(tmp_path / "o.jsonl", ".rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in rejects] == [(1, "refusal"), (3, "length"), (5, "no_assistant_turn")]
    assert rejects[0]["message"] == "I cannot help with that"


def test_changed_sampling_refuses_to_resume_naming_the_change(tmp_path):
    data = rows_file(tmp_path, 2)
    with Fake() as f:
        regenerate(config(tmp_path, [f.url], data), tmp_path / "o.jsonl")
        changed = r"sampling: recorded .*'temperature': 0\.0.*'temperature': 0\.7"
        with pytest.raises(RegenerateResumeError, match=changed):
            regenerate(config(tmp_path, [f.url], data, "regenerate.temperature=0.7"), tmp_path / "o.jsonl")


def test_a_torn_last_log_line_is_cut_off_and_only_that_row_is_asked_again(tmp_path):
    data = rows_file(tmp_path, 3)
    out = tmp_path / "cache.regenerated.jsonl"
    with Fake() as f:
        regenerate(config(tmp_path, [f.url], data), out)
    log = out.with_name(out.name + ".parts") / "log.jsonl"
    text = log.read_bytes()
    log.write_bytes(text[: text.rstrip(b"\n").rfind(b"\n") + 1] + text.rstrip(b"\n").rsplit(b"\n", 1)[1][:20])
    out.unlink()
    with Fake() as again:
        done = regenerate(config(tmp_path, [again.url], data), out)
        assert len(again.requests) == 1
    assert done.counts.asked_now == 1 and len(log.read_text().splitlines()) == 3
    assert_regenerated(output_rows(tmp_path), [json.loads(x) for x in data.read_text().splitlines()])


def tool_row() -> dict:
    return {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "old-1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "old-1", "content": "sunny, 21C"},
                {"role": "assistant", "content": "It is sunny."}]}


def test_tool_results_are_spliced_back_under_the_regenerated_call_ids(tmp_path):
    call = {"id": "new-7", "type": "function", "function": {"name": "lookup", "arguments": "{\"city\": \"Paris\"}"}}

    def behave(n, body):
        if body["messages"][-1]["role"] == "user":
            return 200, completion(body, content="", tool_calls=[call])
        return None

    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(tool_row()) + "\n")
    with Fake(behave) as f:
        done = regenerate(config(tmp_path, [f.url], data), tmp_path / "cache.regenerated.jsonl")
    second = f.requests[1]["messages"]
    assert second[-1] == {"role": "tool", "tool_call_id": "new-7", "content": "sunny, 21C"}
    assert f.requests[0]["tools"] == tool_row()["tools"]
    msgs = output_rows(tmp_path)[0]["messages"]
    assert msgs[1]["tool_calls"] == [call] and msgs[2]["tool_call_id"] == "new-7"
    assert msgs[3]["content"] == "echo: sunny, 21C" and done.counts.tool_mismatches == 0 and done.counts.turns == 2


def test_turns_last_keeps_the_recorded_history_and_regenerates_the_last_turn_only(tmp_path):
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(tool_row()) + "\n")
    with Fake() as f:
        done = regenerate(config(tmp_path, [f.url], data, "regenerate.turns=last"), tmp_path / "o.jsonl")
    assert len(f.requests) == 1 and done.counts.turns == 1
    msgs = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()][0]["messages"]
    assert msgs[:3] == tool_row()["messages"][:3] and msgs[3]["content"] == "echo: sunny, 21C"


def test_a_store_keeps_one_row_per_source_row_in_source_order_whatever_the_completion_order(tmp_path):
    store = ResumeStore(tmp_path / "o.jsonl", {"s": 1}).open()
    for k in ("c", "a", "b"):
        store.append({"key": k, "row": {"messages": [{"role": "user", "content": k}]}})
    store.close()
    assert store.build(["a", "b", "a", "c"]) == 4
    assert [json.loads(x)["messages"][0]["content"] for x in (tmp_path / "o.jsonl").read_text().splitlines()] == \
        ["a", "b", "a", "c"]


def test_regenerate_server_without_urls_and_only_without_server_are_config_errors():
    with pytest.raises(ConfigError, match=r"regenerate=server needs regenerate.base_urls"):
        compose(["regenerate=server"])
    with pytest.raises(ConfigError, match=r"regenerate.only=true needs regenerate=server"):
        compose(["regenerate.only=true"])
    with pytest.raises(ConfigError, match=r"regenerate.temperature=3.0 must be in \[0, 2\]"):
        compose(["regenerate=server", "regenerate.base_urls=[http://x:1/v1]", "regenerate.temperature=3.0"])


def test_a_server_that_does_not_answer_stops_before_any_row_naming_its_url(tmp_path):
    with Fake() as f:
        url = f.url
    with pytest.raises(RegenerateError, match=f"{url}.*does not answer"):
        regenerate(config(tmp_path, [url], rows_file(tmp_path, 1)), tmp_path / "o.jsonl")


def test_the_pool_takes_rows_from_a_generator_as_the_threads_need_them_never_all_at_once():
    """The paper's 1.3M rows: only what is in flight is read, so memory holds keys, not conversations."""
    from dspark_precompute.write.regenerate.client import Pool

    pulled = 0

    def jobs():
        nonlocal pulled
        for i in range(10_000):
            pulled += 1
            yield i

    pool = Pool([object(), object()], concurrency=3)  # 6 threads; work never touches the server
    results = pool.run(jobs(), lambda server, job: job * 2)
    first = next(results)
    assert first[1] == first[0] * 2
    assert pulled <= 2 * 6 + 6 + 1  # the queue ahead (twice the threads) and the jobs in hand, not 10,000
    rest = list(results)
    assert sorted(j for j, _ in [first, *rest]) == list(range(10_000)) and pulled == 10_000
    assert all(r == j * 2 for j, r in rest)


def test_a_resume_reads_finished_rows_back_from_the_log_and_writes_the_same_output(tmp_path):
    data = rows_file(tmp_path, 40)
    with Fake() as f:
        cfg = config(tmp_path, [f.url], data)
        first = regenerate(cfg, tmp_path / "cache.regenerated.jsonl")
        whole = (tmp_path / "cache.regenerated.jsonl").read_bytes()
        again = regenerate(cfg, tmp_path / "cache.regenerated.jsonl")
        assert len(f.requests) == 40
    assert first.counts.regenerated == again.counts.regenerated == 40 and again.counts.asked_now == 0
    assert (tmp_path / "cache.regenerated.jsonl").read_bytes() == whole
    assert_regenerated(output_rows(tmp_path), [json.loads(x) for x in data.read_text().splitlines()])


def test_a_second_regeneration_of_the_same_output_while_one_runs_is_refused_naming_the_owner(tmp_path):
    """Two appenders would interleave their rows in one log (and each read the other's lines as its own)."""
    from dspark_precompute.errors import LockedError

    data, out = rows_file(tmp_path, 4), tmp_path / "cache.regenerated.jsonl"
    started, release = threading.Event(), threading.Event()

    def behave(n, body):
        started.set()
        release.wait(30)

    with Fake(behave) as f:
        cfg = config(tmp_path, [f.url], data)
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(done=regenerate(cfg, out)))
        t.start()
        try:
            assert started.wait(30)
            with pytest.raises(LockedError, match=r"\.parts is being written by pid \d+"):
                regenerate(cfg, out)
        finally:
            release.set()
            t.join(60)
    assert first["done"].counts.regenerated == 4
    assert_regenerated(output_rows(tmp_path), [json.loads(x) for x in data.read_text().splitlines()])
    assert not (out.with_name(out.name + ".parts") / ".writer.lock").exists()


def test_a_log_line_that_is_not_the_row_it_is_indexed_as_is_refused_not_written_as_that_row(tmp_path):
    data, out = rows_file(tmp_path, 3), tmp_path / "cache.regenerated.jsonl"
    with Fake() as f:
        cfg = config(tmp_path, [f.url], data)
        regenerate(cfg, out)
        store = ResumeStore(out, json.loads((out.with_name(out.name + ".parts") / "settings.json").read_text()))
        store.open()
        try:
            log = store.parts / "log.jsonl"
            lines = log.read_bytes().splitlines(keepends=True)
            first_key = json.loads(lines[0])["key"]
            log.write_bytes(lines[1] + lines[0] + b"".join(lines[2:]))  # swapped under the open store
            with pytest.raises(RegenerateError, match="not the logged row"):
                list(store.records([first_key]))  # its offset now holds the other row (or half of one)
        finally:
            store.close()


@pytest.mark.parametrize("damage", [b"{not json\n", b"[1, 2]\n", b'{"row": {}}\n'])
def test_a_damaged_log_line_is_a_typed_refusal_naming_the_line_not_a_traceback(tmp_path, damage):
    data, out = rows_file(tmp_path, 3), tmp_path / "cache.regenerated.jsonl"
    with Fake() as f:
        cfg = config(tmp_path, [f.url], data)
        regenerate(cfg, out)
        log = out.with_name(out.name + ".parts") / "log.jsonl"
        lines = log.read_bytes().splitlines(keepends=True)
        log.write_bytes(lines[0] + damage + b"".join(lines[1:]))
        with pytest.raises(RegenerateError, match=r"log.jsonl: line 2 is not a finished row's record"):
            regenerate(cfg, out)
    assert not (out.with_name(out.name + ".parts") / ".writer.lock").exists()  # the refusal released the lock


def rejects_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in sibling(out, ".rejects.jsonl").read_text().splitlines()]


def call_row(calls: object) -> dict:
    return {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x", "tool_calls": calls}}


def chat_answer(choices: object) -> bytes:
    """A 200 answer with these ``choices`` (absent when None), shaped as no engine should shape it."""
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "fake-model",
            "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}
    return json.dumps(body if choices is None else {**body, "choices": choices}).encode()


@pytest.mark.parametrize(("message", "extra", "why"), [
    ({"content": None}, [], "no content, no tool calls and no reasoning"),
    ({"content": ""}, [], "no content, no tool calls and no reasoning"),
    ({"content": " \n\t"}, [], r"content ' \\n\\t', no tool calls"),
    ({}, [], "no content, no tool calls"),
    ({"content": None, "reasoning_content": "let me think"}, ["regenerate.reasoning=none"],
     "only reasoning, which regenerate.reasoning=none drops"),
])
def test_an_empty_answer_is_an_empty_answer_reject_never_an_empty_stored_turn(tmp_path, message, extra, why):
    def behave(n, body):
        if body["messages"][-1]["content"] == "question 1":
            payload = json.loads(completion(body))
            payload["choices"][0]["message"] = {"role": "assistant", **message}
            return 200, json.dumps(payload).encode()
        return None

    data, out = rows_file(tmp_path, 3), tmp_path / "cache.regenerated.jsonl"
    with Fake(behave) as f:
        done = regenerate(config(tmp_path, [f.url], data, *extra), out)
    c = done.counts
    assert (c.rows_in, c.regenerated, c.rejected, c.reasons) == (3, 2, 1, {"empty_answer": 1})
    assert [(r["row"], r["reason"]) for r in rejects_of(out)] == [(1, "empty_answer")]
    assert re.search(why, rejects_of(out)[0]["message"])
    assert json.loads(sibling(out, ".meta.json").read_text())["counts"]["reasons"] == {"empty_answer": 1}
    source = [json.loads(line) for line in data.read_text().splitlines()]
    assert_regenerated(output_rows(tmp_path), [source[0], source[2]])  # no row holds an empty turn
    assert not done.failed  # the engine's answer: kept in the log, not asked again
    with Fake() as again:
        assert regenerate(config(tmp_path, [again.url], data, *extra), out).counts.reasons == {"empty_answer": 1}
        assert not again.requests


@pytest.mark.parametrize(("message", "extra"), [
    ({"content": None, "tool_calls": [{"id": "c-1", "type": "function",
                                       "function": {"name": "lookup", "arguments": "{}"}}]}, []),
    ({"content": None, "reasoning_content": "let me think"}, ["regenerate.reasoning=save"]),
])
def test_a_turn_without_content_but_with_tool_calls_or_kept_reasoning_is_an_answer(tmp_path, message, extra):
    def behave(n, body):
        payload = json.loads(completion(body))
        payload["choices"][0]["message"] = {"role": "assistant", **message}
        return 200, json.dumps(payload).encode()

    with Fake(behave) as f:
        done = regenerate(config(tmp_path, [f.url], rows_file(tmp_path, 1), *extra), tmp_path / "o.jsonl")
    assert done.counts.regenerated == 1 and done.counts.rejected == 0
    turn = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()][0]["messages"][1]
    assert turn.get("tool_calls") == message.get("tool_calls")
    assert turn.get("reasoning_content") == message.get("reasoning_content")


@pytest.mark.parametrize(("choices", "why"), [
    (None, "answered without choices"),
    ([], "answered without choices"),
    ([{"index": 0, "finish_reason": "stop"}], "first choice has no message"),
    ([{"index": 0, "finish_reason": "stop", "message": None}], "first choice has no message"),
    ([{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": 5}}],
     "content is of type int, not a string or null"),
    ([{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": [{"type": "text",
                                                                                          "text": "hi"}]}}],
     "content is of type list"),
    ([call_row("lookup")], "tool_calls is not a list of calls"),
])
def test_an_answer_of_the_wrong_shape_is_a_request_failed_reject_naming_what_is_wrong(tmp_path, choices, why):
    data, out = rows_file(tmp_path, 2), tmp_path / "cache.regenerated.jsonl"
    with Fake(lambda n, b: (200, chat_answer(choices)) if b["messages"][-1]["content"] == "question 0" else None) as f:
        with pytest.raises(RegenerateError, match="1 of 2 row"):
            regenerate_stage(config(tmp_path, [f.url], data))
    [reject] = rejects_of(out)
    assert (reject["row"], reject["reason"]) == (0, "request_failed") and why in reject["message"]
    logged = [json.loads(x) for x in (out.with_name(out.name + ".parts") / "log.jsonl").read_text().splitlines()]
    assert [r["row"]["messages"][1]["content"] for r in logged] == ["echo: question 1"]  # the bad one: not logged


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from dspark_precompute.write.target.tiny import save_image_text_checkpoint

    d = tmp_path_factory.mktemp("tiny_qwen3_vl")
    save_image_text_checkpoint("qwen3_vl", d)
    return d


def image_rows_file(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """Two rows with a JPEG each (relative paths, both forms) and a text row; the images' bytes."""
    import numpy as np
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    rng, blobs = np.random.default_rng(0), []
    for k in range(2):
        Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "imgs" / f"{k}.jpg")
        blobs.append((tmp_path / "imgs" / f"{k}.jpg").read_bytes())
    rows = [{"messages": [{"role": "user", "content": "<image>What is it?"},
                          {"role": "assistant", "content": "recorded"}], "images": ["imgs/0.jpg"]},
            {"messages": [{"role": "user", "content": "plain question"}, {"role": "assistant", "content": "rec"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "And this?"},
                                                        {"type": "image_url", "image_url": {"url": "imgs/1.jpg"}}]},
                          {"role": "assistant", "content": "recorded"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, blobs


def sent_images(body: dict) -> list[bytes]:
    import base64

    return [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for m in body["messages"]
            if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"]


def test_rows_with_images_are_asked_with_the_images_inline_and_the_regenerated_rows_capture(tmp_path, vl_dir):
    from helpers import small

    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.run import run

    data, blobs = image_rows_file(tmp_path)
    with Fake() as f:
        done, capture = regenerate_stage(config(tmp_path, [f.url], data, f"model.path={vl_dir}"))
        sent = {i: sent_images(b) for i, b in enumerate(f.requests)}
    assert done.counts.regenerated == 3 and sorted(map(len, sent.values())) == [0, 1, 1]
    assert sorted(x[0] for x in sent.values() if x) == sorted(blobs)  # the files' own bytes, as data: URLs
    rows = output_rows(tmp_path)
    parts = [p for r in rows for m in r["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "image"]
    assert [Path(p["image"]).read_bytes() for p in parts] == blobs  # named absolutely: read from anywhere
    assert all(m["content"].startswith("echo: ") for r in rows for m in r["messages"] if m["role"] == "assistant")
    result = run(compose([*small(tmp_path, f"model.path={vl_dir}", "seq_length=1024"),
                          f"data.path={capture.data.path}"]))
    assert result.complete and len(CacheReader(result.path)) == 3


def test_a_changed_image_is_asked_again_and_a_missing_one_is_an_invalid_row_never_sent(tmp_path, vl_dir):
    import numpy as np
    from PIL import Image

    data, _ = image_rows_file(tmp_path)
    with Fake() as f:
        regenerate_stage(config(tmp_path, [f.url], data, f"model.path={vl_dir}"))
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(tmp_path / "imgs" / "1.jpg")
    (tmp_path / "imgs" / "0.jpg").unlink()
    with Fake() as f:
        done, _ = regenerate_stage(config(tmp_path, [f.url], data, f"model.path={vl_dir}"))
        asked = [sent_images(b) for b in f.requests]
    assert asked == [[(tmp_path / "imgs" / "1.jpg").read_bytes()]]  # only the changed image's row, again
    assert done.counts.regenerated == 2
    assert [(r["row"], r["reason"]) for r in rejects_of(tmp_path / "cache.regenerated.jsonl")] == [
        (0, "image_missing")]


def test_each_image_is_read_and_hashed_once_per_run_though_both_passes_and_every_turn_need_it(
        tmp_path, vl_dir, monkeypatch):
    """A two-turn row and a second row name the same image, a third row another: each file is read once (the
    selection hashes it, the pending pass reuses the hash, every request that sends it reuses the bytes)."""
    from collections import Counter

    data, blobs = image_rows_file(tmp_path)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[0]["messages"] += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "later"}]
    rows.append({"messages": [{"role": "user", "content": "<image>Again?"}, {"role": "assistant", "content": "r"}],
                 "images": ["imgs/0.jpg"]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reads: Counter[str] = Counter()
    read_bytes = Path.read_bytes

    def counted(self: Path) -> bytes:
        if self.suffix == ".jpg":
            reads[self.name] += 1
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", counted)
    with Fake() as f:
        regenerate(config(tmp_path, [f.url], data, f"model.path={vl_dir}"), tmp_path / "out.jsonl")
        sent = [sent_images(b) for b in f.requests]
    assert sorted(map(len, sent)) == [0, 1, 1, 1, 1]  # row 0 asked twice (two turns), rows 2 and 3 once each
    assert sum(x == [blobs[0]] for x in sent) == 3 and sum(x == [blobs[1]] for x in sent) == 1
    assert reads == {"0.jpg": 1, "1.jpg": 1}


def test_the_kept_image_bytes_stay_within_the_budget_and_a_dropped_image_is_read_again(tmp_path):
    import base64

    from dspark_precompute.write.regenerate.request import InlineImages

    files = []
    for k in range(3):
        files.append(tmp_path / f"{k}.png")
        files[-1].write_bytes(b"\x89PNG" + bytes([k]) * 96)  # 100 bytes each
    images = InlineImages(budget=250)
    digests = [images.sha256(str(p)) for p in files]
    assert images.held == 200 and len(set(digests)) == 3  # the first one dropped: 300 > 250
    for p in files:
        url = images.part(str(p))["image_url"]["url"]
        assert url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == p.read_bytes()
    assert images.held <= 250
    assert images.sha256(str(tmp_path / "none.png")).startswith("missing:")


def test_a_video_part_is_sent_as_a_video_url_with_the_files_bytes_and_its_mime_type(tmp_path):
    """What vLLM's OpenAI-compatible API takes for a video (the capture side's tests: test_media_video.py)."""
    import base64

    from dspark_precompute.write.regenerate.request import InlineImages, history_message

    mp4 = tmp_path / "a.mp4"
    mp4.write_bytes(b"\0\0\0\x20ftypisom" + bytes(range(40)))
    avi = tmp_path / "b.avi"
    avi.write_bytes(b"RIFF\x10\0\0\0AVI LIST" + bytes(20))
    m = {"role": "user", "content": [{"type": "video", "video": str(mp4)}, {"type": "text", "text": "and"},
                                     {"type": "video", "video": str(avi)}]}
    for images in (None, InlineImages()):
        parts = history_message(m, images)["content"]
        assert [p["type"] for p in parts] == ["video_url", "text", "video_url"]
        urls = [p["video_url"]["url"] for p in parts if p["type"] == "video_url"]
        assert urls[0].startswith("data:video/mp4;base64,") and urls[1].startswith("data:video/x-msvideo;base64,")
        assert base64.b64decode(urls[0].split(",", 1)[1]) == mp4.read_bytes()
