"""``run(cfg)``: config -> target & tokenizer -> samples -> batches -> capture -> writers -> store.

Everything cheap happens first (config checks, fingerprints, the resume decision, the
tokenization of every row) so a wrong run fails in seconds, before weights load. Then the
layout is allocated and every unit's ``input_ids`` and ``loss_mask`` are written (a resume
reads them back instead of tokenizing again), the target loads, and each unit's batches are
forwarded into a unit buffer the writers compress and commit while the next unit runs.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark_precompute.contract.commits import CommitRecord, TokenDigests, committed_units
from dspark_precompute.contract.layout import Layout, build_layout
from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.contract.manifest import Counts, Manifest
from dspark_precompute.contract.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HYDRA_RECORD,
    IMAGE_SAMPLE,
    LOCK,
    MANIFEST,
    REJECTS,
    TOKEN_DIGESTS,
    TOKENS_FIRST,
    VIDEO_SAMPLE,
    WEIGHTS,
)
from dspark_precompute.contract.store import CacheStore, is_url
from dspark_precompute.contract.vocab import RejectReason, StorageDtype
from dspark_precompute.errors import (
    CacheFormatError,
    ConfigError,
    ForeignDirectoryError,
    InterruptedRunError,
    RankFailedError,
    StoppedBySignal,
    StorageWriteError,
)
from dspark_precompute.faults import fault_point
from dspark_precompute.humanize import human_bytes
from dspark_precompute.tensors import torch_dtype
from dspark_precompute.write.config.schema import PrecomputeConfig
from dspark_precompute.write.parallel.distributed import (
    Coordinator,
    Lockstep,
    Ranks,
    assign_units,
    init_ranks,
    unit_share,
)
from dspark_precompute.write.plan import resume
from dspark_precompute.write.plan.prepare import Plan, prepare
from dspark_precompute.write.plan.provenance import run_record, with_loaded_model
from dspark_precompute.write.samples.media import image_tables, media_inputs
from dspark_precompute.write.samples.normalize import Reject
from dspark_precompute.write.samples.tokenize import (
    Tokenized,
    ensure_encoded,
    reason_counts,
    tokenize,
    warn_about_rejects,
)
from dspark_precompute.write.store.allocate import allocate, write_tokens
from dspark_precompute.write.store.forward import ForwardLoop
from dspark_precompute.write.store.window import WindowGate, check_window
from dspark_precompute.write.target.capture import export_weights
from dspark_precompute.write.target.load import load_target

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a run did: the cache, its counts, bytes on disk, time, and the units written now and before."""

    path: str
    samples: int
    tokens: int
    supervised_tokens: int
    truncated_samples: int
    rejected: int
    bytes_on_disk: int
    wall_seconds: float
    units_written: int
    resumed_units: int
    complete: bool = True
    timing: dict[str, float] = field(default_factory=dict)
    finalized: bool = False  # this run wrote the final manifest (a no-op run on a complete cache did not)

    @classmethod
    def of(cls, path: str, counts: Counts, nbytes: int, seconds: float, written: int, before: int,
           complete: bool = True, timing: dict[str, float] | None = None, finalized: bool = False) -> RunResult:
        return cls(path, counts.samples, counts.tokens, counts.supervised_tokens, counts.truncated_samples,
                   counts.rejected, nbytes, seconds, written, before, complete, dict(timing or {}), finalized)


def run(cfg: PrecomputeConfig, provenance: dict[str, Any] | None = None) -> RunResult:
    """Precompute the cache described by ``cfg`` (resuming a compatible partial cache).

    Under torchrun / SLURM every rank calls this with the same config; they split the
    units between them and rank 0 finishes the manifest. ``provenance`` (the entry point's
    command line, Hydra overrides and composed config) is recorded in the cache this run
    finishes; Hydra's own files are never read back, so the record is always this run's.
    """
    if cfg.dry_run:  # planning writes nothing, so it never goes through the run
        raise ConfigError(["dry_run=true plans a run without running it: call dspark_precompute.run(cfg) or "
                           "dspark_precompute.write.dryrun.dry_run(cfg), or drop dry_run to run"])
    if cfg.regenerate.engine != "none":  # the paper's recipe: the target's own answers first
        from dspark_precompute.write.plan.regenerated import regenerate_stage

        if cfg.regenerate.only:
            raise ConfigError(["regenerate.only=true stops before capture: call "
                               "dspark_precompute.write.plan.regenerated.regenerate_stage(cfg)"])
        regenerated, cfg = regenerate_stage(cfg)
        provenance = {**(provenance or {}), "regeneration": regenerated.record}
    ranks = init_ranks(cuda_collectives=cfg.parallel.sharded and cfg.model.device != "cpu"
                       and torch.cuda.is_available())
    clean = False
    try:
        result = _Run(cfg, ranks, provenance or {}).execute()
        clean = True
        return result
    finally:
        ranks.close(clean)


