"""A cache streamed through a window: the records that bound its disk, and who may delete what.

A run with ``storage.window_units`` (or ``storage.window_mib``) writes ``window/stream.json`` before
its first unit and then never holds more than the window's committed units that a trainer has not
released. The trainer group (``build_dataloader(path, stream=True)``) claims the stream in
``window/trainer.json``, marks each unit it is done with per rank (``window/done/u000012.r0003.json``),
and the rank whose marker completes a unit's set releases it: it writes ``window/released/u000012.json``
first, then deletes the unit's hidden-state (and fp8 scale) shards. The trainer deletes, not the
producer: the trainer is the one that knows a unit is no longer needed, it frees the disk at once
even when the producer has finished or died, and the producer never deletes anything it wrote, so
no fault of its own can lose a unit before the trainer has it. Two ranks completing a set at the
same moment write the same record and delete the same objects; both are idempotent.

What stays: every commit record (a resumed run treats a released unit as done: it is never
captured again), the token arrays (``input_ids``/``loss_mask``: a few bytes per token, what a
resume reads back instead of tokenizing, and what ``verify`` still checks), the tables. A release
record is how ``verify``, ``info`` and the readers know that a unit's states are gone on purpose.

Shards are never rewritten after a release, so a key holds the unit's bytes or nothing: a reader
that opened a unit before its release reads the right bytes (a local file it holds open stays
readable after the unlink) or finds the object gone and raises
:class:`~dspark_precompute.errors.ReleasedUnitError`, never garbage.

The window is over unit numbers, in order: unit ``u`` may start once ``u < r + window_units``,
where ``r`` is the first unit not yet released, and (byte cap) once units ``r..u`` hold at most
``window_mib`` of hidden states. Trainers consume units in that same order, so the unit a trainer
waits for is always one the producer may write: no deadlock, however the producer's ranks share
the units.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_precompute.contract.spec import KEY_SEPARATOR, WINDOW
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.faults import fault_point

STREAM = f"{WINDOW}/stream.json"
TRAINER = f"{WINDOW}/trainer.json"
DONE = f"{WINDOW}/done"
RELEASED = f"{WINDOW}/released"
DEFAULT_GROUP = "default"
_DONE_RE = re.compile(r"^u(\d{6,})\.r(\d{4,})\.json$")
_RELEASED_RE = re.compile(r"^u(\d{6,})\.json$")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def done_key(unit: int, rank: int) -> str:
    return f"{DONE}/u{unit:06d}.r{rank:04d}.json"


def released_key(unit: int) -> str:
    return f"{RELEASED}/u{unit:06d}.json"


def _read_json(store: CacheStore, key: str) -> Any:
    try:
        return json.loads(store.read_bytes(key))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def check_group(name: str) -> str:
    """A trainer group's name, as a record holds it (letters, digits, ``_.-``, at most 64)."""
    if not isinstance(name, str) or not _GROUP_RE.match(name):
        raise ValueError(f"stream group {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return name


@dataclass
class StreamRecord:
    """``window/stream.json``: this cache is written through a window (the producer's bound)."""

    units: int | None = None  # committed-but-unreleased units at most (with the in-flight ones)
    mib: int | None = None  # MiB of hidden states at most over those units

    def to_bytes(self) -> bytes:
        return json.dumps({"format": "dspark-window", **asdict(self)}, sort_keys=True).encode()

    def write(self, store: CacheStore, fsync: bool = True) -> None:
        store.write_bytes(STREAM, self.to_bytes(), fsync)

    def admits(self, u: int, r: int, unit_bytes: Any) -> bool:
        """Whether unit ``u`` may be written while ``r`` is the first unit not released (``r`` always may):
        the one rule both the producer's wait and a trainer's deadlock check use. ``unit_bytes``: hidden-state bytes
        per unit (a numpy array)."""
        if u <= r:
            return True
        if self.units is not None and u >= r + self.units:
            return False
        return self.mib is None or int(unit_bytes[r:u + 1].sum()) <= self.mib << 20

    def describe(self) -> str:
        parts = ([f"{self.units} unit(s)"] if self.units else []) + ([f"{self.mib} MiB"] if self.mib else [])
        return " and ".join(parts) or "unbounded"

    @classmethod
    def read(cls, store: CacheStore) -> StreamRecord | None:
        """The cache's window; None when it was not written through one (or the record is not ours)."""
        data = _read_json(store, STREAM)
        if not isinstance(data, dict) or data.get("format") != "dspark-window":
            return None
        units, mib = data.get("units"), data.get("mib")
        ok = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in (units, mib))
        return cls(units, mib) if ok else None


