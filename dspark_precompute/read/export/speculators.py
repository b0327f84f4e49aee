"""Export a cache to vLLM speculators' offline training data (speculators 0.9.0, hs-connectors 0.9.0).

``speculators.train.data.ArrowDataset(max_len, datapath)`` loads ``datapath`` with
``datasets.load_from_disk`` (columns ``input_ids``, ``loss_mask``, ``seq_len``, torch
format) and, for row ``i``, ``datapath/hidden_states/hs_{i}.safetensors`` through
``hs_connectors.FileTransfer``: ``token_ids`` [T] (must equal the row's ``input_ids``,
else the sample is dropped as unavailable) and ``hidden_states`` [T, k+1, H] bf16. It
flattens slots ``[:-1]`` into the draft's input and takes slot ``-1`` as
``verifier_last_hidden_states``, to which the draft applies the verifier's final norm
itself (``speculators/models/eagle3/core.py``: ``self.verifier_norm(...)``): that slot
must be the last decoder output **before** the final norm. A cache holds it only when
made with ``capture.last_state=pre_norm`` or ``both``; any other is refused.

ids and masks are int64 (what speculators' own preprocessing stores); states are bf16
(fp8 dequantized, fp16/fp32 rounded to nearest even, and said so). The export is staged
beside ``out`` and renamed onto it when whole. Memory: one sample, plus ``datasets``'
writer batch (1,000 rows of ids and masks).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dspark_precompute.contract.spec import PRE_NORM
from dspark_precompute.errors import ExportError, MissingDependencyError
from dspark_precompute.humanize import human_bytes
from dspark_precompute.progress import Progress
from dspark_precompute.read.export.common import (
    ExportResult,
    SafetensorsStreamWriter,
    Selection,
    StagedExport,
    bf16_bits,
    export_marker,
    export_progress,
    open_complete,
    select_export,
    staging,
)
from dspark_precompute.read.reader import CacheReader

log = logging.getLogger(__name__)

HS_DIR = "hidden_states"
INSTALL = 'pip install "datasets>=4,<=5.1"  (or pip install -e ".[interop]")'
# why speculators 0.9.0 cannot train on rows whose positions an M-RoPE target moved
SPECULATORS_POSITIONS = ("speculators 0.9.0 reads no positions: BaseDataset.__getitem__ (speculators/train/data.py) "
                         "sets position_ids = torch.arange(seq_len) for every row, its own image rows included")




def hs_file(i: int) -> str:
    return f"{HS_DIR}/hs_{i}.safetensors"


@contextlib.contextmanager
def _datasets_bars(enabled: bool) -> Iterator[None]:
    """``datasets`` draws its own bars: only where ours would be drawn (a terminal, progress on)."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    if not (enabled and sys.stderr.isatty()):
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


def export_speculators(cache: str | Path | CacheReader, out: str | Path, *, layers: list[int] | None = None,
                       max_length: int | None = None, overwrite: bool = False,
                       skip_image_rows: bool = False, progress: bool = True) -> ExportResult:
    """Write vLLM speculators' ``datasets`` folder and ``hidden_states/hs_{i}.safetensors`` for ``cache``."""
    t0 = time.perf_counter()
    c = open_complete(cache, "speculators' training data")
    # first: image rows an M-RoPE target moved are refused (no re-run makes them exportable)
    sel = select_export(c, layers, max_length, loader=SPECULATORS_POSITIONS, skip_image_rows=skip_image_rows)
    if not c.has_pre_norm:
        last = c.manifest.capture.last_state if c.manifest.capture is not None else None
        raise ExportError(
            f"{c.path} stores no pre-norm last state (its last state is {last or 'post_final_norm'}): speculators "
            "puts the decoder's last output before the final norm in the last slot of hidden_states and applies the "
            "verifier's norm itself, so the post-norm state would be normalized twice. Re-run the precompute with "
            "capture.last_state=pre_norm (or both) to store it.")
    try:  # what _write_rows uses, checked before anything is written
        from datasets import Dataset, Features, Sequence, Value  # noqa: F401
        from datasets.arrow_writer import ArrowWriter  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(f"export to speculators writes a `datasets` folder: {INSTALL}") from exc
    n = len(sel)
    if not sel.layers:
        raise ExportError("layers=[]: speculators needs at least one captured layer before the verifier state")
    notes: list[str] = []
    if c.manifest.storage_dtype == "fp8_e4m3":
        notes.append("fp8 (e4m3) states exported dequantized to bf16")
    if c.output_dtype != "bf16" or c.last_output_dtype != "bf16":
        notes.append(f"{c.output_dtype} states rounded to bf16 (nearest even): speculators trains on bf16")
    for note in notes:
        log.warning("export speculators: %s", note)
    stage = StagedExport(Path(out), c.path, overwrite, "speculators training data")
    prog = export_progress("speculators", sel, progress)
    with staging(stage, prog):
        total = _write_hidden_states(stage, c, sel, prog)
        prog.close()
        _write_rows(stage, sel, progress)
        total += sum(p.stat().st_size for p in stage.dir.iterdir() if p.is_file())
        total += stage.finish(export_marker(c, sel, "speculators", notes, slots=[*sel.layers, PRE_NORM],
                                            checked_with="speculators==0.9.0, hs-connectors==0.9.0"))
    secs = time.perf_counter() - t0
    log.info("export speculators: %d samples, %s -> %s (%.1fs)", n, human_bytes(total), out, secs)
    return ExportResult(str(out), n, n, 1, total, secs, target="speculators", layers=list(sel.layers),
                        max_length=sel.max_length, dropped=dict(sel.dropped), notes=notes)


