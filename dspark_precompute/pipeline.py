"""``run(cfg)``: config -> target & tokenizer -> samples -> batches -> capture -> writer -> store.

Everything cheap happens first (config checks, fingerprints, the resume decision, the
tokenization of every row) so a wrong run fails in seconds, before weights load.
"""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute import __version__
from dspark_precompute import format as fmt
from dspark_precompute.chat import ChatEncoder, Encoded, resolve_chat_template, sha256_text
from dspark_precompute.config import EMBEDDED, DataConfig, PrecomputeConfig
from dspark_precompute.data import Reason, Reject, iter_rows, normalize, resolve_source
from dspark_precompute.distributed import Coordinator, RankFailedError, Ranks, assign_units, init_ranks
from dspark_precompute.errors import (
    CacheFormatError, ConfigError, DataError, IncompatibleCacheError, InterruptedRunError, InvalidRowError,
    StorageWriteError, TargetError,
)
from dspark_precompute.faults import fault_point
from dspark_precompute.layers import layer_id_problems, resolve_layer_ids
from dspark_precompute.lock import WriterLock
from dspark_precompute.progress import Progress, human_bytes
from dspark_precompute.store import CacheStore, is_url
from dspark_precompute.target import (
    HiddenStateCapture, export_weights, inspect_target, load_target, load_tokenizer, resolve_compute_dtype,
    resolve_device, tokenizer_sha256,
)
from dspark_precompute.writer import ArraySpec, UnitWriter, allocate, token_array_specs

log = logging.getLogger(__name__)

# Rows that are well-formed but leave nothing to train on at this seq_length: recorded in
# the rejects file, never counted as invalid data.
FILTERED_REASONS = {Reason.NO_SUPERVISED_TOKENS}
_TORCH_STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:64] or "x"


def default_storage_path(cfg: PrecomputeConfig) -> str:
    """``<root>/<model>/<data>/seq<S>-<hash>``: swept values give separate caches, same values the same one.

    The short hash covers the settings that change stored values (layers, masks, dtype,
    split, template, chunking) but not file contents, so a changed data file under the
    same settings maps to the same path and is refused rather than silently forked.
    """
    m, d, s = cfg.model, cfg.data, cfg.storage
    model = "tiny" if m.path == "tiny" else Path(m.path.rstrip("/")).name
    if m.path == "tiny":
        r = m.random
        model = f"tiny-h{r.hidden_size}-l{r.num_hidden_layers}"
    data = "embedded" if d.path == EMBEDDED else Path(d.path.rstrip("/")).stem
    knobs = {
        "model": {k: v for k, v in cfg.to_dict()["model"].items()
                  if k in ("path", "tokenizer", "revision", "dtype", "layer_ids", "draft_num_hidden_layers", "random")},
        "data": {k: v for k, v in cfg.to_dict()["data"].items()
                 if k in ("path", "format", "split", "shuffle_seed", "chat_template", "mask_reasoning_content",
                          "mask_generation_prompt", "max_samples")
                 or (k == "max_row_bytes" and v != DataConfig.max_row_bytes)},
        "storage": {k: v for k, v in cfg.to_dict()["storage"].items() if k not in ("path", "root")},
        "seq_length": cfg.seq_length,
    }
    tag = fmt.config_hash(knobs)[:8]
    root = s.root.rstrip("/")
    return f"{root}/{_slug(model)}/{_slug(data)}/seq{cfg.seq_length}-{tag}"


@dataclass
class Plan:
    """Everything known before the target's weights load."""

    cfg: PrecomputeConfig
    path: str
    store: CacheStore
    tokenizer: Any
    template: str
    target: Any  # TargetInfo
    layer_ids: list[int]
    device: torch.device
    compute_dtype: torch.dtype
    identity: dict[str, Any]
    config_hash: str
    specs: list[ArraySpec]
    names: dict[str, str]
    chunk_tokens: int
    unit_tokens: int
    data_sha256: str


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


