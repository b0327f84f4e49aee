"""Opening a cache: the one place that reads a manifest, its arrays' metadata and its tables.

Everything that reads a cache (the reader, a resumed run, ``verify``, the checks that rerun
the target) opens it here. :func:`open_stored` in strict mode (the default) checks what is
cheap and already in hand before anything else is read (the manifest's fields, every array's
zarr.json against it, the sample/unit tables against the layout) and raises one
:class:`~dspark_precompute.errors.CacheFormatError` listing every problem; ``verify`` calls the
same steps (:func:`read_metas`, :func:`read_tables`) and reports what they find instead.
Format 1 and 2 caches open alike; what differs (chunk keys, shards, unit placement) is
decided by the manifest's ``format_version``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import ArrayMeta
from dspark_precompute.contract.chunks import ChunkSource, read_array_metas
from dspark_precompute.contract.commits import CommitRecord, committed_units
from dspark_precompute.contract.layout import table_problems
from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.spec import BOUND_FORMAT, TABLES
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import released_units
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError, MissingChunkError
from dspark_precompute.humanize import listing

_FIX = "re-create the cache (re-run the precompute command with overwrite=true)"


@dataclass
class OpenedCache:
    """A cache's checked metadata, tables and chunk source (what every reader of it starts from)."""

    store: CacheStore
    manifest: Manifest
    zstore: Any
    metas: dict[str, ArrayMeta]
    source: ChunkSource
    tables: dict[str, np.ndarray] = field(default_factory=dict)
    committed: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)  # a streamed cache's units whose states the trainer deleted
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def path(self) -> str:
        return self.store.path

    def readable(self, units: list[int] | None = None) -> np.ndarray:
        """Sample ids a reader may return: every sample (or those of ``units``), minus the dropped ones."""
        unit = self.tables["samples/unit"]
        ids = np.arange(len(unit), dtype=np.int64) if units is None else np.flatnonzero(
            np.isin(unit, units)).astype(np.int64)
        return ids[~np.isin(ids, self.dropped)] if len(self.dropped) else ids

    def close(self) -> None:
        self.source.close()


def zarr_store_for(store: CacheStore) -> Any:
    """The zarr store remote reads go through (None for a local cache: files are read directly)."""
    return store.zarr_store(read_only=True) if store.url else None


def read_metas(store: CacheStore, m: Manifest, zstore: Any = None) -> tuple[dict[str, ArrayMeta], list[str]]:
    """Every array's zarr.json checked against the manifest: (parsed metas, problems)."""
    metas, problems = read_array_metas(store, m, zstore)
    return metas, [p for _, p in problems]


def read_tables(source: ChunkSource) -> tuple[dict[str, np.ndarray], dict[str, list[tuple[int, str]]]]:
    """The sample/unit tables, whole: (tables, {table: [(chunk, why unreadable)]}).

    A table with an unreadable chunk is left out: a missing one is damage (it would read as zeros).
    """
    tables: dict[str, np.ndarray] = {}
    broken: dict[str, list[tuple[int, str]]] = {}
    for name in TABLES:
        meta = source.metas.get(name)
        if meta is None:
            continue
        jobs = [(name, c) for c in range(meta.num_chunks)]
        parts = []
        for (_, c), raw in zip(jobs, source.read(jobs)):
            idx = meta.chunk_index(c)
            if raw is None:
                rows = f"[{c * meta.chunks[0]}, {min((c + 1) * meta.chunks[0], meta.shape[0])})"
                broken.setdefault(name, []).append((c, f"table {name!r} chunk {idx} is missing (file "
                                                       f"{meta.object_key(c)}): its rows {rows} would read back as "
                                                       "zeros"))
                continue
            try:
                parts.append(source.decode(name, c, raw))
            except CacheFormatError as exc:
                broken.setdefault(name, []).append((c, str(exc)))
        if name not in broken:
            tables[name] = (np.concatenate(parts) if parts else np.zeros(0, meta.dtype))[:meta.shape[0]]
    return tables, broken


def dropped_samples(store: CacheStore, m: Manifest, committed: set[int]) -> np.ndarray:
    """Samples whose states were not finite: the manifest lists them once complete, the commit records before."""
    if m.complete:
        return np.asarray(m.dropped_samples or [], dtype=np.int64)
    out = []
    for u in sorted(committed):
        rec = CommitRecord.read(store, u)
        for d in (rec.extra.get("dropped") or []) if rec is not None else []:
            out.append(int(d["sample"]))
    return np.asarray(sorted(out), dtype=np.int64)


def open_stored(path: str | CacheStore, *, allow_incomplete: bool = False, check_tables: bool = True,
                max_files: int = 64) -> OpenedCache:
    """Open a cache strictly: any problem in its manifest, array metadata or tables is one CacheFormatError.

    An unfinished cache raises :class:`IncompleteCacheError` unless ``allow_incomplete``.
    ``check_tables=False`` skips the table checks (a resumed run compares the tables itself).
    """
    store = path if isinstance(path, CacheStore) else CacheStore(str(path))
    m = Manifest.read(store)
    committed = committed_units(store, m.layout.num_units)
    released = released_units(store, m.layout.num_units)
    if released and not allow_incomplete:
        raise IncompleteCacheError(
            f"{store.path} was streamed through a window: {len(released)} of its {m.layout.num_units} units were "
            "released by the trainer and their hidden states deleted (window/released/). open_cache(..., "
            "allow_incomplete=True) reads the units still there; build_dataloader(path, stream=True) trains on the "
            "stream; write the cache without storage.window_units to keep every unit.")
    if not m.complete and not allow_incomplete:
        raise IncompleteCacheError(
            f"{store.path} is incomplete ({len(committed)}/{m.layout.num_units} units committed): the precompute run "
            "has not finished. Re-run it with the same command to finish, or open_cache(..., "
            "allow_incomplete=True) to read the committed samples only.")
    zstore = zarr_store_for(store)
    metas, problems = read_metas(store, m, zstore)
    if problems:
        raise CacheFormatError(listing(f"{store.path}: the arrays disagree with the manifest", problems,
                                       f"Run `dspark-cache verify {store.path}` for a full report; {_FIX}."))
    source = ChunkSource(store, metas, zstore, max_files=max_files, bound=m.format_version >= BOUND_FORMAT)
    tables, broken = read_tables(source)
    for name, found in broken.items():
        _, why = found[0]
        if "checksum" in why.lower():
            raise ChecksumError(f"{store.path}: {why}")
        raise MissingChunkError(f"{store.path}: {why}, so every sample's place is unknown. The cache is damaged: "
                                f"{_FIX}.", array=name, chunk=source.metas[name].chunk_index(found[0][0]))
    if check_tables:
        wrong = table_problems(m, tables)
        if wrong:
            raise CacheFormatError(listing(f"{store.path}: the sample/unit tables disagree with the layout", wrong,
                                           "Samples would be read from the wrong tokens, so the cache is refused. "
                                           f"Run `dspark-cache verify {store.path}` for a full report; {_FIX}."))
    return OpenedCache(store, m, zstore, metas, source, tables, committed, released,
                       dropped_samples(store, m, committed))

