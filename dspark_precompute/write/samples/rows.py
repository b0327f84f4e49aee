"""Reading rows: every reader streams one row at a time (jsonl lines, a JSON array's values, parquet record
batches, ``datasets``), and a row larger than ``data.max_row_bytes`` becomes a ``row_too_large`` read error
without ever being held whole, so memory does not depend on what the data holds.
Row selection is: optional seeded shuffle -> split slice -> ``max_samples``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dspark_precompute.contract.vocab import RejectReason
from dspark_precompute.errors import DataError
from dspark_precompute.write.config.schema import DataConfig
from dspark_precompute.write.samples.files import READ_CHUNK, UTF8_BOM, DataSource, select_split, sniff
from dspark_precompute.write.samples.json_scan import JsonValues

log = logging.getLogger(__name__)


@dataclass
class RawRow:
    """One input row as read: its position in the source and either a record or a read error."""

    row: int  # 0-based index over the whole source (all files in order; blank jsonl lines skipped)
    line: int | None  # 1-based line in its file (jsonl, json), where the row starts
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, message) when the row could not be parsed
    file: str | None = None  # the file, relative to data.path (its name when data.path is a file)
    file_row: int | None = None  # 0-based row within that file


def _too_large(size: int | str, limit: int, what: str) -> tuple[str, str]:
    message = (f"{what} holds {size} bytes, more than data.max_row_bytes={limit}; it was not parsed (a row "
               f"costs a few hundred bytes of memory per byte to tokenize). Split or trim the row, or raise "
               f"data.max_row_bytes if the memory is there")
    return RejectReason.ROW_TOO_LARGE, message


def _parse(data: bytes, where: str) -> tuple[Any, tuple[str, str] | None]:
    """A JSON value from UTF-8 bytes, or (None, (reason, message))."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = (f"{where}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at byte {exc.start} of the row: "
                   f"{exc.reason}); if the file is in another encoding (Latin-1, cp1252), convert it to UTF-8, "
                   f"e.g. iconv -f cp1252 -t UTF-8")
        return None, (RejectReason.INVALID_UTF8, message)
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.msg == "Extra data":
            hint = ("; the row holds more than one JSON value" + (
                " (its lines seem to end with a bare \\r: convert the line ends to \\n)" if "\r" in text else ""))
        return None, (RejectReason.MALFORMED_JSON, f"{where}: {exc}{hint}")
    except RecursionError:
        message = (f"{where}: nested deeper than the JSON parser allows (about {sys.getrecursionlimit()} "
                   "levels); flatten the row")
        return None, (RejectReason.MALFORMED_JSON, message)
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        return None, (RejectReason.MALFORMED_JSON, f"{where}: {exc}")


def _bounded_lines(fh: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(1-based line number, the line without its end-of-line, its size) for each non-blank line.

    A line longer than ``limit`` comes back as None and is read past in 1 MiB steps,
    never held whole. A UTF-8 byte-order mark at a line start (a file's first line, or
    files concatenated) is dropped.
    """
    cap = limit + len(UTF8_BOM) + 2  # room for a BOM and \r\n around `limit` bytes of row
    lineno = 0
    while True:
        raw = fh.readline(cap)
        if not raw:
            return
        lineno += 1
        if len(raw) == cap and not raw.endswith(b"\n"):
            size, blank, tail = len(raw), not raw.strip(), b""
            while True:
                chunk = fh.readline(READ_CHUNK)
                size += len(chunk)
                blank = blank and not chunk.strip()
                if chunk:
                    tail = chunk[-2:]
                if not chunk or chunk.endswith(b"\n"):
                    break
            if not blank:
                yield lineno, None, size - (2 if tail.endswith(b"\r\n") else 1 if tail.endswith(b"\n") else 0)
            continue
        if raw.endswith(b"\n"):
            raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
        raw = raw.removeprefix(UTF8_BOM)
        if raw.strip():
            yield lineno, raw, len(raw)


def _jsonl_file(f: Path, rel: str, limit: int) -> Iterator[RawRow]:
    with open(f, "rb") as fh:
        sniff(fh.read(4096), rel)
        fh.seek(0)
        for n, (lineno, raw, size) in enumerate(_bounded_lines(fh, limit)):
            out = RawRow(-1, lineno, file=rel, file_row=n)
            if raw is None or size > limit:
                out.error = _too_large(size, limit, f"{rel}:{lineno}: the line")
            else:
                out.record, out.error = _parse(raw, f"{rel}:{lineno}")
            yield out


def _json_file(f: Path, rel: str, limit: int) -> Iterator[RawRow]:
    with open(f, "rb") as fh:
        sniff(fh.read(4096), rel)
        fh.seek(0)
        for n, (line, data, size) in enumerate(JsonValues(fh, rel, limit)):
            out = RawRow(-1, line, file=rel, file_row=n)
            if data is None:
                out.error = _too_large(size, limit, f"{rel}:{line}: the value")
            else:
                out.record, out.error = _parse(data, f"{rel}:{line}")
            yield out


def record_size(value: Any, limit: int) -> int:
    """About the bytes ``value`` takes as JSON (its text in UTF-8), counted only up to past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) if v.isascii() or len(v) > limit else len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, (bytes, bytearray)):
            total += len(v)
        else:
            total += 8
    return total