@dataclass
class _Samples:
    """The selection's samples: from tokenizing now (``tok``) or read back from a resumed cache (``stored``)."""

    layout: Layout
    counts: Counts  # before any sample is dropped for non-finite states
    tables: dict[str, np.ndarray]
    tok: Tokenized | None = None
    stored: resume.Stored | None = None
    tokens: TokenDigests | None = None  # the token shards' digests as written (commits/tokens.json)

    def ids(self, plan: Plan, units: list[int]) -> Mapping[int, np.ndarray]:
        """Sample id -> input ids, for the samples of ``units``."""
        if self.stored is not None:
            return self.stored.ids(units)
        assert self.tok is not None
        wanted = {int(s) for u in units for s in self.layout.unit_order[u]}
        ensure_encoded(plan.encoding, plan.cfg.data, self.tok, wanted)
        return {s: e.input_ids for s, e in self.tok.encoded.items()}

    def rejects(self) -> bytes:
        return self.stored.rejects() if self.stored is not None else _rejects_bytes(self.tok)

    def close(self) -> None:
        if self.stored is not None:
            self.stored.close()


class _Run:
    """One run on one rank: decide, read or tokenize, allocate, store the tokens, forward, finish."""

    def __init__(self, cfg: PrecomputeConfig, ranks: Ranks, provenance: dict[str, Any]):
        self.cfg, self.ranks, self.provenance = cfg, ranks, provenance
        self.t_start = time.perf_counter()
        self.timing: dict[str, float] = {}
        self.plan = prepare(cfg, world=ranks.world)
        self.store: CacheStore = self.plan.store
        self.lock = WriterLock(self.store.root) if ranks.main and not is_url(self.plan.path) else None

    def execute(self) -> RunResult:
        plan, ranks = self.plan, self.ranks
        if ranks.main:  # before anything is created: never leave even a lock file in a foreign directory
            problem = resume.directory_problem(self.store, plan.path, deleting=self.cfg.overwrite)
            if problem:
                raise ForeignDirectoryError(problem)
        try:
            manifest = ranks.broadcast(ranks.together(self._decide))
            if manifest is not None and manifest.complete:
                if ranks.main:  # a window asked of a cache written in full is refused, saying why
                    check_window(self.store, self.cfg.storage, True, manifest.layout.num_units,
                                 manifest.layout.num_units, self.cfg.parallel.tp > 1)
                log.info("cache %s is complete (%d samples): nothing to do", plan.path, manifest.counts.samples)
                return RunResult.of(plan.path, manifest.counts, self.store.nbytes(),
                                    time.perf_counter() - self.t_start, 0, manifest.layout.num_units)
            samples = self._samples(manifest)
            try:
                return self._write(manifest, samples)
            finally:
                samples.close()
        finally:
            if self.lock:
                self.lock.release()

    def _decide(self) -> Manifest | None:
        """Rank 0: take the lock, then the manifest this run continues (None: start afresh)."""
        if self.lock:
            try:
                self.lock.acquire()
            except OSError as exc:
                raise StorageWriteError(f"cannot create the writer lock in {self.plan.path}: {exc}. Check the "
                                        "path's permissions and free space.") from exc
        if not self.ranks.main:
            return None
        manifest = resume.existing_manifest(self.plan)
        if manifest is not None and manifest.tokens_stored and not manifest.complete:
            damaged = resume.stored_token_problems(self.store, manifest)
            if damaged:  # tokenize again (the data's hash is unchanged) and rewrite every unit's ids and masks
                log.warning("%s: the stored token ids or masks of %d unit(s) cannot be read back (%s%s); tokenizing "
                            "again and rewriting every unit's input_ids and loss_mask", self.plan.path, len(damaged),
                            damaged[0], f"; +{len(damaged) - 1} more" if len(damaged) > 1 else "")
                manifest.tokens_stored = False
        if manifest is not None and manifest.tokens_stored and not manifest.complete and self.plan.media is not None:
            # rows with images: the forward reads each image again from the references tokenizing gives (the ids
            # alone do not name them); the images' hashes in the identity already proved them unchanged
            log.info("%s: rows with images: tokenizing again to find their images", self.plan.path)
            manifest.tokens_stored = False
        return manifest

    def _samples(self, manifest: Manifest | None) -> _Samples:
        """Read the samples back (a resume whose tokens are stored) or tokenize every row."""
        t0 = time.perf_counter()
        if manifest is not None and manifest.tokens_stored:
            stored = self.ranks.together(lambda: resume.load_stored(self.plan, manifest))
            self.timing["read_tokens_s"] = time.perf_counter() - t0
            log.info("resuming %s: samples and tokens read back from the cache (%d samples, %.1f s)", self.plan.path,
                     manifest.stored_samples, self.timing["read_tokens_s"])
            return _Samples(stored.layout, manifest.counts, stored.tables, stored=stored, tokens=stored.tokens)
        tok = tokenize(self.plan.encoding, self.plan.cfg.data, self.ranks)
        self.timing["tokenize_s"] = time.perf_counter() - t0
        if self.ranks.main:
            warn_about_rejects(tok)
        layout = build_layout(tok.lengths, self.plan.chunk_tokens, self.plan.unit_tokens)
        tables = {"samples/start": layout.start, "samples/length": layout.length,
                  "samples/source_row": tok.sample_rows, "samples/unit": layout.unit,
                  "samples/untruncated_length": tok.untruncated.astype(np.int32)}
        if self.plan.media is not None:  # an image cache: each image's sample, grid and content hash
            tables.update(image_tables(tok.images))
        return _Samples(layout, _counts(tok), tables, tok=tok)

    def _write(self, manifest: Manifest | None, samples: _Samples) -> RunResult:
        plan, ranks, layout = self.plan, self.ranks, samples.layout
        coord = Coordinator(self.store, ranks, ranks.broadcast(Coordinator.new_run_id() if ranks.main else None))
        created, done = ranks.broadcast(ranks.together(lambda: self._setup(manifest, samples)))
        if manifest is None or not manifest.tokens_stored:
            self._store_tokens(samples, created)
        todo_all = [u for u in range(layout.num_units) if u not in done]
        mine, writes = unit_share(todo_all, layout.unit_stop - layout.unit_start, ranks, self.cfg.parallel.tp)
        ids = samples.ids(plan, mine)
        model = self._load_target()
        t0 = time.perf_counter()
        try:
            loop = ForwardLoop(plan, model, ids, layout, self._device(), samples.tokens, writes=writes)
            loop.gate = self._gate(layout, len(done))
            if plan.media is not None and samples.tok is not None:
                loop.media = media_inputs(plan.encoding.spec.build(plan.tokenizer), samples.tok.encoded)
            lockstep = Lockstep(ranks, self.cfg.parallel.sharded)  # a rank without units still joins the forwards
            written = loop.run(mine, coord, lockstep) if mine or lockstep.enabled else 0
            self.timing.update(loop.stats.as_dict())
        except StoppedBySignal as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            committed = len(committed_units(self.store, layout.num_units)) if ranks.main else 0
            raise InterruptedRunError(exc.signum, plan.path, committed, layout.num_units) from None
        except BaseException as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            raise
        self.timing["forward_write_s"] = time.perf_counter() - t0
        try:  # the end barrier: a peer that died (any way) closes its sockets and gloo raises here
            hosts = ranks.gather(socket.gethostname())
        except RuntimeError as exc:
            raise RankFailedError(f"a peer rank ended before finishing its units: {exc}") from exc
        coord.check()
        if not ranks.main:
            return RunResult.of(plan.path, samples.counts, 0, time.perf_counter() - self.t_start, written, len(done),
                                False, self.timing)
        coord.cleanup()
        return self._finish(samples, created, done, written, hosts, model)

    def _gate(self, layout: Layout, committed: int) -> WindowGate | None:
        """storage.window_units/window_mib: the wait that keeps this rank's units inside the window (None: no
        window). Rank 0 checks the window against the cache and records it; every rank gets it."""
        storage = self.cfg.storage
        window = self.ranks.broadcast(self.ranks.together(lambda: check_window(
            self.store, storage, False, committed, layout.num_units, self.cfg.parallel.tp > 1)
            if self.ranks.main else None))
        if window is None:
            return None
        row = sum(s.row_bytes for s in self.plan.specs if s.name not in TOKENS_FIRST)
        return WindowGate(self.store, window, (layout.unit_stop - layout.unit_start).astype(np.int64) * row,
                          storage.window_timeout_s)

    def _setup(self, manifest: Manifest | None, samples: _Samples) -> tuple[str, set[int]]:
        """Rank 0: allocate a fresh cache (tables, rejects, manifest), or find a resumed one's committed units."""
        if not self.ranks.main:
            return "", set()
        plan, store, layout = self.plan, self.store, samples.layout
        if manifest is not None:
            if samples.tok is not None:  # tokenized again: it must be the layout the first run wrote
                resume.check_same_layout(store, layout, samples.tables, manifest)
            done = committed_units(store, layout.num_units)
            left = resume.clear_temporaries(store)
            log.info("resuming %s: %d of %d units already committed%s", plan.path, len(done), layout.num_units,
                     f"; {len(left)} unfinished write(s) of the interrupted run removed" if left else "")
            return manifest.created_at, done
        if set(store.top_level_names()) - {LOCK}:
            # ours (checked before): an overwrite, or an allocation a kill interrupted; either way it is deleted,
            # so nothing of a user's may sit inside its directories
            problem = resume.directory_problem(self.store, plan.path, deleting=True)
            if problem:
                raise ForeignDirectoryError(problem)
            log.warning("%s: deleting the existing cache in %s", "overwrite=true" if self.cfg.overwrite
                        else "restarting an allocation that was interrupted", plan.path)
            resume.clear(store)
        fresh = plan.manifest(layout, samples.counts, image_samples=samples.tables.get(IMAGE_SAMPLE),
                              video_samples=samples.tables.get(VIDEO_SAMPLE))
        attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "manifest": MANIFEST}
        try:
            allocate(store, plan.specs, layout, plan.cfg.storage, samples.tables, attrs)
        except OSError as exc:
            raise StorageWriteError(
                f"allocating the cache in {plan.path} failed: {exc}. Free space or fix the storage, then re-run the "
                "same command: an interrupted allocation is started again.") from exc
        _put(store, REJECTS, samples.rejects(), plan.cfg.storage.fsync)
        _write_manifest(store, fresh)
        return fresh.created_at, set()

    def _store_tokens(self, samples: _Samples, created: str) -> None:
        """Every unit's input_ids and loss_mask (each rank its share), then the manifest says they are stored."""
        plan, ranks, layout = self.plan, self.ranks, samples.layout
        t0 = time.perf_counter()
        share = assign_units(layout.unit_stop - layout.unit_start, ranks.world)[ranks.rank]
        assert samples.tok is not None
        ensure_encoded(plan.encoding, plan.cfg.data, samples.tok, {int(s) for u in share for s in layout.unit_order[u]})
        try:
            _, digests = ranks.together(lambda: write_tokens(self.store, layout, plan.cfg.storage, plan.specs,
                                                             samples.tok.encoded if samples.tok else {}, share))
        except OSError as exc:
            raise StorageWriteError(f"writing the token ids of {plan.path} failed: {exc}. Free space or fix the "
                                    "storage, then re-run the same command.") from exc
        # every rank's tokens are durable before the record and the manifest say so; each rank takes every digest
        samples.tokens = TokenDigests.of({u: d for part in ranks.gather(digests) for u, d in part.items()},
                                         layout.num_units)
        if ranks.main:
            _put(self.store, TOKEN_DIGESTS, samples.tokens.to_bytes(), plan.cfg.storage.fsync)
            resume.rebind_tokens(self.store, samples.tokens, plan.cfg.storage.fsync)
            m = plan.manifest(layout, samples.counts, created, samples.tables.get(IMAGE_SAMPLE),
                              samples.tables.get(VIDEO_SAMPLE))
            m.tokens_stored = True
            _write_manifest(self.store, m)
        self.timing["store_tokens_s"] = time.perf_counter() - t0

    def _device(self) -> torch.device:
        device = self.plan.device
        if device.type == "cuda" and self.ranks.world > 1 and self.plan.cfg.model.device == "auto":
            device = torch.device("cuda", self.ranks.local_rank)
        return device

    def _load_target(self) -> Any:
        plan, t0 = self.plan, time.perf_counter()
        ranks = self.ranks
        model = ranks.together(lambda: load_target(self.cfg.model, plan.target, len(plan.tokenizer), self._device(),
                                                   plan.compute_dtype, self.cfg.parallel, ranks.world, ranks.rank))
        self.timing["load_target_s"] = time.perf_counter() - t0
        if not self.cfg.parallel.sharded:
            if ranks.main and not self.store.exists(WEIGHTS):
                _write_weights(plan, model)
        elif ranks.broadcast(not self.store.exists(WEIGHTS) if ranks.main else None):
            tensors = export_weights(model)  # sharded: an all-gather every rank joins, rank 0 writes
            if ranks.main:
                _write_weights(plan, tensors)
        return model

    def _finish(self, samples: _Samples, created: str, done: set[int], written: int, hosts: list[str],
                model: Any) -> RunResult:
        """Rank 0, every unit committed: the rejects and counts with dropped samples, the final manifest."""
        plan, store, layout = self.plan, self.store, samples.layout
        missing = sorted(set(range(layout.num_units)) - committed_units(store, layout.num_units))
        if missing:
            raise CacheFormatError(f"units {missing[:10]} have no commit record after every rank finished; "
                                   "re-run the same command to write them")
        _write_provenance(store, self.provenance, plan.cfg.storage.fsync)
        dropped = _dropped_samples(store, layout.num_units)
        counts = samples.counts
        if dropped:  # samples whose states were not finite: rejects now, so rows_in = samples + rejected holds
            counts = _dropped_counts(counts, samples, dropped, plan)
            _put(store, REJECTS, _with_dropped(samples.rejects(), samples.tables, dropped), plan.cfg.storage.fsync)
        self.timing["wall_s"] = time.perf_counter() - self.t_start
        final = plan.manifest(layout, counts, created, samples.tables.get(IMAGE_SAMPLE),
                              samples.tables.get(VIDEO_SAMPLE))
        final.tokens_stored = True
        if dropped:
            final.dropped_samples = sorted(dropped)
            final.nonfinite_values = _nonfinite_totals(dropped)
        final.capture = with_loaded_model(final.capture, model)
        final.mark_complete(self.timing, store.sha256(WEIGHTS),
                            run_record(self.provenance, hosts, self.ranks.world, store, done, self.cfg.parallel))
        _write_manifest(store, final)
        result = RunResult.of(plan.path, counts, store.nbytes(), self.timing["wall_s"], written, len(done), True,
                              self.timing, finalized=True)
        _log_summary(result)
        return result


