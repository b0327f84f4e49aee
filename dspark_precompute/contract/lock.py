"""One writer at a time: an exclusive ``flock`` on a lock file inside the cache directory.

The kernel drops the lock when its process dies, however it dies, so a lock left by a
killed run is simply free again (no pid guessing, no race between two starters taking
over the same stale lock). The file also records host, pid and start time, so a refused
run can name the owner.

Releasing removes the lock file (a finished cache holds only what the format names), and a
run that gives up before writing anything also removes the directories the lock had to make,
so a refused run leaves nothing behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from dspark_precompute.contract.spec import LOCK
from dspark_precompute.errors import ForeignDirectoryError, LockedError

LOCK_NAME = LOCK


class WriterLock:
    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        self.path = self.dir / LOCK_NAME
        self._fd: int | None = None
        self._made_dirs: list[Path] = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WriterLock:
        missing = []
        d = self.dir
        while not d.exists():
            missing.append(d)
            d = d.parent
        self.dir.mkdir(parents=True, exist_ok=True)
        self._made_dirs = missing  # deepest first
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except (OSError, json.JSONDecodeError):
                    owner = {}
                os.close(fd)
                raise LockedError(
                    f"{self.dir} is being written by pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
                    f"(started {owner.get('started', '?')}). Wait for it to finish or stop it; a lock left by a "
                    "killed run frees itself."
                ) from None
            # A refused run may have unlinked the file between our open and our flock: then we
            # hold a lock on a name nobody else can see. Retry on the file the path names now.
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file, created if absent; never through a symlink, and only when it is a file of its own.

        The lock is written (truncated, then the owner recorded), so a ``.writer.lock`` someone made
        a symlink or hard link to another file would have that file overwritten: refused instead,
        touching nothing.
        """
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise self._foreign("a symlink") from None
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 0):
                break
            # no links: the holder released (unlinked) it between our open and fstat; open the path again
        raise self._foreign("not a regular file" if not stat.S_ISREG(st.st_mode) else
                            f"a file with {st.st_nlink} hard links")

    def _foreign(self, what: str) -> ForeignDirectoryError:
        return ForeignDirectoryError(
            f"{self.path} is {what}, not a lock file of this tool: taking the lock would overwrite what it points "
            "at, so nothing was written. Remove it if it is yours to remove, or choose another storage.path.")

    def release(self) -> None:
        """Remove the lock file (while still holding it) and, when nothing else is left, the directories
        the lock made; then drop the lock. A starter that opened the old file sees it unlinked and retries."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            if not any(self.dir.iterdir()):
                for d in self._made_dirs:
                    try:
                        d.rmdir()
                    except OSError:
                        break
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
