"""The producer's side of a window (``storage.window_units`` / ``window_mib``): wait for the trainer, say so.

Before the forward loop starts unit ``u`` it asks :class:`WindowGate` whether ``u`` fits the window
(:mod:`~dspark_precompute.contract.window`: ``u < r + window_units`` and units ``r..u`` within
``window_mib``, ``r`` the first unit the trainer has not released). When it does not, the loop waits
here: the progress line says it waits for the trainer and for how long, a log line repeats it every
minute, a signal stops the wait like any step of the run, and ``storage.window_timeout_s`` (when set)
turns a trainer that never comes back into a :class:`~dspark_precompute.errors.WindowError` (the run
is resumable like any stopped run). The producer never deletes anything: the trainer does.

:func:`check_window` decides at the start of a run whether the window may apply to this cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from dspark_precompute import signals
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import StreamRecord, first_unreleased, released_units
from dspark_precompute.errors import WindowError
from dspark_precompute.humanize import human_seconds
from dspark_precompute.progress import Progress
from dspark_precompute.write.config.schema import StorageConfig

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting producer lists the release records
SAY_EVERY_S = 60.0  # how often it logs that it still waits


def check_window(store: CacheStore, storage: StorageConfig, complete: bool, committed: int, num_units: int,
                 tensor_parallel: bool) -> StreamRecord | None:
    """The window this run writes through (None: the full cache), or a WindowError saying why it cannot.

    A window given for a cache written in full, a windowed cache resumed without one (it would grow to
    the whole dataset while units are already released), and tensor parallel (a group's followers forward the
    writer's batches and cannot wait with it) are refused. Under fsdp/ep the ranks wait in lockstep
    (:meth:`WindowGate.wait`'s ``step``).
    """
    recorded = StreamRecord.read(store)
    path = store.path
    if not storage.windowed:
        if recorded is not None and not complete:
            raise WindowError(f"{path} is being streamed through a window of {recorded.describe()} (window/stream.json)"
                              f": resuming it without one would write the rest of its {num_units} units at once. Pass "
                              f"storage.window_units={recorded.units or 'N'} (or storage.window_mib) to resume it")
        return None
    if recorded is None and complete:
        raise WindowError(f"{path} was already written in full ({num_units} units, complete): a window bounds the disk "
                          "only while a cache is written. Train from it as it is (build_dataloader(path), no stream), "
                          "or drop storage.window_units/window_mib, or write a new windowed cache (another "
                          "storage.path, or overwrite=true)")
    if tensor_parallel:
        raise WindowError("storage.window_units/window_mib with tensor parallel (parallel.tp > 1) is not supported: "
                          "a group's ranks forward the same batches and only its first writes, so its followers "
                          "cannot wait for the trainer with it. Use parallel.fsdp/ep (supported with a window), or "
                          "drop the window")
    window = StreamRecord(storage.window_units, storage.window_mib)
    if recorded != window:
        if recorded is None and committed:
            log.info("%s: %d unit(s) were committed before the window; they count against it", path, committed)
        window.write(store, storage.fsync)
    return window


class WindowGate:
    """Holds the forward loop back until a unit fits the window (one per writing rank)."""

    def __init__(self, store: CacheStore, window: StreamRecord, unit_bytes: np.ndarray, timeout_s: float | None,
                 progress: Progress | None = None):
        self.store, self.window = store, window
        self.unit_bytes = np.asarray(unit_bytes, dtype=np.int64)
        self.num_units = len(self.unit_bytes)
        self.timeout_s = timeout_s
        self.progress = progress
        self.wait_s = 0.0  # total time spent waiting for the trainer (the manifest's timing)

    def fits(self, u: int, r: int) -> bool:
        """Whether unit ``u`` may start while ``r`` is the first unit not released (``r`` itself always may)."""
        return self.window.admits(u, r, self.unit_bytes)

    def wait(self, u: int, settle: Callable[[], None] | None = None, step: Callable[[], bool] | None = None) -> bool:
        """Block until unit ``u`` fits; False when a signal came first (the loop stops as on any signal).

        ``settle`` (the writers' drain) runs once before waiting: the units in flight must be
        committed while the loop waits, or the trainer could wait for one of them forever.
        ``step`` (a sharded target's ranks in lockstep) replaces each pause: one agreement of the group, with the
        dummy forward a busy peer needs; False from it (the group stops: a signal, a peer's failure) ends the wait.
        """
        r = first_unreleased(released_units(self.store, self.num_units), self.num_units)
        if self.fits(u, r):
            return True
        if settle is not None:
            settle()
        t0 = time.monotonic()
        said = stall = t0  # a stall is counted from the trainer's last release
        last_r = r
        self._say(u, r, 0.0)
        while not self.fits(u, r):
            if step is None and signals.STATE.signum is not None:
                self._done(t0)
                return False
            now = time.monotonic()
            if r != last_r:
                last_r, stall = r, now
            if self.timeout_s is not None and now - stall >= self.timeout_s:
                self._done(t0)
                raise WindowError(
                    f"{self.store.path}: the window of {self.window.describe()} is full and the trainer released no "
                    f"unit for {human_seconds(now - stall)} (storage.window_timeout_s={self.timeout_s}): unit {r} "
                    f"is the next it must release. Start (or restart) the trainer with build_dataloader(path, "
                    "stream=True), then re-run the same command: committed units are kept")
            if now - said >= SAY_EVERY_S:
                said = now
                self._say(u, r, now - t0)
            if step is None:
                time.sleep(POLL_S)
            elif not step():
                self._done(t0)
                return False
            r = first_unreleased(released_units(self.store, self.num_units), self.num_units)
        self._done(t0)
        return True

    def _say(self, u: int, r: int, waited: float) -> None:
        status = f"waiting for the trainer to release unit {r} ({human_seconds(waited)})"
        log.info("%s: window of %s full: unit %d waits until the trainer releases unit %d (waiting %s)",
                 self.store.path, self.window.describe(), u, r, human_seconds(waited))
        if self.progress is not None:
            self.progress.note(status)

    def _done(self, t0: float) -> None:
        self.wait_s += time.monotonic() - t0
        if self.progress is not None:
            self.progress.note("")
