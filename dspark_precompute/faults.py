"""Named fault points for crash tests: ``DSPARK_FAULT="point=N"`` kills the process (SIGKILL)
on the N-th time it reaches ``point``; ``point=N:raise`` raises instead, ``point=N:enospc``
raises ``OSError(ENOSPC)``, ``point=N:sleep`` sleeps half a second at every hit from the
N-th on (to give a signal time to arrive), ``point=N:term`` sends the process SIGTERM (a signal that
reaches one rank only), ``point=N:await`` orders processes without timing: at the N-th hit it writes
the file ``$DSPARK_FAULT_READY`` (if set; its text is the point's name) and waits until a path matching
the glob ``$DSPARK_FAULT_AWAIT`` exists (if set; else until a signal ends the wait), raising after
:data:`AWAIT_S` seconds so that a test can fail but never hang. ``DSPARK_FAULT_RANK=r`` limits faults to one
torchrun rank; a suffix ``@r`` (``unit_start=2:await@0``) limits one fault.
Unset (always, outside tests), a point costs a dict lookup. A process reads the variable at its
first fault point, never at import (a malformed value cannot break ``import``); :func:`reload`
reads it again (each helper process does, as it starts).

Points: ``unit_start`` (forward loop, before a unit's first batch, before a peer's marker is read),
``unit_submitted`` (forward loop, after a unit is handed to the writers),
``writer_array`` (a writer process, after each shard it writes; each writer counts its own hits),
``writer_before_commit`` (main process, a unit all written, its commit record not yet),
``atomic_write`` (any file written atomically: a shard, a table, a record; after its temporary is written,
before the rename), ``write_part`` (after each part of such a file: a kill here leaves half a temporary),
``shard_part`` (a writer process, between the parts of a hidden-state shard it streams out),
``tokens_unit`` (after a unit's token ids and masks are written, before the first forward),
``manifest`` (before a manifest update), ``weights`` (before target_weights is written),
``allocate`` (while arrays are created), ``tokenize_start`` (a tokenizing worker, before it builds its
encoder), ``tokenize_row`` (before each row is tokenized, in whichever
process tokenizes it; each process counts its own hits), ``export_sample`` (``dspark-cache export``, after each
sample is written into the staging directory; ``:enospc`` there is a full disk), ``regenerate_row`` (after a
regenerated row is fsynced to the regeneration log), ``stream_batch`` (a stream loader, before it builds each
batch), ``window_release`` (a stream's trainer releasing a unit: its release record written, its shards not yet
deleted).
"""

from __future__ import annotations

import errno
import glob
import os
import signal
import time
from pathlib import Path

from dspark_precompute import signals
from dspark_precompute.errors import ConfigError

ACTIONS = ("kill", "raise", "enospc", "sleep", "term", "await")
AWAIT_S = 300.0  # the longest an ``await`` fault waits before it raises
_counts: dict[str, int] = {}
_PLAN: dict[str, tuple[int, str]] | None = None  # read from the environment at the first fault point


def _schedule() -> dict[str, tuple[int, str]]:
    spec = os.environ.get("DSPARK_FAULT", "")
    only = os.environ.get("DSPARK_FAULT_RANK")
    if only is not None and only != os.environ.get("RANK", "0"):
        return {}
    out: dict[str, tuple[int, str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition("=")
        rest, _, rank = rest.partition("@")
        n, _, action = rest.partition(":")
        action = action or "kill"
        if (not name or not (n or "1").isdigit() or int(n or 1) < 1 or action not in ACTIONS
                or (rank and not rank.isdigit())):
            raise ConfigError([f"DSPARK_FAULT={spec!r}: {part!r} is not a fault; write point=N[:action][@rank] with "
                               f"N >= 1 and an action among {list(ACTIONS)} (e.g. unit_submitted=2:raise@1), "
                               "or unset it"])
        if not rank or rank == os.environ.get("RANK", "0"):
            out[name] = (int(n or 1), action)
    return out


def reload() -> None:
    """Read ``$DSPARK_FAULT`` now: a process forked from a server started before it was set, or a test that
    fixes this process's plan before setting it for helper processes only."""
    global _PLAN
    _PLAN = _schedule()
    _counts.clear()


def fault_point(name: str) -> None:
    signals.checkpoint()  # the points sit where a run does work: a stop a finalizer swallowed ends it here
    if _PLAN is None:  # first use: importing the package never reads the environment
        reload()
    if not _PLAN or name not in _PLAN:
        return
    _counts[name] = _counts.get(name, 0) + 1
    n, action = _PLAN[name]
    if action == "sleep":
        if _counts[name] >= n:
            time.sleep(0.5)
        return
    if _counts[name] != n:
        return
    if action == "raise":
        raise RuntimeError(f"injected fault at {name} (hit {n})")
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    if action == "await":
        _await(name)
        return
    os.kill(os.getpid(), signal.SIGTERM if action == "term" else signal.SIGKILL)


def _await(name: str) -> None:
    """Tell a test this process is at ``name`` (``$DSPARK_FAULT_READY``), then wait for ``$DSPARK_FAULT_AWAIT``."""
    ready, pattern = os.environ.get("DSPARK_FAULT_READY"), os.environ.get("DSPARK_FAULT_AWAIT")
    if ready:
        Path(ready).write_text(name)
    deadline = time.monotonic() + AWAIT_S
    while time.monotonic() < deadline:
        if pattern and glob.glob(pattern):
            return
        time.sleep(0.02)  # polling a file; a signal's handler runs here
    raise RuntimeError(f"injected fault at {name}: waited {AWAIT_S:.0f} s for {pattern or 'a signal'}")