def _counts(tok: Tokenized) -> Counts:
    """The accounting of the selection as tokenized."""
    return Counts(rows_in=tok.rows_in, samples=len(tok.lengths), rejected=len(tok.rejects),
                  tokens=int(tok.lengths.sum()), supervised_tokens=int(tok.supervised.sum()),
                  truncated_samples=int((tok.untruncated > tok.lengths).sum()),
                  rejected_by_reason=reason_counts(tok.rejects))


def _dropped_counts(counts: Counts, samples: _Samples, dropped: dict[int, dict[str, int]], plan: Plan) -> Counts:
    """``counts`` with the ``dropped`` samples (non-finite states) moved from the samples to the rejects."""
    ids = np.asarray(sorted(dropped), dtype=np.int64)
    length = samples.tables["samples/length"].astype(np.int64)[ids]
    untrunc = samples.tables["samples/untruncated_length"].astype(np.int64)[ids]
    if samples.tok is not None:
        supervised = int(samples.tok.supervised[ids].sum())
    else:
        assert samples.stored is not None
        supervised = samples.stored.supervised(ids)
    by = dict(counts.rejected_by_reason)
    by[RejectReason.NONFINITE] = by.get(RejectReason.NONFINITE, 0) + len(ids)
    return Counts(rows_in=counts.rows_in, samples=counts.samples - len(ids), rejected=counts.rejected + len(ids),
                  tokens=counts.tokens - int(length.sum()), supervised_tokens=counts.supervised_tokens - supervised,
                  truncated_samples=counts.truncated_samples - int((untrunc > length).sum()),
                  rejected_by_reason=dict(sorted((str(k), v) for k, v in by.items())))


