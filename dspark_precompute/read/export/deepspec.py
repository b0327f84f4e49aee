"""Export a cache to DeepSpec's target cache (``data.target_cache_path``), version 2.

DeepSpec (github.com/deepseek-ai/DeepSpec, ``deepspec/data/target_cache_dataset.py`` at
commit afdfa7c) reads a directory of:

* ``shard-%05d.bin``: samples back to back, each contiguous: ``input_ids`` int32 [T],
  ``attention_mask`` uint8 [T] (ones), ``loss_mask`` uint8 [T], ``target_hidden_states``
  bf16 [T, k*H] (the captured layers concatenated along hidden) and
  ``target_last_hidden_states`` bf16 [T, H] (the decoder's output after its final norm);
* ``samples.idx``: one 56-byte little-endian record per sample, in sample-id order,
  ``struct.Struct("<QIIQQQQQ")``: sample id, shard id, length, then the byte offset in
  its shard of each of the five arrays above;
* ``manifest.json``: ``version`` 2, ``num_samples``, ``num_shards``, ``target_layer_ids``
  (ascending), ``hidden_dtype`` ``bfloat16``, ``token_dtype`` ``int32``, ``mask_dtype``
  ``uint8``, ``index_record_size`` 56, ``hidden_size``, ``shards`` (``shard_id``,
  ``file_name``), plus ``target_model_name_or_path``, which its trainer requires to equal
  its own ``model.target_model_name_or_path`` (as it requires the layer ids and hidden size
  to equal the draft's).

DeepSpec reads bf16 only: an fp8 cache is exported dequantized and an fp16/fp32 one
rounded to bf16; either is logged and recorded in the manifest (``converted_from``).
The export is staged beside ``out`` and renamed onto it when whole (manifest and marker
last). Memory: one sample plus the index (56 bytes per sample, written in place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dspark_precompute.errors import ExportError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.progress import Progress
from dspark_precompute.read.export.common import (
    ExportResult,
    Selection,
    StagedExport,
    atomic_write_bytes,
    bf16_bits,
    export_marker,
    export_progress,
    json_bytes,
    open_complete,
    select_export,
    staging,
)
from dspark_precompute.read.reader import CacheReader

log = logging.getLogger(__name__)

DEEPSPEC_VERSION = 2
INDEX_RECORD = struct.Struct("<QIIQQQQQ")  # 56 bytes
DEEPSPEC_MANIFEST = "manifest.json"
DEEPSPEC_INDEX = "samples.idx"
DEFAULT_SHARD_BYTES = 64 * 1024**3  # DeepSpec's own --max-shard-bytes default
DEEPSPEC_MIN_LOSS_TOKENS = 14  # its prepare_target_cache.py --min-loss-tokens default
DEEPSPEC_QWEN_TEMPLATE = "qwen"  # the registry name its configs use for Qwen targets
# why DeepSpec cannot train on rows whose positions an M-RoPE target moved (its source at afdfa7c)
DEEPSPEC_POSITIONS = ("DeepSpec reads no positions: CacheDataset.__getitem__ (deepspec/data/target_cache_dataset.py) "
                      "returns input_ids, loss_mask and the two states, and Qwen3DSparkModel.forward "
                      "(deepspec/modeling/dspark/qwen3/modeling.py) builds its context positions as "
                      "torch.arange(seq_len)")


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.bin"


def export_deepspec(cache: str | Path | CacheReader, out: str | Path, *, layers: list[int] | None = None,
                    max_length: int | None = None, overwrite: bool = False, skip_image_rows: bool = False,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, target_model_name_or_path: str | None = None,
                    progress: bool = True) -> ExportResult:
    """Write DeepSpec's target cache for ``cache`` into ``out``.

    ``target_model_name_or_path`` is what DeepSpec's trainer compares with its config's
    ``model.target_model_name_or_path`` (default: the manifest's ``target_model``, the
    ``model.path`` the cache was made with). ``shard_bytes`` starts a new shard file when
    the next sample would pass it (DeepSpec's own rule). ``layers`` must be ascending.
    """
    t0 = time.perf_counter()
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, (int, np.integer)) or shard_bytes < 1:
        raise ExportError(f"shard_bytes={shard_bytes!r} must be a positive number of bytes per shard file")
    c = open_complete(cache, "DeepSpec's target cache")
    sel = select_export(c, layers, max_length, loader=DEEPSPEC_POSITIONS, skip_image_rows=skip_image_rows)
    lids = sel.layers
    if lids != sorted(lids) or len(set(lids)) != len(lids):
        raise ExportError(f"layers={lids}: DeepSpec's manifest needs target_layer_ids in ascending order without "
                          f"repeats (its loader asserts it); pass --layers {','.join(map(str, sorted(set(lids))))}")
    if not lids:
        raise ExportError("layers=[]: DeepSpec needs at least one target layer")
    m = c.manifest
    n = len(sel)
    notes, converted_from = _conversion_notes(c)
    rule = m.capture.mask.rule if m.capture is not None and m.capture.mask is not None else None
    if rule != "deepspec":
        notes.append(f"loss masks follow the cache's rule ({rule or 'not recorded'}), not DeepSpec's own "
                     "preparation; precompute with data.mask_rule=deepspec for that")
    for note in notes:
        log.warning("export deepspec: %s", note)
    target_name = str(target_model_name_or_path or m.target_model)
    stage = StagedExport(Path(out), c.path, overwrite, "DeepSpec target cache")
    prog = export_progress("deepspec", sel, progress)
    with staging(stage, prog):
        shards, total = _write_shards(stage, c, sel, shard_bytes, prog)
        prog.close()
        manifest = deepspec_manifest(c, sel, shards, target_name, rule, converted_from, notes)
        data = json_bytes(manifest)
        with stage.writing():
            atomic_write_bytes(stage.dir / DEEPSPEC_MANIFEST, data)
        total += len(data)
        total += stage.finish(export_marker(c, sel, "deepspec", notes, converted_from=converted_from,
                                            target_model_name_or_path=target_name))
    secs = time.perf_counter() - t0
    log.info("export deepspec: %d samples in %d shard(s), %s -> %s (%.1fs)", n, len(shards), human_bytes(total),
             out, secs)
    return ExportResult(str(out), n, len(shards), 0, total, secs, target="deepspec", layers=list(lids),
                        max_length=sel.max_length, dropped=dict(sel.dropped), notes=notes)


def _conversion_notes(c: CacheReader) -> tuple[list[str], str | None]:
    """What reading bf16 only forces on this cache: (notes, the dtype converted from, or None)."""
    m = c.manifest
    if m.storage_dtype == "fp8_e4m3" or m.last_storage_dtype == "fp8_e4m3":
        return ["fp8 (e4m3) states exported dequantized to bf16: DeepSpec reads bf16 only"], "fp8_e4m3"
    if c.output_dtype != "bf16" or c.last_output_dtype != "bf16":
        converted_from = c.output_dtype if c.output_dtype != "bf16" else c.last_output_dtype
        return [f"{converted_from} states rounded to bf16 (nearest even): DeepSpec reads bf16 only"], converted_from
    return [], None


def _sample_parts(c: CacheReader, raw: dict[str, np.ndarray]) -> list[np.ndarray]:
    """One sample's five arrays as DeepSpec lays them out, back to back: ids, attention mask, loss mask, states."""
    T = len(raw["input_ids"])
    return [
        np.ascontiguousarray(raw["input_ids"], dtype="<i4"),
        np.ones(T, dtype=np.uint8),
        np.ascontiguousarray(raw["loss_mask"], dtype=np.uint8),
        np.ascontiguousarray(bf16_bits(raw["target_hidden_states"], c.output_dtype)),
        np.ascontiguousarray(bf16_bits(raw["target_last_hidden_states"], c.last_output_dtype)),
    ]


def _write_shards(stage: StagedExport, c: CacheReader, sel: Selection, shard_bytes: int,
                  prog: Progress) -> tuple[list[dict[str, object]], int]:
    """The shard files (a new one when the next sample would pass ``shard_bytes``) and ``samples.idx``, written in
    place record by record in disk order: (the manifest's shard list, bytes written)."""
    H, k, n = c.hidden_size, len(sel.layers), len(sel)
    total = 0
    shards: list[dict[str, object]] = []
    shard = _ShardFiles(stage.dir, shard_bytes)
    with stage.writing():
        idx_fd = os.open(stage.dir / DEEPSPEC_INDEX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with stage.writing():
            os.ftruncate(idx_fd, n * INDEX_RECORD.size)
        for j, raw in sel.iter_disk_order():
            T = len(raw["input_ids"])
            parts = _sample_parts(c, raw)
            nbytes = sum(p.nbytes for p in parts)
            assert parts[3].shape == (T, k * H) and parts[4].shape == (T, H)
            with stage.writing():
                if shard.needs_new(nbytes):
                    shards.append({"shard_id": len(shards), "file_name": shard.start(len(shards))})
                offsets = shard.append(parts)
                os.pwrite(idx_fd, INDEX_RECORD.pack(j, len(shards) - 1, T, *offsets), j * INDEX_RECORD.size)
            total += nbytes
            stage.sample_written(prog, T, nbytes)
        with stage.writing():
            shard.close()
            os.fsync(idx_fd)
    finally:
        os.close(idx_fd)
        shard.drop()
    return shards, total + n * INDEX_RECORD.size


class _ShardFiles:
    """The shard file being written: a new one when the next sample would pass ``shard_bytes`` (DeepSpec's rule),
    each finished one flushed, fsynced and closed."""

    def __init__(self, root: Path, shard_bytes: int) -> None:
        self.root, self.limit = root, shard_bytes
        self.fh: BinaryIO | None = None
        self.size = 0

    def needs_new(self, nbytes: int) -> bool:
        return self.fh is None or (self.size > 0 and self.size + nbytes > self.limit)

    def start(self, index: int) -> str:
        self.close()
        name = shard_file(index)
        self.fh = open(self.root / name, "wb")
        self.size = 0
        return name

    def append(self, parts: list[np.ndarray]) -> list[int]:
        """One sample's arrays, back to back: their offsets in the shard."""
        assert self.fh is not None
        offsets = []
        for p in parts:
            offsets.append(self.size)
            self.fh.write(p.data)
            self.size += p.nbytes
        return offsets

    def close(self) -> None:
        if self.fh is not None:
            _close_durably(self.fh)  # a failed flush leaves it to drop()
            self.fh = None

    def drop(self) -> None:
        """Close without flushing what a failed write left buffered (the staging directory goes anyway)."""
        if self.fh is not None:
            fh, self.fh = self.fh, None
            with contextlib.suppress(OSError):
                fh.close()


def _close_durably(fh: BinaryIO) -> None:
    """A finished shard file: flushed, fsynced, closed."""
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()


def deepspec_manifest(c: CacheReader, sel: Selection, shards: list[dict[str, object]], target_name: str,
                      rule: str | None, converted_from: str | None, notes: list[str]) -> dict[str, Any]:
    """DeepSpec's ``manifest.json`` (version 2), plus where the export came from and what it changed."""
    m = c.manifest
    mrule = m.capture.mask if m.capture is not None else None
    return {
        "version": DEEPSPEC_VERSION,
        "num_samples": len(sel),
        "num_shards": len(shards),
        "target_layer_ids": list(sel.layers),
        "hidden_dtype": "bfloat16",
        "token_dtype": "int32",
        "mask_dtype": "uint8",
        "index_record_size": INDEX_RECORD.size,
        "hidden_size": c.hidden_size,
        "shards": shards,
        "target_model_name_or_path": target_name,
        "source_jsonl_paths": [str(m.data_identity("path"))],
        "chat_template": DEEPSPEC_QWEN_TEMPLATE if rule == "deepspec" else None,
        "max_length": int(sel.max_length or c.seq_length),
        "min_loss_tokens": DEEPSPEC_MIN_LOSS_TOKENS if rule == "deepspec" else 1,
        "project_name": None,
        "exp_name": None,
        "git_sha": None,
        # beyond DeepSpec's own fields (its loader ignores them): where this came from and what was changed
        "exported_by": "dspark-precompute",
        "source_cache": str(c.path),
        "source_config_hash": m.config_hash,
        "mask_rule": rule,
        "mask_generation_prompt": getattr(mrule, "mask_generation_prompt", None),
        "converted_from": converted_from,
        "dropped_samples": dict(sorted(sel.dropped.items())),
        "notes": notes,
    }