def prepare(cfg: PrecomputeConfig) -> Plan:
    """Resolve paths, tokenizer, template and target identity; validate it all together."""
    path = cfg.storage.path or default_storage_path(cfg)
    store = CacheStore(path)
    problems: list[str] = []
    try:
        source = resolve_source(cfg.data.path, cfg.data.split_slice()[0])
        data_sha = source.content_sha256()
    except DataError as exc:
        problems.append(str(exc))
        source, data_sha = None, ""
    tokenizer = template = target = None
    try:
        tokenizer = load_tokenizer(cfg.model)
        template = resolve_chat_template(tokenizer, cfg.data.chat_template)
    except (TargetError, ValueError, OSError) as exc:
        problems.append(str(exc))
    if tokenizer is not None:
        try:
            target = inspect_target(cfg.model, tokenizer)
        except TargetError as exc:
            problems.append(str(exc))
    layer_ids: list[int] = []
    if target is not None:
        if cfg.model.layer_ids is not None:
            problems += layer_id_problems(cfg.model.layer_ids, target.num_hidden_layers)
        if not problems:
            try:
                layer_ids = resolve_layer_ids(cfg.model.layer_ids, target.num_hidden_layers,
                                              cfg.model.draft_num_hidden_layers)
            except (ConfigError, ValueError) as exc:
                problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    device = resolve_device(cfg.model.device)
    compute_dtype = resolve_compute_dtype(cfg.model.dtype, device)
    hidden = target.hidden_size
    specs = token_array_specs(layer_ids, target.num_hidden_layers, hidden, cfg.storage.dtype)
    names = fmt.hidden_arrays(layer_ids, target.num_hidden_layers)
    itemsize = np.dtype(fmt.STORAGE_DTYPES[cfg.storage.dtype][0]).itemsize
    chunk = cfg.storage.chunk_tokens or fmt.auto_chunk_tokens(hidden, itemsize)
    n_hidden = sum(1 for s in specs if s.width)
    per_token = fmt.bytes_per_token(hidden, itemsize, n_hidden)
    unit = cfg.storage.unit_tokens or max(chunk, (cfg.storage.unit_mib << 20) // per_token // chunk * chunk)
    unit = max(unit, -(-cfg.seq_length // chunk) * chunk)
    storage_knobs = {k: v for k, v in cfg.to_dict()["storage"].items() if k not in ("path", "root", "unit_mib")}
    storage_knobs.update(chunk_tokens=chunk, unit_tokens=unit)
    identity = {
        "format_version": fmt.FORMAT_VERSION,
        "target": {
            "path": target.path, "model_type": target.model_type, "config_sha256": target.config_sha256,
            "weights_fingerprint": target.weights_fingerprint, "fingerprint_kind": cfg.model.fingerprint,
            "revision": cfg.model.revision,
            # eager / sdpa / flash attention round differently: part of what the values are
            "attn_implementation": cfg.model.attn_implementation,
        },
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": sha256_text(template),
        "data": {
            "path": str(cfg.data.path), "content_sha256": data_sha, "format": cfg.data.format,
            "split": cfg.data.split, "shuffle_seed": cfg.data.shuffle_seed, "max_samples": cfg.data.max_samples,
            "mask_reasoning_content": cfg.data.mask_reasoning_content,
            "mask_generation_prompt": cfg.data.mask_generation_prompt,
            # which rows are rejected as too large; recorded only when not the default, so caches
            # written before the limit existed keep their hash
            **({"max_row_bytes": cfg.data.max_row_bytes}
               if cfg.data.max_row_bytes != DataConfig.max_row_bytes else {}),
        },
        "seq_length": cfg.seq_length,
        "layer_ids": layer_ids,
        "storage": storage_knobs,
    }
    return Plan(cfg, path, store, tokenizer, template, target, layer_ids, device, compute_dtype, identity,
                fmt.config_hash(identity), specs, names, chunk, unit, data_sha)


def _read_manifest(store: CacheStore) -> dict[str, Any] | None:
    if not store.exists(fmt.MANIFEST):
        return None
    try:
        return json.loads(store.read_bytes(fmt.MANIFEST))
    except json.JSONDecodeError as exc:
        raise CacheFormatError(f"{store.path}/{fmt.MANIFEST} is corrupt ({exc}); pass overwrite=true") from exc


def _partial_allocation(store: CacheStore) -> bool:
    """A group this tool began to allocate (its zarr.json says so) but never gave a manifest.

    Only a cache with nothing committed and no weights qualifies: a finished cache that lost
    its manifest is refused like any other foreign directory, never wiped.
    """
    if store.list_keys(fmt.COMMITS) or store.exists(fmt.WEIGHTS):
        return False
    try:
        attrs = json.loads(store.read_bytes("zarr.json")).get("attributes", {})
    except (OSError, FileNotFoundError, json.JSONDecodeError):
        return False
    return attrs.get("format") == fmt.FORMAT_NAME


def check_resume(plan: Plan) -> dict[str, Any] | None:
    """The existing manifest if this run may continue it; raise if it must not."""
    store, cfg = plan.store, plan.cfg
    manifest = _read_manifest(store)
    if manifest is None:
        if not store.is_empty():
            if cfg.overwrite or _partial_allocation(store):
                return None  # ours, killed while allocating: start it again
            raise CacheFormatError(
                f"storage.path={plan.path} exists and is not empty but holds no cache manifest; choose an "
                "empty directory or pass overwrite=true to replace its contents"
            )
        return None
    if cfg.overwrite:
        return None
    problems = fmt.manifest_problems(manifest)
    if problems:
        raise CacheFormatError(f"{plan.path}: " + "; ".join(problems) + " (pass overwrite=true to replace it)")
    if manifest["config_hash"] != plan.config_hash:
        raise IncompatibleCacheError(plan.path, fmt.identity_differences(manifest["identity"], plan.identity))
    return manifest


@dataclass
class Tokenized:
    """The selection after tokenization: per-sample tables (global) and this rank's encodings."""

    rows_in: int
    sample_rows: np.ndarray  # selection index of each sample
    lengths: np.ndarray
    untruncated: np.ndarray
    supervised: np.ndarray
    rejects: list[Reject]
    encoded: dict[int, Encoded]  # sample id -> tokens, for the samples this rank tokenized


def _encoder(plan: Plan) -> ChatEncoder:
    d = plan.cfg.data
    return ChatEncoder(plan.tokenizer, plan.template, plan.cfg.seq_length, d.mask_reasoning_content,
                       d.mask_generation_prompt)


def _encode_row(plan: Plan, encoder: ChatEncoder, raw: Any, sel: int) -> Encoded | Reject:
    item = normalize(raw, plan.cfg.data.format)
    if not isinstance(item, Reject):
        item = encoder.encode(item, raw.row)
    if isinstance(item, Reject):
        # row: index in the selection (what samples/source_row counts); file/file_row/line: the source
        item.row, item.line, item.file = sel, raw.line, raw.file
        item.file_row = raw.row if raw.file_row is None else raw.file_row
        if plan.cfg.data.on_invalid == "error" and item.reason not in FILTERED_REASONS:
            where = ", ".join(x for x in (f"file {raw.file}" if raw.file else "",
                                          f"line {raw.line}" if raw.line else "") if x)
            raise InvalidRowError(str(plan.cfg.data.path), raw.row, item.reason,
                                  item.message + (f" ({where})" if where else ""))
    return item


def tokenize(plan: Plan, ranks: Ranks | None = None) -> Tokenized:
    """Tokenize the selection (rank r takes rows r, r+W, ...) and agree on the sample tables."""
    ranks = ranks or Ranks()
    cfg = plan.cfg
    encoder = _encoder(plan)

    def mine() -> tuple[int, list[tuple[int, Any]], dict[int, Encoded]]:
        info: list[tuple[int, Any]] = []
        own: dict[int, Encoded] = {}
        n = 0
        for sel, raw in enumerate(iter_rows(resolve_source(cfg.data.path), cfg.data)):
            n += 1
            if sel % ranks.world != ranks.rank:
                continue
            item = _encode_row(plan, encoder, raw, sel)
            if isinstance(item, Reject):
                info.append((sel, item))
            else:
                own[sel] = item
                info.append((sel, (len(item.input_ids), item.untruncated_length, int(item.loss_mask.sum()))))
        return n, info, own

    n, info, own = ranks.together(mine)
    merged = sorted((x for part in ranks.gather(info) for x in part), key=lambda x: x[0])
    rejects = [r for _, r in merged if isinstance(r, Reject)]
    kept = [(sel, r) for sel, r in merged if not isinstance(r, Reject)]
    if n == 0:
        raise DataError(f"data.path={cfg.data.path!r} with split={cfg.data.split!r} selects no rows")
    invalid = [r for r in rejects if r.reason not in FILTERED_REASONS]
    if invalid and len(invalid) / n > cfg.data.max_invalid_fraction:
        by = _reason_counts(invalid)
        raise DataError(
            f"{len(invalid)} of {n} rows ({len(invalid) / n:.1%}) are invalid, above "
            f"data.max_invalid_fraction={cfg.data.max_invalid_fraction}: "
            + ", ".join(f"{k}={v}" for k, v in sorted(by.items()))
            + f". First: row {invalid[0].row}{_where(invalid[0])}: {invalid[0].message}. Fix the data or raise "
            "the threshold."
        )
    if not kept:
        raise DataError(f"no row of data.path={cfg.data.path!r} became a sample")
    sample_rows = np.asarray([sel for sel, _ in kept], dtype=np.int64)
    stats = np.asarray([r for _, r in kept], dtype=np.int64).reshape(-1, 3)
    sample_of = {int(sel): i for i, sel in enumerate(sample_rows)}
    encoded = {sample_of[sel]: e for sel, e in own.items()}
    return Tokenized(n, sample_rows, stats[:, 0], stats[:, 1], stats[:, 2], rejects, encoded)


def ensure_encoded(plan: Plan, tok: Tokenized, sample_ids: set[int]) -> None:
    """Tokenize the samples this rank will forward but another rank tokenized."""
    missing = {int(tok.sample_rows[s]): s for s in sample_ids if s not in tok.encoded}
    if not missing:
        return
    encoder = _encoder(plan)
    for sel, raw in enumerate(iter_rows(resolve_source(plan.cfg.data.path), plan.cfg.data)):
        if sel in missing:
            item = _encode_row(plan, encoder, raw, sel)
            assert isinstance(item, Encoded), (sel, item)
            tok.encoded[missing.pop(sel)] = item
            if not missing:
                return
    raise CacheFormatError(f"rows {sorted(missing)[:5]} vanished from data.path between two reads")


def _where(r: Reject) -> str:
    parts = [f"file {r.file}" if r.file else "", f"line {r.line}" if r.line else ""]
    return f" ({', '.join(x for x in parts if x)})" if any(parts) else ""


def _reason_counts(rejects: list[Reject]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rejects:
        out[r.reason] = out.get(r.reason, 0) + 1
    return out


def build_manifest(plan: Plan, layout: fmt.Layout, counts: dict[str, Any], complete: bool,
                   created_at: str, timing: dict[str, float] | None = None) -> dict[str, Any]:
    t = plan.target
    hidden = t.hidden_size
    n_hidden = sum(1 for s in plan.specs if s.width)
    itemsize = np.dtype(fmt.STORAGE_DTYPES[plan.cfg.storage.dtype][0]).itemsize
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "tool_version": __version__,
        "config_hash": plan.config_hash,
        "identity": plan.identity,
        "config": plan.cfg.to_dict(),
        "target_model": t.path,
        "target_model_type": t.model_type,
        "target_vocab_size": t.vocab_size,
        "num_hidden_layers": t.num_hidden_layers,
        "hidden_size": hidden,
        "layer_ids": plan.layer_ids,
        "target_hidden_dim": hidden * len(plan.layer_ids),
        "target_last_hidden_dim": hidden,
        "seq_length": plan.cfg.seq_length,
        "storage_dtype": plan.cfg.storage.dtype,
        "bytes_per_token": fmt.bytes_per_token(hidden, itemsize, n_hidden),
        "pad_token_id": getattr(plan.tokenizer, "pad_token_id", None),
        "eos_token_id": getattr(plan.tokenizer, "eos_token_id", None),
        "chat_template": plan.template,
        "arrays": plan.names,
        "tied_embeddings": plan.target.tied,
        "layout": {"chunk_tokens": layout.chunk_tokens, "unit_tokens": layout.unit_tokens,
                   "num_units": layout.num_units, "total_token_slots": layout.total_slots},
        "counts": counts,
        "complete": complete,
        "created_at": created_at,
        "updated_at": now,
        **({"completed_at": now} if complete else {}),
        **({"timing": timing} if timing else {}),
    }


def _write_json(store: CacheStore, key: str, obj: Any) -> None:
    fault_point("manifest")
    _put(store, key, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _put(store: CacheStore, key: str, data: bytes) -> None:
    try:
        store.write_bytes(key, data)
    except OSError as exc:
        raise StorageWriteError(
            f"writing {store.path}/{key} ({len(data) / 1e6:,.1f} MB) failed: {exc}. Free space or fix the "
            "storage, then re-run the same command: the cache resumes."
        ) from exc


def _write_weights(plan: Plan, model: Any) -> None:
    from safetensors.torch import save

    dtype = _TORCH_STORAGE[plan.cfg.storage.dtype]
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in export_weights(model).items()}
    fault_point("weights")
    # One metadata key only: safetensors orders several keys differently from run to run,
    # and the file must be byte-identical across resumes. Tying is recorded in the manifest.
    _put(plan.store, fmt.WEIGHTS, save(tensors, metadata={"format": "pt"}))


def _sha256_of(store: CacheStore, key: str) -> str:
    """sha256 of one stored file, streamed (the weights file of a large target is GBs)."""
    import hashlib

    h = hashlib.sha256()
    if store.url:
        h.update(store.read_bytes(key))
    else:
        with open(Path(store.root) / key, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def make_batches(order: np.ndarray, lengths: np.ndarray, max_tokens: int, max_samples: int | None
                 ) -> list[np.ndarray]:
    """Greedy batches over longest-first samples: rows x longest row <= max_tokens."""
    out, i, n = [], 0, len(order)
    cap = max_samples or n
    while i < n:
        longest = int(lengths[order[i]])
        j = i + 1
        while j < n and j - i < cap and (j - i + 1) * longest <= max_tokens:
            j += 1
        out.append(order[i:j])
        i = j
    return out


def batch_inputs(samples: Any, batch: np.ndarray, lengths: np.ndarray, pad_id: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One forward's inputs: right-padded ids, the attention mask to pass, and the real-token mask.

    The mask passed to the forward is always None: the padding is on the right, so causal
    attention alone keeps every real token from seeing it (positions are 0..T-1 either way),
    and the mask-free path runs the fast causal kernels. ``rows`` (None when unpadded) picks
    the real tokens out of the output.
    """
    blens = lengths[batch]
    T = int(blens.max())
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : blens[r]] = torch.from_numpy(samples[s].input_ids.astype(np.int64))
    rows = None
    if bool((blens != T).any()):
        rows = (torch.arange(T)[None, :] < torch.from_numpy(np.asarray(blens))[:, None]).to(device)
    return ids.to(device, non_blocking=True), None, rows


def _setup_logging(level: str) -> None:
    root = logging.getLogger("dspark_precompute")
    root.setLevel(level.upper())
    if not logging.getLogger().handlers and not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(h)


def run(cfg: PrecomputeConfig) -> RunResult:
    """Precompute the cache described by ``cfg`` (resuming a compatible partial cache).

    Under torchrun / SLURM every rank calls this with the same config; they split the
    units between them and rank 0 finishes the manifest.
    """
    ranks = init_ranks()
    _setup_logging(cfg.log_level if ranks.main else "WARNING")
    try:
        return _run(cfg, ranks)
    finally:
        ranks.close()


class _StopOnSignal:
    """SIGINT/SIGTERM set a flag; the forward loop drops the unit in flight and stops cleanly."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: finishing the units already handed to the writer, then stopping",
                    signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _run(cfg: PrecomputeConfig, ranks: Ranks) -> RunResult:
    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    plan = prepare(cfg)
    store = plan.store
    lock = WriterLock(store.root) if ranks.main and not is_url(plan.path) else None

    def decide() -> dict[str, Any] | None:
        if lock:
            lock.acquire()
        return check_resume(plan) if ranks.main else None

    try:
        manifest = ranks.broadcast(ranks.together(decide))
        if manifest is not None and manifest.get("complete"):
            log.info("cache %s is complete (%d samples): nothing to do", plan.path, manifest["counts"]["samples"])
            c = manifest["counts"]
            return RunResult(plan.path, c["samples"], c["tokens"], c["supervised_tokens"], c["truncated_samples"],
                             c["rejected"], store.nbytes(), time.perf_counter() - t_start, 0,
                             manifest["layout"]["num_units"])

        t0 = time.perf_counter()
        tok = tokenize(plan, ranks)
        timing["tokenize_s"] = time.perf_counter() - t0
        layout = fmt.plan_layout(tok.lengths, plan.chunk_tokens, plan.unit_tokens)
        counts = {
            "rows_in": tok.rows_in, "samples": len(tok.lengths), "rejected": len(tok.rejects),
            "rejected_by_reason": _reason_counts(tok.rejects),
            "tokens": int(tok.lengths.sum()),
            "supervised_tokens": int(tok.supervised.sum()),
            "truncated_samples": int((tok.untruncated > tok.lengths).sum()),
        }
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
                if not store.is_empty():
                    log.warning("overwrite=true: deleting the existing contents of %s", plan.path)
                    _clear(store)
                created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                attrs = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "manifest": fmt.MANIFEST}
                allocate(store, plan.specs, layout, plan.identity["storage"], tables, attrs)
                _put(store, fmt.REJECTS, "".join(json.dumps(r.to_json(), sort_keys=True) + "\n"
                                                       for r in tok.rejects).encode())
                _write_json(store, fmt.MANIFEST, build_manifest(plan, layout, counts, False, created))
                return created, set()
            _check_same_layout(store, layout, tables, manifest)
            done = {int(k.rsplit("u", 1)[1].split(".")[0]) for k in store.list_keys(fmt.COMMITS)}
            log.info("resuming %s: %d of %d units already committed", plan.path, len(done), layout.num_units)
            return manifest.get("created_at", ""), done

        created, done = ranks.broadcast(ranks.together(setup))
        todo_all = [u for u in range(layout.num_units) if u not in done]
        unit_tok = (layout.unit_stop - layout.unit_start)[todo_all]
        mine = [todo_all[i] for i in assign_units(unit_tok, ranks.world)[ranks.rank]]
        ensure_encoded(plan, tok, {int(s) for u in mine for s in layout.unit_order[u]})

        t0 = time.perf_counter()
        device = plan.device
        if device.type == "cuda" and ranks.world > 1 and plan.cfg.model.device == "auto":
            device = plan.device = torch.device("cuda", ranks.local_rank)
        model = ranks.together(lambda: load_target(cfg.model, plan.target, len(plan.tokenizer), device,
                                                   plan.compute_dtype))
        timing["load_target_s"] = time.perf_counter() - t0
        if ranks.main and not store.exists(fmt.WEIGHTS):
            _write_weights(plan, model)
        t0 = time.perf_counter()
        try:
            with _StopOnSignal() as stop:
                written = _forward_units(plan, model, tok.encoded, layout, mine, timing, coord, stop) if mine else 0
        except BaseException as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            raise
        timing["forward_write_s"] = time.perf_counter() - t0
        try:  # the end barrier: a peer that died (any way) closes its sockets and gloo raises here
            ranks.gather(None)
        except RuntimeError as exc:
            raise RankFailedError(f"a peer rank ended before finishing its units: {exc}") from exc
        coord.check()
        if not ranks.main:
            return RunResult(plan.path, counts["samples"], counts["tokens"], counts["supervised_tokens"],
                             counts["truncated_samples"], counts["rejected"], 0, time.perf_counter() - t_start,
                             written, len(done), False, timing)
        missing = sorted(set(range(layout.num_units)) - {
            int(k.rsplit("u", 1)[1].split(".")[0]) for k in store.list_keys(fmt.COMMITS)})
        if missing:
            raise CacheFormatError(f"units {missing[:10]} have no commit record after every rank finished; "
                                   "re-run the same command to write them")
        coord.cleanup()
        timing["wall_s"] = time.perf_counter() - t_start
        final = build_manifest(plan, layout, counts, True, created, timing)
        final["weights_sha256"] = _sha256_of(store, fmt.WEIGHTS)
        _write_json(store, fmt.MANIFEST, final)
        nbytes = store.nbytes()
        result = RunResult(plan.path, counts["samples"], counts["tokens"], counts["supervised_tokens"],
                           counts["truncated_samples"], counts["rejected"], nbytes, timing["wall_s"], written,
                           len(done), True, timing)
        _log_summary(result)
        return result
    finally:
        if lock:
            lock.release()


def _clear(store: CacheStore) -> None:
    if store.url:
        store.remove_all()
        return
    for p in Path(store.root).iterdir():
        if p.name == ".writer.lock":
            continue
        store.delete(p.name)


def _check_same_layout(store: CacheStore, layout: fmt.Layout, tables: dict[str, np.ndarray],
                       manifest: dict[str, Any]) -> None:
    import zarr

    group = zarr.open_group(store.zarr_store(read_only=True), mode="r")
    for name in ("samples/length", "samples/source_row", "samples/start"):
        if not np.array_equal(np.asarray(group[name][:]), tables[name]):
            raise CacheFormatError(
                f"{store.path}: the recorded {name} differs from this run's tokenization although the "
                "configuration hash matches (non-deterministic tokenizer?); pass overwrite=true"
            )
    if manifest["layout"]["num_units"] != layout.num_units:
        raise CacheFormatError(f"{store.path}: recorded unit count differs; pass overwrite=true")


def _forward_units(plan: Plan, model: Any, samples: dict[int, Encoded], layout: fmt.Layout, todo: list[int],
                   timing: dict[str, float], coord: Coordinator, stop: _StopOnSignal | None = None) -> int:
    """Forward every unit in ``todo`` and hand it to the writer; fills ``timing`` per stage."""
    cfg = plan.cfg
    device = plan.device
    capture = HiddenStateCapture(model, plan.layer_ids)
    storage_dtype = _TORCH_STORAGE[cfg.storage.dtype]
    lengths = layout.length.astype(np.int64)
    pad_id = getattr(plan.tokenizer, "pad_token_id", None)
    pad_id = int(pad_id if pad_id is not None else (plan.tokenizer.eos_token_id or 0))
    total_tok = int(sum(layout.unit_stop[u] - layout.unit_start[u] for u in todo))
    total_smp = int(sum(len(layout.unit_order[u]) for u in todo))
    progress = Progress(total_smp, total_tok, enabled=cfg.progress)
    writer = UnitWriter(plan.store, plan.specs, layout, cfg.batch.writer_slots, todo)
    hidden_specs = [s for s in plan.specs if s.width]
    t_batch = t_forward = t_copy = 0.0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        for u in todo:
            coord.check()
            slot = writer.acquire()
            bufs = writer.buffers(slot)
            base = int(layout.unit_start[u])
            order = layout.unit_order[u]
            views = {s.name: torch.from_numpy(bufs[s.name].view(np.int16) if s.dtype == "uint16" else bufs[s.name])
                     for s in hidden_specs}
            for s in order:
                a = int(layout.start[s]) - base
                bufs[fmt.INPUT_IDS][a:a + lengths[s]] = samples[s].input_ids
                bufs[fmt.LOSS_MASK][a:a + lengths[s]] = samples[s].loss_mask
            for batch in make_batches(order, lengths, cfg.batch.max_tokens, cfg.batch.max_samples):
                if stop is not None and stop.signum is not None:
                    break
                c0 = time.perf_counter()
                blens = lengths[batch]
                ids, mask, rows = batch_inputs(samples, batch, lengths, pad_id, device)
                c1 = time.perf_counter()
                states, last = capture(ids, mask)
                sync()
                c2 = time.perf_counter()
                a = int(layout.start[batch[0]]) - base
                n = int(blens.sum())
                for spec in hidden_specs:
                    t = states[spec.layer_id] if spec.layer_id in states else last
                    flat = (t[rows] if rows is not None else t.reshape(-1, t.shape[-1])).to(storage_dtype)
                    if spec.dtype == "uint16":
                        flat = flat.view(torch.int16)
                    views[spec.name][a:a + n].copy_(flat)
                c3 = time.perf_counter()
                t_batch, t_forward, t_copy = t_batch + (c1 - c0), t_forward + (c2 - c1), t_copy + (c3 - c2)
                progress.update(samples=len(batch), tokens=n, bytes_written=writer.raw_bytes)
                writer.poll()
            if stop is not None and stop.signum is not None:  # drop the unit in flight, keep the rest
                writer.release(slot)
                writer.drain()
                done_units = len(layout.unit_start) - len(todo) + len(writer.committed)
                raise InterruptedRunError(stop.signum, plan.path, done_units, layout.num_units)
            n_tok = int(layout.unit_stop[u] - layout.unit_start[u])
            record = {"unit": u, "token_start": base, "token_stop": base + n_tok, "samples": len(order),
                      "host": socket.gethostname()}
            writer.submit(u, slot, n_tok, record)
            fault_point("unit_submitted")
        writer.drain()
        if stop is not None and stop.signum is not None and len(writer.committed) < len(todo):
            raise InterruptedRunError(stop.signum, plan.path, layout.num_units - len(todo) + len(writer.committed),
                                      layout.num_units)
        progress.update(bytes_written=writer.raw_bytes)
        progress.close()
        timing.update(batch_s=t_batch, forward_s=t_forward, copy_s=t_copy, writer_wait_s=writer.wait_s,
                      writer_busy_s=writer.busy_s)
    finally:
        writer.close()
        capture.close()
    return len(todo)


def _log_summary(r: RunResult) -> None:
    log.info(
        "done: %d samples, %d tokens (%d supervised, %.1f%%), %d truncated, %d rejected; %s on disk "
        "(%.1f B/token) in %.1fs -> %s",
        r.samples, r.tokens, r.supervised_tokens, 100.0 * r.supervised_tokens / max(1, r.tokens),
        r.truncated_samples, r.rejected, human_bytes(r.bytes_on_disk), r.bytes_on_disk / max(1, r.tokens),
        r.wall_seconds, r.path,
    )
    log.info("open it with: from dspark_precompute import open_cache; c = open_cache(%r); c[0]", r.path)


def describe(result: RunResult) -> str:
    buf = io.StringIO()
    json.dump(result.__dict__, buf, indent=2, default=str)
    return buf.getvalue()
