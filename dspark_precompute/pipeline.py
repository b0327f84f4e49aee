"""``run(cfg)``: config -> target & tokenizer -> samples -> batches -> capture -> writer -> store.

Everything cheap happens first (config checks, fingerprints, the resume decision, the
tokenization of every row) so a wrong run fails in seconds, before weights load.
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
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
from dspark_precompute import signals
from dspark_precompute.errors import (
    CacheFormatError, ConfigError, DataError, ForeignDirectoryError, IncompatibleCacheError, InterruptedRunError,
    InvalidRowError, StoppedBySignal, StorageWriteError, TargetError,
)
from dspark_precompute.faults import fault_point
from dspark_precompute.layers import layer_id_problems, resolve_layer_ids
from dspark_precompute.lock import WriterLock
from dspark_precompute.progress import Progress, human_bytes
from dspark_precompute.store import CacheStore, is_url
from dspark_precompute.target import (
    HiddenStateCapture, export_weights, fit_problem, inspect_target, load_target, load_tokenizer, resolve_compute_dtype,
    resolve_device, tokenizer_sha256,
)
from dspark_precompute.writer import ArraySpec, UnitWriter, allocate, token_array_specs

log = logging.getLogger(__name__)

# Rows that are well-formed but leave nothing to train on at this seq_length: recorded in
# the rejects file, never counted as invalid data.
FILTERED_REASONS = {Reason.NO_SUPERVISED_TOKENS}
REJECT_WARN_FRACTION = 0.10  # above this share of rejected rows the run warns, with the likely fixes
REJECT_FIXES = {
    Reason.NO_SUPERVISED_TOKENS: "raise seq_length (the assistant turns start after the first seq_length tokens)",
    Reason.MALFORMED_JSON: "fix the listed lines of the data file (each must be one JSON object)",
    Reason.INVALID_UTF8: "re-encode the data file as UTF-8",
    Reason.MISSING_MESSAGES: "set data.format (messages or sharegpt) or fix the rows' keys",
    Reason.UNKNOWN_ROLE: "map the roles to system/user/assistant/tool, or use data.format=sharegpt",
    Reason.NON_TEXT_CONTENT: "drop image/audio parts; this tool captures text targets only",
    Reason.NO_ASSISTANT_TURN: "the rows have nothing to supervise; check the role names",
    Reason.TEMPLATE_ERROR: "check data.chat_template against these rows",
    Reason.UNMASKABLE: "use a chat template with {% generation %} blocks (data.chat_template)",
}
# storage settings that change what is stored (the rest: where, and how fast it is written)
_STORED_STORAGE_KEYS = ("dtype", "compressor", "compression_level", "shuffle")
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
        "storage": {k: getattr(s, k) for k in (*_STORED_STORAGE_KEYS, "chunk_tokens", "unit_tokens", "unit_mib")},
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
    finalized: bool = False  # this run wrote the final manifest (a no-op run on a complete cache did not)


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
        if len(tokenizer) > target.vocab_size:
            what = "model.random.vocab_size" if cfg.model.path == "tiny" else "the target's vocab_size (config.json)"
            problems.append(
                f"{what} is {target.vocab_size} but the tokenizer has {len(tokenizer)} tokens: ids from "
                f"{target.vocab_size} up would index past the embedding. "
                + ("Raise model.random.vocab_size or leave it null (the tokenizer's size)" if cfg.model.path == "tiny"
                   else "Point model.tokenizer at the target's own tokenizer")
            )
    device = resolve_device(cfg.model.device)
    compute_dtype = resolve_compute_dtype(cfg.model.dtype, device)
    if target is not None and not problems:
        try:
            problem = fit_problem(cfg.model, target, device, compute_dtype)
        except TargetError as exc:
            problem = str(exc)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    hidden = target.hidden_size
    specs = token_array_specs(layer_ids, target.num_hidden_layers, hidden, cfg.storage.dtype)
    names = fmt.hidden_arrays(layer_ids, target.num_hidden_layers)
    itemsize = np.dtype(fmt.STORAGE_DTYPES[cfg.storage.dtype][0]).itemsize
    chunk = cfg.storage.chunk_tokens or fmt.auto_chunk_tokens(hidden, itemsize)
    if chunk * hidden * itemsize > fmt.MAX_CHUNK_BYTES:
        raise ConfigError([f"storage.chunk_tokens={chunk} makes {chunk * hidden * itemsize / 2**30:.1f} GiB chunks "
                           f"at hidden size {hidden}; readers refuse chunks over {fmt.MAX_CHUNK_BYTES >> 30} GiB. "
                           f"Use at most {fmt.MAX_CHUNK_BYTES // (hidden * itemsize)} (or null: about 1 MiB)"])
    n_hidden = sum(1 for s in specs if s.width)
    per_token = fmt.bytes_per_token(hidden, itemsize, n_hidden)
    unit = cfg.storage.unit_tokens or max(chunk, (cfg.storage.unit_mib << 20) // per_token // chunk * chunk)
    unit = max(unit, -(-cfg.seq_length // chunk) * chunk)
    storage_knobs = {k: getattr(cfg.storage, k) for k in _STORED_STORAGE_KEYS}
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
    return _group_attributes(store).get("format") == fmt.FORMAT_NAME


def check_resume(plan: Plan) -> dict[str, Any] | None:
    """The existing manifest if this run may continue it; raise if it must not."""
    store, cfg = plan.store, plan.cfg
    manifest = _read_manifest(store)
    if manifest is None:
        if set(store.top_level_names()) - {fmt.LOCK}:
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
            fault_point("tokenize_row")
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


def run(cfg: PrecomputeConfig, provenance: dict[str, Any] | None = None) -> RunResult:
    """Precompute the cache described by ``cfg`` (resuming a compatible partial cache).

    Under torchrun / SLURM every rank calls this with the same config; they split the
    units between them and rank 0 finishes the manifest. ``provenance`` (the entry point's
    command line, Hydra overrides and composed config) is recorded in the cache this run
    finishes; Hydra's own files are never read back, so the record is always this run's.
    """
    ranks = init_ranks()
    _setup_logging(cfg.log_level if ranks.main else "WARNING")
    clean = False
    try:
        with signals.handled():
            result = _run(cfg, ranks, provenance or {})
        clean = True
        return result
    finally:
        ranks.close(clean)


def _own_directory_problem(store: CacheStore, path: str, deleting: bool) -> str | None:
    """Why this run must not use (or, when ``deleting``, clear) the directory at ``path``; None if it may.

    A directory proves it is ours by its group attributes or manifest; one that does not
    is used only when it is empty. Nothing is deleted in a directory holding anything this
    tool did not write.
    """
    names = store.top_level_names()
    if not names or set(names) <= {fmt.LOCK} | {n for n in names if fmt.is_own_temporary(n)}:
        return None  # empty (or only what a refused or killed run of ours left)
    foreign = fmt.foreign_entries(names)
    ours = _group_attributes(store).get("format") == fmt.FORMAT_NAME or _manifest_format(store) == fmt.FORMAT_NAME
    if not ours:
        shown = ", ".join(foreign[:5] or names[:5]) + (" ..." if len(foreign or names) > 5 else "")
        return (f"storage.path={path} is not empty and is not a dspark-precompute cache (it holds {shown}); "
                "nothing was written or deleted there. Choose an empty or new directory for the cache.")
    if foreign and deleting:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        return (f"storage.path={path} is a cache but also holds files this tool did not write ({shown}); "
                "refusing to delete anything there. Move those files out, or choose another storage.path.")
    return None


def _group_attributes(store: CacheStore) -> dict[str, Any]:
    try:
        attrs = json.loads(store.read_bytes("zarr.json")).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return attrs if isinstance(attrs, dict) else {}


def _manifest_format(store: CacheStore) -> Any:
    try:
        m = json.loads(store.read_bytes(fmt.MANIFEST))
    except (OSError, ValueError):
        return None
    return m.get("format") if isinstance(m, dict) else None


def _warn_about_rejects(tok: "Tokenized") -> None:
    """Many rejects deserve more than an INFO line: counts per reason and the likely fix."""
    if not tok.rejects:
        return
    share = len(tok.rejects) / max(1, tok.rows_in)
    by = _reason_counts(tok.rejects)
    listed = ", ".join(f"{k}={v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    if share <= REJECT_WARN_FRACTION:
        log.info("%d of %d rows rejected (%.1f%%): %s (see rejects.jsonl)", len(tok.rejects), tok.rows_in,
                 100 * share, listed)
        return
    fixes = [f"{k}: {REJECT_FIXES[k]}" for k in sorted(by, key=lambda k: -by[k]) if k in REJECT_FIXES]
    log.warning("%d of %d rows (%.1f%%) were rejected and will not be in the cache: %s. %s Each row is listed "
                "in rejects.jsonl.", len(tok.rejects), tok.rows_in, 100 * share, listed,
                " ".join(f"Likely fix for {f}." for f in fixes))


def _run(cfg: PrecomputeConfig, ranks: Ranks, provenance: dict[str, Any]) -> RunResult:
    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    plan = prepare(cfg)
    store = plan.store
    if ranks.main:  # before anything is created: never leave even a lock file in a foreign directory
        problem = _own_directory_problem(store, plan.path, deleting=cfg.overwrite)
        if problem:
            raise ForeignDirectoryError(problem)
    lock = WriterLock(store.root) if ranks.main and not is_url(plan.path) else None

    def decide() -> dict[str, Any] | None:
        if lock:
            try:
                lock.acquire()
            except OSError as exc:
                raise StorageWriteError(f"cannot create the writer lock in {plan.path}: {exc}. Check the path's "
                                        "permissions and free space.") from exc
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
        if ranks.main:
            _warn_about_rejects(tok)
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
                if store.top_level_names() and set(store.top_level_names()) != {fmt.LOCK}:
                    # ours (checked above): an overwrite, or an allocation a kill interrupted
                    log.warning("%s: deleting the existing cache in %s", "overwrite=true" if cfg.overwrite
                                else "restarting an allocation that was interrupted", plan.path)
                    _clear(store)
                created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                attrs = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "manifest": fmt.MANIFEST}
                try:
                    allocate(store, plan.specs, layout, plan.identity["storage"], tables, attrs)
                except OSError as exc:
                    raise StorageWriteError(
                        f"allocating the cache in {plan.path} failed: {exc}. Free space or fix the storage, then "
                        "re-run the same command: an interrupted allocation is started again.") from exc
                _put(store, fmt.REJECTS, "".join(json.dumps(r.to_json(), sort_keys=True) + "\n"
                                                 for r in tok.rejects).encode())
                _write_json(store, fmt.MANIFEST, build_manifest(plan, layout, counts, False, created))
                return created, set()
            _check_same_layout(store, layout, tables, manifest)
            done = _committed_units(store)
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
            device = torch.device("cuda", ranks.local_rank)
        model = ranks.together(lambda: load_target(cfg.model, plan.target, len(plan.tokenizer), device,
                                                   plan.compute_dtype))
        timing["load_target_s"] = time.perf_counter() - t0
        if ranks.main and not store.exists(fmt.WEIGHTS):
            _write_weights(plan, model)
        t0 = time.perf_counter()
        try:
            written = _forward_units(plan, model, tok.encoded, layout, mine, timing, coord, device) if mine else 0
        except StoppedBySignal as exc:
            coord.fail(f"{type(exc).__name__}: {exc}")
            committed = len(_committed_units(store)) if ranks.main else 0
            raise InterruptedRunError(exc.signum, plan.path, committed, layout.num_units) from None
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
        missing = sorted(set(range(layout.num_units)) - _committed_units(store))
        if missing:
            raise CacheFormatError(f"units {missing[:10]} have no commit record after every rank finished; "
                                   "re-run the same command to write them")
        coord.cleanup()
        _write_provenance(store, provenance)
        timing["wall_s"] = time.perf_counter() - t_start
        final = build_manifest(plan, layout, counts, True, created, timing)
        final["weights_sha256"] = _sha256_of(store, fmt.WEIGHTS)
        final["provenance"] = {k: v for k, v in provenance.items() if k != "files"}
        _write_json(store, fmt.MANIFEST, final)
        nbytes = store.nbytes()
        result = RunResult(plan.path, counts["samples"], counts["tokens"], counts["supervised_tokens"],
                           counts["truncated_samples"], counts["rejected"], nbytes, timing["wall_s"], written,
                           len(done), True, timing, finalized=True)
        _log_summary(result)
        return result
    finally:
        if lock:
            lock.release()


def _committed_units(store: CacheStore) -> set[int]:
    return {u for u in (fmt.parse_commit_key(k) for k in store.list_keys(fmt.COMMITS)) if u is not None}


def _write_provenance(store: CacheStore, provenance: dict[str, Any]) -> None:
    """This run's Hydra record (built in memory by the entry point) into ``.hydra/``."""
    files = provenance.get("files") or {}
    if files:
        store.delete(fmt.HYDRA_RECORD)
    for name, text in sorted(files.items()):
        _put(store, f"{fmt.HYDRA_RECORD}/{name}", text.encode())


