"""May this run use the directory at ``storage.path``, and does it start, resume or stop?

Nothing here deletes what the tool did not write: a directory proves it is a cache of this
tool by its group attributes or manifest, and ``overwrite=true`` (or the restart of an
allocation a kill interrupted) clears only the tool's own entries, in a directory that
holds nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark_precompute.contract.chunks import read_slots
from dspark_precompute.contract.commits import CommitRecord, TokenDigests, commit_key, committed_units
from dspark_precompute.contract.layout import Layout, build_layout
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.opener import OpenedCache, open_stored
from dspark_precompute.contract.spec import (
    COMMITS,
    FORMAT_NAME,
    FORMAT_VERSION,
    IMAGE_ARRAYS,
    INPUT_IDS,
    LOCK,
    LOSS_MASK,
    MANIFEST,
    OWN_ENTRIES,
    REJECTS,
    SAMPLE_ARRAYS,
    VIDEO_ARRAYS,
    WEIGHTS,
    foreign_entries,
    foreign_nested,
    is_own_temporary,
    is_own_temporary_key,
)
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import CacheFormatError, IncompatibleCacheError
from dspark_precompute.write.plan.prepare import Plan


def _group_attributes(store: CacheStore) -> dict[str, Any]:
    try:
        attrs = json.loads(store.read_bytes("zarr.json")).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return attrs if isinstance(attrs, dict) else {}


def _manifest_format(store: CacheStore) -> Any:
    try:
        m = json.loads(store.read_bytes(MANIFEST))
    except (OSError, ValueError):
        return None
    return m.get("format") if isinstance(m, dict) else None


def _only_leftovers(names: list[str]) -> bool:
    """Nothing, or only what a refused or killed run of ours leaves (its lock, temporaries)."""
    return all(n == LOCK or is_own_temporary(n) for n in names)


def directory_problem(store: CacheStore, path: str, deleting: bool) -> str | None:
    """Why this run must not use (or, when ``deleting``, clear) the directory at ``path``; None if it may."""
    names = store.top_level_names()
    if _only_leftovers(names):
        return None
    foreign = foreign_entries(names)
    ours = _group_attributes(store).get("format") == FORMAT_NAME or _manifest_format(store) == FORMAT_NAME
    if not ours:
        shown = ", ".join(foreign[:5] or names[:5]) + (" ..." if len(foreign or names) > 5 else "")
        return (f"storage.path={path} is not empty and is not a dspark-precompute cache (it holds {shown}); "
                "nothing was written or deleted there. Choose an empty or new directory for the cache.")
    if deleting:  # deleting one of our directories takes everything in it along: it must hold only our files
        foreign += foreign_nested(store.file_keys(n for n in names if n in OWN_ENTRIES))
    if foreign and deleting:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        return (f"storage.path={path} is a cache but also holds files this tool did not write ({shown}); "
                "refusing to delete anything there. Move those files out, or choose another storage.path.")
    return None


def _partial_allocation(store: CacheStore) -> bool:
    """A group this tool began to allocate (its zarr.json says so) but never gave a manifest.

    Only a cache with nothing committed and no weights qualifies: a finished cache that lost
    its manifest is refused like any other directory, never wiped.
    """
    if store.list_keys(COMMITS) or store.exists(WEIGHTS):
        return False
    return _group_attributes(store).get("format") == FORMAT_NAME


def existing_manifest(plan: Plan) -> Manifest | None:
    """The manifest this run continues, or None to start afresh; raises when it must not touch the cache."""
    store, cfg = plan.store, plan.cfg
    if not store.exists(MANIFEST):
        if not _only_leftovers(store.top_level_names()):
            if cfg.overwrite or _partial_allocation(store):
                return None  # ours, killed while allocating: start it again
            raise CacheFormatError(
                f"storage.path={plan.path} exists and is not empty but holds no cache manifest; choose an "
                "empty directory or pass overwrite=true to replace its contents")
        return None
    if cfg.overwrite:
        return None
    try:
        manifest = Manifest.read(store)
    except CacheFormatError as exc:
        raise CacheFormatError(f"{exc} (pass overwrite=true to replace it)") from None
    if manifest.format_version != FORMAT_VERSION:
        raise CacheFormatError(version_problem(plan.path, manifest))
    if manifest.config_hash != plan.config_hash:
        raise IncompatibleCacheError(plan.path, manifest.differences(plan.identity))
    return manifest


def version_problem(path: str, m: Manifest) -> str:
    """Why a cache of another format version is not resumed, and what to do instead."""
    by = f"dspark-precompute {m.tool_version}" if m.tool_version else "an earlier dspark-precompute"
    state = "It is complete: read it as it is (this version reads and verifies it)" if m.complete else (
        f"It is unfinished: finish it with the version that wrote it (pip install 'dspark-precompute=="
        f"{m.tool_version or '0.2.0'}', then the same command)")
    return (f"storage.path={path} holds a format {m.format_version} cache written by {by}; this version writes and "
            f"resumes format {FORMAT_VERSION} only. {state}, or pass overwrite=true to re-create it in format "
            f"{FORMAT_VERSION}.")


def clear_temporaries(store: CacheStore) -> list[str]:
    """Remove what writes a kill interrupted left behind (temporaries never renamed into place); their keys.

    Only this tool's own: named for a file it writes, in a directory it writes (a user's
    ``notes/.draft.abcdefgh.tmp`` or ``input_ids/.c.0.abc.tmp`` stays)."""
    found = [key for key in store.temporaries() if is_own_temporary_key(key)]
    for key in found:
        store.delete(key)
    return found


def clear(store: CacheStore) -> None:
    """Delete this tool's entries (``directory_problem`` proved the directory holds nothing else)."""
    for name in store.top_level_names():
        if name != LOCK and (name in OWN_ENTRIES or is_own_temporary(name)):
            store.delete(name)


