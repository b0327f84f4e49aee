"""One writer at a time, and a refused or empty run leaves nothing behind."""

from __future__ import annotations

import pytest

from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.errors import LockedError


def test_a_second_holder_is_refused_while_the_first_holds_it(tmp_path):
    with WriterLock(tmp_path / "c"):
        with pytest.raises(LockedError, match="is being written by pid"):
            WriterLock(tmp_path / "c").acquire()
    with WriterLock(tmp_path / "c") as again:  # released: free again
        assert again.held


def test_a_lock_that_made_the_directories_removes_them_when_nothing_else_was_written(tmp_path):
    lock = WriterLock(tmp_path / "a" / "b" / "c").acquire()
    assert (tmp_path / "a" / "b" / "c" / ".writer.lock").exists()
    lock.release()
    assert not (tmp_path / "a").exists()


def test_releasing_removes_the_lock_file_but_never_the_cache_beside_it(tmp_path):
    (tmp_path / "c").mkdir()
    with WriterLock(tmp_path / "c"):
        (tmp_path / "c" / "manifest.json").write_text("{}")
    assert not (tmp_path / "c" / ".writer.lock").exists() and (tmp_path / "c" / "manifest.json").exists()


def test_a_starter_that_opened_the_lock_file_before_it_was_removed_takes_the_new_one(tmp_path):
    import fcntl
    import os

    held = WriterLock(tmp_path / "c").acquire()
    stale = os.open(held.path, os.O_RDWR)  # a second starter's open, before the holder releases
    held.release()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the unlinked file's lock ...
    try:
        with WriterLock(tmp_path / "c") as fresh:  # ... which excludes nobody: the path names a new file
            assert fresh.held and (tmp_path / "c" / ".writer.lock").exists()
    finally:
        os.close(stale)


def test_a_starter_whose_open_lands_just_before_the_holder_unlinks_retries_instead_of_refusing(tmp_path, monkeypatch):
    """Opened, then the holder released (unlinked) it before the starter's fstat: no links is a file being removed,
    not a foreign one; the starter opens the path again."""
    import os

    import dspark_precompute.contract.lock as lock_mod

    real, calls = os.fstat, []

    def fstat(fd):
        st = real(fd)
        calls.append(fd)
        if len(calls) == 1:  # the first look sees the file as the holder's release left it
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, 0, *tuple(st)[4:10]))
        return st
    monkeypatch.setattr(lock_mod.os, "fstat", fstat)
    with WriterLock(tmp_path / "c") as lock:
        assert lock.held and len(calls) >= 2


def test_an_existing_empty_directory_is_kept_and_only_the_lock_file_goes(tmp_path):
    (tmp_path / "c").mkdir()
    with WriterLock(tmp_path / "c"):
        pass
    assert (tmp_path / "c").is_dir() and list((tmp_path / "c").iterdir()) == []


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_lock_file_linked_to_someone_elses_file_is_refused_and_that_file_is_never_written(tmp_path, link):
    import os

    from dspark_precompute.errors import ForeignDirectoryError

    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data")
    (tmp_path / "c").mkdir()
    lock = tmp_path / "c" / ".writer.lock"
    lock.symlink_to(precious) if link == "symlink" else os.link(precious, lock)
    words = "is a symlink" if link == "symlink" else "is a file with 2 hard links"
    with pytest.raises(ForeignDirectoryError, match=rf"\.writer\.lock {words}, not a lock file of this tool"):
        WriterLock(tmp_path / "c").acquire()
    assert precious.read_text() == "the user's data" and os.path.lexists(lock)  # neither written nor removed

