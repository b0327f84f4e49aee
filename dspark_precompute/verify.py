"""``verify_cache(path)``: prove a cache is whole, consistent and (optionally) reproducible.

Checks, in order, and every problem is reported (not just the first):

* manifest: present, parseable, a supported format version, complete, every field of the
  right type and range (``format.manifest_problems``, the reader's own check);
* structure: every array the manifest names exists and its zarr.json matches the manifest
  (dtype, shape, chunks, layer id, the writer's codec chain: ``format.array_meta_problems``);
* offsets: the sample and unit tables match the layout the recorded lengths imply
  (``format.table_problems``, as the reader checks on open, then per sample), every
  sample lies inside its unit, none overlap;
* commits: one record per unit, agreeing with the unit table;
* chunks: every chunk a committed unit owns exists (a deleted chunk file would read back
  silently as zeros) and decodes with a matching crc32c; ids are in the vocabulary,
  masks are 0/1, hidden states finite;
* counts: samples, tokens, supervised tokens, rejects and truncations match the manifest;
* weights: ``target_weights.safetensors`` has the sha256 the manifest records (a note when
  the cache predates it) and loads with the manifest's shapes;
* ``recompute=N``: reload the target named in the manifest, re-tokenize N random samples
  and rerun the very forward batch each was written in, comparing ids and masks exactly
  and hidden states within one step of the storage dtype.

Only the recompute step needs transformers; it is imported lazily.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from dspark_precompute import format as fmt
from dspark_precompute.errors import CacheFormatError, ChecksumError, DsparkError
from dspark_precompute.reader import _get_many, decode_chunk, read_array_metas, weights_sha256
from dspark_precompute.store import CacheStore

log = logging.getLogger(__name__)

# one step (unit in the last place, relative) of each storage dtype, and its smallest normal
_STEP = {"bf16": (2.0 ** -7, 2.0 ** -126), "fp16": (2.0 ** -10, 2.0 ** -14), "fp32": (2.0 ** -23, 2.0 ** -126)}
_COMPUTE_NAME = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Problem:
    """One thing wrong, with the array, chunk and sample it concerns when there is one."""

    check: str
    message: str
    array: str | None = None
    chunk: tuple[int, ...] | None = None
    sample: int | None = None
    unit: int | None = None

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


@dataclass
class VerifyReport:
    path: str
    problems: list[Problem] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    chunks_checked: int = 0
    recomputed: int = 0
    recompute_exact: int = 0
    recompute_max_steps: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # worth knowing, not a problem

    @property
    def ok(self) -> bool:
        return not self.problems

    def damaged_units(self) -> list[int]:
        return sorted({p.unit for p in self.problems if p.unit is not None})

    def format(self) -> str:
        head = (f"{'OK' if self.ok else 'FAILED'}: {self.path}: {self.samples} samples, {self.tokens} tokens, "
                f"{self.chunks_checked} chunks checked")
        if self.recomputed:
            head += (f", {self.recomputed} samples recomputed ({self.recompute_exact} bit-exact, worst "
                     f"{self.recompute_max_steps:.2f} storage steps)")
        head += f" in {self.seconds:.1f}s"
        lines = [head] + [f"  note: {n}" for n in self.notes] + [f"  {p}" for p in self.problems]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s).")
        return "\n".join(lines)


class _Collector:
    def __init__(self, report: VerifyReport, limit: int):
        self.report, self.limit = report, limit
        self.per_check: dict[str, int] = {}

    def add(self, check: str, message: str, **where: Any) -> None:
        k = self.per_check.get(check, 0) + 1
        self.per_check[check] = k
        if k <= self.limit:
            self.report.problems.append(Problem(check, message, **where))
        elif k == self.limit + 1:
            self.report.problems.append(Problem(check, f"... more {check} problems not listed (limit {self.limit})"))


def _list_chunk_keys(store: CacheStore, name: str) -> set[str]:
    """Chunk keys (relative to the array, e.g. ``c/3/0``) that exist under ``name``."""
    if store.url:
        base = f"{store.root}/{name}"
        if not store.fs.exists(f"{base}/c"):
            return set()
        return {p[len(base) + 1:] for p in store.fs.find(f"{base}/c")}
    base = Path(store.root) / name
    out = set()
    for dirpath, _dirs, files in os.walk(base / "c"):
        for f in files:
            if not f.startswith("."):
                out.add((Path(dirpath) / f).relative_to(base).as_posix())
    return out


def _fmt_ids(ids: np.ndarray, limit: int = 8) -> str:
    ids = [int(x) for x in ids]
    return ("samples " + ", ".join(map(str, ids[:limit])) + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")
            ) if ids else "no samples"


def verify_cache(path: str | Path, *, recompute: int = 0, seed: int = 0, allow_incomplete: bool = False,
                 tolerance: float = 1.0, device: str | None = None, max_problems_per_check: int = 20,
                 model: str | None = None, trust_remote_code: bool = False) -> VerifyReport:
    """Check the cache at ``path``; ``report.ok`` is true only if nothing is wrong.

    ``recompute`` samples (chosen with ``seed``) are recomputed with the target named in
    the manifest; a hidden state may differ from the recomputation by at most
    ``tolerance`` steps (ulps) of the storage dtype. ``device`` overrides model.device,
    ``model`` the target's path. Nothing read from the cache can turn on remote code or
    point the loader into the cache itself: only ``trust_remote_code=True`` (the user's
    own flag) lets a checkpoint's code run. A malformed cache is reported as problems,
    never raised.
    """
    t0 = time.perf_counter()
    report = VerifyReport(str(path))
    bad = _Collector(report, max_problems_per_check)
    try:
        store = CacheStore(str(path))
        _verify(store, report, bad, recompute, seed, allow_incomplete, tolerance,
                {"device": device, "model": model, "trust_remote_code": bool(trust_remote_code)})
    except Exception as exc:  # a crafted cache must end in a report, not a traceback
        log.debug("verify stopped", exc_info=True)
        bad.add("verify", f"verify stopped at {type(exc).__name__}: {exc}; the cache is malformed in a way the "
                          "checks before did not name. Re-create it (re-run the precompute command with "
                          "overwrite=true)")
    finally:
        report.seconds = time.perf_counter() - t0
    return report


def _verify(store: CacheStore, report: VerifyReport, bad: _Collector, recompute: int, seed: int,
            allow_incomplete: bool, tolerance: float, loader: dict[str, Any]) -> None:
    path = store.path
    # -- manifest -------------------------------------------------------------------------
    if not store.exists(fmt.MANIFEST):
        bad.add("manifest", f"{path} has no {fmt.MANIFEST}: not a dspark-precompute cache, or its run never started")
        return
    try:
        m = json.loads(store.read_bytes(fmt.MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        bad.add("manifest", f"{path}/{fmt.MANIFEST} is not valid JSON ({exc}); re-create the cache "
                            "(re-run the precompute command with overwrite=true)")
        return
    problems = fmt.manifest_problems(m)
    for p in problems:
        bad.add("manifest", p)
    if problems:
        return
    complete = bool(m["complete"])
    if not complete and not allow_incomplete:
        bad.add("manifest", f"{path} is incomplete (complete=false): its run has not finished. Re-run the "
                            "precompute command to finish it, or pass --allow-incomplete to check the committed part")
    layout = m["layout"]
    ct, unit_tokens = int(layout["chunk_tokens"]), int(layout["unit_tokens"])
    num_units, total_slots = int(layout["num_units"]), int(layout["total_token_slots"])
    zstore = store.zarr_store(read_only=True) if store.url else None

    # -- structure ------------------------------------------------------------------------
    metas, problems = read_array_metas(store, m, zstore)
    for name, p in problems:
        bad.add("structure", p, array=name)
    arrays = {name: meta for name, meta in metas.items() if name not in fmt.SAMPLE_ARRAYS and name not in
              fmt.UNIT_ARRAYS}
    tables: dict[str, np.ndarray] = {}
    missing_tables: dict[str, list[str]] = {}
    for name in (*fmt.SAMPLE_ARRAYS, *fmt.UNIT_ARRAYS):
        meta = metas.get(name)
        if meta is None:
            continue
        keys = _list_chunk_keys(store, name)
        parts = []
        for c in range(meta.num_chunks):
            idx = meta.chunk_index(c)
            key = meta.chunk_key(idx)
            if key not in keys:
                missing_tables.setdefault(name, []).append(key)
                parts.append(np.zeros(meta.chunks, dtype=meta.dtype))
                continue
            try:
                (raw,) = _get_many(store, zstore, [f"{name}/{key}"], [meta.max_stored_bytes()])
                if raw is None:
                    raise FileNotFoundError(key)
                parts.append(decode_chunk(meta, idx, raw))
            except ChecksumError:
                bad.add("checksum", f"table {name!r} chunk {idx} (file {name}/{key}) fails its crc32c checksum: the "
                                    "stored bytes are corrupt; re-create the cache", array=name, chunk=idx)
                break
            except (CacheFormatError, FileNotFoundError) as exc:
                bad.add("checksum", f"table {name!r} chunk {idx} (file {name}/{key}) cannot be read ({exc}); "
                                    "re-create the cache", array=name, chunk=idx)
                break
            report.chunks_checked += 1
        else:
            tables[name] = (np.concatenate(parts) if parts else np.zeros(0, meta.dtype))[:meta.shape[0]]
    if len(tables) < len(fmt.SAMPLE_ARRAYS) + len(fmt.UNIT_ARRAYS):
        return  # offsets cannot be checked without every table

    # -- offsets --------------------------------------------------------------------------
    start, length = tables["samples/start"].astype(np.int64), tables["samples/length"].astype(np.int64)
    unit, untrunc = tables["samples/unit"].astype(np.int64), tables["samples/untruncated_length"].astype(np.int64)
    n = len(start)
    u_start, u_stop = tables["units/token_start"].astype(np.int64), tables["units/token_stop"].astype(np.int64)
    # the reader's own checks on open; counts are reported below (complete caches) in verify's words
    for p in fmt.table_problems(m, tables):
        if not (complete and p.startswith("manifest counts.")):
            bad.add("offsets", p)
    seq = int(m["seq_length"])
    for i in np.flatnonzero((length < 1) | (length > seq)):
        bad.add("offsets", f"samples/length[{i}] = {length[i]} is outside [1, seq_length={seq}]",
                array="samples/length", sample=int(i))
    for i in np.flatnonzero(untrunc < length):
        bad.add("offsets", f"samples/untruncated_length[{i}] = {untrunc[i]} is below its stored length {length[i]}",
                array="samples/untruncated_length", sample=int(i))
    for i in np.flatnonzero((unit < 0) | (unit >= num_units)):
        bad.add("offsets", f"samples/unit[{i}] = {unit[i]} is not a unit id in [0, {num_units})", array="samples/unit",
                sample=int(i))
    plan = fmt.plan_layout(np.clip(length, 1, seq), ct, unit_tokens)
    for i in np.flatnonzero(plan.start != start):
        bad.add("offsets", f"samples/start[{i}] = {start[i]}, but the layout of the recorded lengths puts sample "
                           f"{i} at token {plan.start[i]}: the offset table was altered, so sample {i} would read "
                           "another sample's tokens. Re-create the cache", array="samples/start", sample=int(i),
                unit=int(plan.unit[i]))
    for i in np.flatnonzero(plan.unit != unit):
        bad.add("offsets", f"samples/unit[{i}] = {unit[i]}, the layout puts sample {i} in unit {plan.unit[i]}",
                array="samples/unit", sample=int(i))
    if plan.num_units != num_units:
        bad.add("offsets", f"the recorded lengths give {plan.num_units} units, layout.num_units is {num_units}")
    else:
        for u in np.flatnonzero((plan.unit_start != u_start) | (plan.unit_stop != u_stop)):
            bad.add("offsets", f"unit {u} spans tokens [{u_start[u]}, {u_stop[u]}), the layout gives "
                               f"[{plan.unit_start[u]}, {plan.unit_stop[u]})", array="units/token_start", unit=int(u))
        if plan.total_slots != total_slots:
            bad.add("offsets", f"layout.total_token_slots is {total_slots}, the lengths need {plan.total_slots}")
    ok_unit = (unit >= 0) & (unit < num_units)
    su = np.where(ok_unit, unit, 0)
    if num_units:
        for i in np.flatnonzero(ok_unit & ((start < u_start[su]) | (start + length > u_stop[su]))):
            bad.add("offsets", f"sample {i} spans tokens [{start[i]}, {start[i] + length[i]}) outside its unit "
                               f"{unit[i]} [{u_start[unit[i]]}, {u_stop[unit[i]]})", array="samples/start",
                    sample=int(i), unit=int(unit[i]))
    order = np.argsort(start, kind="stable")
    ends = start[order] + length[order]
    for k in np.flatnonzero(start[order][1:] < ends[:-1]):
        a, b = int(order[k]), int(order[k + 1])
        bad.add("offsets", f"samples {a} and {b} overlap on the token axis ([{start[a]}, {start[a] + length[a]}) and "
                           f"[{start[b]}, ...))", array="samples/start", sample=b)
    # every table chunk is written since weights_sha256 is recorded; before, all-zero ones were not
    legacy = "weights_sha256" not in m
    may_be_zero = {"samples/start": not plan.start.any(), "samples/unit": not plan.unit.any(),
                   "units/token_start": not plan.unit_start.any(), "samples/source_row": n <= 1}
    for name, keys in missing_tables.items():
        if not (legacy and may_be_zero.get(name, False)):
            for key in keys:
                bad.add("missing-chunk", f"table {name!r} chunk file {name}/{key} is missing: the table reads back "
                                         "as zeros; re-create the cache", array=name)
    if n > 1 and (np.diff(tables["samples/source_row"].astype(np.int64)) <= 0).any():
        bad.add("offsets", "samples/source_row is not strictly increasing: samples are stored in input order, "
                           "so the table was altered", array="samples/source_row")
    offsets_ok = bad.per_check.get("offsets", 0) == 0
    report.samples, report.tokens = n, int(length.sum())

    # -- commits --------------------------------------------------------------------------
    committed: set[int] = set()
    for key in store.list_keys(fmt.COMMITS):
        stem = key.rsplit("/", 1)[-1]
        if not (stem.startswith("u") and stem.endswith(".json") and stem[1:-5].isdigit()):
            continue
        u = int(stem[1:-5])
        if u >= num_units:
            bad.add("commits", f"commit record {key} names unit {u}, but the cache has {num_units} units", unit=u)
            continue
        try:
            rec = json.loads(store.read_bytes(key))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            bad.add("commits", f"commit record {key} is not valid JSON ({exc})", unit=u)
            continue
        committed.add(u)
        want = {"token_start": int(u_start[u]), "token_stop": int(u_stop[u]), "samples": int((unit == u).sum())}
        for k2, v in want.items():
            if not isinstance(rec, dict) or rec.get(k2) != v:
                got = rec.get(k2) if isinstance(rec, dict) else rec
                bad.add("commits", f"commit record {key} has {k2}={got!r:.80}, the tables give {v}", unit=u)
    if complete:
        for u in sorted(set(range(num_units)) - committed):
            bad.add("commits", f"unit {u} has no commit record {fmt.commit_key(u)} although the cache is complete",
                    unit=u)
    readable = np.isin(unit, sorted(committed)) if not complete else np.ones(n, dtype=bool)

    # -- chunks ---------------------------------------------------------------------------
    where = fmt.SampleIndex(start, length) if offsets_ok else None
    supervised = np.zeros(n, dtype=np.int64)
    mask_ok = fmt.LOSS_MASK in arrays
    vocab = int(m.get("target_vocab_size") or 0)
    units = sorted(committed) if not complete else list(range(num_units))
    maybe_empty: list[tuple[tuple[int, ...], str, int, int, int, np.ndarray]] = []
    for name, meta in arrays.items():
        existing = _list_chunk_keys(store, name)
        for u in units:
            a0, a1 = (int(np.clip(x, 0, total_slots)) for x in (u_start[u], u_stop[u]))  # never past the array
            for c in range(a0 // ct, -(-a1 // ct)):
                idx = meta.chunk_index(c)
                key = meta.chunk_key(idx)
                lo, hi = c * ct, min((c + 1) * ct, total_slots)
                holds = where.in_range(lo, hi) if where is not None else np.zeros(0, dtype=np.int64)
                if key not in existing and name == fmt.LOSS_MASK and where is not None and not _holds_whole(
                        holds, start, length, lo, hi):
                    maybe_empty.append((idx, key, lo, hi, u, holds))  # an all-zero mask chunk is never written
                    continue
                if key not in existing:
                    bad.add("missing-chunk", f"array {name!r} chunk {idx} is missing (file {name}/{key}): token "
                                             f"slots [{lo}, {hi}) of unit {u}, {_fmt_ids(holds)}. A missing chunk "
                                             "reads back as zeros, so these samples are silently wrong",
                            array=name, chunk=idx, unit=u, sample=int(holds[0]) if len(holds) else None)
                    if name == fmt.LOSS_MASK:
                        mask_ok = False
                    continue
                try:
                    (raw,) = _get_many(store, zstore, [f"{name}/{key}"], [meta.max_stored_bytes()])
                    if raw is None:
                        raise CacheFormatError("it vanished while verify ran")
                    data = decode_chunk(meta, idx, raw)[:hi - lo]
                except ChecksumError:
                    bad.add("checksum", f"array {name!r} chunk {idx} (file {name}/{key}) fails its crc32c checksum: "
                                        f"the stored bytes are corrupt; token slots [{lo}, {hi}) of unit {u}, "
                                        f"{_fmt_ids(holds)}", array=name, chunk=idx, unit=u,
                            sample=int(holds[0]) if len(holds) else None)
                    if name == fmt.LOSS_MASK:
                        mask_ok = False
                    continue
                except CacheFormatError as exc:  # a chunk whose size or codec header is wrong: never decoded
                    bad.add("checksum", f"array {name!r} chunk {idx} (file {name}/{key}) cannot be decoded "
                                        f"({exc}); {_fmt_ids(holds)}", array=name, chunk=idx, unit=u)
                    if name == fmt.LOSS_MASK:
                        mask_ok = False
                    continue
                report.chunks_checked += 1
                if where is not None:
                    _check_values(name, idx, data, lo, holds, start, length, m, vocab, supervised, bad, u)
    # -- counts ---------------------------------------------------------------------------
    counts = m["counts"]
    if complete:
        checks = {"samples": n, "tokens": int(length.sum()), "truncated_samples": int((untrunc > length).sum())}
        if mask_ok and where is not None:
            checks["supervised_tokens"] = int(supervised.sum())
            if counts.get("supervised_tokens") != checks["supervised_tokens"]:
                for idx, key, lo, hi, u, holds in maybe_empty:
                    bad.add("missing-chunk", f"array {fmt.LOSS_MASK!r} chunk {idx} is missing (file "
                                             f"{fmt.LOSS_MASK}/{key}) and the supervised-token count is short: "
                                             f"token slots [{lo}, {hi}) of unit {u}, {_fmt_ids(holds)}",
                            array=fmt.LOSS_MASK, chunk=idx, unit=u, sample=int(holds[0]) if len(holds) else None)
        for k, v in checks.items():
            if counts.get(k) != v:
                bad.add("counts", f"manifest counts.{k} = {counts.get(k)!r}, the cache holds {v}")
        if store.exists(fmt.REJECTS):
            lines = [ln for ln in store.read_bytes(fmt.REJECTS).decode("utf-8", "replace").splitlines() if ln.strip()]
            if counts.get("rejected") != len(lines):
                bad.add("counts", f"manifest counts.rejected = {counts.get('rejected')!r}, {fmt.REJECTS} has "
                                  f"{len(lines)} lines")
        else:
            bad.add("structure", f"{fmt.REJECTS} is missing")
        if counts.get("rows_in") != n + int(counts.get("rejected") or 0):
            bad.add("counts", f"manifest counts.rows_in = {counts.get('rows_in')!r}, but samples + rejected = "
                              f"{n + int(counts.get('rejected') or 0)}")
    # -- weights --------------------------------------------------------------------------
    _check_weights(store, m, bad, report)
    # -- recompute ------------------------------------------------------------------------
    if recompute > 0:
        if not offsets_ok or bad.per_check.get("structure"):
            bad.add("recompute", "skipped: the cache's structure or offsets are broken, fix those first")
        else:
            ids = np.flatnonzero(readable)
            pick = np.sort(np.random.default_rng(seed).choice(ids, size=min(int(recompute), len(ids)), replace=False))
            _recompute(store, m, tables, pick, tolerance, loader, report, bad)


def _holds_whole(holds: np.ndarray, start: np.ndarray, length: np.ndarray, lo: int, hi: int) -> bool:
    """Whether some sample lies wholly inside ``[lo, hi)`` (its mask there cannot be all zero)."""
    return bool(len(holds)) and bool(((start[holds] >= lo) & (start[holds] + length[holds] <= hi)).any())


def _check_values(name: str, idx: tuple[int, ...], data: np.ndarray, lo: int, holds: np.ndarray, start: np.ndarray,
                  length: np.ndarray, m: dict[str, Any], vocab: int, supervised: np.ndarray, bad: _Collector,
                  u: int) -> None:
    """Per-sample value checks on one decoded chunk (only over real tokens)."""
    logical = fmt.STORAGE_DTYPES[m["storage_dtype"]][1]
    for s in holds:
        a = max(int(start[s]), lo) - lo
        b = min(int(start[s] + length[s]), lo + len(data)) - lo
        if b <= a:
            continue
        part = data[a:b]
        if name == fmt.INPUT_IDS:
            badpos = np.flatnonzero((part < 0) | ((part >= vocab) if vocab else False))
            if len(badpos):
                bad.add("values", f"array {name!r} chunk {idx}: sample {s} has token id {int(part[badpos[0]])} "
                                  f"outside the vocabulary [0, {vocab})", array=name, chunk=idx, sample=int(s), unit=u)
        elif name == fmt.LOSS_MASK:
            if ((part != 0) & (part != 1)).any():
                bad.add("values", f"array {name!r} chunk {idx}: sample {s} has loss_mask values other than 0/1",
                        array=name, chunk=idx, sample=int(s), unit=u)
            supervised[s] += int(part.sum())
        else:
            nonfinite = ((part & 0x7F80) == 0x7F80) if logical == "bfloat16" else ~np.isfinite(part)
            if nonfinite.any():
                bad.add("values", f"array {name!r} chunk {idx}: sample {s} has {int(nonfinite.sum())} non-finite "
                                  "hidden values", array=name, chunk=idx, sample=int(s), unit=u)


def _check_weights(store: CacheStore, m: dict[str, Any], bad: _Collector, report: VerifyReport) -> None:
    if not store.exists(fmt.WEIGHTS):
        bad.add("weights", f"{fmt.WEIGHTS} is missing: training cannot initialise the draft's embedding and head. "
                           "Re-run the precompute command to rewrite it")
        return
    want = m.get("weights_sha256")
    if want is None:
        report.notes.append(f"no weights checksum recorded (weights_sha256: the cache predates it or is incomplete); "
                            f"the bytes of {fmt.WEIGHTS} were not checked, only its tensors' names and shapes")
    else:
        got = weights_sha256(store)
        if got != want:
            bad.add("weights", f"{fmt.WEIGHTS} has sha256 {got}, the manifest records {want}: the file is corrupt "
                               "or was replaced. Re-run the precompute command to rewrite it, or re-create the cache")
            return
    from safetensors import safe_open

    local = None if store.url else str(Path(store.root) / fmt.WEIGHTS)
    try:
        if local is None:
            from safetensors.torch import load

            tensors = load(store.read_bytes(fmt.WEIGHTS))
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            meta: dict[str, str] = {}
        else:
            with safe_open(local, framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        bad.add("weights", f"{fmt.WEIGHTS} cannot be read ({exc}); re-run the precompute command to rewrite it")
        return
    for p in fmt.weights_problems(shapes, m, meta):
        bad.add("weights", p)


def _paths_inside(cfgd: dict[str, Any], root: str) -> list[str]:
    """Config keys whose path lies inside the cache: a cache never holds the target, data or template."""
    inside = []
    base = Path(root).resolve()
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "path"), ("data", "chat_template")):
        value = (cfgd.get(section) or {}).get(key)
        if not isinstance(value, str) or "{" in value or "://" in value:
            continue
        try:
            p = Path(value).expanduser().resolve()
        except (OSError, RuntimeError):
            continue
        if p == base or base in p.parents:
            inside.append(f"{section}.{key}={value!r}")
    return inside


def _recompute(store: CacheStore, m: dict[str, Any], tables: dict[str, np.ndarray], pick: np.ndarray,
               tolerance: float, loader: dict[str, Any], report: VerifyReport, bad: _Collector) -> None:
    """Rerun the target on the batches the picked samples were written in; compare."""
    import torch

    from dspark_precompute.chat import ChatEncoder
    from dspark_precompute.config import from_dict
    from dspark_precompute.data import Reject, normalize, read_rows, resolve_source
    from dspark_precompute.pipeline import batch_inputs, make_batches, prepare
    from dspark_precompute.reader import open_cache, to_torch
    from dspark_precompute.target import HiddenStateCapture, load_target

    if not isinstance(m.get("config"), dict) or not isinstance(m["config"].get("storage"), dict):
        bad.add("recompute", "the manifest holds no resolved config (config.storage): the run cannot be rebuilt")
        return
    cfgd = copy.deepcopy(m["config"])
    cfgd["storage"]["path"] = store.path
    cfgd.update(overwrite=False, progress=False)
    device = loader.get("device")
    if isinstance(cfgd.get("model"), dict):
        if cfgd["model"].get("trust_remote_code") and not loader.get("trust_remote_code"):
            report.notes.append("the cache was written with model.trust_remote_code=true; recompute loads without "
                                "it (pass --trust-remote-code to verify if you trust that code)")
        cfgd["model"]["trust_remote_code"] = bool(loader.get("trust_remote_code"))  # only the user's flag
        if loader.get("model"):
            cfgd["model"]["path"] = loader["model"]
    if not store.url:
        inside = _paths_inside(cfgd, store.root)
        if inside:
            bad.add("recompute", f"the manifest points {', '.join(inside)} inside the cache itself; a cache never "
                                 "holds the target, its tokenizer, data or template, so nothing there is loaded. "
                                 "Pass --model PATH for the target, or recompute from the original run's files")
            return
    recorded = _COMPUTE_NAME.get(m["identity"].get("compute_dtype", ""), None)
    if recorded:
        cfgd["model"]["dtype"] = recorded  # same arithmetic as the run, whatever this machine's default
    if device:
        cfgd["model"]["device"] = device
    try:
        cfg = from_dict(cfgd)
        plan = prepare(cfg)
    except DsparkError as exc:
        bad.add("recompute", f"cannot rebuild the run from the manifest's config: {exc}")
        return
    if plan.config_hash != m["config_hash"]:
        diffs = fmt.identity_differences(m["identity"], plan.identity)
        listed = "; ".join(f"{k}: recorded {a!r}, now {b!r}" for k, a, b in diffs[:6])
        bad.add("recompute", f"the target, tokenizer or data named in the manifest changed since the cache was "
                             f"written ({listed}); recomputing would compare against a different run")
        return
    cache = open_cache(store.path, allow_incomplete=True, chunk_cache_bytes=0)
    lengths = tables["samples/length"].astype(np.int64)
    ct, unit_tokens = int(m["layout"]["chunk_tokens"]), int(m["layout"]["unit_tokens"])
    layout = fmt.plan_layout(lengths, ct, unit_tokens)
    rows = read_rows(resolve_source(cfg.data.path), cfg.data)
    encoder = ChatEncoder(plan.tokenizer, plan.template, cfg.seq_length, cfg.data.mask_reasoning_content,
                          cfg.data.mask_generation_prompt)
    model = load_target(cfg.model, plan.target, len(plan.tokenizer), plan.device, plan.compute_dtype)
    capture = HiddenStateCapture(model, plan.layer_ids)
    pad_id = getattr(plan.tokenizer, "pad_token_id", None)
    pad_id = int(pad_id if pad_id is not None else (plan.tokenizer.eos_token_id or 0))
    sdtype = m["storage_dtype"]
    step, floor = _STEP[sdtype]
    torch_storage = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sdtype]
    names = {**{int(k): v for k, v in m["arrays"].items() if k != "last"}}
    start = tables["samples/start"].astype(np.int64)
    try:
        for s in (int(x) for x in pick):
            a, n = int(start[s]), int(lengths[s])
            try:
                wanted = [fmt.INPUT_IDS, fmt.LOSS_MASK, *dict.fromkeys(m["arrays"].values())]
                stored = cache.read_tokens(wanted, a, a + n)
            except CacheFormatError as exc:  # a corrupt or missing chunk, named by the reader
                bad.add("recompute", f"sample {s}: cannot read it ({exc})", sample=s, array=getattr(exc, "array", None))
                continue
            raw = rows[int(tables["samples/source_row"][s])]
            conv = normalize(raw, cfg.data.format)
            enc = conv if isinstance(conv, Reject) else encoder.encode(conv, raw.row)
            if isinstance(enc, Reject):
                bad.add("recompute", f"sample {s}: its source row {raw.row} no longer encodes ({enc.reason}: "
                                     f"{enc.message})", sample=s)
                continue
            for key, want in ((fmt.INPUT_IDS, enc.input_ids), (fmt.LOSS_MASK, enc.loss_mask)):
                got = stored[key]
                if len(got) != len(want) or not np.array_equal(got, want):
                    pos = int(np.flatnonzero(got[:len(want)] != want[:len(got)])[0]) if \
                        (got[:len(want)] != want[:len(got)]).any() else min(len(got), len(want))
                    bad.add("recompute", f"sample {s}: stored {key} differs from re-tokenizing source row {raw.row} "
                                         f"(first at token {pos}, chunk {(a + pos) // ct})", sample=s, array=key,
                            chunk=((a + pos) // ct,), unit=int(layout.unit[s]))
            # the forward batch the pipeline ran this sample in, rebuilt from the layout
            u = int(layout.unit[s])
            batch = next(b for b in make_batches(layout.unit_order[u], lengths, cfg.batch.max_tokens,
                                                 cfg.batch.max_samples) if s in set(b.tolist()))
            members = {int(t): SimpleNamespace(input_ids=cache.read_tokens(
                [fmt.INPUT_IDS], int(start[t]), int(start[t] + lengths[t]))[fmt.INPUT_IDS]) for t in batch}
            ids, mask, _ = batch_inputs(members, batch, lengths, pad_id, plan.device)  # the pipeline's own inputs
            states, last = capture(ids, mask)
            r = int(np.flatnonzero(batch == s)[0])
            worst, exact = 0.0, True
            checks = [(f"layer {lid}", names[lid], states[lid]) for lid in plan.layer_ids]
            checks.append(("last (post-norm)", m["arrays"]["last"], last))
            for label, arr_name, t in checks:
                want = t[r, :n].detach().cpu()
                got = to_torch(stored[arr_name], sdtype)
                exact = exact and torch.equal(got, want.to(torch_storage))
                wf = want.float()
                steps = (got.float() - wf).abs() / (wf.abs().clamp_min(floor) * step)
                ms = float(steps.max()) if steps.numel() else 0.0
                worst = max(worst, ms)
                if ms > tolerance:
                    pos = int(steps.amax(dim=-1).argmax())
                    bad.add("recompute", f"sample {s}, {label} (array {arr_name!r}): stored hidden states differ from "
                                         f"the recomputation by {ms:.1f} {sdtype} steps (> tolerance {tolerance}), "
                                         f"worst at token {pos} in chunk {((a + pos) // ct, 0)}",
                            sample=s, array=arr_name, chunk=((a + pos) // ct, 0), unit=u)
            report.recomputed += 1
            report.recompute_exact += int(exact)
            report.recompute_max_steps = max(report.recompute_max_steps, worst)
    finally:
        capture.close()


def mark_for_recompute(path: str | Path, units: list[int]) -> list[str]:
    """Make the next precompute run rewrite ``units``: drop their commits, set complete=false.

    The precompute job resumes any cache whose manifest says incomplete and rewrites
    exactly the units without a commit record, so re-running the command that made the
    cache (same overrides) repairs it. Takes the writer lock; returns the commit keys removed.
    """
    from dspark_precompute.lock import WriterLock

    store = CacheStore(str(path))
    if store.url:
        raise DsparkError(f"{path}: --repair works on local caches only; copy the cache locally or re-create it")
    lock = WriterLock(store.root).acquire()  # raises LockedError while a run is writing
    removed = []
    try:
        from dspark_precompute.reader import load_manifest

        m = load_manifest(store)  # a manifest the reader refuses is not edited: the cache needs re-creating
        if m.get("complete"):
            m["complete"] = False
            m.pop("completed_at", None)
            store.write_bytes(fmt.MANIFEST, (json.dumps(m, indent=2, sort_keys=True) + "\n").encode())
        for u in sorted({int(u) for u in units if 0 <= int(u) < int(m["layout"]["num_units"])}):
            key = fmt.commit_key(u)
            if store.exists(key):
                store.delete(key)
                removed.append(key)
    finally:
        lock.release()
    return removed
