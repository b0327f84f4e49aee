"""Export a cache to SpecForge's offline DSpark features (``data.hidden_states_path``, SpecForge 0.2.0).

SpecForge 0.2.0 with ``training.strategy: dspark`` reads every ``*.ckpt`` / ``*.ckpt.gz``
below ``hidden_states_path`` (``specforge/runtime/data_plane/offline_reader.py``:
``os.walk``, then the absolute paths sorted as strings) and ``torch.load``\\s each as a
dict. Its DSpark normalizer (``specforge/algorithms/common/dflash_family_data.py``)
takes ``input_ids`` [T], ``loss_mask`` [T], ``hidden_states`` [T, k*H] or [1, T, k*H]
(the captured layers concatenated along hidden) and ``target_last_hidden_states``
[T, H] (after the final norm: its DSpark head applies ``lm_head`` to it directly), and
refuses a sample without two consecutive supervised tokens; such samples are left out
here, counted.

One file per sample: ``rows_<g>/data_<j>.ckpt`` with ``j`` and ``g`` (the first row of
a group of 5,000, as SpecForge's own writer groups them) zero-padded to nine digits, so
SpecForge's string sort gives the export order (its own ``data_10`` sorts before
``data_2``). ids and mask are int64 (what its own preparation stores); the states keep
the reader's dtype (bf16, fp16 or fp32; fp8 dequantized to bf16). The export is staged
beside ``out`` and renamed onto it when whole, so SpecForge never sees a partial one.
Memory: one sample.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from dspark_precompute.contract.vocab import MaskRule
from dspark_precompute.errors import ExportError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.read.export.common import (
    ExportResult,
    StagedExport,
    export_marker,
    export_progress,
    keep_two_consecutive,
    open_complete,
    select_export,
    staging,
)
from dspark_precompute.read.reader import CacheReader, to_torch

log = logging.getLogger(__name__)

GROUP = 5000  # files per folder, as SpecForge's prepare_hidden_states.py groups them
_WIDTH = 9  # digits: sorted as strings, names keep their numeric order up to 10**9 samples
# why SpecForge 0.2.0 cannot train on rows whose positions an M-RoPE target moved
SPECFORGE_POSITIONS = ("SpecForge 0.2.0's DSpark offline path reads no positions: build_dspark_offline_reader "
                       "(specforge/algorithms/common/dflash_family_data.py) loads input_ids, loss_mask, hidden_states "
                       "and target_last_hidden_states (a 'text' feature contract), and _forward_draft_blocks "
                       "(specforge/algorithms/common/dflash_family_model.py) builds its context positions as "
                       "torch.arange(seq_len)")


def sample_file(j: int) -> str:
    """Export row ``j``'s path relative to the export root."""
    g = (j // GROUP) * GROUP
    return f"rows_{g:0{_WIDTH}d}/data_{j:0{_WIDTH}d}.ckpt"


def export_specforge(cache: str | Path | CacheReader, out: str | Path, *, layers: list[int] | None = None,
                     max_length: int | None = None, overwrite: bool = False,
                     skip_image_rows: bool = False, progress: bool = True) -> ExportResult:
    """Write SpecForge's offline DSpark feature files for ``cache`` into ``out``."""
    t0 = time.perf_counter()
    c = open_complete(cache, "SpecForge's offline features")
    sel = select_export(c, layers, max_length, keep=keep_two_consecutive, loader=SPECFORGE_POSITIONS,
                        skip_image_rows=skip_image_rows)
    n = len(sel)
    if n >= 10**_WIDTH:
        raise ExportError(f"{n} samples: file names hold {_WIDTH} digits; export at most {10**_WIDTH - 1} samples "
                          "at a time (split the cache's data)")
    notes = ["fp8 states exported dequantized to bf16"] if c.manifest.storage_dtype == "fp8_e4m3" else []
    mask = c.manifest.capture.mask if c.manifest.capture is not None else None
    if mask is None or mask.rule != MaskRule.specforge:
        notes.append(f"loss masks follow the cache's rule ({mask.rule if mask and mask.rule else 'not recorded'}), "
                     "not SpecForge's own preparation; precompute with data.mask_rule=specforge for that")
    for note in notes:
        log.info("export specforge: %s", note)
    stage = StagedExport(Path(out), c.path, overwrite, "SpecForge offline features")
    total = 0
    prog = export_progress("specforge", sel, progress)
    with staging(stage, prog):
        made: set[str] = set()
        for j, raw in sel.iter_disk_order():
            rel = sample_file(j)
            item = {
                "input_ids": torch.from_numpy(raw["input_ids"].astype(np.int64)),
                "loss_mask": torch.from_numpy(raw["loss_mask"].astype(np.int64)),
                # clone: torch.save writes a tensor's whole storage, and a cut sample is a view of a longer one
                "hidden_states": to_torch(raw["target_hidden_states"], c.output_dtype).clone(),
                "target_last_hidden_states": to_torch(raw["target_last_hidden_states"], c.last_output_dtype).clone(),
            }
            with stage.writing():
                folder = rel.split("/")[0]
                if folder not in made:
                    (stage.dir / folder).mkdir(exist_ok=True)
                    made.add(folder)
                nbytes = save(item, stage.dir / rel)
            total += nbytes
            stage.sample_written(prog, len(raw["input_ids"]), nbytes)
        prog.close()
        total += stage.finish(export_marker(c, sel, "specforge", notes, layout="rows_<g>/data_<j>.ckpt",
                                            checked_with="specforge==0.2.0"))
    secs = time.perf_counter() - t0
    log.info("export specforge: %d samples, %s -> %s (%.1fs)", n, human_bytes(total), out, secs)
    return ExportResult(str(out), n, n, 1, total, secs, target="specforge", layers=list(sel.layers),
                        max_length=sel.max_length, dropped=dict(sel.dropped), notes=notes)


class _Recorded:
    """A file ``torch.save`` writes through, keeping the OS error of a failed write: torch reports that as its
    own ``RuntimeError`` ("unexpected pos"), which never says the disk is full."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def save(item: dict[str, torch.Tensor], path: Path) -> int:
    """``torch.save`` of one sample to ``path``; a failed write raises its own OSError. Returns the bytes written."""
    with open(path, "wb") as fh:
        rec = _Recorded(fh)
        try:
            torch.save(item, rec)  # type: ignore[arg-type]  # torch wants a file; write and flush are what it calls
        except RuntimeError:
            if rec.error is not None:
                raise rec.error from None
            raise
        return fh.tell()