def check_same_layout(store: CacheStore, layout: Layout, tables: dict[str, np.ndarray], manifest: Manifest) -> None:
    """A resume that tokenized again must lay samples out exactly as the first run did (same tables)."""
    try:
        opened = open_stored(store, allow_incomplete=True, check_tables=False)
    except CacheFormatError as exc:
        raise CacheFormatError(f"{exc}; pass overwrite=true to re-create the cache") from None
    try:
        for name in ("samples/length", "samples/source_row", "samples/start", *IMAGE_ARRAYS, *VIDEO_ARRAYS):
            if name not in opened.tables and name not in tables:
                continue  # a text cache has no image tables
            if name in opened.tables and name in tables and opened.tables[name].size == tables[name].size == 0:
                continue  # an empty table (a cache of videos alone has no image) reads back without its width
            if name not in opened.tables or name not in tables or not np.array_equal(opened.tables[name],
                                                                                     tables[name]):
                raise CacheFormatError(
                    f"{store.path}: the recorded {name} differs from this run's tokenization although the "
                    "configuration hash matches (non-deterministic tokenizer?); pass overwrite=true")
    finally:
        opened.close()
    if manifest.layout.num_units != layout.num_units:
        raise CacheFormatError(f"{store.path}: recorded unit count differs; pass overwrite=true")