def _write_hidden_states(stage: StagedExport, c: CacheReader, sel: Selection, prog: Progress) -> int:
    """``hidden_states/hs_{j}.safetensors`` per export row, in disk order: ``token_ids`` and the captured layers with
    the pre-norm state as the last slot, bf16. Returns the bytes written."""
    H, k = c.hidden_size, len(sel.layers)
    total = 0
    with stage.writing():
        (stage.dir / HS_DIR).mkdir()
    for j, raw in sel.iter_disk_order(last=False, pre_norm=True):
        T = len(raw["input_ids"])
        hs = np.empty((T, k + 1, H), dtype=np.uint16)
        hs[:, :k, :] = bf16_bits(raw["target_hidden_states"], c.output_dtype).reshape(T, k, H)
        pre = raw[f"target_{PRE_NORM}_hidden_states"]
        hs[:, k, :] = bf16_bits(pre, c.last_output_dtype)  # a final state: stored as last_dtype
        with stage.writing():
            w = SafetensorsStreamWriter(stage.dir / hs_file(j), {
                "token_ids": ("I64", (T,), 8),
                "hidden_states": ("BF16", (T, k + 1, H), 2),
            }, {"format": "pt"}, fsync=False)
            try:
                w.write_rows("token_ids", 0, raw["input_ids"].astype(np.int64))
                w.write_rows("hidden_states", 0, hs)
                w.commit()
            except BaseException:
                w.abort()
                raise
        total += w.nbytes
        stage.sample_written(prog, T, w.nbytes)
    return total


def _write_rows(stage: StagedExport, sel: Selection, progress: bool) -> None:
    """The ``datasets`` folder of ids, masks and lengths (row ``j`` <-> ``hs_{j}``), through an Arrow file beside
    the staging directory (``datasets`` refuses to save a dataset into the folder holding its file); only ids and
    masks are read."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter

    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    rows_file = stage.beside("rows.arrow")
    with stage.writing():
        aw = ArrowWriter(features=features, path=str(rows_file), writer_batch_size=1000)
    try:
        for j in range(len(sel)):  # export order: row j <-> hs_{j}; only ids and masks are read here
            ids, mask = sel.read_tokens(j)
            with stage.writing():
                aw.write({"input_ids": ids.astype(np.int64), "loss_mask": mask.astype(np.int64),
                          "seq_len": int(len(ids))})
        with stage.writing():
            aw.finalize()
            aw.close()
    except BaseException:
        with contextlib.suppress(Exception):  # what failed is the error to report, not the close after it
            aw.close()
        raise
    with stage.writing():
        ds = Dataset.from_file(str(rows_file))
        ds.set_format("torch")
        with _datasets_bars(progress):
            ds.save_to_disk(str(stage.dir))
        del ds
        rows_file.unlink()
