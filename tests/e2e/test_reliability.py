"""Nothing lost, nothing mixed: kills at many points, signals, full disks, locks, bad rows, bad configs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, assert_same_cache, compose, small
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_precompute import open_cache
from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.errors import CacheFormatError, ConfigError, DsparkError, LockedError, StorageWriteError
from dspark_precompute.read.verify import verify_cache
from dspark_precompute.write.plan.prepare import prepare
from dspark_precompute.write.run import run
from dspark_precompute.write.samples.chat import ChatEncoder
from dspark_precompute.write.samples.normalize import Reject, normalize
from dspark_precompute.write.samples.rows import RawRow
from dspark_precompute.write.samples.tokenize import tokenize
from dspark_precompute.write.target import tiny

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024", "data.max_samples=16")

# (fault point, hit) -> where the kill lands (16 rows, 4 units of 1024 token slots, one writer)
KILL_POINTS = [
    ("allocate", 1),               # while the arrays are being created
    ("atomic_write", 3),           # writing the sample tables (a temporary written, not renamed)
    ("atomic_write", 8),           # rejects.jsonl written, not yet renamed
    ("atomic_write", 9),           # first manifest written, not yet renamed
    ("write_part", 12),            # half-way through a unit's token ids shard (before the first forward)
    ("tokens_unit", 2),            # token ids and masks of two units stored, two not
    ("atomic_write", 18),          # the manifest saying every unit's tokens are stored, not yet renamed
    ("weights", 1),                # before target_weights.safetensors
    ("atomic_write", 19),          # during target_weights.safetensors (temp written, rename pending)
    ("unit_submitted", 1),         # a unit handed to the writers, nothing committed
    ("write_part", 2),             # in the middle of a shard's bytes (writer process: half a temporary)
    ("writer_array", 2),           # between a unit's shards (writer process)
    ("writer_before_commit", 1),   # a unit's shards all written, its commit record not
    ("unit_submitted", 3),         # later in the run, earlier units committed
    ("writer_array", 7),           # between a later unit's shards
    ("writer_before_commit", 3),   # between data and commit, later unit
    ("manifest", 3),               # during the final manifest update
]
# the default suite's share (one kill before the forward, between data and commit, in the final manifest;
# a stop in the token stores runs in-process in tests/write/plan/test_resume.py); the slow lane runs every point
FAST = {("write_part", 12), ("writer_before_commit", 3), ("manifest", 3)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    run(compose(small(tmp, *UNITS, name="ref")))
    return str(tmp / "ref"), open_cache(str(tmp / "ref"))


def cli(tmp_path, overrides, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tmp_path,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def assert_visible_samples_are_whole(path: str, reference) -> int:
    """Whatever a reader can see of a partial cache equals the finished reference."""
    try:
        c = open_cache(path, allow_incomplete=True)
    except CacheFormatError:
        return 0  # no manifest yet: nothing is visible
    ref_ids = {int(r): i for i, r in enumerate(reference[1].source_row)}
    for i in range(len(c)):
        got, want = c[i], reference[1][ref_ids[int(c.source_row[i])]]
        for k in want:
            assert np.array_equal(got[k].float().numpy(), want[k].float().numpy()), (i, k)
    return len(c)


def assert_incomplete_not_damaged(path: str) -> None:
    """A stopped run's cache is incomplete, never damaged: ``verify --allow-incomplete`` passes it with a note
    naming what the run writes later, or (stopped before its first manifest) finds no cache there at all."""
    report = verify_cache(path, allow_incomplete=True)
    if not (Path(path) / "manifest.json").exists():
        assert [p.check for p in report.problems] == ["manifest"] and "no manifest.json" in str(report.problems[0])
        return
    assert report.ok, report.format()
    assert [n for n in report.notes if n.startswith("incomplete: ")], report.format()


@pytest.mark.parametrize("point,hit", [pytest.param(p, h, marks=() if (p, h) in FAST else pytest.mark.slow)
                                       for p, h in KILL_POINTS])
def test_a_kill_at_any_point_then_the_same_command_gives_the_uninterrupted_cache(tmp_path, reference, point, hit):
    overrides = small(tmp_path, *UNITS, name="c")
    proc = cli(tmp_path, overrides, env={"DSPARK_FAULT": f"{point}={hit}"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-2000:]
    assert_visible_samples_are_whole(str(tmp_path / "c"), reference)
    assert_incomplete_not_damaged(str(tmp_path / "c"))
    again = cli(tmp_path, overrides)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert_same_cache(reference[0], str(tmp_path / "c"))


# with three writer processes a kill lands in one writer while the others hold pieces of the same unit
MULTI_WRITER_KILLS = [("writer_array", 2), ("writer_before_commit", 2), ("unit_submitted", 2)]


@pytest.mark.slow  # every case: the default lane's kills run with one writer count
@pytest.mark.parametrize("point,hit", MULTI_WRITER_KILLS)
def test_a_kill_with_three_writers_then_a_resume_with_one_gives_the_uninterrupted_cache(tmp_path, reference, point,
                                                                                        hit):
    overrides = small(tmp_path, *UNITS, name="c")
    proc = cli(tmp_path, [*overrides, "storage.writers=3"], env={"DSPARK_FAULT": f"{point}={hit}"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-2000:]
    assert_visible_samples_are_whole(str(tmp_path / "c"), reference)
    assert_incomplete_not_damaged(str(tmp_path / "c"))
    again = cli(tmp_path, [*overrides, "storage.writers=1"])
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert_same_cache(reference[0], str(tmp_path / "c"), process_counts=True)


def test_three_writers_and_two_tokenizers_write_the_same_bytes_as_one_of_each(tmp_path, reference, monkeypatch):
    from dspark_precompute.write.samples import tokenize as tokenize_module
    monkeypatch.setattr(tokenize_module, "START_ROWS", 4)
    monkeypatch.setattr(tokenize_module, "INLINE_ROWS", 4)  # the pool takes every row after the fourth
    run(compose(small(tmp_path, *UNITS, "storage.writers=3", "data.num_workers=2", name="c")))
    assert_same_cache(reference[0], str(tmp_path / "c"), process_counts=True)


def test_a_writer_whose_run_was_sigkilled_mid_shard_never_puts_that_shard_in_place(tmp_path):
    """The run's process SIGKILLed alone while its writer is inside a shard: the writer finishes nothing. A shard
    renamed into place after the run died could land after a resumed run committed that unit again, or after a
    trainer released and deleted it (a deleted unit's states back on disk)."""
    import psutil

    cache, ready, go = tmp_path / "c", tmp_path / "ready", tmp_path / "go"
    env = {"DSPARK_FAULT": "shard_part=1:await", "DSPARK_FAULT_READY": str(ready), "DSPARK_FAULT_AWAIT": str(go)}
    proc = cli(tmp_path, [*small(tmp_path, *UNITS, name="c"), "storage.writers=1"], env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():  # the writer waits inside its first shard (written in part, not yet in place)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        helpers = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()  # the run's process alone, as the OOM killer does: its writer lives on
        proc.wait()
        go.touch()  # the writer goes on: it must see its run is gone before anything is put in place
        gone, alive = psutil.wait_procs(helpers, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert not list((cache / "hidden_states").rglob("c.*"))  # no shard
    assert not list((cache / "hidden_states").rglob(".c.*.tmp"))  # and its temporary removed


def test_sigterm_stops_cleanly_with_a_resume_message_and_the_rerun_completes(tmp_path, reference):
    overrides = small(tmp_path, *UNITS, name="c")
    proc = cli(tmp_path, overrides, env={"DSPARK_FAULT": "unit_submitted=1:sleep"})
    commits = tmp_path / "c" / "commits"
    deadline = time.time() + 120
    while time.time() < deadline and not (commits.exists() and any(commits.glob("u*.json"))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "resume with the same command" in out + err
    with WriterLock(tmp_path / "c") as lock:  # the stopped run released it
        assert lock.held
    assert 0 < assert_visible_samples_are_whole(str(tmp_path / "c"), reference)
    again = cli(tmp_path, overrides)
    assert again.wait(timeout=300) == 0
    assert_same_cache(reference[0], str(tmp_path / "c"))


def test_a_full_disk_stops_with_the_path_and_bytes_left_and_the_cache_resumes(tmp_path, reference, monkeypatch):
    cfg = compose(small(tmp_path, *UNITS, name="c"))
    monkeypatch.setenv("DSPARK_FAULT", "writer_array=7:enospc")  # read by the spawned writer process
    with pytest.raises(StorageWriteError) as err:
        run(cfg)
    msg = str(err.value)
    assert str(tmp_path / "c") in msg and "No space left on device" in msg and re.search(r"[\d.]+ MB", msg)
    assert "re-run the same command" in msg
    monkeypatch.delenv("DSPARK_FAULT")
    assert run(cfg).resumed_units >= 1
    assert_same_cache(reference[0], str(tmp_path / "c"))


def test_a_full_disk_before_the_weights_are_written_leaves_a_cache_verify_calls_incomplete(tmp_path, reference,
                                                                                           monkeypatch, capsys):
    """A full disk while writing the token ids (seen on a 200 KiB tmpfs): 0 units committed, nothing damaged."""
    from dspark_precompute import faults
    from dspark_precompute.cli.cache import main as cache_cli

    cfg = compose(small(tmp_path, *UNITS, name="c"))
    monkeypatch.setenv("DSPARK_FAULT", "tokens_unit=2:enospc")  # two units' token ids written, two not
    faults.reload()
    with pytest.raises(StorageWriteError, match="No space left on device"):
        run(cfg)
    monkeypatch.delenv("DSPARK_FAULT")
    faults.reload()
    assert not (tmp_path / "c" / "target_weights.safetensors").exists()
    assert cache_cli(["verify", str(tmp_path / "c"), "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "incomplete: 0 of 4 unit(s) committed" in out
    assert "not written yet: " in out and "target_weights.safetensors" in out.split("not written yet: ")[1], out
    run(cfg)
    assert_same_cache(reference[0], str(tmp_path / "c"))


def test_a_second_run_on_a_locked_cache_is_refused_naming_the_owner(tmp_path):
    cfg = compose(small(tmp_path, name="c"))
    with WriterLock(tmp_path / "c"):
        with pytest.raises(LockedError) as err:
            run(cfg)
    assert f"pid {os.getpid()}" in str(err.value) and "started" in str(err.value)


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dspark_precompute.contract.lock import WriterLock; WriterLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LockedError, match=f"pid {holder.pid}"):
        run(compose(small(tmp_path, "data.max_samples=2", name="c")))
    holder.kill()
    holder.wait()
    assert json.loads((tmp_path / "c" / ".writer.lock").read_text())["pid"] == holder.pid  # its record stays
    assert run(compose(small(tmp_path, "data.max_samples=2", name="c"))).complete


def test_every_bad_row_kind_is_accounted_for_and_the_run_goes_on(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [json.dumps(good).encode(), b"{not json", b'{"messages": "\xff"}',
            json.dumps({"text": "x"}).encode(), json.dumps({"messages": []}).encode(),
            json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode(),
            json.dumps({"messages": [{"role": "alien", "content": "q"}, good["messages"][1]]}).encode(),
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]},
                                     good["messages"][1]]}).encode(),
            json.dumps({"messages": [{"role": "user", "content": "w " * 400}, good["messages"][1]]}).encode()]
    rows += [json.dumps(good).encode()] * 3
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join(rows) + b"\n")
    base = small(tmp_path, f"data.path={data}", "data.max_samples=null", "seq_length=128", "batch.max_tokens=512")
    with pytest.raises(DsparkError, match="above data.max_invalid_fraction"):
        run(compose(base))
    with pytest.raises(DsparkError, match=r"row 1 is invalid \(malformed_json\).*line 2"):
        run(compose([*base, "data.on_invalid=error", "data.max_invalid_fraction=1"]))
    result = run(compose([*base, "data.max_invalid_fraction=1"]))
    m = open_cache(result.path).manifest.to_json()["counts"]
    assert m["rows_in"] == 12 == m["samples"] + m["rejected"] and m["samples"] == 4
    rejects = [json.loads(x) for x in (Path(result.path) / "rejects.jsonl").read_text().splitlines()]
    assert {r["reason"] for r in rejects} == {
        "malformed_json", "invalid_utf8", "missing_messages", "empty_conversation", "no_assistant_turn",
        "unknown_role", "non_text_content", "no_supervised_tokens"}
    assert sorted(r["row"] for r in rejects) == list(range(1, 9))


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bot", None])},
    optional={"content": st.one_of(_text, st.none(), st.integers(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]), "text": _text}), max_size=2)),
        "reasoning_content": st.one_of(_text, st.none()),
        "tool_calls": st.one_of(st.none(), st.just("[bad"), st.lists(st.fixed_dictionaries(
            {"function": st.fixed_dictionaries({"name": _text, "arguments": st.dictionaries(_text, _text,
                                                                                              max_size=2)})}),
            max_size=2))})
