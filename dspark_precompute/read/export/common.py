"""What every export shares: the staging directory, its destination checks, write errors, the sample selection.

An export reads one sample at a time through the reader's public API (``read_raw``), in
disk order (each chunk decoded about once), and writes it straight to its place in the
target format. Memory is bounded by one sample's arrays, the reader's chunk cache and a
few integers per sample (the selection's tables), whatever the cache's size.

Every export is atomic the same way (:class:`StagedExport`): it is written into a staging
directory beside the destination, which is renamed onto it only when whole (its marker
file written last), so a killed or failed export never leaves a readable partial one and
never harms the previous export in the destination. Any OS error of a write (a full disk,
a read-only or unwritable destination) is a :class:`StorageWriteError` naming the path
and what to do, and the staging directory is removed.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.fp8 import convert
from dspark_precompute.contract.spec import POSITION_IDS
from dspark_precompute.contract.store import fsync_dir, write_atomically
from dspark_precompute.errors import CacheFormatError, ExportError, IncompleteCacheError, StorageWriteError
from dspark_precompute.faults import fault_point
from dspark_precompute.progress import Progress
from dspark_precompute.read.reader import CacheReader, open_cache

log = logging.getLogger(__name__)

EXPORT_MARKER = "dspark_export.json"  # written last into every staged export: what it is and where it came from
TARGETS = ("nemo", "deepspec", "specforge", "speculators")

# why an exported sample was left out (counted in the result, the log and the export's marker)
DROP_NO_SUPERVISED = "no_supervised_token_within_max_length"
DROP_NO_CONSECUTIVE = "no_two_consecutive_supervised_tokens"
DROP_IMAGE_ROWS = "holds_images"  # skip_image_rows=True: a sample whose images moved its positions (M-RoPE)


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` whole or not at all under a temporary name beside ``path``
    (:func:`~dspark_precompute.contract.store.write_atomically`)."""
    write_atomically(path, [data], tmp=tmp_name(path))


def bf16_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """bf16 bits (uint16) of a block in the reader's output dtype (rounded to nearest even from fp16/fp32)."""
    return values if dtype == "bf16" else convert(values, dtype, "bf16")


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


class SafetensorsStreamWriter:
    """A safetensors file whose tensors are filled one leading-axis row at a time.

    The header (names, dtypes, shapes, offsets) is fixed at creation, so rows can be
    written in any order straight to their place in a temporary file; :meth:`commit`
    checks every row was written, fsyncs and renames it into place.
    """

    def __init__(self, path: Path, tensors: dict[str, tuple[str, tuple[int, ...], int]],
                 metadata: dict[str, str] | None = None, *, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
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
        self._tmp = tmp_name(self.path)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(blob)) + blob, 0)
            os.ftruncate(self._fd, self.nbytes)
        except BaseException:  # a full disk at the header: no temporary is left behind
            self.abort()
            raise

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
        try:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


@dataclass
class ExportResult:
    """What an export wrote. ``num_shards`` counts the data files (shards, or one file per sample)."""

    path: str
    num_samples: int
    num_shards: int
    shard_size: int  # samples per shard (NeMo); 0 where shards are cut by bytes or hold one sample
    bytes_written: int
    seconds: float
    target: str = "nemo"
    layers: list[int] = field(default_factory=list)
    max_length: int | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> samples left out
    notes: list[str] = field(default_factory=list)  # conversions the format forced (fp8 dequantized, dtype cast)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())


def export_progress(target: str, sel: Selection, enabled: bool) -> Progress:
    """The shared progress reporter, for an export to ``target``: tokens, samples and bytes written."""
    return Progress(f"export {target}", sel.total_tokens, len(sel), enabled=enabled)


# -- the samples an export writes ----------------------------------------------------------
def keep_any_supervised(mask: np.ndarray) -> str | None:
    return None if mask.any() else DROP_NO_SUPERVISED


def keep_two_consecutive(mask: np.ndarray) -> str | None:
    """SpecForge's DFlash-family normalizer refuses a sample without two adjacent supervised tokens."""
    if not mask.any():
        return DROP_NO_SUPERVISED
    m = mask.astype(bool)
    return None if bool((m[:-1] & m[1:]).any()) else DROP_NO_CONSECUTIVE


