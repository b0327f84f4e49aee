"""``run(cfg)``: config -> target & tokenizer -> samples -> batches -> capture -> writer -> store.

Everything cheap happens first (config checks, fingerprints, the resume decision, the
tokenization of every row) so a wrong run fails in seconds, before weights load. Then
the layout is allocated, the target loads, and each unit's batches are forwarded into a
unit buffer the writer compresses and commits while the next unit runs.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark_precompute.contract.commits import CommitRecord, committed_units
from dspark_precompute.contract.layout import Layout, build_layout
from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.contract.manifest import Counts, Manifest
from dspark_precompute.contract.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HYDRA_RECORD,
    INPUT_IDS,
    LOCK,
    LOSS_MASK,
    MANIFEST,
    OUTPUT_DTYPES,
    REJECTS,
    WEIGHTS,
)
from dspark_precompute.contract.store import CacheStore, is_url
from dspark_precompute.errors import (
    CacheFormatError,
    ConfigError,
    ForeignDirectoryError,
    InterruptedRunError,
    NonFiniteStatesError,
    RankFailedError,
    StoppedBySignal,
    StorageWriteError,
)
from dspark_precompute.faults import fault_point
from dspark_precompute.humanize import human_bytes
from dspark_precompute.write import resume, signals
from dspark_precompute.write.batching import batch_inputs, make_batches
from dspark_precompute.write.capture import HiddenStateCapture, export_weights
from dspark_precompute.write.chat import Encoded
from dspark_precompute.write.config import PrecomputeConfig
from dspark_precompute.write.data import Reason, Reject
from dspark_precompute.write.distributed import Coordinator, Ranks, assign_units, init_ranks
from dspark_precompute.write.plan import Plan, prepare
from dspark_precompute.write.progress import Progress
from dspark_precompute.write.provenance import run_record, with_loaded_model
from dspark_precompute.write.target import load_target
from dspark_precompute.write.tokenize import Tokenized, ensure_encoded, reason_counts, tokenize, warn_about_rejects
from dspark_precompute.write.transfer import StateArray, UnitCheck, UnitTransfer, zero_samples
from dspark_precompute.write.writer import ArraySpec, UnitWriter, allocate, resolve_writers

log = logging.getLogger(__name__)
TORCH_STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RunResult:
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
    ranks = init_ranks()
    clean = False
    try:
        result = _run(cfg, ranks, provenance or {})
        clean = True
        return result
    finally:
        ranks.close(clean)


def _run(cfg: PrecomputeConfig, ranks: Ranks, provenance: dict[str, Any]) -> RunResult:
    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    plan = prepare(cfg)
    store = plan.store
    if ranks.main:  # before anything is created: never leave even a lock file in a foreign directory
        problem = resume.directory_problem(store, plan.path, deleting=cfg.overwrite)
        if problem:
            raise ForeignDirectoryError(problem)
    lock = WriterLock(store.root) if ranks.main and not is_url(plan.path) else None

    def decide() -> Manifest | None:
        if lock:
            try:
                lock.acquire()
            except OSError as exc:
                raise StorageWriteError(f"cannot create the writer lock in {plan.path}: {exc}. Check the path's "
                                        "permissions and free space.") from exc
        return resume.existing_manifest(plan) if ranks.main else None

    try:
        manifest = ranks.broadcast(ranks.together(decide))
        if manifest is not None and manifest.complete:
            c = manifest.counts
            log.info("cache %s is complete (%d samples): nothing to do", plan.path, c.samples)
            return RunResult(plan.path, c.samples, c.tokens, c.supervised_tokens, c.truncated_samples, c.rejected,
                             store.nbytes(), time.perf_counter() - t_start, 0, manifest.layout.num_units)

        t0 = time.perf_counter()
        tok = tokenize(plan, ranks)
        timing["tokenize_s"] = time.perf_counter() - t0
        if ranks.main:
            warn_about_rejects(tok)
        layout = build_layout(tok.lengths, plan.chunk_tokens, plan.unit_tokens)
        counts = _counts(tok)
        tables = {
            "samples/start": layout.start, "samples/length": layout.length,
            "samples/source_row": tok.sample_rows, "samples/unit": layout.unit,
            "samples/untruncated_length": tok.untruncated.astype(np.int32),
        }
        run_id = ranks.broadcast(Coordinator.new_run_id() if ranks.main else None)
        coord = Coordinator(store, ranks, run_id)

        def setup() -> tuple[str, set[int]]:
            if not ranks.main:
                return "", set()
            if manifest is None:
                if set(store.top_level_names()) - {LOCK}:
                    # ours (checked above): an overwrite, or an allocation a kill interrupted
                    log.warning("%s: deleting the existing cache in %s", "overwrite=true" if cfg.overwrite
                                else "restarting an allocation that was interrupted", plan.path)
                    resume.clear(store)
                fresh = plan.manifest(layout, counts)
                attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "manifest": MANIFEST}
                try:
                    allocate(store, plan.specs, layout, plan.cfg.storage, tables, attrs)
                except OSError as exc:
                    raise StorageWriteError(
                        f"allocating the cache in {plan.path} failed: {exc}. Free space or fix the storage, then "
                        "re-run the same command: an interrupted allocation is started again.") from exc
                _put(store, REJECTS, _rejects_bytes(tok))
                _write_manifest(store, fresh)
                return fresh.created_at, set()
            resume.check_same_layout(store, layout, tables, manifest)
            done = committed_units(store, layout.num_units)
            log.info("resuming %s: %d of %d units already committed", plan.path, len(done), layout.num_units)
            return manifest.created_at, done

        created, done = ranks.broadcast(ranks.together(setup))
        todo_all = [u for u in range(layout.num_units) if u not in done]
        unit_tok = (layout.unit_stop - layout.unit_start)[todo_all]
        mine = [todo_all[i] for i in assign_units(unit_tok, ranks.world)[ranks.rank]]
        ensure_encoded(plan, tok, {int(s) for u in mine for s in layout.unit_order[u]})

        t0 = time.perf_counter()
        device = plan.device
        if device.type == "cuda" and ranks.world > 1 and plan.cfg.model.device == "auto":
            device = torch.device("cuda", ranks.local_rank)
        model = ranks.together(lambda: load_target(cfg.model, plan.target, len(plan.tokenizer), device,
                                                   plan.compute_dtype))
        timing["load_target_s"] = time.perf_counter() - t0
        if ranks.main and not store.exists(WEIGHTS):
            _write_weights(plan, model)
        t0 = time.perf_counter()
        try:
            written = _forward_units(plan, model, tok.encoded, layout, mine, timing, coord, device) if mine else 0
        except StoppedBySignal as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            committed = len(committed_units(store, layout.num_units)) if ranks.main else 0
            raise InterruptedRunError(exc.signum, plan.path, committed, layout.num_units) from None
        except BaseException as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            raise
        timing["forward_write_s"] = time.perf_counter() - t0
        try:  # the end barrier: a peer that died (any way) closes its sockets and gloo raises here
            hosts = ranks.gather(socket.gethostname())
        except RuntimeError as exc:
            raise RankFailedError(f"a peer rank ended before finishing its units: {exc}") from exc
        coord.check()
        if not ranks.main:
            return RunResult(plan.path, counts.samples, counts.tokens, counts.supervised_tokens,
                             counts.truncated_samples, counts.rejected, 0, time.perf_counter() - t_start,
                             written, len(done), False, timing)
        missing = sorted(set(range(layout.num_units)) - committed_units(store, layout.num_units))
        if missing:
            raise CacheFormatError(f"units {missing[:10]} have no commit record after every rank finished; "
                                   "re-run the same command to write them")
        coord.cleanup()
        _write_provenance(store, provenance)
        dropped = _dropped_samples(store, layout.num_units)
        if dropped:  # samples whose states were not finite: rejects now, so rows_in = samples + rejected holds
            counts = _counts(tok, dropped)
            _put(store, REJECTS, _rejects_bytes(tok, dropped))
        timing["wall_s"] = time.perf_counter() - t_start
        final = plan.manifest(layout, counts, created)
        if dropped:
            final.dropped_samples = sorted(dropped)
            final.nonfinite_values = _nonfinite_totals(dropped)
        final.capture = with_loaded_model(final.capture, model)
        final.mark_complete(timing, store.sha256(WEIGHTS), run_record(provenance, hosts, ranks.world, store, done))
        _write_manifest(store, final)
        nbytes = store.nbytes()
        result = RunResult(plan.path, counts.samples, counts.tokens, counts.supervised_tokens,
                           counts.truncated_samples, counts.rejected, nbytes, timing["wall_s"], written,
                           len(done), True, timing, finalized=True)
        _log_summary(result)
        return result
    finally:
        if lock:
            lock.release()


def _counts(tok: Tokenized, dropped: dict[int, dict[str, int]] | None = None) -> Counts:
    """The accounting of the selection; ``dropped`` samples (non-finite states) count as rejects."""
    keep = np.ones(len(tok.lengths), dtype=bool)
    keep[list(dropped or {})] = False
    by = reason_counts(tok.rejects)
    if dropped:
        by[Reason.NONFINITE] = by.get(Reason.NONFINITE, 0) + len(dropped)
    return Counts(rows_in=tok.rows_in, samples=int(keep.sum()), rejected=len(tok.rejects) + len(dropped or {}),
                  tokens=int(tok.lengths[keep].sum()), supervised_tokens=int(tok.supervised[keep].sum()),
                  truncated_samples=int((tok.untruncated > tok.lengths)[keep].sum()), rejected_by_reason=by)


def _rejects_bytes(tok: Tokenized, dropped: dict[int, dict[str, int]] | None = None) -> bytes:
    """rejects.jsonl: the tokenizer's rejects, then the dropped samples, in selection order (deterministic)."""
    rows = [r.to_json() for r in tok.rejects]
    for s, arrays in sorted((dropped or {}).items()):
        row = int(tok.sample_rows[s])
        rows.append(Reject(row, Reason.NONFINITE, "the target's hidden states for this row are not finite ("
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


def _put(store: CacheStore, key: str, data: bytes) -> None:
    try:
        store.write_bytes(key, data)
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
    from safetensors.torch import save

    dtype = TORCH_STORAGE[OUTPUT_DTYPES[plan.cfg.storage.dtype]]  # an fp8 cache's weights are bf16
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in export_weights(model).items()}
    fault_point("weights")
    # One metadata key only: safetensors orders several keys differently from run to run,
    # and the file must be byte-identical across resumes. Tying is recorded in the manifest.
    _put(plan.store, WEIGHTS, save(tensors, metadata={"format": "pt"}))


def _write_provenance(store: CacheStore, provenance: dict[str, Any]) -> None:
    """This run's Hydra record (built in memory by the entry point) into ``.hydra/``."""
    files = provenance.get("files") or {}
    if files:
        store.delete(HYDRA_RECORD)
    for name, text in sorted(files.items()):
        _put(store, f"{HYDRA_RECORD}/{name}", text.encode())


def _forward_units(plan: Plan, model: Any, samples: dict[int, Encoded], layout: Layout, todo: list[int],
                   timing: dict[str, float], coord: Coordinator, device: torch.device) -> int:
    """Forward every unit in ``todo`` and hand it to the writers; fills ``timing`` per stage.

    A sample whose states hold NaN/Inf is dropped (its states zeroed, its id in the unit's
    commit record) or stops the run, per ``data.on_nonfinite``. A first SIGINT/SIGTERM
    drops the unit in flight, lets the writers finish the units they already hold, and
    raises :class:`StoppedBySignal`; a second one raises at once.
    """
    cfg = plan.cfg
    capture = HiddenStateCapture(model, plan.layer_ids)
    lengths = layout.length.astype(np.int64)
    total_tok = int(sum(layout.unit_stop[u] - layout.unit_start[u] for u in todo))
    total_smp = int(sum(len(layout.unit_order[u]) for u in todo))
    progress = Progress(total_smp, total_tok, enabled=cfg.progress)
    n_writers = resolve_writers(cfg.storage.writers)
    writer = UnitWriter(plan.store, plan.specs, layout, cfg.storage.writer_slots, todo, writers=n_writers,
                        pin_memory=device.type == "cuda", storage=cfg.storage)
    hidden = state_arrays(plan.specs)
    transfer = UnitTransfer(hidden, device=device)
    fills = {s.name: s.fill for s in plan.specs if s.fill}
    t_batch = t_forward = t_copy = 0.0
    stop = signals.STATE
    try:
        with signals.graceful():
            for u in todo:
                if stop.signum is not None:
                    break
                coord.check()
                slot = writer.acquire()
                bufs = writer.buffers(slot)
                transfer.start(bufs)
                base = int(layout.unit_start[u])
                order = layout.unit_order[u]
                for s in order:
                    a = int(layout.start[s]) - base
                    bufs[INPUT_IDS][a:a + lengths[s]] = samples[s].input_ids
                    bufs[LOSS_MASK][a:a + lengths[s]] = samples[s].loss_mask
                for batch in make_batches(order, lengths, cfg.batch.max_tokens, cfg.batch.max_samples):
                    if stop.signum is not None:
                        break
                    c0 = time.perf_counter()
                    blens = lengths[batch]
                    ids, _ = batch_inputs(samples, batch, lengths, plan.pad_id, device)
                    c1 = time.perf_counter()
                    states, last = capture(ids)
                    c2 = time.perf_counter()
                    transfer.add(batch, blens, ids.shape[1], states, last, int(layout.start[batch[0]]) - base)
                    c3 = time.perf_counter()
                    t_batch, t_forward, t_copy = t_batch + (c1 - c0), t_forward + (c2 - c1), t_copy + (c3 - c2)
                    progress.update(samples=len(batch), tokens=int(blens.sum()), bytes_written=writer.raw_bytes)
                    writer.poll()
                if stop.signum is not None:  # drop the unit in flight, keep the ones the writers hold
                    transfer.finish()
                    writer.release(slot)
                    break
                c4 = time.perf_counter()
                check = transfer.finish()  # on CUDA: the unit's copies are done
                t_copy += time.perf_counter() - c4
                n_tok = int(layout.unit_stop[u] - layout.unit_start[u])
                record = CommitRecord(u, base, base + n_tok, len(order), socket.gethostname())
                if check.bad_samples:
                    names = [a.name for a in hidden] + [a.scale for a in hidden if a.scale]
                    _drop_nonfinite(plan, check, layout, bufs, base, names, record, fills)
                writer.submit(u, slot, n_tok, record)
                fault_point("unit_submitted")
            writer.drain()
        if stop.signum is not None and len(writer.committed) < len(todo):
            raise StoppedBySignal(stop.signum)
        progress.update(bytes_written=writer.raw_bytes)
        progress.close()
        timing.update(batch_s=t_batch, forward_s=t_forward, copy_s=t_copy, writer_wait_s=writer.wait_s,
                      writer_busy_s=writer.busy_s, writers=float(n_writers))
    finally:
        writer.close()
        capture.close()
    return len(todo)


def state_arrays(specs: list[ArraySpec]) -> list[StateArray]:
    """The hidden-state arrays of a run's specs, each with its cast (or fp8 quantization) and its layer."""
    return [StateArray(s.name, int(s.layer_id), None if s.scale else TORCH_STORAGE[str(s.storage)],
                       s.storage == "bf16", s.scale, int(s.group or 0))
            for s in specs if s.width and s.layer_id is not None]


def _drop_nonfinite(plan: Plan, check: UnitCheck, layout: Layout, bufs: dict[str, np.ndarray], base: int,
                    names: list[str], record: CommitRecord, fills: dict[str, float] | None = None) -> None:
    """Samples whose states are not finite: stop (``data.on_nonfinite=error``) or drop them from the cache.

    A dropped sample's states are zeroed (no Inf is ever stored) and its id goes into the
    unit's commit record; the run's end moves it from the samples to the rejects.
    """
    bad = check.bad_samples
    if plan.cfg.data.on_nonfinite == "error":
        s = min(bad)
        raise NonFiniteStatesError(
            f"sample {s} has non-finite hidden states ({', '.join(f'{k}: {v} values' for k, v in bad[s].items())}) "
            f"and {len(bad) - 1} more sample(s) of unit {record.unit} too; a {plan.cfg.model.dtype} forward "
            "overflowed or the target is broken. Use model.dtype=bf16 or fp32 instead of fp16, or pass "
            "data.on_nonfinite=reject to drop such samples (listed in rejects.jsonl); committed units are kept.")
    spans = [(int(layout.start[s]) - base, int(layout.start[s] + layout.length[s]) - base) for s in sorted(bad)]
    zero_samples(bufs, names, spans, fills)
    record.extra["dropped"] = [{"sample": s, "nonfinite": bad[s]} for s in sorted(bad)]
    log.warning("unit %d: %d sample(s) with non-finite hidden states dropped (%s)", record.unit, len(bad),
                ", ".join(f"{k}={v}" for k, v in check.nonfinite.items()))


def _log_summary(r: RunResult) -> None:
    log.info(
        "done: %d samples, %d tokens (%d supervised, %.1f%%), %d truncated, %d rejected; %s on disk "
        "(%.1f B/token) in %.1fs -> %s",
        r.samples, r.tokens, r.supervised_tokens, 100.0 * r.supervised_tokens / max(1, r.tokens),
        r.truncated_samples, r.rejected, human_bytes(r.bytes_on_disk), r.bytes_on_disk / max(1, r.tokens),
        r.wall_seconds, r.path,
    )
    log.info("open it with: from dspark_precompute import open_cache; c = open_cache(%r); c[0]", r.path)
