"""A resume reads back what the first run stored before its first forward (ids, masks, tables) instead of
tokenizing again, still refuses changed inputs, and says what to do with a cache of another format version."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, assert_same_cache, compose, small, stopped_after_units

from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import CacheFormatError, IncompatibleCacheError
from dspark_precompute.write.run import run
from dspark_precompute.write.samples import tokenize as tokenize_module

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024", "data.max_samples=16")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_ref")
    run(compose(small(tmp, *UNITS, name="ref")))
    return str(tmp / "ref")


def interrupted(tmp_path: Path, monkeypatch, after_units: int = 3, *extra: str) -> list[str]:
    """A run stopped by an error once ``after_units`` units were handed to the writers; its overrides."""
    overrides = small(tmp_path, *UNITS, *extra, name="c")
    stopped_after_units(overrides, monkeypatch, after_units)
    return overrides


def test_a_resume_reads_the_stored_tokens_back_and_never_tokenizes(tmp_path, monkeypatch, reference):
    overrides = interrupted(tmp_path, monkeypatch)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["tokens_stored"] is True and not m["complete"]
    done = committed_units(CacheStore(tmp_path / "c"))
    assert 0 < len(done) < m["layout"]["num_units"]

    def refuse(*args, **kwargs):
        raise AssertionError("a resume tokenized again")

    monkeypatch.setattr("dspark_precompute.write.run.tokenize", refuse)
    monkeypatch.setattr(tokenize_module, "encode_selection", refuse)
    result = run(compose(overrides))
    assert result.complete and result.resumed_units == len(done)
    assert "read_tokens_s" in result.timing and "tokenize_s" not in result.timing
    assert_same_cache(reference, str(tmp_path / "c"))


def test_a_resume_still_refuses_changed_data_naming_its_content_hash(tmp_path, monkeypatch):
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 20},
                          {"role": "assistant", "content": f"answer {i} " * 40}]} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = interrupted(tmp_path, monkeypatch, 1, f"data.path={data}", "storage.unit_tokens=512")
    rows[3]["messages"][1]["content"] = "an edited answer " * 40
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(IncompatibleCacheError, match=r"data.content_sha256: recorded '[0-9a-f]+', requested"):
        run(compose(overrides))


def test_a_resume_of_a_run_killed_before_its_tokens_were_stored_tokenizes_and_completes(tmp_path, monkeypatch,
                                                                                      reference):
    overrides = small(tmp_path, *UNITS, name="c")
    monkeypatch.setenv("DSPARK_FAULT", "tokens_unit=2:raise")
    from dspark_precompute import faults

    faults.reload()
    with pytest.raises(Exception, match="fault"):
        run(compose(overrides))
    monkeypatch.delenv("DSPARK_FAULT")
    faults.reload()
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["tokens_stored"] is False
    result = run(compose(overrides))
    assert result.complete and "tokenize_s" in result.timing
    assert_same_cache(reference, str(tmp_path / "c"))


def test_resuming_a_format_1_cache_is_refused_saying_which_version_wrote_it_and_what_to_do(tmp_path):
    with tarfile.open(REPO / "tests" / "data" / "format1_caches.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    cache = tmp_path / "bf16"
    m = json.loads((cache / "manifest.json").read_text())
    m["complete"] = False  # as if 0.2 had been stopped half-way
    (cache / "manifest.json").write_text(json.dumps(m))
    cfg = json.loads(json.dumps(m["config"]))
    overrides = [f"storage.path={cache}", f"seq_length={cfg['seq_length']}", "data.max_samples=5",
                 "storage.chunk_tokens=64", "storage.unit_tokens=256", "progress=false"]
    with pytest.raises(CacheFormatError, match=r"holds a format 1 cache written by dspark-precompute 0.2.0; this "
                                               r"version writes and resumes format 3 only. It is unfinished: finish it "
                                               r"with the version that wrote it .*or pass overwrite=true"):
        run(compose(overrides))
    shutil.rmtree(tmp_path / "fp8_e4m3")


@pytest.mark.parametrize("complete,words", [
    (True, r"It is complete: read it as it is \(this version reads and verifies it\)"),
    (False, r"It is unfinished: finish it with the version that wrote it \(pip install 'dspark-precompute==0.3.0', "
            r"then the same command\)"),
])
def test_resuming_a_format_2_cache_is_refused_so_bound_and_unbound_units_never_mix(tmp_path, complete, words):
    """Format 2 records bind nothing: a resume would commit bound units beside unbound ones. It is refused, saying
    what to do, before anything is written."""
    with tarfile.open(REPO / "tests" / "data" / "format2_caches.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    cache = tmp_path / "bf16"
    m = json.loads((cache / "manifest.json").read_text())
    m["complete"] = complete
    (cache / "manifest.json").write_text(json.dumps(m))
    before = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*"))
    overrides = [f"storage.path={cache}", "seq_length=128", "data.max_samples=12", "storage.chunk_tokens=128",
                 "storage.unit_tokens=256", "progress=false"]
    with pytest.raises(CacheFormatError, match=r"holds a format 2 cache written by dspark-precompute 0.3.0; this "
                                               r"version writes and resumes format 3 only. " + words
                                               + r".*or pass overwrite=true to re-create it in format 3"):
        run(compose(overrides))
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")) == before


def test_a_resume_finds_token_shards_moved_since_the_first_run_and_tokenizes_again(tmp_path, monkeypatch,
                                                                                  reference):
    """The ids a resume forwards are read back from the stored shards: two of them swapped between the runs are
    found by the token record (written from the bytes the first run wrote), so the run tokenizes again and rewrites
    them, instead of forwarding other samples' tokens."""
    overrides = interrupted(tmp_path, monkeypatch, 1)
    cache = tmp_path / "c"
    import zarr

    g = zarr.open_group(str(cache), mode="r")
    chunks = -(-(np.asarray(g["units/token_stop"][:]) - np.asarray(g["units/token_start"][:])) // 256)
    left = sorted(set(range(len(chunks))) - committed_units(CacheStore(cache)))
    pair = next((u, v) for u in left for v in left if u < v and chunks[u] == chunks[v])  # every chunk reads back
    a, b = (cache / "input_ids" / f"c.{u}" for u in pair)
    blob = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(blob)
    result = run(compose(overrides))
    assert result.complete and "tokenize_s" in result.timing
    assert_same_cache(reference, str(cache))


def test_a_resume_that_tokenizes_again_rebinds_the_committed_units_to_the_token_shards_it_wrote(tmp_path,
                                                                                               monkeypatch,
                                                                                               reference):
    """A codec that writes other bytes for the same tokens (a library upgraded between the runs) is simulated by a
    committed record naming other token bytes: the shards written again are what it must bind."""
    overrides = interrupted(tmp_path, monkeypatch)
    cache = tmp_path / "c"
    u = min(committed_units(CacheStore(cache)))
    f = cache / "commits" / f"u{u:06d}.json"
    rec = json.loads(f.read_text())
    rec["shards"]["input_ids"] = "00" * (len(rec["shards"]["input_ids"]) // 2)
    f.write_text(json.dumps(rec, sort_keys=True))
    m = json.loads((cache / "manifest.json").read_text())
    m["tokens_stored"] = False  # what `verify --repair` does for damaged ids or masks
    (cache / "manifest.json").write_text(json.dumps(m))
    result = run(compose(overrides))
    assert result.complete and "tokenize_s" in result.timing
    assert_same_cache(reference, str(cache))  # the record again binds the shard on disk, byte for byte


def _delete(f: Path) -> None:
    f.unlink()


def _flip(f: Path) -> None:
    blob = bytearray(f.read_bytes())
    blob[10] ^= 0x01  # inside the first inner chunk: its crc32c fails
    f.write_bytes(bytes(blob))


@pytest.mark.parametrize("array", ["input_ids", "loss_mask"])
@pytest.mark.parametrize("damage", [_delete, _flip])
def test_a_resume_whose_stored_tokens_were_damaged_tokenizes_again_and_ends_as_the_uninterrupted_run(
        tmp_path, monkeypatch, reference, caplog, array, damage):
    overrides = interrupted(tmp_path, monkeypatch)
    cache = tmp_path / "c"
    m = json.loads((cache / "manifest.json").read_text())
    todo = sorted(set(range(m["layout"]["num_units"])) - committed_units(CacheStore(cache)))
    assert m["tokens_stored"] and todo
    damage(cache / array / f"c.{todo[-1]}")  # a unit the resume still has to forward
    with caplog.at_level("WARNING"):
        result = run(compose(overrides))
    assert result.complete and "tokenize_s" in result.timing  # never a "complete" cache missing what it forwarded
    assert f"the stored token ids or masks of 1 unit(s) cannot be read back (unit {todo[-1]}: " in caplog.text
    assert array in caplog.text
    assert_same_cache(reference, str(cache))


def test_a_resume_removes_only_its_own_temporaries_never_a_file_merely_named_like_one(tmp_path, monkeypatch,
                                                                                      reference):
    import tempfile

    overrides = interrupted(tmp_path, monkeypatch)
    cache = tmp_path / "c"

    def temporary(d: Path, target: str) -> Path:  # named exactly as write_parts names its temporaries
        fd, name = tempfile.mkstemp(dir=d, prefix=f".{target}.", suffix=".tmp")
        os.write(fd, b"half a write")
        os.close(fd)
        return Path(name)

    own = [temporary(cache / "input_ids", "c.3"), temporary(cache / "hidden_states" / "layer_1", "c.3.0"),
           temporary(cache, "manifest.json"), temporary(cache / "commits", "u000003.json")]
    (cache / "notes").mkdir()
    foreign = [temporary(cache / "notes", "draft"),              # in a directory the tool does not write
               temporary(cache / "notes", "c.0"),
               temporary(cache / "input_ids", "my_data"),        # not a name the tool writes there
               cache / "input_ids" / ".c.0.abc.tmp",             # not mkstemp's 8 random characters
               cache / ".manifest.json.backup.tmp"]
    for f in foreign[3:]:
        f.write_text("the user's")
    result = run(compose(overrides))
    assert result.complete
    assert not [f for f in own if f.exists()]
    assert [f for f in foreign if f.exists()] == foreign, "a resume removed files it did not write"
    shutil.rmtree(cache / "notes")
    for f in foreign[2:]:
        f.unlink()
    assert_same_cache(reference, str(cache))


def test_a_run_on_a_cache_whose_lock_is_a_symlink_writes_nothing_through_it(default_run, tmp_path):
    from dspark_precompute.errors import ForeignDirectoryError

    _, result = default_run
    shutil.copytree(result.path, tmp_path / "cache")
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data")
    (tmp_path / "cache" / ".writer.lock").symlink_to(precious)
    with pytest.raises(ForeignDirectoryError, match="is a symlink"):  # even a run that would have nothing to do
        run(compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024")))
    assert precious.read_text() == "the user's data"


@pytest.mark.parametrize("nested", ["hidden_states/README.md", "input_ids/notes/todo.txt", "commits/mine.json.bak",
                                    # the tool's own file names in places it never puts them
                                    "input_ids/notes/zarr.json", "hidden_states/exp/c.0", "samples/start/notes.yaml",
                                    "commits/old/u000001.json", ".hydra/mine/config.yaml"])
def test_overwrite_refuses_a_cache_with_a_foreign_file_inside_one_of_its_directories(default_run, tmp_path, nested):
    from dspark_precompute.errors import ForeignDirectoryError

    _, result = default_run
    shutil.copytree(result.path, tmp_path / "cache")
    f = tmp_path / "cache" / nested
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("the user's")
    with pytest.raises(ForeignDirectoryError, match=rf"also holds files this tool did not write \({re.escape(nested)}"):
        run(compose([*small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024"), "overwrite=true"]))
    assert f.read_text() == "the user's" and (tmp_path / "cache" / "manifest.json").exists()


def test_restarting_an_interrupted_allocation_refuses_a_foreign_file_inside_the_cache(default_run, tmp_path):
    """A kill before the manifest leaves a group this tool began to allocate; the next run deletes and allocates
    again, but never takes a user's file inside one of its directories along."""
    from dspark_precompute.errors import ForeignDirectoryError

    _, result = default_run
    cache = tmp_path / "cache"
    shutil.copytree(result.path, cache)
    for name in ("manifest.json", "target_weights.safetensors"):
        (cache / name).unlink()
    shutil.rmtree(cache / "commits")
    f = cache / "hidden_states" / "README.md"
    f.write_text("the user's")
    with pytest.raises(ForeignDirectoryError, match=r"also holds files this tool did not write \(hidden_states/README"):
        run(compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=1024")))
    assert f.read_text() == "the user's"