def _rejects_bytes(tok: Tokenized | None) -> bytes:
    """rejects.jsonl as the tokenizer found them, in selection order (deterministic)."""
    rows = sorted((r.to_json() for r in (tok.rejects if tok else [])), key=lambda r: r["row"])
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def _with_dropped(rejects: bytes, tables: dict[str, np.ndarray], dropped: dict[int, dict[str, int]]) -> bytes:
    """rejects.jsonl with a line for each dropped sample, in selection order."""
    rows = [json.loads(line) for line in rejects.decode("utf-8").splitlines() if line.strip()]
    source = tables["samples/source_row"]
    for s, arrays in sorted(dropped.items()):
        rows.append(Reject(int(source[s]), RejectReason.NONFINITE,
                           "the target's hidden states for this row are not finite ("
                           + ", ".join(f"{k}: {v} values" for k, v in sorted(arrays.items())) + ")").to_json())
    rows.sort(key=lambda r: r["row"])
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def _dropped_samples(store: CacheStore, num_units: int) -> dict[int, dict[str, int]]:
    """Samples the units' commit records say were dropped, with their non-finite counts per array."""
    out: dict[int, dict[str, int]] = {}
    for u in range(num_units):
        rec = CommitRecord.read(store, u)
        for d in (rec.extra.get("dropped") or []) if rec is not None else []:
            out[int(d["sample"])] = {str(k): int(v) for k, v in d["nonfinite"].items()}
    return out


