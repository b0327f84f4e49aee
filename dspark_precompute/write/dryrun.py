"""``dry_run=true``: plan a run before paying for it, without weights and without writing anything.

Everything that needs no weights runs exactly as in the real run (the config checks, the
data reading, the tokenization with the real masks, the rejects, the layout); the weight
files are not even hashed. The plan gives rows, samples, rejects by reason, real and
supervised tokens, truncated samples, units, the exact uncompressed bytes of the cache, an
*estimate* of its size after compression (from measured ratios, below) and of its time.
Nothing is written to ``storage.path`` (no directory, no lock) or anywhere else: only
Hydra's own output directory is created, by Hydra.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.inventory import inventory
from dspark_precompute.contract.layout import Layout, build_layout
from dspark_precompute.contract.manifest import Manifest, identity_differences
from dspark_precompute.contract.spec import (
    IMAGE_SAMPLE,
    INPUT_IDS,
    LOSS_MASK,
    POSITION_IDS,
    SAMPLE_ARRAYS,
    TOKEN_ARRAYS,
    UNIT_ARRAYS,
    VIDEO_SAMPLE,
)
from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import DsparkError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.write.config.schema import TINY, PrecomputeConfig, StorageConfig
from dspark_precompute.write.plan import resume
from dspark_precompute.write.plan.prepare import Plan, prepare
from dspark_precompute.write.samples.media import image_tables
from dspark_precompute.write.samples.tokenize import Tokenized, reason_counts, tokenize, warn_about_rejects
from dspark_precompute.write.store.batching import make_batches
from dspark_precompute.write.target.load import parameter_count, rank_weight_bytes, vision_bytes, weight_bytes

log = logging.getLogger(__name__)

# Compression ratios (raw bytes / stored bytes) of the writer's own codec chains at level 1 (1 MiB blosc
# blocks, crc32c), keyed by (storage.compressor, storage.shuffle), in the default chunks (256 KiB of the widest
# array). Measured 2026-12-07 by `python scripts/bench_codecs.py` on the 2-core Intel Xeon VM: two uncompressed
# caches of a random-weight Qwen3 (`bench_mid`, hidden 512, 12 layers, layers 1, 6 and 11 captured) over the
# first 48 rows of the shared chat mix at seq_length 512, one in fp32 (its states cast to bf16, fp16, fp32) and
# one in fp8_e4m3 (its bits and float32 scales), every array re-encoded chunk by chunk. fp8 bits take
# storage.fp8_shuffle (byte shuffle does nothing to one-byte values: the "byte" rows give the unshuffled
# figure). Random weights: real activations may compress differently, so the size after compression is an
# estimate.
COMPRESSION_RATIOS: dict[tuple[str, str], dict[str, float]] = {
    ("blosc_lz4hc", "byte"): {"bf16": 1.29, "fp16": 1.03, "fp32": 1.12,
                              INPUT_IDS: 2.35, LOSS_MASK: 21.60, "fp8_e4m3": 1.01, "fp8_scale": 1.25},
    ("blosc_lz4hc", "bit"): {"bf16": 1.36, "fp16": 1.09, "fp32": 1.15,
                             INPUT_IDS: 2.03, LOSS_MASK: 21.60, "fp8_e4m3": 1.14, "fp8_scale": 1.05},
    ("blosc_lz4hc", "none"): {"bf16": 1.00, "fp16": 1.00, "fp32": 1.00,
                              INPUT_IDS: 2.03, LOSS_MASK: 21.60, "fp8_e4m3": 1.01, "fp8_scale": 1.05},
    ("blosc_zstd", "byte"): {"bf16": 1.52, "fp16": 1.19, "fp32": 1.15,
                             INPUT_IDS: 2.74, LOSS_MASK: 65.48, "fp8_e4m3": 1.22, "fp8_scale": 1.30},
    ("blosc_zstd", "bit"): {"bf16": 1.43, "fp16": 1.10, "fp32": 1.14,
                            INPUT_IDS: 2.80, LOSS_MASK: 65.48, "fp8_e4m3": 1.18, "fp8_scale": 1.23},
    ("blosc_zstd", "none"): {"bf16": 1.29, "fp16": 1.09, "fp32": 1.08,
                             INPUT_IDS: 2.80, LOSS_MASK: 65.48, "fp8_e4m3": 1.22, "fp8_scale": 1.23},
    ("blosc_lz4", "byte"): {"bf16": 1.15, "fp16": 1.00, "fp32": 1.08,
                            INPUT_IDS: 2.02, LOSS_MASK: 20.68, "fp8_e4m3": 1.00, "fp8_scale": 1.18},
    ("blosc_lz4", "bit"): {"bf16": 1.27, "fp16": 1.05, "fp32": 1.12,
                           INPUT_IDS: 1.49, LOSS_MASK: 20.68, "fp8_e4m3": 1.11, "fp8_scale": 1.03},
    ("blosc_lz4", "none"): {"bf16": 1.00, "fp16": 1.00, "fp32": 1.00,
                            INPUT_IDS: 1.49, LOSS_MASK: 20.68, "fp8_e4m3": 1.00, "fp8_scale": 1.03},
    ("zstd", "*"): {"bf16": 1.29, "fp16": 1.09, "fp32": 1.08,
                    INPUT_IDS: 2.81, LOSS_MASK: 74.83, "fp8_e4m3": 1.22, "fp8_scale": 1.23},
}
CRC32C_BYTES = 4  # per stored chunk
# The time estimate when plan.tokens_per_second is not given: 2 x (parameters outside the embedding and
# lm_head, which the capture never multiplies) FLOP per forward token, attention's quadratic term left out,
# at an assumed 300 TFLOP/s sustained bf16 per H100/H200-class GPU (about 40% of peak). An assumption, not a
# measurement: measure with scripts/bench.py --device cuda and pass plan.tokens_per_second.
ASSUMED_GPU_FLOPS = 300e12


def compression_ratio(compressor: str, shuffle: str, kind: str) -> float | None:
    """The measured ratio of one array kind (a storage dtype for hidden states, else the array's name), or None."""
    if compressor == "none":
        return 1.0
    ratios = COMPRESSION_RATIOS.get((compressor, "*" if compressor == "zstd" else shuffle))
    return ratios.get(kind) if ratios else None


@dataclass
class ArrayPlan:
    """One token array: ``rows x row_bytes`` uncompressed (exact) and its estimated stored bytes."""

    name: str
    dtype: str
    row_bytes: int
    rows: int
    raw_bytes: int
    estimated_bytes: int
    ratio: float | None


@dataclass
class DryRunPlan:
    """What the run would do and cost. Every count and raw byte is exact; ``estimated_*`` and time are estimates."""

    path: str
    storage_state: str
    target: str
    layer_ids: list[int]
    layer_preset: str
    rows_in: int
    samples: int
    rejected: int
    rejected_by_reason: dict[str, int]
    tokens: int
    supervised_tokens: int
    truncated_samples: int
    max_length: int
    num_units: int
    chunk_tokens: int
    unit_tokens: int
    total_token_slots: int  # the token axis: num_units x unit_tokens (one shard per unit)
    written_slots: int  # token slots the units write: each unit's tokens rounded up to whole chunks
    forward_tokens: int  # tokens the forward passes process, padding of the length-sorted batches included
    arrays: list[ArrayPlan] = field(default_factory=list)
    bytes_per_token: int = 0
    token_array_bytes: int = 0  # sum over stored token arrays of rows x row bytes
    table_bytes: int = 0
    image_table_bytes: int = 0  # an image cache's images/* tables (each image's sample, grid, sha256)
    images: int | None = None  # an image cache's image count; None: a text cache (no images group)
    videos: int = 0  # a cache with videos: their count (the videos/* tables, in image_table_bytes)
    weights_file_bytes: int = 0
    rejects_file_bytes: int = 0
    raw_bytes: int = 0
    estimated_bytes: int = 0
    estimate_note: str = ""
    parameters: int = 0
    tokens_per_second: float = 0.0
    rate_note: str = ""
    estimated_seconds: float = 0.0
    files: int = 0  # the finished cache's files and directories (exact; .hydra/ as the command line writes it)
    directories: int = 0
    entries_per_tb: float = 0.0  # files and directories per 10^12 bytes of raw hidden states
    weight_bytes: int = 0  # the target's parameters at the compute dtype (safetensors headers)
    rank_weight_bytes: int = 0  # what one rank holds of them under parallel.* (all of them: one copy)
    weights_layout: str = ""  # parallel.* as the report shows it
    weights_source: str = "the safetensors headers"  # or config.json alone (no weight files yet)
    weights_fingerprint: str = "not computed (a dry run never hashes the weights)"
    fit: str = ""  # whether one rank's share fits this machine, and the layout that would
    target_part: str = ""  # an image-text checkpoint: what loads, what is left out

    def _unit_line(self) -> str:
        """What sizes a window (storage.window_units): a unit's raw hidden states at most."""
        row = sum(a.row_bytes for a in self.arrays if a.name not in (*TOKEN_ARRAYS, POSITION_IDS))
        unit = self.unit_tokens * row
        return (f"at most {unit:,} B ({human_bytes(unit)}) of raw hidden states; a stream through "
                f"storage.window_units=N holds at most N units of them (and the one being written)")

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (label, value) lines: the CLI's table and the log's report."""
        n = self.rejected_by_reason
        why = (": " + ", ".join(f"{k}={v:,}" for k, v in sorted(n.items(), key=lambda kv: (-kv[1], kv[0])))) if n \
            else ""
        pct = 100.0 * self.supervised_tokens / max(1, self.tokens)
        pad = 100.0 * (self.forward_tokens - self.tokens) / max(1, self.forward_tokens)
        arrays = ", ".join(f"{a.name} {a.row_bytes} B" for a in self.arrays)
        images = "" if self.images is None else \
            f"{self.image_table_bytes:,} B of image tables ({self.images:,} images" + (
                f", {self.videos:,} videos" if self.videos else "") + "), "
        return [
            ("storage.path", f"{self.path} ({self.storage_state})"),
            ("target", self.target),
            ("layers", f"{self.layer_ids} (preset {self.layer_preset})"),
            ("rows", f"{self.rows_in:,} read: {self.samples:,} samples, {self.rejected:,} rejected{why}"),
            ("real tokens", f"{self.tokens:,} (mean {self.tokens / max(1, self.samples):,.1f}, longest "
                            f"{self.max_length:,})"),
            ("supervised tokens", f"{self.supervised_tokens:,} ({pct:.1f}%)"),
            ("truncated samples", f"{self.truncated_samples:,}"),
            ("units", f"{self.num_units:,} of up to {self.unit_tokens:,} tokens (a shard each per array), chunks of "
                      f"{self.chunk_tokens:,}; {self.written_slots:,} token slots written"),
            ("per unit", self._unit_line()),
            ("files", f"{self.files:,} files and {self.directories:,} directories, exact "
                      f"({self.entries_per_tb:,.0f} per TB of raw hidden states)"),
            ("forward tokens", f"{self.forward_tokens:,} ({pad:.1f}% padding in the length-sorted batches)"),
            ("token arrays", f"{self.token_array_bytes:,} B ({human_bytes(self.token_array_bytes)}) uncompressed, "
                             f"exact: {self.written_slots:,} slots x {sum(a.row_bytes for a in self.arrays)} B "
                             f"({arrays}); real tokens {self.tokens * self.bytes_per_token:,} B"),
            ("other files", f"{self.table_bytes:,} B of sample/unit tables, {images}{self.weights_file_bytes:,} B "
                            f"target_weights.safetensors, {self.rejects_file_bytes:,} B rejects.jsonl (exact; "
                            "plus a few KB of metadata)"),
            ("uncompressed", f"{self.raw_bytes:,} B ({human_bytes(self.raw_bytes)}), exact"),
            ("on disk (estimate)", f"about {human_bytes(self.estimated_bytes)} ({self.estimate_note})"),
            ("weights per rank", f"{self.rank_weight_bytes:,} B ({human_bytes(self.rank_weight_bytes)}) of "
                                 f"{self.weight_bytes:,} B ({human_bytes(self.weight_bytes)}) under "
                                 f"{self.weights_layout} (exact, from {self.weights_source}; the FSDP root's "
                                 "embedding, final norm and lm_head are gathered after the first forward)"),
            *([("loaded part", self.target_part)] if self.target_part else []),
            ("fit here", self.fit),
            ("weights fingerprint", self.weights_fingerprint),
            ("time (estimate)", f"about {_duration(self.estimated_seconds)} at {self.tokens_per_second:,.0f} "
                                f"tokens/s ({self.rate_note}); weights loading and tokenization come on top"),
        ]

    def table(self) -> str:
        """The plan as a plain-text table (what ``python -m dspark_precompute ... dry_run=true`` prints)."""
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        head = "dry run: nothing was written; this is what the run would do"
        return "\n".join([head] + [f"  {k.ljust(width)}  {v}" for k, v in rows]) + "\n"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def storage_state(plan: Plan) -> str:
    """What the real run would find at ``storage.path`` (read only; the weights fingerprint is not compared)."""
    store, cfg = plan.store, plan.cfg
    names = store.top_level_names()
    if not names:
        return "new cache"
    problem = resume.directory_problem(store, plan.path, deleting=cfg.overwrite)
    if problem:
        return f"the run would be refused: {problem}"
    try:
        m = Manifest.read_if_present(store)
    except DsparkError as exc:
        return f"holds a damaged manifest: the run would be refused ({str(exc).splitlines()[0]})"
    if m is None:
        return "holds an unfinished allocation: the run would start it again" if not cfg.overwrite else \
            "overwrite=true: its contents would be deleted"
    if cfg.overwrite:
        return "overwrite=true: the cache there would be deleted and written again"
    diffs = [d for d in identity_differences(m.identity, plan.identity) if d[0] != "target.weights_fingerprint"]
    if diffs:
        listed = "; ".join(f"{k}: recorded {a!r}, requested {b!r}" for k, a, b in diffs[:4])
        return f"holds a cache written with other settings ({listed}): the run would be refused"
    if m.complete:
        return "holds this cache, complete: the run would have nothing to do (if the weights are unchanged)"
    done = len(committed_units(store, m.layout.num_units))
    return f"holds this cache with {done} of {m.layout.num_units} units committed: the run would resume it"


def weights_file_bytes(plan: Plan) -> int:
    """Exact size of ``target_weights.safetensors``: header (compact JSON, padded to 8 bytes) plus the tensors."""
    t, sdt = plan.target, StorageDtype(plan.cfg.storage.dtype).output  # an fp8 cache's weights are bf16
    n = t.vocab_size * t.hidden_size * sdt.disk.itemsize
    names = ["embed_tokens.weight"] + ([] if t.tied else ["lm_head.weight"])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i, name in enumerate(names):
        header[name] = {"dtype": sdt.safetensors, "shape": [t.vocab_size, t.hidden_size],
                        "data_offsets": [i * n, (i + 1) * n]}
    text = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + -(-text // 8) * 8 + n * len(names)


def forward_tokens(plan: Plan, layout: Layout) -> int:
    """Tokens the forward passes process: each unit's batches (the run's own batching), rows x longest row."""
    lengths = layout.length.astype(np.int64)
    b = plan.cfg.batch
    return int(sum(len(batch) * int(lengths[batch].max()) for u in range(layout.num_units)
                   for batch in make_batches(layout.unit_order[u], lengths, b.max_tokens, b.max_samples)))


def dry_run(cfg: PrecomputeConfig) -> DryRunPlan:
    """Plan the run ``cfg`` describes: everything that needs no weights, nothing written. Logs the report."""
    plan = prepare(cfg, fingerprint=False)
    state = storage_state(plan)
    tok = tokenize(plan.encoding, plan.cfg.data)
    warn_about_rejects(tok)
    layout = build_layout(tok.lengths, plan.chunk_tokens, plan.unit_tokens)
    t = plan.target
    slots = int(sum(layout.unit_slots(u) for u in range(layout.num_units)))
    tokens = int(tok.lengths.sum())
    arrays, notes = array_plans(plan, layout, slots, tokens)
    token_bytes = sum(a.raw_bytes for a in arrays)
    n, u = len(tok.lengths), layout.num_units
    table_bytes = sum(n * np.dtype(d).itemsize for d in SAMPLE_ARRAYS.values()) + \
        sum(u * np.dtype(d).itemsize for d in UNIT_ARRAYS.values())
    images, image_bytes = image_table_facts(plan, tok)
    wbytes = weights_file_bytes(plan)
    rbytes = sum(len((json.dumps(r.to_json(), sort_keys=True) + "\n").encode()) for r in tok.rejects)
    fwd = forward_tokens(plan, layout)
    params = parameter_count(cfg.model, t)
    rate, seconds, rate_note = time_estimate(plan, params, tokens, fwd)
    out = DryRunPlan(
        path=plan.path, storage_state=state,
        target=(f"{t.path} ({t.model_type}): {t.num_hidden_layers} layers, hidden {t.hidden_size}, vocab "
                f"{t.vocab_size:,}, {_count(params)} parameters"),
        layer_ids=list(plan.layer_ids),
        layer_preset="explicit" if cfg.model.layer_ids is not None else cfg.model.layer_preset,
        rows_in=tok.rows_in, samples=n, rejected=len(tok.rejects), rejected_by_reason=reason_counts(tok.rejects),
        tokens=tokens, supervised_tokens=int(tok.supervised.sum()),
        truncated_samples=int((tok.untruncated > tok.lengths).sum()), max_length=int(tok.lengths.max()),
        num_units=u, chunk_tokens=layout.chunk_tokens, unit_tokens=layout.unit_tokens,
        total_token_slots=layout.total_slots, written_slots=slots,
        forward_tokens=fwd, arrays=arrays,
        bytes_per_token=sum(spec.row_bytes for spec in plan.specs),
        token_array_bytes=token_bytes, table_bytes=table_bytes, image_table_bytes=image_bytes, images=images,
        weights_file_bytes=wbytes, rejects_file_bytes=rbytes,
        raw_bytes=token_bytes + table_bytes + image_bytes + wbytes + rbytes,
        estimated_bytes=sum(a.estimated_bytes for a in arrays) + table_bytes + image_bytes + wbytes + rbytes,
        estimate_note=estimate_note(cfg.storage, notes), parameters=params, tokens_per_second=rate,
        rate_note=rate_note, estimated_seconds=seconds,
    )
    videos = len(image_tables(tok.images).get(VIDEO_SAMPLE, ())) if plan.media is not None else 0
    files = inventory(len(plan.specs), u, n, any(spec.scale_of for spec in plan.specs), images=images,
                      videos=videos)
    hidden_raw = sum(a.raw_bytes for a in arrays if a.name not in (INPUT_IDS, LOSS_MASK, POSITION_IDS))
    out.files, out.directories, out.entries_per_tb = files.files, files.directories, files.per_tb(hidden_raw)
    out.videos = videos
    out.weight_bytes, out.rank_weight_bytes, out.weights_layout = weights_per_rank(plan)
    _weights_facts(plan, out)
    for k, v in out.rows():
        log.info("dry run: %s: %s", k, v)
    for a in arrays:
        log.info("dry run: array %s: %s x %d B = %s B uncompressed, about %s stored", a.name, f"{a.rows:,}",
                 a.row_bytes, f"{a.raw_bytes:,}", human_bytes(a.estimated_bytes))
    return out


def image_table_facts(plan: Plan, tok: Tokenized) -> tuple[int | None, int]:
    """(images, raw bytes of the images/* and videos/* tables) of an image cache, from the tables the run writes;
    (None, 0) for a text cache."""
    if plan.media is None:
        return None, 0
    tables = image_tables(tok.images)
    return len(tables[IMAGE_SAMPLE]), sum(int(v.nbytes) for v in tables.values())


def _weights_facts(plan: Plan, out: DryRunPlan) -> None:
    """Where the weight bytes came from, whether they fit here, the fingerprint's state, an image-text part."""
    t = plan.target
    if not t.weight_files and plan.cfg.model.path != TINY:
        out.weights_source = "config.json alone (no weight files yet: a meta-device build of its class)"
        out.weights_fingerprint = ("not computed (no weight files yet; the real run needs them and hashes them "
                                   "into the identity)")
    elif plan.cfg.model.path == TINY:
        out.weights_fingerprint = f"{t.weights_fingerprint} (the built-in target's: its config and seed)"
    out.fit = plan.fit or f"one rank's share fits {plan.device} ({str(plan.compute_dtype).replace('torch.', '')})"
    if t.part is not None and t.part.vision:
        out.target_part = f"the whole {t.part.checkpoint_class}, vision tower included (the rows hold images)"
    elif t.part is not None:
        skipped = "?" if t.skipped_bytes is None else human_bytes(t.skipped_bytes)
        out.target_part = (f"the language model of {t.part.checkpoint_class} (model.language_model); left out for "
                           f"text rows: {', '.join(t.part.skipped_modules)} ({skipped} stored)")


def weights_per_rank(plan: Plan) -> tuple[int, int, str]:
    """(the target's weight bytes, one rank's share under ``parallel.*``, the layout in words)."""
    par = plan.cfg.parallel
    whole = weight_bytes(plan.cfg.model, plan.target, plan.compute_dtype)
    layout = (f"parallel.fsdp={par.fsdp} parallel.ep={par.ep} ({par.group} ranks per copy)" if par.sharded
              else "one copy per rank")
    return whole, rank_weight_bytes(whole, par, vision_bytes(plan.target, plan.compute_dtype)), layout


def array_plans(plan: Plan, layout: Layout, slots: int, tokens: int) -> tuple[list[ArrayPlan], set[str]]:
    """Each token array's exact raw bytes (``slots`` written token slots) and estimated stored bytes (``tokens``
    real tokens at its measured ratio, plus a checksum per chunk); notes name the arrays with no measured ratio."""
    s = plan.cfg.storage
    arrays, notes = [], set()
    for spec in plan.specs:
        kind = spec.name if spec.width is None else spec.storage or "fp8_scale"
        ratio = compression_ratio(s.compressor, s.fp8_shuffle if kind == "fp8_e4m3" else s.shuffle, kind)
        raw = slots * spec.row_bytes
        chunks = -(-slots // layout.chunk_tokens)
        if ratio is None:
            notes.add(f"no measured ratio for {s.compressor} with shuffle={s.shuffle} and {kind}: counted uncompressed")
            est = raw
        elif s.compressor == "none":
            est = raw
        else:  # the unit tails' slack is zeros, which compress to next to nothing
            est = int(tokens * spec.row_bytes / ratio)
        arrays.append(ArrayPlan(spec.name, spec.dtype, spec.row_bytes, slots, raw, est + chunks * CRC32C_BYTES, ratio))
    return arrays, notes


def estimate_note(s: StorageConfig, notes: set[str]) -> str:
    """How the size after compression was estimated (the measured hidden-state ratio, its caveat), and ``notes``."""
    hidden_ratio = compression_ratio(s.compressor, s.fp8_shuffle if s.dtype == "fp8_e4m3" else s.shuffle, s.dtype)
    shown = f"{hidden_ratio:.2f}x" if hidden_ratio else "(no measured ratio)"
    note = (f"{s.compressor} level {s.compression_level}: hidden states {shown} as measured at level 1 "
            "on a random-weight Qwen3; real activations may compress differently" if s.compressor != "none"
            else "storage.compressor=none: the raw bytes plus checksums")
    return "; ".join([note, *sorted(notes)])


def time_estimate(plan: Plan, params: int, tokens: int, forward: int) -> tuple[float, float, str]:
    """(tokens per second, seconds, how the rate was found): ``plan.tokens_per_second`` over the real tokens when
    given, else the assumed GPU rate over the ``forward`` tokens (padding included)."""
    cfg, t = plan.cfg, plan.target
    if cfg.plan.tokens_per_second:
        rate = float(cfg.plan.tokens_per_second)
        return rate, tokens / rate, "plan.tokens_per_second, real tokens"
    matmul = max(1, params - t.vocab_size * t.hidden_size * (1 if t.tied else 2))
    rate = ASSUMED_GPU_FLOPS / (2 * matmul)
    return rate, forward / rate, (f"estimated for one GPU, whatever this machine has: 2 x {_count(matmul)} parameters "
                                  f"(the embedding and lm_head left out) FLOP per forward token at an assumed "
                                  f"{ASSUMED_GPU_FLOPS / 1e12:.0f} TFLOP/s; N data-parallel GPUs take about 1/N of it; "
                                  "set plan.tokens_per_second to use a measured rate")
