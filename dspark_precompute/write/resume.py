"""May this run use the directory at ``storage.path``, and does it start, resume or stop?

Nothing here deletes what the tool did not write: a directory proves it is a cache of this
tool by its group attributes or manifest, and ``overwrite=true`` (or the restart of an
allocation a kill interrupted) clears only the tool's own entries, in a directory that
holds nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dspark_precompute.contract.chunks import read_array_metas, read_slots
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.spec import (
    COMMITS,
    FORMAT_NAME,
    LOCK,
    MANIFEST,
    OWN_ENTRIES,
    WEIGHTS,
    foreign_entries,
    is_own_temporary,
)
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import CacheFormatError, IncompatibleCacheError
from dspark_precompute.write.plan import Plan


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
    if manifest.config_hash != plan.config_hash:
        raise IncompatibleCacheError(plan.path, manifest.differences(plan.identity))
    return manifest


def clear(store: CacheStore) -> None:
    """Delete this tool's entries (``directory_problem`` proved the directory holds nothing else)."""
    for name in store.top_level_names():
        if name != LOCK and (name in OWN_ENTRIES or is_own_temporary(name)):
            store.delete(name)


def check_same_layout(store: CacheStore, layout: Layout, tables: dict[str, np.ndarray], manifest: Manifest) -> None:
    """A resume must lay samples out exactly as the first run did (same tokenization, same tables)."""
    zstore = store.zarr_store(read_only=True) if store.url else None
    metas, problems = read_array_metas(store, manifest, zstore)
    if problems:
        raise CacheFormatError(f"{store.path}: {problems[0][1]}; pass overwrite=true to re-create the cache")
    for name in ("samples/length", "samples/source_row", "samples/start"):
        recorded = read_slots(store, metas, [name], 0, metas[name].shape[0], zstore)[name]
        if not np.array_equal(recorded, tables[name]):
            raise CacheFormatError(
                f"{store.path}: the recorded {name} differs from this run's tokenization although the "
                "configuration hash matches (non-deterministic tokenizer?); pass overwrite=true")
    if manifest.layout.num_units != layout.num_units:
        raise CacheFormatError(f"{store.path}: recorded unit count differs; pass overwrite=true")
