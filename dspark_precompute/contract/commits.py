"""Commit records: ``commits/u000012.json`` exists only once unit 12's data is whole.

A unit is all-or-nothing: its writers make every chunk it owns durable first, then its
record is written (atomically). Readers see the samples of committed units only, and a
resumed run rewrites exactly the units without a record.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_precompute.contract.spec import COMMITS
from dspark_precompute.contract.store import CacheStore

_KEY_RE = re.compile(r"^u(\d{1,12})\.json$")


def commit_key(unit: int) -> str:
    return f"{COMMITS}/u{unit:06d}.json"


def parse_commit_key(key: str) -> int | None:
    """The unit of a commit record key (``commits/u000012.json`` -> 12); None for anything else."""
    m = _KEY_RE.match(key.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass
class CommitRecord:
    """What one committed unit holds (checked against the tables by ``verify``)."""

    unit: int
    token_start: int
    token_stop: int
    samples: int
    host: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # written as top-level keys (e.g. dropped samples)

    def to_bytes(self) -> bytes:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(self.extra)
        return json.dumps(out, sort_keys=True).encode()

    def write(self, store: CacheStore) -> None:
        store.write_bytes(commit_key(self.unit), self.to_bytes())

    @classmethod
    def parse(cls, data: Any) -> CommitRecord | None:
        """The record from its JSON value; None when it is not a record of this tool."""
        if not isinstance(data, dict):
            return None
        core = {k: data.get(k) for k in ("unit", "token_start", "token_stop", "samples")}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in core.values()):
            return None
        extra = {k: v for k, v in data.items() if k not in (*core, "host")}
        return cls(**core, host=str(data.get("host", "")), extra=extra)  # type: ignore[arg-type]

    @classmethod
    def read(cls, store: CacheStore, unit: int) -> CommitRecord | None:
        try:
            return cls.parse(json.loads(store.read_bytes(commit_key(unit))))
        except (OSError, ValueError, UnicodeDecodeError):
            return None


def committed_units(store: CacheStore, num_units: int | None = None) -> set[int]:
    """Units with a commit record (names that are not ``u<digits>.json``, or past ``num_units``, are ignored)."""
    out = set()
    for key in store.list_keys(COMMITS):
        u = parse_commit_key(key)
        if u is not None and (num_units is None or u < num_units):
            out.add(u)
    return out


def drop_commits(store: CacheStore, units: list[int]) -> list[str]:
    """Remove the records of ``units`` (so the next run rewrites them); the keys removed."""
    removed = []
    for u in sorted(set(units)):
        key = commit_key(u)
        if store.exists(key):
            store.delete(key)
            removed.append(key)
    return removed
