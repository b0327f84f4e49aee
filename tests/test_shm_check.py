"""The "nothing left in /dev/shm" checks on a shared machine: another process's names are not ours to count."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import uuid

from helpers import SHM, shm_left, shm_names

HOLD = r'''
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)  # mapped, as a live loader's worker or a semaphore's owner maps its name
print("ready", flush=True)
sys.stdin.read()
'''


def test_a_name_another_live_process_maps_is_not_left_but_an_unmapped_one_or_this_process_s_own_is():
    before = shm_names()
    theirs, leaked, mine = (SHM / f"dspark-test-{k}-{uuid.uuid4().hex[:8]}" for k in ("theirs", "leaked", "mine"))
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(theirs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "ready\n"  # mapped now
        assert theirs.name in shm_names() - before  # what the old checks (a plain listing) counted as ours
        assert shm_left(before) == set()
        os.close(os.open(leaked, os.O_CREAT | os.O_WRONLY, 0o600))  # made and let go: a leak
        fd = os.open(mine, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        held = mmap.mmap(fd, 4096)  # this process's own mapping still counts
        assert shm_left(before) == {leaked.name, mine.name}
        held.close()
        os.close(fd)
    finally:
        other.communicate("", timeout=60)
        for p in (theirs, leaked, mine):
            p.unlink(missing_ok=True)
