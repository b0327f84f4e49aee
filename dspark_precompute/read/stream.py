"""Training on a cache while it is written through a window: ``build_dataloader(path, stream=True)``.

The producer (``storage.window_units``) keeps at most a window of units on disk that the trainer has
not released (:mod:`~dspark_precompute.contract.window`). :class:`StreamLoader` takes the units in
order, 0, 1, 2, ..., each as soon as its commit record exists: it makes ``passes`` passes over the
unit (each pass its own seeded permutation of the unit's samples: the *windowed shuffle*), then marks
the unit done for its rank; the rank whose marker completes the group's set releases the unit (its
record, then its hidden-state shards deleted). It ends once every unit of the cache was consumed.

Ranks (torch.distributed, or ``num_replicas``/``rank``) split each pass of a unit without overlap:
rank r takes every W-th sample of the permutation, the first samples repeated so every rank gets
as many (as ``DistributedSampler`` does; ``drop_last`` cuts the tail instead), so every rank has the
same number of batches per unit.

When a unit is released decides what a restarted trainer can get back. ``release="checkpoint"`` (the
default): a ``state_dict()`` call releases the units that were finished when the *previous*
``state_dict()`` was taken, so the checkpoint on disk (the previous one, at worst, when a kill hits
while the newest is being saved) never points into a deleted unit; ``close()`` (after the last
checkpoint) releases the rest. ``release="delivery"``: a unit is released as soon as its last batch
is delivered (a trainer that does not checkpoint the loader). ``state_dict()``/``load_state_dict()``
hold the position (unit, pass, batches of that pass): a restarted trainer continues with the next
batch it had not received.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute.contract.commits import CommitRecord, commit_key
from dspark_precompute.contract.spec import MANIFEST
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import (
    DEFAULT_GROUP,
    StreamRecord,
    TrainerClaim,
    check_group,
    done_marks,
    finish_releases,
    first_unreleased,
    mark_done,
    release,
    released_units,
)
from dspark_precompute.errors import LoaderStateError, WindowError
from dspark_precompute.faults import fault_point
from dspark_precompute.humanize import human_seconds
from dspark_precompute.read.assemble import BatchAssembler
from dspark_precompute.read.prefetch import to_device
from dspark_precompute.read.reader import CacheReader

log = logging.getLogger(__name__)
STATE_FORMAT = "dspark-stream-loader"
STATE_VERSION = 1
RELEASES = ("checkpoint", "delivery")
SAY_EVERY_S = 60.0


def _wait_for_stream(store: CacheStore, poll_s: float, timeout_s: float | None) -> StreamRecord:
    """The cache's window record, once the producer has written it (its tables come before it)."""
    t0 = said = time.monotonic()
    while True:
        window = StreamRecord.read(store)
        if window is not None and store.exists(MANIFEST):
            return window
        if store.exists(MANIFEST) and window is None:
            from dspark_precompute.contract.manifest import Manifest

            if Manifest.read(store).complete:
                raise WindowError(f"{store.path} was written in full, not through a window: nothing to stream. Train "
                                  "from it with build_dataloader(path) (no stream=True)")
        now = time.monotonic()
        if timeout_s is not None and now - t0 >= timeout_s:
            raise WindowError(f"{store.path} has no window record (window/stream.json) after "
                              f"{human_seconds(now - t0)}: start the precompute run with storage.window_units=N")
        if now - said >= SAY_EVERY_S:
            said = now
            log.info("%s: waiting for the producer to start its window (%s)", store.path, human_seconds(now - t0))
        time.sleep(poll_s)


