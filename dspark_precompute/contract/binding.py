"""What binds each shard of a format 3 cache to its place: the digests its writers recorded.

Each crc32c inside a shard covers only its own chunk or index, so a shard swapped with another
unit's, copied from another cache, or given a reordered index with a fresh crc32c reads as
plausible numbers. A :class:`Binder` holds, per unit, the
:class:`~dspark_precompute.contract.shards.ShardDigest` of each of its shards as the writers
wrote them: from the unit's commit record, or, for the token arrays of a unit not committed yet,
from ``commits/tokens.json``. :class:`~dspark_precompute.contract.chunks.ChunkSource` checks a
shard's index crc32c against it when it loads the index, and each chunk's stored crc32c when it
decodes the chunk: both are bytes it reads anyway, so the check reads only the record (once per
unit, fetched with the unit's first shard indexes). A record that is absent, unreadable or
without the array's digest leaves the shard unbound, and nothing is read from it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from dspark_precompute.contract.commits import CommitRecord, TokenDigests, commit_key
from dspark_precompute.contract.shards import ShardDigest
from dspark_precompute.contract.spec import MAX_RECORD_BYTES, TOKEN_DIGESTS, TOKENS_FIRST
from dspark_precompute.contract.store import CacheStore

_ABSENT = object()


class BindingProblem(ValueError):
    """Why a shard, or one chunk of it, is not the one its unit's record binds to its place."""


class Binder:
    """The shard digests of a format 3 cache's units, read on first use and kept (``max_units`` of them).

    ``read`` fetches objects of the cache by key (None for an absent one, at most
    :data:`~dspark_precompute.contract.spec.MAX_RECORD_BYTES` + 1 bytes each), together.
    """

    def __init__(self, store: CacheStore, read: Callable[[list[str]], list[bytes | None]], max_units: int = 4096):
        self.store, self.read, self.max_units = store, read, int(max_units)
        self._units: OrderedDict[int, dict[str, ShardDigest | None] | None] = OrderedDict()
        self._tokens: object = _ABSENT  # TokenDigests | None once read
        self._lock = threading.Lock()
        self.record_reads = 0  # commit records fetched (for tests and benchmarks)

    # -- records ---------------------------------------------------------------------------
    def missing(self, units: Sequence[int]) -> list[int]:
        """The units among ``units`` whose record is not in hand."""
        with self._lock:
            return sorted({int(u) for u in units} - self._units.keys())

    @staticmethod
    def key(unit: int) -> str:
        return commit_key(unit)

    def take(self, units: Sequence[int], raws: Sequence[bytes | None]) -> None:
        """Keep the records of ``units`` from their bytes (None: the unit has no record)."""
        parsed = {int(u): _digests(raw) for u, raw in zip(units, raws)}
        with self._lock:
            self.record_reads += len(parsed)
            for u, found in parsed.items():
                self._units[u] = found
                self._units.move_to_end(u)
            while len(self._units) > self.max_units:
                self._units.popitem(last=False)

    def _unit(self, unit: int) -> dict[str, ShardDigest | None] | None:
        with self._lock:
            if unit in self._units:
                self._units.move_to_end(unit)
                return self._units[unit]
        self.take([unit], self.read([self.key(unit)]))
        with self._lock:
            return self._units.get(unit)

    def _token_record(self) -> TokenDigests | None:
        with self._lock:
            if self._tokens is not _ABSENT:
                return self._tokens  # type: ignore[return-value]
        found = TokenDigests.read(self.store)
        with self._lock:
            self._tokens = found
        return found

    def digest(self, name: str, unit: int) -> ShardDigest:
        """The digest unit ``unit``'s shard of array ``name`` is bound to; raises :class:`BindingProblem` when none
        is: the unit has no commit record (and, for ``input_ids``/``loss_mask``, the token record none for it), or
        its record holds no valid digest for the array."""
        found = self._unit(unit)
        if found is None:
            tokens = self._token_record() if name in TOKENS_FIRST else None
            d = tokens.digest(name, unit) if tokens is not None else None
            if d is not None:
                return d
            raise BindingProblem(f"is not bound to its place: unit {unit} has no commit record ({commit_key(unit)})"
                                 + (f" and {TOKEN_DIGESTS} no digest for it" if name in TOKENS_FIRST else "")
                                 + ", so nothing says what was written there (the unit is not committed, or its "
                                 "record was deleted)")
        d = found.get(name)
        if d is None:
            raise BindingProblem(f"is not bound to its place: the commit record of unit {unit} ({commit_key(unit)}) "
                                 "holds no valid digest of it (the record was altered or not written by this tool)")
        return d

    def forget(self) -> None:
        with self._lock:
            self._units.clear()
            self._tokens = _ABSENT

    # -- checks ----------------------------------------------------------------------------
    def check_index(self, name: str, unit: int, index_crc: bytes, present: int) -> None:
        """A shard's index (its crc32c, the shard's last 4 bytes, and its present chunks) against the record."""
        d = self.digest(name, unit)
        if index_crc != d.index:
            raise BindingProblem(f"is not the shard that was written there: its index has crc32c {index_crc.hex()}, "
                                 f"the commit record of unit {unit} binds {d.index.hex()} (a shard of another unit or "
                                 "another cache, or one rewritten after its unit was committed)")
        if present != d.n_chunks:
            raise BindingProblem(f"holds {present} inner chunks, the commit record of unit {unit} binds {d.n_chunks}")

    def check_chunk(self, name: str, unit: int, k: int, rank: int, crc: bytes) -> None:
        """Inner chunk ``k`` of a shard, the ``rank``-th present one (``k`` itself unless an earlier chunk is absent),
        by its stored crc32c (the chunk's last 4 bytes) against the record."""
        want = self.digest(name, unit).chunk(rank)
        if crc != want:
            raise BindingProblem(f"holds at its inner chunk {k} a chunk with crc32c {crc.hex()}, the commit record of "
                                 f"unit {unit} binds {want.hex() if want else 'no chunk'} there: the shard's chunks "
                                 "were reordered, or the chunk comes from another place or another cache")


def _digests(raw: bytes | None) -> dict[str, ShardDigest | None] | None:
    """A record's shard digests, by array; None for no record, {} for one that does not parse."""
    if raw is None:
        return None
    try:
        rec = CommitRecord.parse(json.loads(raw)) if len(raw) <= MAX_RECORD_BYTES else None
    except (ValueError, UnicodeDecodeError):
        rec = None
    return rec.digests() if rec is not None else {}