@dataclass
class TrainerClaim:
    """``window/trainer.json``: the one trainer group that consumes (and releases) this stream."""

    group: str
    world_size: int
    plan: dict[str, Any] = field(default_factory=dict)  # what else the group was built with (passes, seed, ...)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def read(cls, store: CacheStore) -> TrainerClaim | None:
        data = _read_json(store, TRAINER)
        if not isinstance(data, dict) or not isinstance(data.get("group"), str) or not isinstance(
                data.get("world_size"), int):
            return None
        return cls(data["group"], int(data["world_size"]), dict(data.get("plan") or {}))

    def write(self, store: CacheStore) -> None:
        store.write_bytes(TRAINER, self.to_bytes())


def released_units(store: CacheStore, num_units: int | None = None) -> set[int]:
    """Units with a release record (their hidden states are deleted, or about to be)."""
    out = set()
    for key in store.list_keys(RELEASED):
        m = _RELEASED_RE.match(key.rsplit("/", 1)[-1])
        if m and (num_units is None or int(m.group(1)) < num_units):
            out.add(int(m.group(1)))
    return out


def done_marks(store: CacheStore) -> dict[int, set[int]]:
    """Unit -> the trainer ranks that marked it done (one listing of ``window/done``)."""
    out: dict[int, set[int]] = {}
    for key in store.list_keys(DONE):
        m = _DONE_RE.match(key.rsplit("/", 1)[-1])
        if m:
            out.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return out


def first_unreleased(released: Iterable[int], num_units: int) -> int:
    """``r``, the unit the window starts at: the first unit without a release record (num_units when none)."""
    gone = set(released)
    r = 0
    while r < num_units and r in gone:
        r += 1
    return r


def unit_shard_keys(hidden_arrays: Iterable[str], unit: int) -> list[str]:
    """The keys of unit ``unit``'s hidden-state and scale shards (2-D arrays: ``<name>/c.<u>.0``), what a release
    deletes; the token arrays' shards are kept."""
    return [f"{name}/c{KEY_SEPARATOR}{unit}{KEY_SEPARATOR}0" for name in hidden_arrays]


def mark_done(store: CacheStore, unit: int, rank: int, group: str) -> None:
    store.write_bytes(done_key(unit, rank), json.dumps({"unit": unit, "rank": rank, "group": group}).encode())


def release(store: CacheStore, unit: int, group: str, world_size: int, hidden_arrays: Iterable[str]) -> list[str]:
    """Unit ``unit`` released: its record first, then its hidden shards deleted (the keys deleted).

    The record comes first so that a kill between the two leaves a unit whose shards are gone on
    purpose (or still there, deleted by :func:`finish_releases` on the next start), never one whose
    shards are missing without a word.
    """
    if not store.exists(released_key(unit)):
        store.write_bytes(released_key(unit), json.dumps({"unit": unit, "group": group,
                                                          "world_size": world_size}).encode())
    fault_point("window_release")
    keys = unit_shard_keys(hidden_arrays, unit)
    for key in keys:
        store.delete(key)
    return keys


def finish_releases(store: CacheStore, group: str, world_size: int, hidden_arrays: list[str],
                    num_units: int) -> list[int]:
    """Complete what a killed trainer left half done: units every rank marked done get their release, and released
    units whose shards are still there lose them. The units released now."""
    released = released_units(store, num_units)
    now = []
    for u, ranks in sorted(done_marks(store).items()):
        if u < num_units and u not in released and ranks >= set(range(world_size)):
            release(store, u, group, world_size, hidden_arrays)
            now.append(u)
    for u in sorted(released):
        if any(store.exists(k) for k in unit_shard_keys(hidden_arrays, u)):
            release(store, u, group, world_size, hidden_arrays)
    return now


@dataclass
class WindowStatus:
    """What ``dspark-cache info`` shows of a windowed cache."""

    window: StreamRecord
    captured: int
    released: int
    resident: list[int]
    trainer: TrainerClaim | None
    position: dict[int, int]  # trainer rank -> units it has marked done

    @classmethod
    def read(cls, store: CacheStore, committed: set[int], num_units: int) -> WindowStatus | None:
        window = StreamRecord.read(store)
        if window is None:
            return None
        gone = released_units(store, num_units)
        position: dict[int, int] = {}
        for _u, ranks in done_marks(store).items():
            for r in ranks:
                position[r] = position.get(r, 0) + 1
        return cls(window, len(committed), len(gone), sorted(committed - gone), TrainerClaim.read(store), position)

    def lines(self, num_units: int) -> list[str]:
        res = self.resident
        shown = ", ".join(map(str, res[:8])) + (f" (+{len(res) - 8} more)" if len(res) > 8 else "")
        out = [f"window: {self.window.describe()}; units captured {self.captured} of {num_units}, released "
               f"{self.released}, resident {len(res)}" + (f" ({shown})" if res else "")]
        if self.trainer is None:
            out.append("trainer: none has claimed the stream yet")
        else:
            pos = ", ".join(f"rank {r}: {n} unit(s) done" for r, n in sorted(self.position.items())) or "no unit done"
            out.append(f"trainer: group {self.trainer.group!r} ({self.trainer.world_size} rank(s)); {pos}")
        return out