_RENDERED = ("messages", "conversations", "tools")


def _checked(rec: Any, out: RawRow, limit: int, where: str) -> RawRow:
    """A record read by pyarrow/datasets, or a row_too_large reject when what it would render is too large.

    Only the fields that reach the chat template count (other columns, an image say, are
    never tokenized); the record is already in memory, the limit guards the tokenizer.
    """
    rendered = {k: rec[k] for k in _RENDERED if k in rec} if isinstance(rec, dict) else rec
    size = record_size(rendered or rec, limit)
    if size > limit:
        out.error = _too_large(f"at least {size}", limit, f"{where}: its messages and tools")
    else:
        out.record = rec
    return out


def _parquet_file(f: Path, rel: str, limit: int) -> Iterator[RawRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{rel}: parquet input needs pyarrow (pip install pyarrow)") from None
    n = 0
    for batch in pq.ParquetFile(f).iter_batches(batch_size=64):
        for rec in batch.to_pylist():
            yield _checked(rec, RawRow(-1, None, file=rel, file_row=n), limit, f"{rel}: row {n}")
            n += 1


def _read_with_datasets(source: DataSource, split: str, limit: int) -> Iterator[RawRow]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.path={source.path!r} needs the `datasets` package (pip install datasets)"
        ) from None
    if source.kind == "hf_disk":
        ds = datasets.load_from_disk(source.path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(source.path, split=split)
    for i, rec in enumerate(ds):
        yield _checked(rec, RawRow(i, None, file_row=i), limit, f"row {i}")


_READERS = {"jsonl": _jsonl_file, "json": _json_file, "parquet": _parquet_file}


def _read_files(source: DataSource, limit: int) -> Iterator[RawRow]:
    row = 0
    for f in source.files:
        rel, n = source.rel(f), 0
        for out in _READERS[source.kind_of(f)](f, rel, limit):
            out.row = row
            row += 1
            n += 1
            yield out
        log.info("data: %s: %d rows", rel, n)


def iter_rows(source: DataSource, cfg: DataConfig) -> Iterator[RawRow]:
    """Rows of the selection in selection order (split slice, shuffle, max_samples).

    Streams the files when no shuffle is asked for, so memory does not grow with the data.
    """
    import itertools

    split, sl = cfg.split_slice()
    limit = int(cfg.max_row_bytes)
    if source.kind in ("hf_disk", "hub"):
        rows: Iterator[RawRow] = _read_with_datasets(source, split, limit)
    else:
        rows = _read_files(select_split(source, split), limit)
    streaming = cfg.shuffle_seed is None and (sl.start or 0) >= 0 and (sl.stop is None or sl.stop >= 0)
    if streaming:
        stop = sl.stop
        if cfg.max_samples is not None:
            stop = (sl.start or 0) + cfg.max_samples if stop is None else min(stop, (sl.start or 0) + cfg.max_samples)
        yield from itertools.islice(rows, sl.start, stop)
        return
    listed = list(rows)
    if cfg.shuffle_seed is not None:  # same permutation as datasets.Dataset.shuffle(seed=...)
        order = np.random.default_rng(cfg.shuffle_seed).permutation(len(listed))
        listed = [listed[i] for i in order]
    listed = listed[sl]
    if cfg.max_samples is not None:
        listed = listed[: cfg.max_samples]
    yield from listed


def read_rows(source: DataSource, cfg: DataConfig) -> list[RawRow]:
    """All rows of the selection, in selection order (see :func:`iter_rows`)."""
    return list(iter_rows(source, cfg))