_row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(_message, max_size=6)}),
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries(
        {"from": st.sampled_from(["human", "gpt", "system", "x"]), "value": _text}), max_size=5)}),
    st.dictionaries(_text, _text, max_size=2), st.lists(st.integers(), max_size=2), _text, st.none())


_TOK: list = []


def _tiny_tokenizer():
    if not _TOK:
        _TOK.append(tiny.build_tokenizer())
    return _TOK[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_row, min_size=1, max_size=8), seq_length=st.integers(1, 64))
def test_random_conversations_give_a_sample_or_a_typed_reject_never_a_crash(rows, seq_length):
    enc = ChatEncoder(_tiny_tokenizer(), tiny.CHAT_TEMPLATE, seq_length)
    samples = rejected = 0
    for i, record in enumerate(rows):
        item = normalize(RawRow(i, i + 1, record=record))
        if not isinstance(item, Reject):
            item = enc.encode(item, i)
        if isinstance(item, Reject):
            assert item.reason in {"malformed_json", "missing_messages", "unknown_role", "non_text_content",
                                   "empty_conversation", "no_assistant_turn", "template_error",
                                   "unmaskable_template", "no_supervised_tokens"}
            rejected += 1
        else:
            assert 0 < len(item.input_ids) <= seq_length and item.loss_mask.any()
            assert item.input_ids.dtype == np.int32 and item.loss_mask.dtype == np.uint8
            samples += 1
    assert samples + rejected == len(rows)


