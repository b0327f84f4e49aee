"""Named fault points for crash tests: ``DSPARK_FAULT="point=N"`` kills the process (SIGKILL)
on the N-th time it reaches ``point``. Unset (always, outside tests), a point costs a dict lookup.

Points: ``unit_submitted`` (forward loop, after a unit is handed to the writer),
``writer_array`` (writer, after each array region of a unit), ``writer_before_commit``,
``atomic_write`` (any small file, after its temporary is written, before the rename),
``manifest`` (before a manifest update), ``weights`` (before target_weights is written).
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def _plan() -> dict[str, int]:
    spec = os.environ.get("DSPARK_FAULT", "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition("=")
        out[name] = int(n or 1)
    return out


_PLAN = _plan()


def fault_point(name: str) -> None:
    if not _PLAN or name not in _PLAN:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == _PLAN[name]:
        os.kill(os.getpid(), signal.SIGKILL)