class StreamLoader:
    """An iterable of padded batches (the keys of :class:`~dspark_precompute.read.loader.CacheLoader`) over a stream.

    Build it with ``build_dataloader(path, stream=True, batch_size=..., passes=...)``.
    """

    def __init__(self, path: str | Path, *, batch_size: int, passes: int = 1, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, group: str = DEFAULT_GROUP,
                 layers: Sequence[int] | None = None, pad_to: int | None = None,
                 pad_to_multiple_of: int | None = None, drop_last: bool = False,
                 device: str | torch.device | None = None, max_length: int | None = None,
                 release: str = "checkpoint", poll_s: float = 0.25, wait_timeout_s: float | None = None):
        if batch_size < 1 or passes < 1:
            raise ValueError(f"batch_size={batch_size} and passes={passes} must be >= 1")
        if release not in RELEASES:
            raise ValueError(f"release={release!r} is not one of {RELEASES}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.store = CacheStore(str(path))
        self.poll_s, self.wait_timeout_s = float(poll_s), wait_timeout_s
        self.window = _wait_for_stream(self.store, self.poll_s, wait_timeout_s)
        self.batch_size, self.passes, self.shuffle, self.seed = int(batch_size), int(passes), bool(shuffle), int(seed)
        self.world, self.rank, self.group = int(num_replicas), int(rank), check_group(group)
        self.drop_last, self.release_on = bool(drop_last), release
        self.device = None if device is None else torch.device(device)
        from dspark_precompute.contract.manifest import Manifest

        self.num_units = Manifest.read(self.store).layout.num_units
        self.reader = CacheReader(str(path), allow_incomplete=True, max_length=max_length,
                                  _units=list(range(self.num_units)))
        self._assembler = BatchAssembler(self.reader, layers, pad_to, pad_to_multiple_of)
        self._sample_units = self.reader._unit[self.reader.indices]  # of every sample a unit could give
        m = self.reader.manifest
        self._hidden = [*m.hidden_array_names, *m.scale_arrays.values()]
        row = self.reader.chunks.token_bytes(self._hidden)
        self.unit_bytes = np.bincount(self.reader._unit, weights=self.reader._length,
                                      minlength=self.num_units).astype(np.int64) * row
        self._claim()
        self._pos = (0, 0, 0)  # (unit, pass, batches of that pass delivered): the next batch to deliver
        self._finished = 0  # units before this one are delivered whole by this rank
        self._marked = 0  # units before this one carry this rank's done marker
        self._checkpointed = 0  # ``_finished`` when the latest state_dict() was taken
        self._plan_len = (-1, -1, -1)  # (unit, pass, its batches) being delivered
        self.wait_s = 0.0  # seconds spent waiting for the producer to commit a unit
        self._skip_released()

    # -- the group and its records ---------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What a saved state must match (besides the cache)."""
        return {"batch_size": self.batch_size, "passes": self.passes, "shuffle": self.shuffle, "seed": self.seed,
                "num_replicas": self.world, "rank": self.rank, "group": self.group, "drop_last": self.drop_last}

    def _claim(self) -> None:
        """Claim the stream for this group, or refuse: one group consumes (and deletes) it."""
        claim = TrainerClaim.read(self.store)
        plan = {k: v for k, v in self.describe().items() if k != "rank"}
        if claim is None:
            claim = TrainerClaim(self.group, self.world, plan)
            claim.write(self.store)
        if claim.group != self.group:
            raise WindowError(f"{self.store.path} is streamed to trainer group {claim.group!r} ({claim.world_size} "
                              f"rank(s)); this loader is group {self.group!r}. A stream feeds one group: each unit is "
                              "deleted once that group is done with it. Resume that group (group="
                              f"{claim.group!r}), or train a second draft from a cache written in full")
        if claim.world_size != self.world:
            raise WindowError(f"{self.store.path}: group {self.group!r} was started with {claim.world_size} rank(s), "
                              f"this loader has num_replicas={self.world}: its units are released when all "
                              f"{claim.world_size} ranks are done. Restart the group with {claim.world_size} ranks")
        finish_releases(self.store, self.group, self.world, self._hidden, self.num_units)

    def _skip_released(self) -> None:
        """A fresh loader of a group that already ran starts at the first unit its group has not released."""
        r = first_unreleased(released_units(self.store, self.num_units), self.num_units)
        mine = done_marks(self.store)
        while r < self.num_units and self.rank in mine.get(r, set()):
            r += 1  # done by this rank, waiting for the others
        self._pos = (r, 0, 0)
        self._finished = self._marked = self._checkpointed = r

    def _mark(self, upto: int) -> None:
        """This rank is done with every unit before ``upto``: its markers, and the releases its markers complete."""
        while self._marked < min(upto, self._finished):
            u = self._marked
            mark_done(self.store, u, self.rank, self.group)
            if done_marks_of(self.store, u) >= set(range(self.world)):
                release(self.store, u, self.group, self.world, self._hidden)
            self._marked += 1

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands (JSON-able). The units finished before it are released at the next batch asked
        for: by then the trainer has saved this state (a checkpoint is saved before the next step)."""
        u, p, k = self._pos
        if u < self.num_units and p == self.passes - 1 and self._plan_len == (u, p, k):
            u, p, k = u + 1, 0, 0  # the unit's last batch delivered: the state is past it
        self._checkpointed = max(self._finished, min(u, self.num_units))
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "unit": u, "pass": p, "batches_done": k,
                "plan": self.describe(), "cache": self.reader._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a state of another cache or plan, or one pointing into a released unit, is
        refused (:class:`LoaderStateError`)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"load_state_dict got {str(state)[:120]!r}, not a state from StreamLoader."
                                   "state_dict() of this version; pass the dict it returned")
        if state.get("cache") != self.reader._fingerprint():
            raise LoaderStateError(f"the stream state was saved for another cache (or {self.store.path} was "
                                   "re-created since); load it with the cache it was saved for")
        diff = {k: (state.get("plan", {}).get(k), v) for k, v in self.describe().items()
                if state.get("plan", {}).get(k) != v}
        if diff:
            shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise LoaderStateError(f"the stream state was saved with another plan ({shown}); build the loader with "
                                   "the saved settings")
        u, p, k = int(state["unit"]), int(state["pass"]), int(state["batches_done"])
        gone = released_units(self.store, self.num_units)
        if not 0 <= u <= self.num_units or not 0 <= p < self.passes:
            raise LoaderStateError(f"the stream state's position (unit {u}, pass {p}) is outside this stream of "
                                   f"{self.num_units} units and {self.passes} passes: the state is damaged")
        if u in gone:
            raise LoaderStateError(f"the stream state is at unit {u}, which was released since (its states are "
                                   "deleted): this is not the newest checkpoint of the group. Load the newest one")
        self._pos = (u, p, k)
        self._finished = self._checkpointed = u
        self._marked = min(u, first_unreleased(gone, self.num_units))
        self._mark(u)  # finished before a saved state: nothing will ever ask for them again

    def close(self) -> None:
        """Release every unit this rank finished (call it after the last checkpoint), then close the reader."""
        self._mark(self._finished)
        self.reader.close()

    # -- iteration ---------------------------------------------------------------------------
    def unit_batches(self, u: int, p: int) -> list[list[int]]:
        """The batches (readable indices) this rank gets from pass ``p`` of unit ``u``."""
        rec = CommitRecord.read(self.store, u)
        dropped = {int(d["sample"]) for d in (rec.extra.get("dropped") or [])} if rec is not None else set()
        idx = np.flatnonzero(self._sample_units == u)
        if dropped:
            idx = idx[~np.isin(self.reader.indices[idx], sorted(dropped))]
        if self.shuffle:
            idx = idx[np.random.default_rng([self.seed, u, p]).permutation(len(idx))]
        n = len(idx)
        if self.drop_last:
            idx = idx[:n - n % self.world]
        elif n % self.world and n:
            idx = np.concatenate([idx, np.resize(idx, self.world - n % self.world)])
        share = idx[self.rank::self.world]
        b = self.batch_size
        out = [share[i:i + b].tolist() for i in range(0, len(share), b)]
        return [x for x in out if len(x) == b] if self.drop_last else out

    def _wait_commit(self, u: int) -> None:
        """Block until unit ``u`` is committed, saying so; refuse a wait that can never end."""
        t0 = said = time.monotonic()
        while not self.store.exists(commit_key(u)):
            now = time.monotonic()
            r = first_unreleased(released_units(self.store, self.num_units), self.num_units)
            if not self.window.admits(u, r, self.unit_bytes) and r < self._finished and r >= self._marked:
                raise WindowError(
                    f"{self.store.path}: unit {u} cannot be written until unit {r} is released, and this trainer "
                    f"releases unit {r} only at its next state_dict() (release='checkpoint': a unit goes once a later "
                    f"checkpoint supersedes the one past it). The window ({self.window.describe()}) is smaller than "
                    "what is read between two checkpoints: checkpoint more often, raise storage.window_units, or "
                    "build the loader with release='delivery'")
            if self.wait_timeout_s is not None and now - t0 >= self.wait_timeout_s:
                raise WindowError(f"{self.store.path}: unit {u} was not committed within {human_seconds(now - t0)}: "
                                  "the producer is not running; re-run its command (it resumes)")
            if now - said >= SAY_EVERY_S:
                said = now
                log.info("%s: waiting %s for the producer to commit unit %d", self.store.path,
                         human_seconds(now - t0), u)
            time.sleep(self.poll_s)
        self.wait_s += time.monotonic() - t0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self._host_batches()
        return to_device(batches, self.device) if self.device is not None else batches

    def _host_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        while self._pos[0] < self.num_units:
            u, p, k = self._pos
            self._wait_commit(u)
            plan = self.unit_batches(u, p)
            self._plan_len = (u, p, len(plan))
            for j in range(k, len(plan)):
                fault_point("stream_batch")
                self._release_saved()
                built = self._assembler.build([plan[j]])[0]
                self._pos = (u, p, j + 1)
                yield built  # type: ignore[misc]
            self._pos = (u, p + 1, 0) if p + 1 < self.passes else (u + 1, 0, 0)
            if self._pos[0] > u:
                self._finished = u + 1
                self._release_saved()

    def _release_saved(self) -> None:
        """Mark (and release) what may go now: the units finished before the latest state_dict() (checkpoint), or
        every unit delivered whole (delivery)."""
        self._mark(self._finished if self.release_on == "delivery" else self._checkpointed)

    def __len__(self) -> int:
        """Batches this rank gets from the whole stream (every unit, every pass)."""
        return sum(len(self.unit_batches(u, p)) for u in range(self.num_units) for p in range(self.passes))


def done_marks_of(store: CacheStore, unit: int) -> set[int]:
    """The ranks that marked ``unit`` done."""
    return done_marks(store).get(unit, set())