def test_pipeline_accounting_holds_for_random_garbage_files(tmp_path):
    rng = np.random.default_rng(0)
    good = (REPO / "dspark_precompute" / "assets" / "embedded_chat.jsonl").read_bytes().splitlines()
    lines = []
    for i in range(200):
        line = bytearray(good[i % len(good)])
        if rng.random() < 0.3:  # corrupt some bytes
            for j in rng.integers(0, len(line), size=3):
                line[j] = int(rng.integers(0, 256))
        lines.append(bytes(line).replace(b"\n", b" "))
    data = tmp_path / "noisy.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    plan = prepare(compose(small(tmp_path, f"data.path={data}", "data.max_samples=null",
                                 "data.max_invalid_fraction=1")))
    tok = tokenize(plan.encoding, plan.cfg.data)
    assert tok.rows_in == 200 == len(tok.lengths) + len(tok.rejects)
    assert len(tok.rejects) > 10


def write_model_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


def test_unsupported_and_audio_text_targets_are_refused_before_weights_load(tmp_path, monkeypatch):
    monkeypatch.setattr("dspark_precompute.write.run.load_target",
                        lambda *a, **k: pytest.fail("weights loaded"))
    bert = write_model_dir(tmp_path / "bert", {"model_type": "bert_like", "hidden_size": 8})
    # audio-text: transformers has no image-text class for it (image-text checkpoints run: test_image_text.py)
    audio = write_model_dir(tmp_path / "audio", {"model_type": "qwen2_audio", "audio_config": {}, "text_config": {
        "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 10}})
    for d, what in ((bert, "not a decoder-only LM"), (audio, "multimodal")):
        monkeypatch.setattr("dspark_precompute.write.plan.prepare.load_tokenizer", lambda cfg: tiny.build_tokenizer())
        with pytest.raises(ConfigError, match=what):
            run(compose(small(tmp_path, f"model.path={d}")))


def test_nothing_in_the_package_unpickles_or_calls_torch_load():
    src = "\n".join(p.read_text() for p in (REPO / "dspark_precompute").rglob("*.py"))
    for banned in ("torch.load(", "pickle.load", "pickle.loads(", "allow_pickle=True", "joblib.load"):
        assert banned not in src, banned
    load = REPO / "dspark_precompute" / "write" / "target" / "load.py"
    assert re.search(r"use_safetensors\W+True", load.read_text())