@dataclass
class Stored:
    """What a resumed run reads back from the cache instead of tokenizing: the layout and the token ids."""

    opened: OpenedCache
    layout: Layout
    tokens: TokenDigests | None = None  # commits/tokens.json: what the first run wrote into the token shards

    @property
    def tables(self) -> dict[str, np.ndarray]:
        return {name: self.opened.tables[name] for name in SAMPLE_ARRAYS}

    def ids(self, units: list[int]) -> dict[int, np.ndarray]:
        """Sample id -> its stored ``input_ids``, for the samples of ``units`` (one read of each unit's shard)."""
        out: dict[int, np.ndarray] = {}
        for u in units:
            a, b = int(self.layout.unit_start[u]), int(self.layout.unit_stop[u])
            ids = read_slots(self.opened.source, [INPUT_IDS], a, b)[INPUT_IDS]
            for s in self.layout.unit_order[u]:
                lo = int(self.layout.start[s]) - a
                out[int(s)] = ids[lo:lo + int(self.layout.length[s])]
        return out

    def supervised(self, samples: np.ndarray) -> int:
        """Supervised tokens (loss_mask 1) of the given samples, read from the stored masks."""
        total = 0
        for s in np.asarray(samples, dtype=np.int64):
            a = int(self.layout.start[s])
            total += int(read_slots(self.opened.source, [LOSS_MASK], a, a + int(self.layout.length[s]))[LOSS_MASK]
                         .sum())
        return total

    def rejects(self) -> bytes:
        """rejects.jsonl as the first run wrote it."""
        store = self.opened.store
        return store.read_bytes(REJECTS) if store.exists(REJECTS) else b""

    def close(self) -> None:
        self.opened.close()


def stored_token_problems(store: CacheStore, manifest: Manifest) -> list[str]:
    """Why the stored ``input_ids``/``loss_mask`` of the units still to write cannot be read back (empty: they can).

    A resume forwards the ids it reads back and never writes those arrays again, so a shard
    deleted or damaged since the first run wrote it would otherwise end in a "complete" cache
    missing it (or stop the run with no way forward). Every chunk of those units is read and
    checked (crc32c, index), about 5 bytes a token. A cache whose metadata or tables do not
    open is left to :func:`load_stored` to refuse.
    """
    try:
        opened = open_stored(store, allow_incomplete=True)
    except CacheFormatError:
        return []
    problems: list[str] = []
    try:
        t = opened.tables
        for u in sorted(set(range(manifest.layout.num_units)) - opened.committed):
            a, b = int(t["units/token_start"][u]), int(t["units/token_stop"][u])
            for name in (INPUT_IDS, LOSS_MASK):
                try:
                    read_slots(opened.source, [name], a, b)
                except CacheFormatError as exc:
                    problems.append(f"unit {u}: {exc}")
    finally:
        opened.close()
    return problems


def load_stored(plan: Plan, manifest: Manifest) -> Stored:
    """Open a resumed cache's tables and token arrays (checked as a reader checks them) and rebuild its layout."""
    try:
        opened = open_stored(plan.store, allow_incomplete=True)
    except CacheFormatError as exc:
        raise CacheFormatError(f"{exc} (pass overwrite=true to re-create the cache)") from None
    m = opened.manifest
    layout = build_layout(opened.tables["samples/length"], m.layout.chunk_tokens, m.layout.unit_tokens)
    if not (np.array_equal(layout.start, opened.tables["samples/start"])
            and np.array_equal(layout.unit_start, opened.tables["units/token_start"])):
        opened.close()
        raise CacheFormatError(f"{plan.path}: the stored tables are not the layout of their lengths; pass "
                               "overwrite=true to re-create the cache")
    return Stored(opened, layout, TokenDigests.read(plan.store))


def rebind_tokens(store: CacheStore, tokens: TokenDigests, fsync: bool = True) -> list[int]:
    """Committed units whose record names other token shards than ``tokens`` (the ones just written) get them;
    those units.

    Token arrays are rewritten whole when a resume tokenizes again. The bytes are the same for
    the same tokens and codec, but a codec library that changed since the first run may write
    others: a committed unit's record must then bind the shards now there (their tokens are the
    same, the config hash says so), or readers would refuse a sound unit.
    """
    changed = []
    for u in sorted(committed_units(store)):
        rec = CommitRecord.read(store, u)
        want = tokens.unit(u)
        if rec is not None and any(rec.shards.get(k) != v for k, v in want.items()):
            rec.shards.update(want)
            store.write_bytes(commit_key(u), rec.to_bytes(), fsync)
            changed.append(u)
    return changed