def _nonfinite_totals(dropped: dict[int, dict[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for arrays in dropped.values():
        for k, v in arrays.items():
            totals[k] = totals.get(k, 0) + v
    return dict(sorted(totals.items()))


def _put(store: CacheStore, key: str, data: bytes, fsync: bool = True) -> None:
    try:
        store.write_bytes(key, data, fsync)
    except OSError as exc:
        raise StorageWriteError(
            f"writing {store.path}/{key} ({len(data) / 1e6:,.1f} MB) failed: {exc}. Free space or fix the "
            "storage, then re-run the same command: the cache resumes."
        ) from exc


def _write_manifest(store: CacheStore, manifest: Manifest) -> None:
    fault_point("manifest")
    try:
        manifest.write(store)
    except OSError as exc:
        raise StorageWriteError(f"writing {store.path}/{MANIFEST} failed: {exc}. Free space or fix the "
                                "storage, then re-run the same command: the cache resumes.") from exc


def _write_weights(plan: Plan, model: Any) -> None:
    """The target's embedding (and untied lm_head) into target_weights.safetensors; ``model`` may be those tensors."""
    from safetensors.torch import save

    dtype = torch_dtype(StorageDtype(plan.cfg.storage.dtype).output)  # an fp8 cache's weights are bf16
    whole = model if isinstance(model, dict) else export_weights(model)
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in whole.items()}
    fault_point("weights")
    # One metadata key only: safetensors orders several keys differently from run to run,
    # and the file must be byte-identical across resumes. Tying is recorded in the manifest.
    _put(plan.store, WEIGHTS, save(tensors, metadata={"format": "pt"}), plan.cfg.storage.fsync)


def _write_provenance(store: CacheStore, provenance: dict[str, Any], fsync: bool = True) -> None:
    """This run's Hydra record (built in memory by the entry point) into ``.hydra/``."""
    files = provenance.get("files") or {}
    if files:
        store.delete(HYDRA_RECORD)
    for name, text in sorted(files.items()):
        _put(store, f"{HYDRA_RECORD}/{name}", text.encode(), fsync)


def _log_summary(r: RunResult) -> None:
    log.info(
        "done: %d samples, %d tokens (%d supervised, %.1f%%), %d truncated, %d rejected; %s on disk "
        "(%.1f B/token) in %.1fs -> %s",
        r.samples, r.tokens, r.supervised_tokens, 100.0 * r.supervised_tokens / max(1, r.tokens),
        r.truncated_samples, r.rejected, human_bytes(r.bytes_on_disk), r.bytes_on_disk / max(1, r.tokens),
        r.wall_seconds, r.path,
    )
    log.info("open it with: from dspark_precompute import open_cache; c = open_cache(%r); c[0]", r.path)