@dataclass
class Selection:
    """Which cache samples an export writes, in export order, and how long each is after the cut."""

    cache: CacheReader
    layers: list[int]
    max_length: int | None
    samples: np.ndarray  # int64 [n]: cache sample index of export row j (ascending: the cache's own order)
    lengths: np.ndarray  # int64 [n]: tokens written for export row j
    dropped: dict[str, int]
    images: int = 0  # exported samples holding images (their positions are the 1-D ones the trainer builds)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def disk_order(self) -> np.ndarray:
        """Export rows sorted by where their tokens lie in the cache: each chunk is decoded about once."""
        return np.argsort(self.cache.starts()[self.samples], kind="stable")

    def read(self, j: int, *, last: bool = True, pre_norm: bool = False) -> dict[str, np.ndarray]:
        """Export row ``j``'s arrays (the reader's dtypes), cut to its exported length."""
        i = int(self.samples[j])
        raw = self.cache.read_raw(i, self.layers, last=last, pre_norm=True) if pre_norm else \
            self.cache.read_raw(i, self.layers, last=last)
        n = int(self.lengths[j])
        return {k: v[:n] for k, v in raw.items()}

    def iter_disk_order(self, **kw: bool) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        for j in self.disk_order():
            yield int(j), self.read(int(j), **kw)

    def read_tokens(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Export row ``j``'s ids and loss mask only (no hidden-state chunk is decoded)."""
        raw = self.cache.read_raw(int(self.samples[j]), [], last=False)
        n = int(self.lengths[j])
        return raw["input_ids"][:n], raw["loss_mask"][:n]


def open_complete(cache: str | Path | CacheReader, what: str) -> CacheReader:
    c = cache if isinstance(cache, CacheReader) else open_cache(cache)
    if not c.complete:
        raise IncompleteCacheError(f"{c.path} is incomplete; {what} has no partial form. Finish the precompute "
                                   "run (re-run the same command) before exporting.")
    return c


def check_max_length(max_length: int | None) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ExportError(f"max_length={max_length!r} must be a positive number of tokens (or None for no cut)")
    return int(max_length)


def _one_axis_positions(c: CacheReader, i: int, n: int) -> bool:
    """Whether sample ``i``'s first ``n`` tokens had the positions 0, 1, 2, ... on every axis (its ids, mask and
    positions are read; no state)."""
    pos = c.read_raw(int(i), [], last=False)[POSITION_IDS][:n]
    return bool((pos == np.arange(n, dtype=pos.dtype)[:, None]).all())


def image_rows(c: CacheReader, cut: np.ndarray, keep_row: np.ndarray, loader: str, skip_image_rows: bool) -> \
        np.ndarray:
    """The kept samples an export must leave out because they hold images (or videos) whose positions the trainer
    cannot reproduce (empty for a text cache).

    Every trainer here builds its draft's positions from the ids alone as 0, 1, 2, ... (``loader`` says where, in
    its own code) and reads no pixels, grids or positions; the states already hold the vision features. So an
    image row is exported as it is exactly when its target gave its ``cut`` tokens those positions: always for a
    target with one position axis (no ``position_ids`` stored), for an M-RoPE target only where the cut ends
    before an image moved them. Any other image row is refused, or left out with ``skip_image_rows``.
    """
    rows = c.image_rows()
    rows = rows[keep_row[rows]]
    if not len(rows) or not c.has_positions:
        return np.zeros(0, dtype=np.int64)
    moved = np.asarray([i for i in rows if not _one_axis_positions(c, int(i), int(cut[i]))], dtype=np.int64)
    if len(moved) and not skip_image_rows:
        axes = c.manifest.media.position_axes if c.manifest.media is not None else "several"
        raise ExportError(
            f"{c.path} holds {len(moved)} of {len(c)} samples with images or videos whose positions are not 0, 1, 2, "
            "...: the "
            f"target's multi-axis rotary (M-RoPE, position_ids of {axes} axes) moved them. {loader}, so its draft "
            "would train on positions the target never gave those tokens. Pass skip_image_rows=True "
            "(--skip-image-rows) to export the other rows (the count left out is recorded in the export's marker); "
            "none of the four trainers' offline loaders reads multi-axis positions (docs/trainers.md)")
    return moved


def select_export(c: CacheReader, layers: list[int] | None, max_length: int | None,
                  keep: Callable[[np.ndarray], str | None] = keep_any_supervised, *, loader: str = "",
                  skip_image_rows: bool = False) -> Selection:
    """Decide the exported samples: cut each at ``max_length`` tokens, drop those ``keep`` refuses.

    A causal target's states for the first L tokens do not depend on later ones, so a cut
    sample is exactly what a run at ``seq_length=L`` would have stored for it. Only the
    ids and masks are read to decide (a few bytes per token), and the positions of samples
    with images (:func:`image_rows`; ``loader`` says why the trainer cannot take moved ones).
    Every drop is counted by reason and logged; none is silent.
    """
    lids = c.check_layers(layers)
    max_length = check_max_length(max_length)
    n = len(c)
    full = np.asarray(c.lengths(), dtype=np.int64)
    if n and int(full.max()) > c.seq_length:
        raise CacheFormatError(f"{c.path}: a sample has {int(full.max())} tokens, more than seq_length="
                               f"{c.seq_length}; the cache is damaged. Run `dspark-cache verify` on it.")
    cut = full if max_length is None else np.minimum(full, max_length)
    keep_row = np.ones(n, dtype=bool)
    dropped: dict[str, int] = {}
    must_look = keep is not keep_any_supervised or (max_length is not None and bool((cut < full).any()))
    if must_look:
        starts = c.starts()
        for i in np.argsort(starts, kind="stable"):
            if keep is keep_any_supervised and cut[i] == full[i]:
                continue  # a stored sample always holds a supervised token
            mask = c.read_raw(int(i), [], last=False)["loss_mask"][: int(cut[i])]
            why = keep(mask)
            if why is not None:
                keep_row[i] = False
                dropped[why] = dropped.get(why, 0) + 1
    skipped = image_rows(c, cut, keep_row, loader, skip_image_rows)
    if len(skipped):
        keep_row[skipped] = False
        dropped[DROP_IMAGE_ROWS] = len(skipped)
    samples = np.flatnonzero(keep_row).astype(np.int64)
    for why, k in sorted(dropped.items()):
        log.warning("export: %d of %d samples left out: %s%s", k, n, why,
                    f" (max_length={max_length})" if max_length is not None else "")
    images = int(np.isin(samples, c.image_rows()).sum())
    if images:
        log.info("export: %d samples with images exported: their positions are 0, 1, 2, ..., what the trainer "
                 "builds; their features are in the states", images)
    return Selection(c, lids, max_length, samples, cut[samples], dropped, images)


# -- destinations --------------------------------------------------------------------------
Earlier = Callable[[Path], "dict[str, Any] | None"]
"""How a format recognises, in a directory without our marker, an export an earlier version of this tool wrote
there: its description (``format``; ``partial`` true for an unfinished one), or None."""


def refuse_inside_cache(out: Path, cache_root: str) -> None:
    root = Path(cache_root).resolve() if "://" not in cache_root else None
    target = out.resolve()
    if root is not None and (target == root or root in target.parents):
        raise CacheFormatError(f"export destination {out} is inside the cache {cache_root}; choose a directory "
                               "outside it")
    if out.exists() and not out.is_dir():
        raise CacheFormatError(f"export destination {out} is a file; give a directory")


def previous_export(out: Path) -> dict[str, Any] | None:
    """The marker of an export this tool finished in ``out``, or None."""
    try:
        return dict(json.loads((out / EXPORT_MARKER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_destination(out: Path, overwrite: bool, earlier: Earlier | None) -> None:
    """Refuse ``out`` unless it is absent, empty, an unfinished export (replaced) or a finished one (replaced only
    with ``overwrite``)."""
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    prev = previous_export(out) or (earlier(out) if earlier is not None else None)
    if prev is None:
        raise CacheFormatError(f"export destination {out} holds other files ({', '.join(entries[:5])}); choose an "
                               "empty directory or one holding a previous export")
    if prev.get("partial"):
        log.warning("export: %s holds an unfinished %s export (%d files, no manifest): it is replaced", out,
                    prev.get("format", "?"), len(entries))
    elif not overwrite:
        source = f" of {prev['source']}" if prev.get("source") else ""
        raise CacheFormatError(f"export destination {out} already holds a {prev.get('format', '?')} export{source}; "
                               "pass overwrite=True (--overwrite) to replace it or choose an empty directory")


_LEFT = re.compile(r"(?P<kind>partial|old)-(?P<pid>\d+)(?P<scratch>\.[a-z.]+)?")  # scratch: StagedExport.beside


def _clear_left_behind(out: Path) -> None:
    """Remove what killed exports to ``out`` left beside it (their process gone): staging directories and their
    scratch files. A previous export a kill caught set aside (between the two renames of :meth:`StagedExport.finish`)
    is put back when ``out`` is absent."""
    prefix = f".{out.name}."
    for p in sorted(out.parent.glob(glob.escape(prefix) + "*")):
        m = _LEFT.fullmatch(p.name[len(prefix):])
        if m is None or _pid_alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and m["scratch"] is None and not out.exists():
            log.warning("export: putting back %s, the previous export a killed export had set aside", out)
            os.replace(p, out)
        elif p.is_dir() and not p.is_symlink():
            log.info("export: removing %s, left by a killed export", p)
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class StagedExport:
    """An export written into a directory beside ``out`` and renamed onto it when whole (its marker file last).

    What killed exports left beside ``out`` is removed first. Then ``out`` must be absent, empty, hold an
    unfinished export (replaced) or a finished one (replaced only with ``overwrite``); anything else is refused
    before a byte of the export is written. A previous export stays whole until :meth:`finish` swaps the new one
    in. Every OS error of a write in :meth:`writing` becomes a :class:`StorageWriteError` naming ``out`` and what
    to do.
    """

    def __init__(self, out: Path, cache_root: str, overwrite: bool, what: str, *, earlier: Earlier | None = None):
        self.out = Path(out)
        self.what = what
        self.dir = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        refuse_inside_cache(self.out, cache_root)
        with self.writing():
            self.out.parent.mkdir(parents=True, exist_ok=True)
            _clear_left_behind(self.out)  # first: a previous export a kill had set aside is back in place
            _check_destination(self.out, overwrite, earlier)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The writes of the export: an OS error in this block is a :class:`StorageWriteError` saying why (the disk
        is full, the place is read-only) and what to do."""
        try:
            yield
        except OSError as exc:
            raise StorageWriteError.of(exc, f"exporting the {self.what} to {self.out}",
                                       "run the export again (nothing of this one is left behind; a previous "
                                       "export there is kept whole)", "choose another destination") from exc

    def beside(self, suffix: str) -> Path:
        """A scratch file next to the staging directory, removed with it (and after a kill)."""
        return self.dir.parent / f"{self.dir.name}.{suffix}"

    def sample_written(self, prog: Progress, tokens: int, nbytes: int) -> None:
        """One more sample is in the staging directory (the ``export_sample`` fault point)."""
        with self.writing():
            fault_point("export_sample")
        prog.update(1, tokens, nbytes)

    def finish(self, marker: dict[str, Any]) -> int:
        """Write the marker last, then put the staged directory in place of ``out``; returns the marker's bytes."""
        data = json_bytes(marker)
        with self.writing():
            atomic_write_bytes(self.dir / EXPORT_MARKER, data)
            fsync_dir(self.dir)
            old = self._set_aside()
            try:
                os.replace(self.dir, self.out)  # onto an absent or empty directory: one rename
            except BaseException:
                if old is not None:
                    os.replace(old, self.out)
                raise
            fsync_dir(self.out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return len(data)

    def _set_aside(self) -> Path | None:
        """Rename a previous export in ``out`` out of the way, whole (put back if the swap fails); None if none."""
        if not self.out.is_dir() or not any(self.out.iterdir()):
            return None
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(self.out, old)
        return old

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for p in self.dir.parent.glob(glob.escape(self.dir.name) + ".*"):
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def staging(stage: StagedExport, prog: Progress) -> Iterator[None]:
    """The writing of a staged export: on any failure (a Ctrl-C's KeyboardInterrupt included) the progress is
    closed and the staging directory removed, so nothing partial is left beside ``out``."""
    try:
        yield
    except BaseException:
        prog.close()
        stage.abort()
        raise


def export_marker(c: CacheReader, sel: Selection, target: str, notes: list[str], **extra: Any) -> dict[str, Any]:
    """What every staged export records about itself: format, source cache, layers, cut, drops and conversions."""
    from dspark_precompute.version import __version__

    m = c.manifest
    return {
        "format": target,
        "source": str(c.path),
        "source_config_hash": m.config_hash,
        "target_model": m.target_model,
        "layer_ids": list(sel.layers),
        "hidden_size": c.hidden_size,
        "seq_length": c.seq_length,
        "max_length": sel.max_length,
        "num_samples": len(sel),
        "num_tokens": sel.total_tokens,
        "dropped_samples": dict(sorted(sel.dropped.items())),
        "samples_with_images": sel.images,
        "source_storage_dtype": m.storage_dtype,
        "notes": list(notes),
        "dspark_precompute_version": __version__,
        **extra,
    }