def _clear(store: CacheStore) -> None:
    """Delete this tool's entries (the caller proved the directory holds nothing else)."""
    for name in store.top_level_names():
        if name != fmt.LOCK and (name in fmt.OWN_ENTRIES or fmt.is_own_temporary(name)):
            store.delete(name)


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
                   timing: dict[str, float], coord: Coordinator, device: torch.device) -> int:
    """Forward every unit in ``todo`` and hand it to the writer; fills ``timing`` per stage.

    A first SIGINT/SIGTERM drops the unit in flight, lets the writer finish the units it
    already holds, and raises :class:`StoppedBySignal`; a second one raises at once.
    """
    cfg = plan.cfg
    capture = HiddenStateCapture(model, plan.layer_ids)
    storage_dtype = _TORCH_STORAGE[cfg.storage.dtype]
    lengths = layout.length.astype(np.int64)
    pad_id = getattr(plan.tokenizer, "pad_token_id", None)
    pad_id = int(pad_id if pad_id is not None else (plan.tokenizer.eos_token_id or 0))
    total_tok = int(sum(layout.unit_stop[u] - layout.unit_start[u] for u in todo))
    total_smp = int(sum(len(layout.unit_order[u]) for u in todo))
    progress = Progress(total_smp, total_tok, enabled=cfg.progress)
    writer = UnitWriter(plan.store, plan.specs, layout, cfg.storage.writer_slots, todo)
    hidden_specs = [s for s in plan.specs if s.width]
    t_batch = t_forward = t_copy = 0.0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stop = signals.STATE
    try:
        with signals.graceful():
            for u in todo:
                if stop.signum is not None:
                    break
                coord.check()
                slot = writer.acquire()
                bufs = writer.buffers(slot)
                base = int(layout.unit_start[u])
                order = layout.unit_order[u]
                views = {s.name: torch.from_numpy(bufs[s.name].view(np.int16) if s.dtype == "uint16"
                                                  else bufs[s.name]) for s in hidden_specs}
                for s in order:
                    a = int(layout.start[s]) - base
                    bufs[fmt.INPUT_IDS][a:a + lengths[s]] = samples[s].input_ids
                    bufs[fmt.LOSS_MASK][a:a + lengths[s]] = samples[s].loss_mask
                for batch in make_batches(order, lengths, cfg.batch.max_tokens, cfg.batch.max_samples):
                    if stop.signum is not None:
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
                if stop.signum is not None:  # drop the unit in flight, keep the ones the writer holds
                    writer.release(slot)
                    break
                n_tok = int(layout.unit_stop[u] - layout.unit_start[u])
                record = {"unit": u, "token_start": base, "token_stop": base + n_tok, "samples": len(order),
                          "host": socket.gethostname()}
                writer.submit(u, slot, n_tok, record)
                fault_point("unit_submitted")
            writer.drain()
        if stop.signum is not None and len(writer.committed) < len(todo):
            raise StoppedBySignal(stop.signum)
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
