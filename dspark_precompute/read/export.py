"""Export a cache to NeMo AutoModel's DSpark offline layout (``recipe_args.cached_target_path``).

NeMo reads ``manifest.json``, ``shard-%06d.safetensors`` (sample ``i`` at row
``i % shard_size`` of shard ``i // shard_size``, every row right-padded to
``seq_length``) and ``target_weights.safetensors``. Shards are written as a stream: the
safetensors header is computed from the shapes up front and each sample's rows are
written in place, so memory stays at one sample (plus the reader's chunk cache)
whatever the shard or dataset size. Every file goes to a temporary name first and is
renamed when whole; the manifest comes last, so a directory with a manifest is a
finished export. An fp8 cache is exported dequantized (``CacheReader.read_raw``: bf16), as
NeMo's layout has no fp8.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import CacheFormatError, IncompleteCacheError, StorageWriteError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.read.reader import CacheReader, open_cache

log = logging.getLogger(__name__)

NEMO_FORMAT_VERSION = 1
NEMO_MANIFEST = "manifest.json"
NEMO_WEIGHTS = "target_weights.safetensors"
NEMO_SHARD_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SafetensorsStreamWriter:
    """A safetensors file whose tensors are filled one leading-axis row at a time.

    The header (names, dtypes, shapes, offsets) is fixed at creation, so rows can be
    written in any order straight to their place in a temporary file; :meth:`commit`
    checks every row was written, fsyncs and renames it into place.
    """

    def __init__(self, path: Path, tensors: dict[str, tuple[str, tuple[int, ...], int]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, Any] = {}
        self._layout: dict[str, tuple[int, int, int]] = {}  # name -> (offset, row bytes, rows)
        off = 0
        for name, (dtype, shape, itemsize) in tensors.items():
            rows = int(shape[0])
            row_bytes = int(itemsize * int(np.prod(shape[1:], dtype=np.int64)))
            header[name] = {"dtype": dtype, "shape": [int(x) for x in shape],
                            "data_offsets": [off, off + rows * row_bytes]}
            self._layout[name] = (off, row_bytes, rows)
            off += rows * row_bytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the reference writer aligns the data to 8 bytes
        self._data_start = 8 + len(blob)
        self.nbytes = self._data_start + off
        self._written = {name: np.zeros(rows, dtype=bool) for name, (_, _, rows) in self._layout.items()}
        self._tmp = _tmp_name(self.path)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(blob)) + blob, 0)
        os.ftruncate(self._fd, self.nbytes)

    def write_rows(self, name: str, first: int, data: np.ndarray) -> None:
        """Rows ``first .. first + len(data)`` of tensor ``name`` (already in its dtype)."""
        off, row_bytes, rows = self._layout[name]
        data = np.ascontiguousarray(data)
        k = int(data.shape[0]) if data.ndim else 0
        buf = data.data.cast("B")
        if buf.nbytes != k * row_bytes or not (0 <= first and first + k <= rows):
            raise ValueError(f"{self.path.name}: rows {first}..{first + k} of {name!r} must be {row_bytes} bytes "
                             f"each within [0, {rows}), got {buf.nbytes} bytes")
        os.pwrite(self._fd, buf, self._data_start + off + first * row_bytes)
        self._written[name][first:first + k] = True

    def write_row(self, name: str, row: int, data: np.ndarray) -> None:
        self.write_rows(name, row, np.asarray(data)[None])

    def commit(self) -> None:
        missing = {k: int((~v).sum()) for k, v in self._written.items() if not v.all()}
        if missing:
            self.abort()
            raise StorageWriteError(f"{self.path}: rows never written {missing}; the export was interrupted "
                                    "or a sample failed to read. Re-run the export.")
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


@dataclass
class ExportResult:
    path: str
    num_samples: int
    num_shards: int
    shard_size: int
    bytes_written: int
    seconds: float


def nemo_manifest(cache: CacheReader, shard_size: int, layers: list[int] | None = None) -> dict[str, Any]:
    """The manifest NeMo's DSpark recipe validates (plus the supervision options it checks)."""
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
        "seq_length": m.seq_length,
        "dtype": str(m.output_dtype),  # an fp8 cache is exported dequantized, as bf16
        "num_samples": len(cache),
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


def _prepare_out(out: Path, cache_root: str, overwrite: bool) -> None:
    root = Path(cache_root).resolve() if "://" not in cache_root else None
    target = out.resolve()
    if root is not None and (target == root or root in target.parents):
        raise CacheFormatError(f"export destination {out} is inside the cache {cache_root}; choose a directory "
                               "outside it")
    if out.exists() and not out.is_dir():
        raise CacheFormatError(f"export destination {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    ours = [p for p in out.iterdir() if p.name in (NEMO_MANIFEST, NEMO_WEIGHTS) or
            (p.name.startswith("shard-") and p.name.endswith(".safetensors"))]
    others = [p for p in out.iterdir() if p not in ours and not p.name.startswith(".")]
    if others:
        names = ", ".join(sorted(p.name for p in others)[:5])
        raise CacheFormatError(f"export destination {out} holds other files ({names}); choose an empty directory "
                               "or one holding a previous export")
    if ours and not overwrite:
        raise CacheFormatError(f"export destination {out} already holds a NeMo DSpark cache ({len(ours)} files); pass "
                               "overwrite=True (--overwrite) to replace it or choose an empty directory")
    if ours:  # the manifest goes first, so a half-replaced directory never looks finished
        (out / NEMO_MANIFEST).unlink(missing_ok=True)
        for p in ours:
            p.unlink(missing_ok=True)
    for p in out.glob(".*.tmp"):
        p.unlink(missing_ok=True)


