"""``verify --repair``: make the next precompute run rewrite exactly the damaged units."""

from __future__ import annotations

from pathlib import Path

from dspark_precompute.contract.commits import drop_commits
from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import DsparkError, StorageWriteError


def mark_for_recompute(path: str | Path, units: list[int], retokenize: bool = False) -> list[str]:
    """Drop the commit records of ``units`` and mark the cache incomplete; the commit keys removed.

    The precompute job resumes any cache whose manifest says incomplete and rewrites
    exactly the units without a commit record, so re-running the command that made the
    cache (same overrides) repairs it. ``retokenize`` (a damaged ``input_ids`` or
    ``loss_mask`` shard, which a resume would otherwise read back) makes that run tokenize
    again and rewrite every unit's token arrays. Takes the writer lock (refused while a run
    writes). A manifest the reader refuses is not edited: that cache needs re-creating.
    """
    store = CacheStore(str(path))
    if store.url:
        raise DsparkError(f"{path}: --repair works on local caches only; copy the cache locally or re-create it")
    try:
        lock = WriterLock(store.root).acquire()
        try:
            m = Manifest.read(store)
            if m.complete or (retokenize and m.tokens_stored):
                m.mark_incomplete()
                m.tokens_stored = m.tokens_stored and not retokenize
                m.write(store)
            return drop_commits(store, [int(u) for u in units if 0 <= int(u) < m.layout.num_units])
        finally:
            lock.release()
    except OSError as exc:  # nothing is changed before the lock is taken; after, the manifest goes first
        raise StorageWriteError.of(exc, f"marking units {sorted(units)} of {path} for recomputation",
                                   "run verify --repair again") from exc
