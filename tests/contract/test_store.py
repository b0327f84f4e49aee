"""The local store: atomic small files, listings that say what is there, a streamed sha256."""

from __future__ import annotations

import hashlib
import os

import pytest

from dspark_precompute.contract import store as store_module
from dspark_precompute.contract.store import CacheStore


def test_a_small_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    s = CacheStore(tmp_path / "c")
    s.write_bytes("commits/u000000.json", b"first")
    s.write_bytes("commits/u000000.json", b"second")
    assert s.read_bytes("commits/u000000.json") == b"second"
    assert sorted(p.name for p in (tmp_path / "c" / "commits").iterdir()) == ["u000000.json"]
    assert oct((tmp_path / "c" / "commits" / "u000000.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_write_that_fails_before_the_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    s = CacheStore(tmp_path / "c")
    s.write_bytes("manifest.json", b"old")

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "replace", boom)
    with pytest.raises(OSError):
        s.write_bytes("manifest.json", b"new")
    assert s.read_bytes("manifest.json") == b"old"
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["manifest.json"]


def test_listings_hide_dotfiles_from_keys_but_not_from_the_top_level(tmp_path):
    s = CacheStore(tmp_path / "c")
    assert s.top_level_names() == [] and s.is_empty()
    s.write_bytes(".writer.lock", b"")
    s.write_bytes("commits/u000001.json", b"{}")
    s.write_bytes("commits/.u000002.json.x.tmp", b"")
    assert s.top_level_names() == [".writer.lock", "commits"]
    assert s.list_keys("commits") == ["commits/u000001.json"]
    assert not s.is_empty()
    s.delete("commits")
    assert s.top_level_names() == [".writer.lock"] and s.is_empty()


def test_sha256_streams_the_file_and_equals_hashlib(tmp_path):
    s = CacheStore(tmp_path / "c")
    data = os.urandom(5 << 20)
    s.write_bytes("target_weights.safetensors", data)
    assert s.sha256("target_weights.safetensors") == hashlib.sha256(data).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("key,own", [
    (".manifest.json.k3x_9q0a.tmp", True),
    (".target_weights.safetensors.abcdefgh.tmp", True),
    ("input_ids/.c.3.abcdefgh.tmp", True),
    ("hidden_states/layer_1/.c.3.0.abcdefgh.tmp", True),
    ("samples/start/.zarr.json.abcdefgh.tmp", True),
    ("commits/.u000003.json.abcdefgh.tmp", True),
    (".hydra/.config.yaml.abcdefgh.tmp", True),
    (".manifest.json.backup.tmp", False),          # not mkstemp's 8 random characters
    (".manifest.json.ABCDEFGH.tmp", False),        # mkstemp draws lower case only
    ("input_ids/.c.0.abc.tmp", False),
    (".notes.txt.abcdefgh.tmp", False),            # not a file the tool writes
    ("input_ids/.my_data.abcdefgh.tmp", False),
    ("notes/.c.0.abcdefgh.tmp", False),            # not a directory the tool writes
    ("notes/.manifest.json.abcdefgh.tmp", False),
])
def test_only_temporaries_named_for_a_file_the_tool_writes_in_a_directory_it_writes_are_its_own(key, own):
    from dspark_precompute.contract.spec import is_own_temporary_key

    assert is_own_temporary_key(key) is own
