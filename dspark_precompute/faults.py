"""Named fault points for crash tests: ``DSPARK_FAULT="point=N"`` kills the process (SIGKILL)
on the N-th time it reaches ``point``; ``point=N:raise`` raises instead, ``point=N:enospc``
raises ``OSError(ENOSPC)``, ``point=N:sleep`` sleeps half a second at every hit from the
N-th on (to give a signal time to arrive). ``DSPARK_FAULT_RANK=r`` limits faults to one torchrun rank.
Unset (always, outside tests), a point costs a dict lookup.

Points: ``unit_submitted`` (forward loop, after a unit is handed to the writer),
``writer_array`` (a writer process, after each piece it writes; each writer counts its own hits),
``writer_before_commit`` (main process, a unit all written, its commit record not yet),
``atomic_write`` (any small file, after its temporary is written, before the rename),
``manifest`` (before a manifest update), ``weights`` (before target_weights is written),
``allocate`` (while arrays are created), ``tokenize_start`` (a tokenizing worker, before it builds its
encoder), ``tokenize_row`` (before each row is tokenized, in whichever
process tokenizes it; each process counts its own hits).
"""

from __future__ import annotations

import errno
import os
import signal
import time

_counts: dict[str, int] = {}



def _schedule() -> dict[str, tuple[int, str]]:
    spec = os.environ.get("DSPARK_FAULT", "")
    only = os.environ.get("DSPARK_FAULT_RANK")
    if only is not None and only != os.environ.get("RANK", "0"):
        return {}
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition("=")
        n, _, action = rest.partition(":")
        out[name] = (int(n or 1), action or "kill")
    return out


_PLAN = _schedule()


def reload() -> None:
    """Read ``$DSPARK_FAULT`` again: a process forked from a server started before it was set."""
    global _PLAN
    _PLAN = _schedule()
    _counts.clear()


def fault_point(name: str) -> None:
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
    os.kill(os.getpid(), signal.SIGKILL)
