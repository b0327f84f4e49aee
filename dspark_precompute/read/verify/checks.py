"""The checks ``verify`` runs, one function each, in order; each adds what it finds to the report.

Every function takes the :class:`Context` the earlier checks filled in (the manifest, the
arrays' metadata, the tables, the committed units) and stops short of what it cannot
check because an earlier check found the ground under it broken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import ArrayMeta, expected_arrays
from dspark_precompute.contract.chunks import ChunkSource, group_problems, read_array_metas
from dspark_precompute.contract.commits import (
    CommitRecord,
    TokenDigests,
    commit_key,
    committed_units,
    parse_commit_key,
)
from dspark_precompute.contract.fp8 import is_nan_bits
from dspark_precompute.contract.layout import SampleIndex, build_layout, table_problems
from dspark_precompute.contract.manifest import Manifest, manifest_problems
from dspark_precompute.contract.opener import read_tables
from dspark_precompute.contract.spec import (
    BOUND_FORMAT,
    COMMITS,
    FORMAT_VERSION,
    GROUPS,
    IMAGE_ARRAYS,
    IMAGE_GRID,
    IMAGE_GROUP,
    IMAGE_SAMPLE,
    INPUT_IDS,
    LOSS_MASK,
    MANIFEST,
    POSITION_IDS,
    REJECTS,
    SAMPLE_ARRAYS,
    TOKEN_ARRAYS,
    TOKEN_DIGESTS,
    UNIT_ARRAYS,
    VIDEO_ARRAYS,
    VIDEO_GRID,
    VIDEO_GROUP,
    VIDEO_SAMPLE,
    WEIGHTS,
    is_own_temporary_key,
)
from dspark_precompute.contract.store import CacheStore, open_regular
from dspark_precompute.contract.vocab import Check
from dspark_precompute.contract.weights import weights_problems
from dspark_precompute.contract.window import StreamRecord, released_units
from dspark_precompute.errors import CacheFormatError, ChecksumError, DamagedShardError, NotRegularFileError
from dspark_precompute.read.verify.report import Collector, VerifyReport

TABLES = (*SAMPLE_ARRAYS, *UNIT_ARRAYS)  # every cache's tables (an image cache adds IMAGE_ARRAYS)


@dataclass
class Context:
    """What the checks learn about one cache, passed from each check to the next."""

    store: CacheStore
    report: VerifyReport
    bad: Collector
    allow_incomplete: bool = False
    m: Manifest | None = None
    zstore: Any = None
    metas: dict[str, ArrayMeta] = field(default_factory=dict)
    tables: dict[str, np.ndarray] = field(default_factory=dict)
    source: ChunkSource | None = None
    committed: set[int] = field(default_factory=set)
    records: dict[int, CommitRecord] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)  # a streamed cache's units whose states were deleted on purpose
    offsets_ok: bool = False
    supervised: np.ndarray | None = None
    mask_ok: bool = True
    image_pads: np.ndarray | None = None  # an image cache: image pad tokens counted per sample in input_ids
    video_pads: np.ndarray | None = None  # a cache with videos: video pad tokens counted per sample
    ids_ok: bool = True  # every readable unit's input_ids decoded (the pad counts are whole)

    @property
    def arrays(self) -> dict[str, ArrayMeta]:
        """The token arrays (ids, mask, hidden states) whose metadata passed."""
        return {k: v for k, v in self.metas.items() if k not in TABLES and k not in IMAGE_ARRAYS
                and k not in VIDEO_ARRAYS}

    def table(self, name: str) -> np.ndarray:
        return self.tables[name].astype(np.int64)

    @property
    def readable_units(self) -> list[int]:
        assert self.m is not None
        return list(range(self.m.layout.num_units)) if self.m.complete else sorted(self.committed)


def fmt_ids(ids: np.ndarray, limit: int = 8) -> str:
    listed = [int(x) for x in ids]
    more = f" (+{len(listed) - limit} more)" if len(listed) > limit else ""
    return ("samples " + ", ".join(map(str, listed[:limit])) + more) if listed else "no samples"


def check_manifest(ctx: Context) -> bool:
    """Present, parseable, every field of the right type and range, complete (or allowed not to be)."""
    store, bad, path = ctx.store, ctx.bad, ctx.store.path
    if not store.exists(MANIFEST):
        bad.add(Check.manifest, f"{path} has no {MANIFEST}: not a dspark-precompute cache, or its run never started")
        return False
    try:
        data = json.loads(store.read_bytes(MANIFEST))
    except NotRegularFileError as exc:
        bad.add(Check.manifest, str(exc))
        return False
    except (ValueError, UnicodeDecodeError) as exc:
        bad.add(Check.manifest, f"{path}/{MANIFEST} is not valid JSON ({exc}); re-create the cache "
                            "(re-run the precompute command with overwrite=true)")
        return False
    problems = manifest_problems(data)
    for p in problems:
        bad.add(Check.manifest, p)
    if problems:
        return False
    ctx.m = Manifest.parse(data)
    if not ctx.m.complete and not ctx.allow_incomplete:
        bad.add(Check.manifest, f"{path} is incomplete (complete=false): its run has not finished. Re-run the "
                            "precompute command to finish it, or pass --allow-incomplete to check the committed part")
    ctx.zstore = store.zarr_store(read_only=True) if store.url else None
    return True


def check_structure(ctx: Context) -> bool:
    """The groups and every array's zarr.json match the manifest; every table chunk reads. False when a table is
    unreadable."""
    assert ctx.m is not None
    for p in group_problems(ctx.store, ctx.m, ctx.zstore):
        ctx.bad.add(Check.structure, p)
    metas, problems = read_array_metas(ctx.store, ctx.m, ctx.zstore)
    for name, p in problems:
        ctx.bad.add(Check.structure, p, array=name)
    ctx.metas = metas
    ctx.source = ChunkSource(ctx.store, metas, ctx.zstore, bound=ctx.m.format_version >= BOUND_FORMAT)
    tables, broken = read_tables(ctx.source)
    for name, found in broken.items():
        for c, why in found:
            check = Check.checksum if "checksum" in why.lower() or "decode" in why.lower() else Check.missing_chunk
            ctx.bad.add(check, f"{why}; re-create the cache", array=name, chunk=metas[name].chunk_index(c))
    ctx.tables = tables
    ctx.report.chunks_checked += sum(metas[n].num_chunks for n in tables)
    return all(n in ctx.tables for n in TABLES)  # offsets cannot be checked without every table


def check_offsets(ctx: Context) -> None:
    """The tables are exactly the layout the recorded lengths imply; every sample inside its unit."""
    assert ctx.m is not None
    m, bad = ctx.m, ctx.bad
    layout = m.layout
    ct, num_units, total_slots = layout.chunk_tokens, layout.num_units, layout.total_token_slots
    start, length, unit = ctx.table("samples/start"), ctx.table("samples/length"), ctx.table("samples/unit")
    untrunc = ctx.table("samples/untruncated_length")
    u_start, u_stop = ctx.table("units/token_start"), ctx.table("units/token_stop")
    n = len(start)
    # the reader's own checks on open; counts are reported by check_counts (complete caches) in verify's words
    for p in table_problems(m, ctx.tables):
        if not (m.complete and p.startswith("manifest counts.")):
            bad.add(Check.offsets, p)
    seq = m.seq_length
    for i in np.flatnonzero((length < 1) | (length > seq)):
        bad.add(Check.offsets, f"samples/length[{i}] = {length[i]} is outside [1, seq_length={seq}]",
                array="samples/length", sample=int(i))
    for i in np.flatnonzero(untrunc < length):
        bad.add(Check.offsets, f"samples/untruncated_length[{i}] = {untrunc[i]} is below its stored length {length[i]}",
                array="samples/untruncated_length", sample=int(i))
    for i in np.flatnonzero((unit < 0) | (unit >= num_units)):
        bad.add(Check.offsets, f"samples/unit[{i}] = {unit[i]} is not a unit id in [0, {num_units})",
                array="samples/unit", sample=int(i))
    plan = build_layout(np.clip(length, 1, seq), ct, layout.unit_tokens, m.format_version)
    for i in np.flatnonzero(plan.start != start):
        bad.add(Check.offsets, f"samples/start[{i}] = {start[i]}, but the layout of the recorded lengths puts sample "
                           f"{i} at token {plan.start[i]}: the offset table was altered, so sample {i} would read "
                           "another sample's tokens. Re-create the cache", array="samples/start", sample=int(i),
                unit=int(plan.unit[i]))
    for i in np.flatnonzero(plan.unit != unit):
        bad.add(Check.offsets, f"samples/unit[{i}] = {unit[i]}, the layout puts sample {i} in unit {plan.unit[i]}",
                array="samples/unit", sample=int(i))
    if plan.num_units != num_units:
        bad.add(Check.offsets, f"the recorded lengths give {plan.num_units} units, layout.num_units is {num_units}")
    else:
        for u in np.flatnonzero((plan.unit_start != u_start) | (plan.unit_stop != u_stop)):
            bad.add(Check.offsets, f"unit {u} spans tokens [{u_start[u]}, {u_stop[u]}), the layout gives "
                               f"[{plan.unit_start[u]}, {plan.unit_stop[u]})", array="units/token_start", unit=int(u))
        if plan.total_slots != total_slots:
            bad.add(Check.offsets, f"layout.total_token_slots is {total_slots}, the lengths need {plan.total_slots}")
    ok_unit = (unit >= 0) & (unit < num_units)
    su = np.where(ok_unit, unit, 0)
    if num_units:
        for i in np.flatnonzero(ok_unit & ((start < u_start[su]) | (start + length > u_stop[su]))):
            bad.add(Check.offsets, f"sample {i} spans tokens [{start[i]}, {start[i] + length[i]}) outside its unit "
                               f"{unit[i]} [{u_start[unit[i]]}, {u_stop[unit[i]]})", array="samples/start",
                    sample=int(i), unit=int(unit[i]))
    order = np.argsort(start, kind="stable")
    ends = start[order] + length[order]
    for k in np.flatnonzero(start[order][1:] < ends[:-1]):
        a, b = int(order[k]), int(order[k + 1])
        bad.add(Check.offsets, f"samples {a} and {b} overlap on the token axis ([{start[a]}, "
                               f"{start[a] + length[a]}) and [{start[b]}, ...))", array="samples/start", sample=b)
    if n > 1 and (np.diff(ctx.table("samples/source_row")) <= 0).any():
        bad.add(Check.offsets, "samples/source_row is not strictly increasing: samples are stored in input order, "
                           "so the table was altered", array="samples/source_row")
    ctx.offsets_ok = bad.per_check.get("offsets", 0) == 0
    ctx.report.samples, ctx.report.tokens = n, int(length.sum())


def check_commits(ctx: Context) -> None:
    """One record per committed unit, agreeing with the unit table; all of them when complete."""
    assert ctx.m is not None
    store, bad, num_units = ctx.store, ctx.bad, ctx.m.layout.num_units
    unit = ctx.table("samples/unit")
    u_start, u_stop = ctx.table("units/token_start"), ctx.table("units/token_stop")
    for key in store.list_keys(COMMITS):
        u = parse_commit_key(key)
        if u is None:
            continue
        if u >= num_units:
            bad.add(Check.commits, f"commit record {key} names unit {u}, but the cache has {num_units} units", unit=u)
            continue
        try:
            data = json.loads(store.read_bytes(key))
        except NotRegularFileError as exc:
            bad.add(Check.commits, f"commit record {key} is {exc.kind}, not a file", unit=u)
            continue
        except OSError as exc:  # listed, yet unreadable: a dangling symlink, a permission
            bad.add(Check.commits, f"commit record {key} cannot be read ({exc})", unit=u)
            continue
        except (ValueError, UnicodeDecodeError) as exc:
            bad.add(Check.commits, f"commit record {key} is not valid JSON ({exc})", unit=u)
            continue
        ctx.committed.add(u)
        rec = CommitRecord.parse(data)
        if rec is not None:
            ctx.records[u] = rec
        want = {"token_start": int(u_start[u]), "token_stop": int(u_stop[u]), "samples": int((unit == u).sum())}
        for k2, v in want.items():
            got = getattr(rec, k2) if rec is not None else (data.get(k2) if isinstance(data, dict) else data)
            if got != v:
                bad.add(Check.commits, f"commit record {key} has {k2}={got!r:.80}, the tables give {v}", unit=u)
    if ctx.m.complete:
        for u in sorted(set(range(num_units)) - ctx.committed):
            bad.add(Check.commits, f"unit {u} has no commit record {commit_key(u)} although the cache is complete",
                    unit=u)


def check_binding(ctx: Context) -> None:
    """Format 3: the token record binds every unit's token shards, as the commit records do; an older format gets a
    note that nothing binds its shards to their places (the chunk check then cannot tell a moved shard)."""
    assert ctx.m is not None
    m, bad = ctx.m, ctx.bad
    if m.format_version < BOUND_FORMAT:
        ctx.report.notes.append(
            f"format {m.format_version}: its {'shards' if m.format_version >= 2 else 'chunks'} are not bound to their "
            "places (its commit records hold no digests of what was written), so a shard swapped with another unit's, "
            "copied from another cache or given a reordered index would pass every check here. Re-create the cache "
            f"with this version (format {FORMAT_VERSION}) to bind them")
        return
    if not m.tokens_stored:
        return  # the token arrays (and their record) are not all written yet
    tokens = TokenDigests.read(ctx.store)
    if tokens is None:
        bad.add(Check.binding, f"{TOKEN_DIGESTS} is missing or not a token record: nothing binds the token shards of "
                               "a unit without a commit record (readers of committed units are unaffected: each "
                               "record binds its own), so a resume would tokenize again. Re-create the cache to "
                               "restore it")
        return
    for name in (*TOKEN_ARRAYS, *([POSITION_IDS] if POSITION_IDS in ctx.metas else [])):
        if len(tokens.arrays.get(name) or []) != m.layout.num_units:
            bad.add(Check.binding, f"{TOKEN_DIGESTS} holds {len(tokens.arrays.get(name) or [])} digests of array "
                                   f"{name!r}, the cache has {m.layout.num_units} units", array=name)
    for u, rec in sorted(ctx.records.items()):
        for name, digest in tokens.unit(u).items():
            if rec.shards.get(name) != digest:
                bad.add(Check.binding, f"commit record {commit_key(u)} binds array {name!r} to "
                                       f"{str(rec.shards.get(name))[:16]}..., {TOKEN_DIGESTS} to {digest[:16]}...: one "
                                       "of them was altered", array=name, unit=u)


def check_entries(ctx: Context) -> None:
    """Every file under the arrays, groups and ``commits/`` is an entry the cache lists: a finished cache holds
    exactly its listed entries (a stray shard past the last unit, a chunk key no array has, a leftover file)."""
    assert ctx.m is not None
    m = ctx.m
    groups = [*GROUPS, *([IMAGE_GROUP] if m.media is not None else []),
              *([VIDEO_GROUP] if m.media is not None and m.media.videos else [])]
    listed = {f"{g}/zarr.json" for g in groups} | {TOKEN_DIGESTS} | {commit_key(u) for u in range(m.layout.num_units)}
    for name, meta in ctx.metas.items():
        per = int(meta.shard_chunks or 1)
        listed |= {f"{name}/zarr.json", *(meta.object_key(c) for c in range(0, meta.num_chunks, per))}
    unchecked = tuple(f"{n}/" for n in expected_arrays(m) if n not in ctx.metas)  # already reported as broken
    tops = [*TOKEN_ARRAYS, POSITION_IDS, *GROUPS, IMAGE_GROUP, VIDEO_GROUP, COMMITS]
    for key in ctx.store.file_keys(t for t in tops if ctx.store.exists(t)):
        if key in listed or is_own_temporary_key(key) or key.startswith(unchecked) or (
                key.startswith(f"{COMMITS}/") and parse_commit_key(key) is not None):  # past the units: check_commits
            continue
        ctx.bad.add(Check.structure, f"{key} is not an entry of this cache (a finished cache holds exactly its zarr "
                                     f"metadata, one shard per unit of each token array, its tables' chunks and its "
                                     f"commit records; this one has {m.layout.num_units} units): it was left by "
                                     "another run or copied in. Remove it")


def _unit_chunks(ctx: Context, meta: ArrayMeta, u: int) -> range:
    """The inner chunks unit ``u`` owns in array ``meta`` (those holding its token slots)."""
    assert ctx.m is not None
    ct, total = meta.chunks[0], ctx.m.layout.total_token_slots
    u_start, u_stop = ctx.table("units/token_start"), ctx.table("units/token_stop")
    a0, a1 = (int(np.clip(x, 0, total)) for x in (u_start[u], u_stop[u]))  # never past the array
    return range(a0 // ct, -(-a1 // ct))


def _damaged_shard(ctx: Context, name: str, exc: DamagedShardError, u: int, where: SampleIndex | None) -> None:
    meta = ctx.metas[name]
    lo = int(ctx.table("units/token_start")[u])
    holds = where.in_range(lo, int(ctx.table("units/token_stop")[u])) if where is not None else np.zeros(0, np.int64)
    ctx.bad.add(Check.binding if exc.misplaced else Check.checksum if exc.checksum else Check.structure,
                f"{exc}: unit {u}, {fmt_ids(holds)}. Nothing in it can be read", array=name,
                chunk=meta.object_index(_unit_chunks(ctx, meta, u).start), unit=u,
                sample=int(holds[0]) if len(holds) else None)


def check_chunks(ctx: Context) -> None:
    """Every chunk a readable unit owns exists and decodes (crc32c; in format 2 its shard's index first);
    ids, masks and states are plausible."""
    assert ctx.m is not None and ctx.source is not None
    start, length = ctx.table("samples/start"), ctx.table("samples/length")
    where = SampleIndex(start, length) if ctx.offsets_ok else None
    ctx.supervised = np.zeros(len(start), dtype=np.int64)
    ctx.image_pads = np.zeros(len(start), dtype=np.int64) if ctx.m.media is not None else None
    ctx.video_pads = np.zeros(len(start), dtype=np.int64) if ctx.m.media is not None and ctx.m.media.videos else None
    ctx.mask_ok = LOSS_MASK in ctx.arrays
    ctx.ids_ok = INPUT_IDS in ctx.arrays
    total = ctx.m.layout.total_token_slots
    note_window(ctx)
    for name, meta in ctx.arrays.items():
        for u in ctx.readable_units:
            if u in ctx.released and name not in TOKEN_ARRAYS:
                continue  # released: its states were deleted on purpose (contract/window.py); its tokens stay
            jobs = [(name, c) for c in _unit_chunks(ctx, meta, u)]
            try:
                raws = ctx.source.read(jobs)
            except DamagedShardError as exc:
                _damaged_shard(ctx, name, exc, u, where)
                _lost(ctx, name)
                continue
            if meta.sharded and jobs and all(r is None for r in raws) and ctx.source.shard_index(
                    name, jobs[0][1] // int(meta.shard_chunks or 1)) is None:
                lo, hi = int(ctx.table("units/token_start")[u]), int(ctx.table("units/token_stop")[u])
                holds = where.in_range(lo, hi) if where is not None else np.zeros(0, dtype=np.int64)
                ctx.bad.add(Check.missing_chunk, f"array {name!r} shard {meta.object_index(jobs[0][1])} (object "
                                                 f"{meta.object_key(jobs[0][1])}) is missing: unit {u}, "
                                                 f"{fmt_ids(holds)} would read back as zeros",
                            array=name, chunk=meta.object_index(jobs[0][1]), unit=u,
                            sample=int(holds[0]) if len(holds) else None)
                _lost(ctx, name)
                continue
            for (_, c), raw in zip(jobs, raws):
                lo, hi = c * meta.chunks[0], min((c + 1) * meta.chunks[0], total)
                holds = where.in_range(lo, hi) if where is not None else np.zeros(0, dtype=np.int64)
                data = _decoded(ctx, meta, c, raw, u, holds)
                if data is None:
                    _lost(ctx, name)
                    continue
                ctx.report.chunks_checked += 1
                if where is not None:
                    _check_values(ctx, name, meta.chunk_index(c), data[:hi - lo], lo, holds, u)


def _lost(ctx: Context, name: str) -> None:
    """A chunk of ``name`` did not decode: the sums over the ids or the mask are no longer whole."""
    ctx.mask_ok = ctx.mask_ok and name != LOSS_MASK
    ctx.ids_ok = ctx.ids_ok and name != INPUT_IDS


def note_window(ctx: Context) -> None:
    """A streamed cache: which units the trainer released (their states are gone on purpose, not damage); a release
    record of a unit without a commit record is a problem (only a committed unit can have been consumed)."""
    assert ctx.m is not None
    window = StreamRecord.read(ctx.store)
    ctx.released = released_units(ctx.store, ctx.m.layout.num_units)
    if window is None and not ctx.released:
        return
    committed = ctx.committed or committed_units(ctx.store, ctx.m.layout.num_units)
    for u in sorted(ctx.released - committed):
        ctx.bad.add(Check.commits, f"unit {u} has a release record (window/released/) but no commit record: a trainer "
                                   "can release only a unit it read. The window records were altered; re-create "
                                   "the cache", unit=u)
    desc = window.describe() if window is not None else "unknown (window/stream.json missing)"
    ctx.report.notes.append(f"streamed through a window of {desc}: {len(ctx.released)} of {ctx.m.layout.num_units} "
                            "unit(s) released by the trainer, their hidden states deleted on purpose (their token "
                            "ids and masks are kept and checked)")


def _decoded(ctx: Context, meta: ArrayMeta, c: int, raw: bytes | None, u: int, holds: np.ndarray
             ) -> np.ndarray | None:
    """One stored chunk decoded, or None after reporting why it cannot be (missing, checksum, header)."""
    name, idx, key = meta.name, meta.chunk_index(c), meta.object_key(c)
    lo = c * meta.chunks[0]
    first = int(holds[0]) if len(holds) else None
    place = f"chunk {idx} ({'in shard ' if meta.sharded else 'file '}{key})"
    if raw is None:
        ctx.bad.add(Check.missing_chunk, f"array {name!r} {place} is missing: token slots [{lo}, "
                                         f"{lo + meta.chunks[0]}) of unit {u}, {fmt_ids(holds)}. A missing chunk "
                                         "reads back as zeros, so these samples are silently wrong",
                    array=name, chunk=idx, unit=u, sample=first)
        return None
    assert ctx.source is not None
    try:
        return ctx.source.decode(name, c, raw)
    except DamagedShardError as exc:  # format 3: not the chunk its unit's record binds to this place
        ctx.bad.add(Check.binding, f"{exc}: {place}, token slots [{lo}, {lo + meta.chunks[0]}) of unit {u}, "
                                   f"{fmt_ids(holds)}", array=name, chunk=idx, unit=u, sample=first)
    except ChecksumError:
        ctx.bad.add(Check.checksum, f"array {name!r} {place} fails its crc32c checksum: the stored bytes are "
                                    f"corrupt; token slots [{lo}, {lo + meta.chunks[0]}) of unit {u}, {fmt_ids(holds)}",
                    array=name, chunk=idx, unit=u, sample=first)
    except CacheFormatError as exc:  # a chunk whose size or codec header is wrong: never decoded
        ctx.bad.add(Check.checksum, f"array {name!r} {place} cannot be decoded ({exc}); {fmt_ids(holds)}",
                    array=name, chunk=idx, unit=u)
    return None


def _check_values(ctx: Context, name: str, idx: tuple[int, ...], data: np.ndarray, lo: int, holds: np.ndarray,
                  u: int) -> None:
    """Per-sample value checks on one decoded chunk (only over real tokens)."""
    assert ctx.m is not None and ctx.supervised is not None
    start, length = ctx.table("samples/start"), ctx.table("samples/length")
    vocab, bad = ctx.m.target_vocab_size, ctx.bad
    stored = ctx.m.array_dtypes.get(name)  # None: ids, mask or an fp8 scale array (checked when decoded)
    if stored is None and name not in (INPUT_IDS, LOSS_MASK, POSITION_IDS):
        return
    for s in holds:
        a = max(int(start[s]), lo) - lo
        b = min(int(start[s] + length[s]), lo + len(data)) - lo
        if b <= a:
            continue
        part = data[a:b]
        if name == INPUT_IDS:
            badpos = np.flatnonzero((part < 0) | (part >= vocab))
            if len(badpos):
                bad.add(Check.values, f"array {name!r} chunk {idx}: sample {s} has token id {int(part[badpos[0]])} "
                                  f"outside the vocabulary [0, {vocab})", array=name, chunk=idx, sample=int(s), unit=u)
            if ctx.image_pads is not None and ctx.m.media is not None:
                ctx.image_pads[s] += int((part == ctx.m.media.image_token_id).sum())
            if ctx.video_pads is not None and ctx.m.media is not None:
                ctx.video_pads[s] += int((part == ctx.m.media.video_token_id).sum())
        elif name == POSITION_IDS:
            if (part < 0).any() or (part >= ctx.m.seq_length).any():  # a position never passes its token's index
                bad.add(Check.values, f"array {name!r} chunk {idx}: sample {s} has positions outside [0, "
                                  f"seq_length = {ctx.m.seq_length})", array=name, chunk=idx, sample=int(s), unit=u)
        elif name == LOSS_MASK:
            if ((part != 0) & (part != 1)).any():
                bad.add(Check.values, f"array {name!r} chunk {idx}: sample {s} has loss_mask values other than 0/1",
                        array=name, chunk=idx, sample=int(s), unit=u)
            ctx.supervised[s] += int(part.sum())
        else:
            nonfinite = ((part & 0x7F80) == 0x7F80) if stored == "bf16" else is_nan_bits(part) if stored == "fp8_e4m3" \
                else ~np.isfinite(part)
            if nonfinite.any():
                bad.add(Check.values, f"array {name!r} chunk {idx}: sample {s} has {int(nonfinite.sum())} non-finite "
                                  "hidden values", array=name, chunk=idx, sample=int(s), unit=u)


def check_images(ctx: Context) -> None:
    """An image cache: its images/* tables (and a cache with videos its videos/* tables) name stored samples in
    order, the manifest counts them, and each readable sample holds exactly sum(t x h x w) / merge^2 image (video)
    pads for its images' (videos') grids."""
    assert ctx.m is not None
    media = ctx.m.media
    if media is None:
        return
    if all(n in ctx.tables for n in IMAGE_ARRAYS):
        _check_media(ctx, "image", IMAGE_SAMPLE, IMAGE_GRID, media.samples_with_images, media.image_token_id,
                     ctx.image_pads)
    if media.videos and all(n in ctx.tables for n in VIDEO_ARRAYS):
        _check_media(ctx, "video", VIDEO_SAMPLE, VIDEO_GRID, int(media.samples_with_videos or 0),
                     int(media.video_token_id or 0), ctx.video_pads)


def _check_media(ctx: Context, kind: str, sample_table: str, grid_table: str, samples_with: int, pad_id: int,
                 pads: np.ndarray | None) -> None:
    assert ctx.m is not None and ctx.m.media is not None
    media = ctx.m.media
    sample, grid = ctx.table(sample_table), ctx.table(grid_table).reshape(-1, 3)  # (0,) when none was written
    stored, bad = ctx.m.stored_samples, ctx.bad
    if len(sample) and (sample.min() < 0 or sample.max() >= stored or (np.diff(sample) < 0).any()):
        bad.add(Check.values, f"table {sample_table!r} names samples outside [0, {stored}) or out of order",
                array=sample_table)
        return
    if (grid <= 0).any():
        bad.add(Check.values, f"table {grid_table!r} holds a grid with a side <= 0", array=grid_table)
        return
    if len(np.unique(sample)) != samples_with:
        bad.add(Check.counts, f"manifest media.samples_with_{kind}s = {samples_with}, table "
                              f"{sample_table!r} names {len(np.unique(sample))}")
    if pads is None or not ctx.ids_ok or not ctx.offsets_ok:
        return
    want = np.zeros(stored, dtype=np.int64)
    np.add.at(want, sample, grid.prod(axis=1) // media.spatial_merge_size ** 2)
    readable = np.flatnonzero(np.isin(ctx.table("samples/unit"), ctx.readable_units))
    wrong = readable[pads[readable] != want[readable]]
    for s in wrong[:8]:
        bad.add(Check.values, f"sample {int(s)} holds {int(pads[s])} {kind} pad tokens (id "
                              f"{pad_id}), its grids in {grid_table!r} give {int(want[s])} "
                              f"(sum(t*h*w) / {media.spatial_merge_size}^2): the ids or the {kind} tables were "
                              "altered", array=grid_table, sample=int(s))


def check_counts(ctx: Context) -> None:
    """Samples, tokens, supervised tokens, truncations and rejects match the manifest (complete caches); rejects.jsonl
    is there (every cache)."""
    assert ctx.m is not None
    m, store, bad = ctx.m, ctx.store, ctx.bad
    if not store.exists(REJECTS):  # written before the first manifest: an incomplete cache has it too
        bad.add(Check.structure, f"{REJECTS} is missing")
    if not m.complete:
        return
    length, untrunc = ctx.table("samples/length"), ctx.table("samples/untruncated_length")
    keep = np.ones(len(length), dtype=bool)  # dropped samples (non-finite states) count as rejects
    keep[np.asarray(m.dropped_samples or [], dtype=np.int64)] = False
    n = int(keep.sum())
    counts = m.counts
    checks = {"samples": n, "tokens": int(length[keep].sum()),
              "truncated_samples": int((untrunc > length)[keep].sum())}
    if ctx.mask_ok and ctx.offsets_ok and ctx.supervised is not None:
        checks["supervised_tokens"] = int(ctx.supervised[keep].sum())
    for k, v in checks.items():
        if getattr(counts, k) != v:
            bad.add(Check.counts, f"manifest counts.{k} = {getattr(counts, k)!r}, the cache holds {v}")
    if store.exists(REJECTS):
        try:
            blob = store.read_bytes(REJECTS)
        except NotRegularFileError as exc:
            bad.add(Check.structure, f"{REJECTS} is {exc.kind}, not a file")
            blob = None
        lines = [ln for ln in blob.decode("utf-8", "replace").splitlines() if ln.strip()] if blob is not None else []
        if blob is not None and counts.rejected != len(lines):
            bad.add(Check.counts, f"manifest counts.rejected = {counts.rejected!r}, {REJECTS} has {len(lines)} lines")
    if counts.rows_in != n + counts.rejected:
        bad.add(Check.counts, f"manifest counts.rows_in = {counts.rows_in!r}, but samples + rejected = "
                          f"{n + counts.rejected}")


def check_weights(ctx: Context) -> None:
    """The weights file has the recorded sha256 (a note when none was recorded) and the manifest's shapes."""
    assert ctx.m is not None
    m, store, bad = ctx.m, ctx.store, ctx.bad
    if not store.exists(WEIGHTS):
        if not m.complete and not _committed(ctx):  # the run writes it after the token ids, before the first unit
            return
        bad.add(Check.weights, f"{WEIGHTS} is missing: training cannot initialise the draft's embedding and head. "
                           "Re-run the precompute command to rewrite it")
        return
    if m.weights_sha256 is None:
        ctx.report.notes.append(f"no weights checksum recorded (weights_sha256: the cache predates it or is "
                                f"incomplete); the bytes of {WEIGHTS} were not checked, only its tensors' names "
                                "and shapes")
    else:
        try:
            got = store.sha256(WEIGHTS)
        except NotRegularFileError as exc:
            bad.add(Check.weights, f"{WEIGHTS} is {exc.kind}, not a file: training cannot initialise the draft's "
                                   "embedding and head. Re-run the precompute command to rewrite it")
            return
        if got != m.weights_sha256:
            bad.add(Check.weights, f"{WEIGHTS} has sha256 {got}, the manifest records {m.weights_sha256}: the file is "
                               "corrupt or was replaced. Re-run the precompute command to rewrite it, or re-create "
                               "the cache")
            return
    from safetensors import safe_open

    try:
        if store.url:
            from safetensors.torch import load

            tensors = load(store.read_bytes(WEIGHTS))
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            meta: dict[str, str] = {}
        else:
            with open_regular(Path(store.root) / WEIGHTS):  # a FIFO would block safe_open for ever
                pass
            with safe_open(str(Path(store.root) / WEIGHTS), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        bad.add(Check.weights, f"{WEIGHTS} cannot be read ({exc}); re-run the precompute command to rewrite it")
        return
    for p in weights_problems(shapes, m, meta):
        bad.add(Check.weights, p)


def _committed(ctx: Context) -> set[int]:
    """The units with a commit record: what :func:`check_commits` found, or the store's records when it did not run."""
    assert ctx.m is not None
    return ctx.committed or committed_units(ctx.store, ctx.m.layout.num_units)


def note_progress(ctx: Context) -> None:
    """An incomplete cache: what its run has written and what it writes later (docs/format.md, section 9), as a note.

    What a run writes after the point it stopped at is missing, not damaged: only what it writes
    before a file that is there counts as damage (the checks above report that).
    """
    m, store = ctx.m, ctx.store
    if m is None or m.complete:
        return
    done, n = _committed(ctx), m.layout.num_units
    unit = ctx.tables.get("samples/unit")
    length = ctx.tables.get("samples/length")
    readable = ""
    if unit is not None and length is not None and len(unit) == len(length):
        mine = np.isin(unit.astype(np.int64), sorted(done))
        readable = f" ({int(mine.sum())} samples, {int(length[mine].astype(np.int64).sum())} tokens readable)"
    there: list[str] = ["the tables", "the manifest"]
    later: list[str] = []
    if store.exists(REJECTS):  # its absence is damage (check_counts): the run writes it before the manifest
        there.insert(1, REJECTS)
    (there if m.tokens_stored else later).append("every unit's input_ids and loss_mask")
    (there if store.exists(WEIGHTS) else later).append(WEIGHTS)
    later.append(f"the hidden states and commit records of {n - len(done)} unit(s)")
    ctx.report.notes.append(
        f"incomplete: {len(done)} of {n} unit(s) committed{readable}; written: {', '.join(there)}; not written yet: "
        f"{', '.join(later)}, then the final manifest. Re-run the precompute command that wrote it (same "
        "overrides) to finish it")
