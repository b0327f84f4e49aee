"""Export a cache to NeMo AutoModel's DSpark offline layout (``recipe_args.cached_target_path``).

NeMo reads ``manifest.json``, ``shard-%06d.safetensors`` (sample ``i`` at row
``i % shard_size`` of shard ``i // shard_size``, every row right-padded to
``seq_length``) and ``target_weights.safetensors``. Shards are written as a stream: the
safetensors header is computed from the shapes up front and each sample's rows are
written in place, so memory stays at one padded sample (plus the reader's chunk cache)
whatever the shard or dataset size. Like every export it is staged
(:class:`~dspark_precompute.read.export.common.StagedExport`): written beside ``out``,
manifest and marker last, and renamed onto it when whole, so a previous export stays
whole until then. An fp8 cache is exported dequantized (``CacheReader.read_raw``: bf16),
as NeMo's layout has no fp8. ``max_length`` cuts every sample (and the padding) at that
many tokens; the manifest's ``seq_length`` is then the cut.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import ExportError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.progress import Progress
from dspark_precompute.read.export.common import (
    ExportResult,
    SafetensorsStreamWriter,
    Selection,
    StagedExport,
    atomic_write_bytes,
    export_marker,
    export_progress,
    json_bytes,
    open_complete,
    select_export,
    staging,
)
from dspark_precompute.read.reader import CacheReader

log = logging.getLogger(__name__)

NEMO_FORMAT_VERSION = 1
NEMO_MANIFEST = "manifest.json"
NEMO_WEIGHTS = "target_weights.safetensors"
NEMO_SHARD_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")
# why NeMo cannot train on rows whose positions an M-RoPE target moved (NVIDIA-NeMo/Automodel at 36044ad3d)
NEMO_POSITIONS = ("NeMo AutoModel's cached DSpark path reads no positions: CachedDSparkDataset "
                  "(components/datasets/llm/dspark_cache.py) loads input_ids, loss_mask and the two states, "
                  "recipes/llm/train_dspark.py _forward_batch hands the draft no position_ids on the cached path, "
                  "and the Qwen3 draft's forward (components/speculative/dspark/draft_qwen3.py) builds its context "
                  "positions as torch.arange(seq_len)")


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def nemo_manifest(cache: CacheReader, shard_size: int, layers: list[int] | None = None, *,
                  num_samples: int | None = None, seq_length: int | None = None) -> dict[str, Any]:
    """The manifest NeMo's DSpark recipe validates (plus the supervision options it checks).

    ``num_samples`` and ``seq_length`` are the exported ones when a ``max_length`` cut them.
    """
    m = cache.manifest
    lids = list(cache.layer_ids if layers is None else layers)
    hidden = m.hidden_size
    return {
        "format_version": NEMO_FORMAT_VERSION,
        "target_model": m.target_model,
        "target_model_type": m.target_model_type,
        "target_vocab_size": m.target_vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": m.num_hidden_layers,
        "seq_length": m.seq_length if seq_length is None else int(seq_length),
        "dtype": str(m.output_dtype),  # an fp8 cache is exported dequantized, as bf16
        "num_samples": len(cache) if num_samples is None else int(num_samples),
        "shard_size": int(shard_size),
        "target_hidden_dim": hidden * len(lids),
        "target_last_hidden_dim": hidden,
        "target_layer_ids": lids,
        "train_data_path": m.data_identity("path"),
        "train_split": m.data_identity("split"),
        "shuffle_seed": m.data_identity("shuffle_seed"),
        "mask_reasoning_content": bool(m.data_identity("mask_reasoning_content", False)),
        "mask_generation_prompt": bool(m.data_identity("mask_generation_prompt", False)),
        "chat_template_sha256": hashlib.sha256(m.chat_template.encode("utf-8")).hexdigest(),
        "complete": True,
    }


_EARLIER_FILE = re.compile(r"manifest\.json|target_weights\.safetensors|shard-\d{6}\.safetensors|\..+\.\d+\.tmp")


def earlier_nemo_export(out: Path) -> dict[str, Any] | None:
    """A NeMo export written in place by an earlier version (no marker): only NeMo's files and their temporaries.
    Without its manifest it is one a kill interrupted, replaced without ``overwrite``."""
    names = [p.name for p in out.iterdir()]
    if not names or not all(_EARLIER_FILE.fullmatch(n) for n in names):
        return None
    return {"format": "nemo", "partial": NEMO_MANIFEST not in names}


def _write_weights(tensors: dict[str, Any], stage: StagedExport) -> int:
    """embed_tokens.weight and lm_head.weight as float32 (NeMo's own writer's dtype), tied or not.

    ``tensors`` come from :meth:`CacheReader.target_weights`, which checked the file's sha256 and shapes.
    """
    emb = tensors["embed_tokens.weight"]
    head = tensors.get("lm_head.weight", emb)  # tied: the embedding is the head
    spec = {"embed_tokens.weight": ("F32", tuple(emb.shape), 4), "lm_head.weight": ("F32", tuple(head.shape), 4)}
    with stage.writing():
        w = SafetensorsStreamWriter(stage.dir / NEMO_WEIGHTS, spec, {"format": "pt"})
        try:
            block = 4096
            for name, t in (("embed_tokens.weight", emb), ("lm_head.weight", head)):
                for r0 in range(0, t.shape[0], block):
                    w.write_rows(name, r0, t[r0:r0 + block].float().numpy())
            w.commit()
        except BaseException:
            w.abort()
            raise
    return w.nbytes


def export_nemo(cache: str | Path | CacheReader, out: str | Path, *, shard_size: int = 256, overwrite: bool = False,
                skip_image_rows: bool = False,
                layers: list[int] | None = None, max_length: int | None = None,
                progress: bool = True) -> ExportResult:
    """Write NeMo AutoModel's DSpark offline cache for ``cache`` into ``out`` (a local directory).

    ``layers`` exports a subset of the captured layer ids (the manifest then names only
    those); ``max_length`` cuts every sample at that many tokens and leaves out (counted,
    logged) those left with no supervised token. Returns what was written; raises
    :class:`CacheFormatError` when ``out`` holds something else or a previous export and
    ``overwrite`` is false, :class:`StorageWriteError` when a write fails (a full disk, a
    read-only destination).
    """
    t0 = time.perf_counter()
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)) or shard_size < 1:
        raise ExportError(f"shard_size={shard_size} must be >= 1 (samples per shard)")
    c = open_complete(cache, "NeMo's layout")
    sel = select_export(c, layers, max_length, loader=NEMO_POSITIONS, skip_image_rows=skip_image_rows)
    lids = sel.layers
    out = Path(out)
    n = len(sel)
    S = c.seq_length if max_length is None else min(c.seq_length, int(max_length))
    weights = c.target_weights()  # checked (sha256, shapes) before anything is written
    num_shards = -(-n // shard_size)
    notes = ["fp8 states exported dequantized to bf16"] if c.manifest.storage_dtype == "fp8_e4m3" else []
    for note in notes:
        log.info("export nemo: %s", note)
    stage = StagedExport(out, c.path, overwrite, "NeMo DSpark cache", earlier=earlier_nemo_export)
    prog = export_progress("nemo", sel, progress)
    with staging(stage, prog):
        total = _write_weights(weights, stage)
        del weights
        rows = _PaddedRows(c, S, len(lids))
        starts = c.starts()
        for k in range(num_shards):
            members = np.arange(k * shard_size, min(n, (k + 1) * shard_size))
            disk_order = members[np.argsort(starts[sel.samples[members]], kind="stable")]  # each chunk decoded once
            total += _write_shard(stage, k, k * shard_size, disk_order, sel, rows, prog)
        prog.close()
        data = json_bytes(nemo_manifest(c, shard_size, lids, num_samples=n, seq_length=S))
        with stage.writing():
            atomic_write_bytes(stage.dir / NEMO_MANIFEST, data)
        total += len(data)
        total += stage.finish(export_marker(c, sel, "nemo", notes, shard_size=int(shard_size)))
    secs = time.perf_counter() - t0
    log.info("export: %d samples in %d shards, %s -> %s (%.1fs)", n, num_shards, human_bytes(total), out, secs)
    return ExportResult(str(out), n, num_shards, int(shard_size), total, secs, target="nemo", layers=list(lids),
                        max_length=sel.max_length, dropped=dict(sel.dropped), notes=notes)


class _PaddedRows:
    """One sample's rows right-padded to ``S`` tokens, in buffers reused across samples: the real tokens are
    copied in, the tail stays padding (what ``read_raw`` returns: fp8 dequantized to bf16, the post-norm state in
    its own dtype)."""

    def __init__(self, c: CacheReader, S: int, num_layers: int) -> None:
        H = c.hidden_size
        self.st_dtype = StorageDtype(c.output_dtype).safetensors
        self.st_last = StorageDtype(c.last_output_dtype).safetensors
        self.disk_dtype, self.last_disk = StorageDtype(c.output_dtype).disk, StorageDtype(c.last_output_dtype).disk
        self.S, self.H, self.width = S, H, H * num_layers
        self.pad_id = c.pad_token_id
        self.ids = np.empty(S, dtype=np.int64)
        self.mask = np.zeros(S, dtype=np.int64)
        self.attn = np.zeros(S, dtype=np.int64)
        self.hid = np.zeros((S, self.width), dtype=self.disk_dtype)
        self.last = np.zeros((S, H), dtype=self.last_disk)
        self.row_bytes = S * (3 * 8 + self.width * self.disk_dtype.itemsize + H * self.last_disk.itemsize)

    def spec(self, rows: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """The safetensors header of a shard of ``rows`` samples."""
        S = self.S
        return {
            "input_ids": ("I64", (rows, S), 8),
            "attention_mask": ("I64", (rows, S), 8),
            "loss_mask": ("I64", (rows, S), 8),
            "target_hidden_states": (self.st_dtype, (rows, S, self.width), self.disk_dtype.itemsize),
            "target_last_hidden_states": (self.st_last, (rows, S, self.H), self.last_disk.itemsize),
        }

    def fill(self, raw: dict[str, np.ndarray]) -> int:
        """Copy one sample in, pad the rest; returns its real length."""
        m = len(raw["input_ids"])
        self.ids[:] = self.pad_id
        self.ids[:m] = raw["input_ids"]
        self.mask[:] = 0
        self.mask[:m] = raw["loss_mask"]
        self.attn[:] = 0
        self.attn[:m] = 1
        self.hid[m:] = 0
        self.hid[:m] = raw["target_hidden_states"]
        self.last[m:] = 0
        self.last[:m] = raw["target_last_hidden_states"]
        return m

    def write(self, w: SafetensorsStreamWriter, r: int) -> None:
        """The filled rows as row ``r`` of every shard tensor."""
        w.write_row("input_ids", r, self.ids)
        w.write_row("attention_mask", r, self.attn)
        w.write_row("loss_mask", r, self.mask)
        w.write_row("target_hidden_states", r, self.hid)
        w.write_row("target_last_hidden_states", r, self.last)


def _write_shard(stage: StagedExport, k: int, first: int, members: np.ndarray, sel: Selection, rows: _PaddedRows,
                 prog: Progress) -> int:
    """Shard ``k``: export rows ``members`` (``first`` is its row 0), streamed in that order; committed whole or
    removed. Returns its bytes."""
    with stage.writing():
        w = SafetensorsStreamWriter(stage.dir / shard_name(k), rows.spec(len(members)), {"format": "pt"})
    try:
        for j in members:
            m = rows.fill(sel.read(int(j)))
            with stage.writing():
                rows.write(w, int(j) - first)
            stage.sample_written(prog, m, rows.row_bytes)
        with stage.writing():
            w.commit()
    except BaseException:
        w.abort()
        raise
    log.info("export: wrote %s (%d samples, %s)", shard_name(k), len(members), human_bytes(w.nbytes))
    return w.nbytes
