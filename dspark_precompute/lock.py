"""One writer at a time: an exclusive ``flock`` on a lock file inside the cache directory.

The kernel drops the lock when its process dies, however it dies, so a lock left by a
killed run is simply free again (no pid guessing, no race between two starters taking
over the same stale lock). The file also records host, pid and start time, so a refused
run can name the owner.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dspark_precompute.errors import LockedError

LOCK_NAME = ".writer.lock"


class WriterLock:
    def __init__(self, cache_dir: str | Path):
        self.path = Path(cache_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "WriterLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (OSError, json.JSONDecodeError):
                owner = {}
            os.close(fd)
            raise LockedError(
                f"{self.path.parent} is being written by pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
                f"(started {owner.get('started', '?')}). Wait for it to finish or stop it; a lock left by a "
                "killed run frees itself."
            ) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race)
            self._fd = None

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
