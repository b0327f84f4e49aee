"""One writer at a time: an exclusive lock file inside the cache directory.

The lock records host, pid and start time. A lock whose process is gone (same host, pid
not alive) is stale and is taken over; a live one is refused with its owner named.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from dspark_precompute.errors import LockedError

LOCK_NAME = ".writer.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLock:
    def __init__(self, cache_dir: str | Path):
        self.path = Path(cache_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> "WriterLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text() or "{}")
                except (OSError, json.JSONDecodeError):
                    owner = {}
                if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) \
                        and not _alive(owner["pid"]):
                    self.path.unlink(missing_ok=True)  # stale: its process is gone
                    continue
                if not owner:  # being written right now, or garbage: wait and look again
                    time.sleep(0.2)
                    if self.path.exists() and not self.path.read_text():
                        self.path.unlink(missing_ok=True)
                    continue
                raise LockedError(
                    f"{self.path.parent} is being written by pid {owner.get('pid')} on {owner.get('host')} "
                    f"(started {owner.get('started')}). Wait for it to finish, or stop it; a lock left by a "
                    f"killed run on this host is taken over automatically (delete {self.path} only if that "
                    "host is gone)."
                ) from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            self.held = True
            return self
        raise LockedError(f"could not take the writer lock {self.path}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