def _write_weights(tensors: dict[str, Any], out: Path) -> int:
    """embed_tokens.weight and lm_head.weight as float32 (NeMo's own writer's dtype), tied or not.

    ``tensors`` come from :meth:`CacheReader.target_weights`, which checked the file's sha256 and shapes.
    """
    emb = tensors["embed_tokens.weight"]
    head = tensors.get("lm_head.weight", emb)  # tied: the embedding is the head
    spec = {"embed_tokens.weight": ("F32", tuple(emb.shape), 4), "lm_head.weight": ("F32", tuple(head.shape), 4)}
    w = SafetensorsStreamWriter(out / NEMO_WEIGHTS, spec, {"format": "pt"})
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
                layers: list[int] | None = None) -> ExportResult:
    """Write NeMo AutoModel's DSpark offline cache for ``cache`` into ``out`` (a local directory).

    ``layers`` exports a subset of the captured layer ids (the manifest then names only
    those). Returns what was written; raises :class:`CacheFormatError` when ``out`` holds
    something else or a previous export and ``overwrite`` is false.
    """
    t0 = time.perf_counter()
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)) or shard_size < 1:
        raise ValueError(f"shard_size={shard_size} must be >= 1 (samples per shard)")
    c = cache if isinstance(cache, CacheReader) else open_cache(cache)
    if not c.complete:
        raise IncompleteCacheError(f"{c.path} is incomplete; NeMo's layout has no partial form. Finish the "
                                   "precompute run (re-run the same command) before exporting.")
    lids = c.check_layers(layers)
    out = Path(out)
    n, S, H = len(c), c.seq_length, c.hidden_size
    longest = int(c.lengths().max()) if n else 0
    if longest > S:
        raise CacheFormatError(f"{c.path}: a sample has {longest} tokens, more than seq_length={S}; the cache is "
                               "damaged. Run `dspark-cache verify` on it.")
    weights = c.target_weights()  # checked (sha256, shapes) before a previous export is replaced
    _prepare_out(out, c.path, overwrite)
    total = _write_weights(weights, out)
    del weights
    # what read_raw returns: fp8 states dequantized to bf16, the post-norm state in its own dtype
    st_dtype, st_last = StorageDtype(c.output_dtype).safetensors, StorageDtype(c.last_output_dtype).safetensors
    disk_dtype, last_disk = StorageDtype(c.output_dtype).disk, StorageDtype(c.last_output_dtype).disk
    width = H * len(lids)
    pad_id = c.pad_token_id
    starts = c.starts()
    num_shards = -(-n // shard_size)
    # row buffers reused across samples: the real tokens are copied in, the tail stays padding
    ids_row = np.empty(S, dtype=np.int64)
    mask_row = np.zeros(S, dtype=np.int64)
    attn_row = np.zeros(S, dtype=np.int64)
    hid_row = np.zeros((S, width), dtype=disk_dtype)
    last_row = np.zeros((S, H), dtype=last_disk)
    for k in range(num_shards):
        rows = np.arange(k * shard_size, min(n, (k + 1) * shard_size))
        spec = {
            "input_ids": ("I64", (len(rows), S), 8),
            "attention_mask": ("I64", (len(rows), S), 8),
            "loss_mask": ("I64", (len(rows), S), 8),
            "target_hidden_states": (st_dtype, (len(rows), S, width), disk_dtype.itemsize),
            "target_last_hidden_states": (st_last, (len(rows), S, H), last_disk.itemsize),
        }
        w = SafetensorsStreamWriter(out / shard_name(k), spec, {"format": "pt"})
        try:
            for i in rows[np.argsort(starts[rows], kind="stable")]:  # disk order: each chunk decoded once
                raw = c.read_raw(int(i), lids)
                m = len(raw["input_ids"])
                r = int(i) - k * shard_size
                ids_row[:] = pad_id
                ids_row[:m] = raw["input_ids"]
                mask_row[:] = 0
                mask_row[:m] = raw["loss_mask"]
                attn_row[:] = 0
                attn_row[:m] = 1
                hid_row[m:] = 0
                hid_row[:m] = raw["target_hidden_states"]
                last_row[m:] = 0
                last_row[:m] = raw["target_last_hidden_states"]
                w.write_row("input_ids", r, ids_row)
                w.write_row("attention_mask", r, attn_row)
                w.write_row("loss_mask", r, mask_row)
                w.write_row("target_hidden_states", r, hid_row)
                w.write_row("target_last_hidden_states", r, last_row)
            w.commit()
        except BaseException:
            w.abort()
            raise
        total += w.nbytes
        log.info("export: wrote %s (%d samples, %s)", shard_name(k), len(rows), human_bytes(w.nbytes))
    manifest = nemo_manifest(c, shard_size, lids)
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write_bytes(out / NEMO_MANIFEST, data)
    total += len(data)
    _fsync_dir(out)
    secs = time.perf_counter() - t0
    log.info("export: %d samples in %d shards, %s -> %s (%.1fs)", n, num_shards, human_bytes(total), out, secs)
    return ExportResult(str(out), n, num_shards, int(shard_size), total, secs)
