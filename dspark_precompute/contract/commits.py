"""Commit records: ``commits/u000012.json`` exists only once unit 12's data is whole.

A unit is all-or-nothing: its writers make every chunk it owns durable first, then its
record is written (atomically). Readers see the samples of committed units only, and a
resumed run rewrites exactly the units without a record.

From format 3 a record also binds the unit's shards to their place: ``shards`` maps every
token array to the :class:`~dspark_precompute.contract.shards.ShardDigest` of the shard the
writers wrote for this unit. The token arrays are written before any unit is forwarded, so
their digests are first recorded in ``commits/tokens.json`` (:class:`TokenDigests`, one list
per array, by unit), which a resumed run copies into the records of the units it commits.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_precompute.contract.shards import ShardDigest
from dspark_precompute.contract.spec import COMMITS, MAX_SHARD_CHUNKS, TOKEN_DIGESTS
from dspark_precompute.contract.store import CacheStore

_KEY_RE = re.compile(r"^u(\d{1,12})\.json$")
SHARDS = "shards"  # a record's array -> shard digest (format 3)


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
    shards: dict[str, str] = field(default_factory=dict)  # array -> ShardDigest.hex() of its shard (format 3)

    def to_bytes(self) -> bytes:
        out = {k: v for k, v in asdict(self).items() if k not in ("extra", SHARDS)}
        out.update(self.extra)
        if self.shards:
            out[SHARDS] = dict(self.shards)
        return json.dumps(out, sort_keys=True).encode()

    def digests(self) -> dict[str, ShardDigest | None]:
        """Array -> the digest this record binds its shard to (None for a value that is not a digest)."""
        return {name: ShardDigest.from_hex(v, MAX_SHARD_CHUNKS) for name, v in self.shards.items()}

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
        extra = {k: v for k, v in data.items() if k not in (*core, "host", SHARDS)}
        shards = data.get(SHARDS)
        shards = {str(k): v for k, v in shards.items()} if isinstance(shards, dict) else {}
        return cls(**core, host=str(data.get("host", "")), extra=extra, shards=shards)  # type: ignore[arg-type]

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


@dataclass
class TokenDigests:
    """``commits/tokens.json``: the digest of every unit's ``input_ids`` and ``loss_mask`` shard, as written.

    The token arrays are written for every unit before the first forward (a resume reads them
    back instead of tokenizing again), long before a unit's commit record exists; this record,
    written once they are all durable (before the manifest says ``tokens_stored``), keeps their
    digests until each unit's record takes them, and binds the token shards of units not yet
    committed. ``arrays`` maps each token array to one hex digest per unit.
    """

    arrays: dict[str, list[str]]

    @classmethod
    def of(cls, units: dict[int, dict[str, str]], num_units: int) -> TokenDigests:
        """The record of every unit's token shards, from their digests by unit (every unit must be there)."""
        names = sorted({name for d in units.values() for name in d})
        return cls({name: [units[u][name] for u in range(num_units)] for name in names})

    def unit(self, u: int) -> dict[str, str]:
        """The token arrays' digests of unit ``u`` (hex), as a commit record holds them."""
        return {name: d[u] for name, d in self.arrays.items() if 0 <= u < len(d)}

    def digest(self, name: str, u: int) -> ShardDigest | None:
        d = self.arrays.get(name) or []
        return ShardDigest.from_hex(d[u], MAX_SHARD_CHUNKS) if 0 <= u < len(d) else None

    def to_bytes(self) -> bytes:
        return json.dumps({"arrays": self.arrays}, sort_keys=True).encode()

    def write(self, store: CacheStore, fsync: bool = True) -> None:
        store.write_bytes(TOKEN_DIGESTS, self.to_bytes(), fsync)

    @classmethod
    def parse(cls, data: Any) -> TokenDigests | None:
        """The record from its JSON value; None when it is not one (every array a list of strings)."""
        arrays = data.get("arrays") if isinstance(data, dict) else None
        if not isinstance(arrays, dict) or not all(
                isinstance(v, list) and all(isinstance(x, str) for x in v) for v in arrays.values()):
            return None
        return cls({str(k): list(v) for k, v in arrays.items()})

    @classmethod
    def read(cls, store: CacheStore) -> TokenDigests | None:
        """The cache's token record; None when it is absent or not one."""
        try:
            return cls.parse(json.loads(store.read_bytes(TOKEN_DIGESTS)))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
