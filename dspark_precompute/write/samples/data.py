"""Input rows -> normalized conversations, with every bad row turned into a typed reject.

Reads ``.jsonl``/``.ndjson`` and ``.json`` natively and parquet through pyarrow, from one
file or from a directory (every data file below it, in sorted relative-path order); a saved
Hugging Face dataset directory or a hub id goes through ``datasets`` when installed.
Every reader streams and holds one row at a time, and a row larger than
``data.max_row_bytes`` is passed over in bounded steps and becomes a ``row_too_large``
reject, so memory does not depend on what the data holds (parquet is read one record
batch of a row group at a time).
Row selection is: optional seeded shuffle -> split slice -> ``max_samples``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dspark_precompute.contract.vocab import RejectReason
from dspark_precompute.errors import DataError
from dspark_precompute.write.config.schema import EMBEDDED, DataConfig

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "function_response": "tool",
}

# File types read as data (by suffix), in a directory or as data.path itself.
DATA_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
# Files in a data directory that are plainly not data: skipped with a log line.
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
# Names that mark a file as belonging to one split (train-00000-of-00001.parquet, test/x.jsonl).
SPLIT_WORDS = ("train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval", "evaluation")
COMPRESSED_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".zstd", ".zip", ".lz4", ".7z", ".tar", ".tgz"}
UTF8_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 20
# First bytes of a file that is not UTF-8 text: (magic, what it is, what to do).
_NOT_UTF8 = [
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian byte-order mark)", "convert it: iconv -f UTF-32 -t UTF-8"),
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian byte-order mark)", "convert it: iconv -f UTF-32 -t UTF-8"),
    (b"\xfe\xff", "UTF-16 (big-endian byte-order mark)", "convert it: iconv -f UTF-16 -t UTF-8"),
    (b"\xff\xfe", "UTF-16 (little-endian byte-order mark)", "convert it: iconv -f UTF-16 -t UTF-8"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it first (gunzip)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first (unzstd)"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first (unxz)"),
    (b"BZh", "bzip2-compressed", "decompress it first (bunzip2)"),
    (b"PK\x03\x04", "a zip archive", "extract it first"),
    (b"PAR1", "a parquet file", "give it the .parquet suffix"),
]


Reason = RejectReason  # the reject codes are part of the format: contract/vocab.py owns them


@dataclass
class RawRow:
    """One input row as read: its position in the source and either a record or a read error."""

    row: int  # 0-based index over the whole source (all files in order; blank jsonl lines skipped)
    line: int | None  # 1-based line in its file (jsonl, json), where the row starts
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, message) when the row could not be parsed
    file: str | None = None  # the file, relative to data.path (its name when data.path is a file)
    file_row: int | None = None  # 0-based row within that file


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


_MESSAGE_CAP = 2000  # a reject keeps at most this much of its message (values can be huge)


@dataclass
class Reject:
    row: int  # index in the selection, the numbering of samples/source_row
    reason: str
    message: str
    line: int | None = None  # 1-based line in a jsonl/json file
    file_row: int | None = None  # row in the source file (differs from row under a slice or shuffle)
    file: str | None = None  # the file, relative to data.path

    def __post_init__(self) -> None:
        if len(self.message) > _MESSAGE_CAP:
            self.message = self.message[:_MESSAGE_CAP] + "..."

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "file_row": self.row if self.file_row is None else self.file_row,
                "line": self.line, "file": self.file, "reason": self.reason, "message": self.message[:500]}


@dataclass
class DataSource:
    """Resolved identity of the data: the files read and the sha256 of their bytes.

    ``root`` is the directory the files were found in (None for a single file): reject
    records and the identity hash name each file by its path relative to it.
    """

    path: str
    files: list[Path] = field(default_factory=list)
    kind: str = "jsonl"  # jsonl | json | parquet (one file type) | files (by suffix) | hf_disk | hub
    root: Path | None = None
    split: str | None = None  # the split the files were already selected for

    def rel(self, f: Path) -> str:
        if self.root is None:
            return f.name
        return f.relative_to(self.root).as_posix()

    def kind_of(self, f: Path) -> str:
        if self.kind in ("jsonl", "json", "parquet"):
            return self.kind
        return DATA_SUFFIXES[f.suffix.lower()]

    def content_sha256(self) -> str:
        h = hashlib.sha256()
        if self.root is None:  # one file (the scheme every cache before directories were read whole used)
            for f in self.files:
                h.update(f.name.encode() + b"\0")
                _hash_file(h, f)
        else:  # a directory: every file read, framed by its relative path and size
            h.update(b"dspark-data-dir/1\0")
            for f in self.files:
                h.update(self.rel(f).encode("utf-8", "surrogateescape") + b"\0"
                         + str(f.stat().st_size).encode() + b"\0")
                _hash_file(h, f)
        if not self.files:  # hub dataset: identity is its id (revision pinning is the user's job)
            h.update(self.path.encode())
        return h.hexdigest()


def _hash_file(h: Any, f: Path) -> None:
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)


def embedded_data_path() -> Path:
    return Path(str(resources.files("dspark_precompute") / "assets" / "embedded_chat.jsonl"))


# -- finding the files ---------------------------------------------------------------------

def _not_data(name: str) -> bool:
    low = name.lower()
    return (name.startswith(".") or low.startswith(("readme", "license", "licence", "copying", "notice"))
            or low.endswith((".md", ".markdown", ".rst")) or low in METADATA_FILES)


def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


@dataclass
class _Walk:
    data: list[tuple[str, Path]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # plainly not data
    unknown: list[str] = field(default_factory=list)  # neither data nor plainly not data
    broken: list[str] = field(default_factory=list)  # cannot be read, with why


def _walk(root: Path) -> _Walk:
    """Every file below ``root`` (following symlinks, never into a loop), classified."""
    out = _Walk()
    todo = [(str(root), "", frozenset({os.path.realpath(root)}))]  # (directory, its relative path, ancestors)
    while todo:
        d, rel, ancestors = todo.pop()
        try:
            entries = list(os.scandir(d))
        except OSError as exc:
            out.broken.append(f"{rel or '.'}/ ({exc.strerror or exc})")
            continue
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            if _not_data(e.name):
                out.skipped.append(r + ("/" if e.is_dir() else ""))
                continue
            try:
                is_dir, is_file = e.is_dir(), e.is_file()  # both follow symlinks
            except OSError:
                is_dir = is_file = False
            if not (is_dir or is_file) and (e.is_symlink() or not os.path.lexists(e.path)):
                try:
                    os.stat(e.path)
                    why = "is not a regular file"
                except OSError as exc:
                    why = "does not exist" if exc.errno == errno.ENOENT else f"cannot be read: {exc.strerror}"
                target = f"a symbolic link to {os.readlink(e.path)!r}, which " if e.is_symlink() else ""
                out.broken.append(f"{r} ({target}{why})")
            elif is_dir:
                real = os.path.realpath(e.path)
                if real in ancestors:
                    log.warning("data: not following %s/: it links back to a directory that contains it", r)
                    continue
                todo.append((e.path, r, ancestors | {real}))
            elif is_file and Path(e.name).suffix.lower() in DATA_SUFFIXES:
                out.data.append((r, Path(e.path)))
            else:
                out.unknown.append(r)
    out.data.sort()
    out.skipped.sort()
    out.unknown.sort()
    out.broken.sort()
    return out


def _named_for(rel: str, split: str) -> bool:
    """Whether a file's path names it as part of ``split`` (a folder of that name, or a file name
    starting with it: ``train.jsonl``, ``train-00000-of-00002.parquet``, ``train/part1.json``)."""
    parts = rel.lower().split("/")
    s = split.lower()
    name = parts[-1]
    return s in parts[:-1] or (name.startswith(s) and len(name) > len(s) and name[len(s)] in "-._")


def select_split(source: DataSource, split: str) -> DataSource:
    """The files of a directory source that belong to ``split``.

    When some files are named for the split, only they are read (the others are named in a
    log line); when none is named for any split, every file is; when files are named only
    for other splits, that is an error.
    """
    if source.root is None or source.split == split or source.kind not in ("files",):
        return source
    rels = [(source.rel(f), f) for f in source.files]
    mine = [(r, f) for r, f in rels if _named_for(r, split)]
    if mine:
        others = [r for r, f in rels if not _named_for(r, split)]
        if others:
            log.info("data: split %r: reading the %d file(s) named for it, not %s", split, len(mine), _few(others))
        return DataSource(source.path, [f for _, f in mine], source.kind, source.root, split)
    named = {w: [r for r, _ in rels if _named_for(r, w)] for w in SPLIT_WORDS}
    named = {w: rs for w, rs in named.items() if rs}
    if named:
        listing = "; ".join(f"{w}: {_few(rs, 3)}" for w, rs in named.items())
        raise DataError(
            f"data.path={source.path!r}: no file is named for split {split!r}, but some are named for other "
            f"splits ({listing}); set data.split to one of {sorted(named)}, or rename the files"
        )
    return DataSource(source.path, source.files, source.kind, source.root, split)


def _sniff(head: bytes, rel: str) -> None:
    """Refuse a file that is plainly not UTF-8 text (other encodings, compressed, binary)."""
    for magic, what, fix in _NOT_UTF8:
        if head.startswith(magic):
            raise DataError(f"{rel}: the file is {what}, not UTF-8 JSON; {fix}")
    first = head.split(b"\n", 1)[0]
    if first and first.count(b"\0") * 4 >= len(first):
        raise DataError(f"{rel}: its first line is mostly NUL bytes: the file is UTF-16/UTF-32 without a "
                        "byte-order mark, or binary, not UTF-8 JSON; convert it, e.g. iconv -f UTF-16LE -t UTF-8")


def _file_problems(rel: str, f: Path, kind: str) -> list[str]:
    if kind == "parquet":
        return []
    try:
        with open(f, "rb") as fh:
            _sniff(fh.read(4096), rel)
    except DataError as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{rel}: cannot be read ({exc.strerror or exc})"]
    return []


def _needs_pyarrow(rels: list[str]) -> str | None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return f"{_few(rels)}: parquet input needs pyarrow (pip install pyarrow)"
    return None


def resolve_source(path: str, split: str | None = None) -> DataSource:
    """Find the files behind ``data.path`` without reading rows (only their first bytes).

    A directory is read whole: every ``.jsonl``/``.ndjson``/``.json``/``.parquet`` file below
    it, in sorted relative-path order (narrowed to the files named for ``split`` when given,
    see :func:`select_split`). Plainly non-data files (dotfiles, README, LICENSE, ``*.md``,
    dataset metadata JSON) are skipped with a log line; any other file is refused.
    """
    if path == EMBEDDED:
        return DataSource(path=EMBEDDED, files=[embedded_data_path()], kind="jsonl")
    p = Path(path).expanduser()
    if p.is_file():
        return _file_source(path, p)
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            arrow = sorted(p.rglob("*.arrow"))
            if arrow:  # written by datasets' save_to_disk
                _need_datasets(path, "a dataset saved with save_to_disk")
                return DataSource(path=str(p), files=arrow, kind="hf_disk", root=p)
        return _directory_source(path, p, split)
    _need_datasets(path, "not a local file or directory, so a Hugging Face hub dataset id")
    return DataSource(path=path, files=[], kind="hub")


def _file_source(path: str, p: Path) -> DataSource:
    """``data.path`` naming one file: a data suffix, readable, its reader installed; else a DataError."""
    suffix = p.suffix.lower()
    kind = DATA_SUFFIXES.get(suffix)
    if kind is None:
        hint = " (decompress it first)" if suffix in COMPRESSED_SUFFIXES else ""
        raise DataError(f"data.path={path!r}: unsupported file type {suffix!r}{hint}; "
                        "use .jsonl, .ndjson, .json or .parquet")
    problems = _file_problems(p.name, p, kind)
    if kind == "parquet" and (need := _needs_pyarrow([p.name])):
        problems.append(need)
    if problems:
        raise DataError(f"data.path={path!r}: " + "; ".join(problems))
    return DataSource(path=str(p), files=[p], kind=kind)


def _directory_source(path: str, p: Path, split: str | None) -> DataSource:
    """``data.path`` naming a directory of data files, read whole (narrowed to ``split``'s files when given): a
    broken, unknown or unreadable file, or none at all, is a DataError naming them."""
    walk = _walk(p)
    if walk.broken:
        raise DataError(f"data.path={path!r}: cannot read {_few(walk.broken)}; fix or remove them")
    if walk.unknown:
        compressed = [r for r in walk.unknown if Path(r).suffix.lower() in COMPRESSED_SUFFIXES]
        arrow_files = [r for r in walk.unknown if r.endswith(".arrow")]
        hint = (" Decompress the compressed ones." if compressed else "") + (
            " .arrow files are read only as a whole dataset saved with datasets' save_to_disk "
            "(point data.path at that folder)." if arrow_files else "")
        raise DataError(
            f"data.path={path!r} holds {len(walk.unknown)} file(s) that are not data this tool reads: "
            f"{_few(walk.unknown)}. A data directory is read whole (.jsonl, .ndjson, .json, .parquet, in any "
            f"subfolder); move the other files out, convert them, or point data.path at one file or a "
            f"subfolder.{hint}"
        )
    if walk.skipped:
        log.info("data: not reading %d file(s) that are not data: %s", len(walk.skipped), _few(walk.skipped))
    if not walk.data:
        raise DataError(f"data.path={path!r} is a directory without .jsonl, .ndjson, .json or .parquet files"
                        + (f" (it holds only {_few(walk.skipped)})" if walk.skipped else ""))
    problems = []
    for rel, f in walk.data:
        problems += _file_problems(rel, f, DATA_SUFFIXES[f.suffix.lower()])
    parquet = [rel for rel, f in walk.data if f.suffix.lower() == ".parquet"]
    if parquet and (need := _needs_pyarrow(parquet)):
        problems.append(need)
    if problems:
        raise DataError(f"data.path={path!r}: {len(problems)} file problem(s): " + "; ".join(problems[:5])
                        + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    source = DataSource(path=str(p), files=[f for _, f in walk.data], kind="files", root=p)
    return select_split(source, split) if split is not None else source


def _need_datasets(path: str, what: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(f"data.path={path!r} is {what}: reading it needs the `datasets` package "
                        "(pip install datasets)") from None


# -- reading rows --------------------------------------------------------------------------

def _too_large(size: int | str, limit: int, what: str) -> tuple[str, str]:
    message = (f"{what} holds {size} bytes, more than data.max_row_bytes={limit}; it was not parsed (a row "
               f"costs a few hundred bytes of memory per byte to tokenize). Split or trim the row, or raise "
               f"data.max_row_bytes if the memory is there")
    return Reason.ROW_TOO_LARGE, message


def _parse(data: bytes, where: str) -> tuple[Any, tuple[str, str] | None]:
    """A JSON value from UTF-8 bytes, or (None, (reason, message))."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = (f"{where}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at byte {exc.start} of the row: "
                   f"{exc.reason}); if the file is in another encoding (Latin-1, cp1252), convert it to UTF-8, "
                   f"e.g. iconv -f cp1252 -t UTF-8")
        return None, (Reason.INVALID_UTF8, message)
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.msg == "Extra data":
            hint = ("; the row holds more than one JSON value" + (
                " (its lines seem to end with a bare \\r: convert the line ends to \\n)" if "\r" in text else ""))
        return None, (Reason.MALFORMED_JSON, f"{where}: {exc}{hint}")
    except RecursionError:
        message = (f"{where}: nested deeper than the JSON parser allows (about {sys.getrecursionlimit()} "
                   "levels); flatten the row")
        return None, (Reason.MALFORMED_JSON, message)
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        return None, (Reason.MALFORMED_JSON, f"{where}: {exc}")


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
                chunk = fh.readline(_CHUNK)
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
        _sniff(fh.read(4096), rel)
        fh.seek(0)
        for n, (lineno, raw, size) in enumerate(_bounded_lines(fh, limit)):
            out = RawRow(-1, lineno, file=rel, file_row=n)
            if raw is None or size > limit:
                out.error = _too_large(size, limit, f"{rel}:{lineno}: the line")
            else:
                out.record, out.error = _parse(raw, f"{rel}:{lineno}")
            yield out


_NON_WS = re.compile(rb"[^ \t\r\n]")
_STRUCT = re.compile(rb'[\[\]{}"]')
_STRING_STOP = re.compile(rb'["\\]')
_SCALAR_END = re.compile(rb"[ \t\r\n,\]}]")


class _JsonValues:
    """The top-level values of a JSON file, found in bounded chunks without parsing the file.

    A top-level array gives its elements; otherwise each top-level value is one (a single
    object, or JSON lines saved as .json). Each comes back as (line, bytes, size) with
    bytes None when the value is larger than ``limit``: it is scanned past, never held.
    Structure (brackets, strings, escapes) is tracked only to find where values end; each
    value's own syntax is checked when it is parsed.
    """

    def __init__(self, fh: BinaryIO, rel: str, limit: int, chunk: int = _CHUNK):
        self.fh, self.rel, self.limit, self.chunk = fh, rel, limit, chunk
        self.buf = bytearray()
        self.pos = 0  # scan position in buf
        self.base = 0  # file offset of buf[0]
        self.keep: int | None = None  # file offset of the value being held, None when none is
        self.mark, self.line = 0, 1  # line number at buf[mark]

    def _line_at(self, i: int) -> int:
        self.line += self.buf.count(b"\n", self.mark, i)
        self.mark = i
        return self.line

    def _fill(self) -> bool:
        """Read the next chunk, dropping what is no longer needed. False at end of file."""
        if self.keep is not None and self.base + len(self.buf) - self.keep > self.limit:
            self.keep = None  # the value is over the limit: stop holding it
        drop = self.pos if self.keep is None else self.keep - self.base
        data = self.fh.read(self.chunk)
        if not data:
            return False
        if drop > self.mark:
            self._line_at(drop)
        del self.buf[:drop]
        self.base += drop
        self.pos -= drop
        self.mark -= drop
        self.buf += data
        return True

    def _error(self, what: str) -> DataError:
        line = self._line_at(max(self.mark, min(self.pos, len(self.buf))))
        return DataError(f"{self.rel}: not valid JSON near line {line} (byte {self.base + self.pos}): {what}; "
                         "fix the file, or save it as JSON lines (.jsonl) so a bad row is only that row's loss")

    def _peek(self) -> int | None:
        """The next non-whitespace byte, not consumed; None at end of file."""
        while True:
            m = _NON_WS.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self._fill():
                return None

    def _string(self) -> None:
        """Move past the closing quote of a string whose opening quote is consumed."""
        while True:
            m = _STRING_STOP.search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)
                if not self._fill():
                    raise self._error("the file ends inside a string")
                continue
            self.pos = m.end()
            if m.group() == b'"':
                return
            if self.pos >= len(self.buf) and not self._fill():  # a backslash: skip the byte it escapes
                raise self._error("the file ends inside a string")
            self.pos += 1

    def _value(self) -> tuple[int, bytes | None, int]:
        start = self.base + self.pos
        line = self._line_at(self.pos)
        self.keep = start
        first = self.buf[self.pos]
        self.pos += 1
        if first in b"[{":
            depth = 1
            while depth:
                m = _STRUCT.search(self.buf, self.pos)
                if m is None:
                    self.pos = len(self.buf)
                    if not self._fill():
                        raise self._error(f"the file ends inside the value that starts at line {line}")
                    continue
                self.pos = m.end()
                c = m.group()
                if c == b'"':
                    self._string()
                else:
                    depth += 1 if c in b"[{" else -1
        elif first == ord('"'):
            self._string()
        else:  # a number, true/false/null or garbage: up to the next delimiter
            while True:
                m = _SCALAR_END.search(self.buf, self.pos)
                if m is not None:
                    self.pos = m.start()
                    break
                self.pos = len(self.buf)
                if not self._fill():
                    break
        size = self.base + self.pos - start
        held = self.keep is not None and size <= self.limit
        data = bytes(self.buf[start - self.base:self.pos]) if held else None
        self.keep = None
        return line, data, size

    def __iter__(self) -> Iterator[tuple[int, bytes | None, int]]:
        self._fill()
        if self.buf.startswith(UTF8_BOM):
            self.pos = len(UTF8_BOM)
        c = self._peek()
        if c is None:
            return
        if c != ord("["):
            while self._peek() is not None:
                yield self._value()
            return
        self.pos += 1
        while True:
            c = self._peek()
            if c is None:
                raise self._error("the file ends inside the top-level array")
            if c == ord("]"):
                break
            yield self._value()
            c = self._peek()
            if c == ord(","):
                self.pos += 1
                continue
            if c == ord("]"):
                break
            raise self._error("expected ',' or ']' after an element of the top-level array"
                              if c is not None else "the file ends inside the top-level array")
        self.pos += 1
        if self._peek() is not None:
            raise self._error("more data after the top-level array")


def _json_file(f: Path, rel: str, limit: int) -> Iterator[RawRow]:
    with open(f, "rb") as fh:
        _sniff(fh.read(4096), rel)
        fh.seek(0)
        for n, (line, data, size) in enumerate(_JsonValues(fh, rel, limit)):
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


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any, path: str) -> tuple[str, int, int] | None:
    """The first string (value or key) holding a lone UTF-16 surrogate: (where, index, code point)."""
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and (m := _SURROGATE.search(v)):
                return where, m.start(), ord(m.group())
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                stack.append((x, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k!r}]"))
                if isinstance(k, str) and not k.isascii() and (m := _SURROGATE.search(k)):
                    return f"a key of {where}", m.start(), ord(m.group())
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _check_unicode(value: Any, path: str) -> None:
    found = _find_surrogate(value, path)
    if found:
        where, i, cp = found
        raise _RowProblem(
            Reason.INVALID_UTF8,
            f"{where} holds U+{cp:04X} at character {i}: the JSON escapes half of a UTF-16 surrogate pair "
            f"(\\u{cp:04x}) without its other half, so the text is not valid Unicode and cannot be encoded "
            f"as UTF-8. Fix the producer (it split a surrogate pair, e.g. by cutting a string), or replace "
            f"the escape with \\ufffd or the intended character",
        )


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise _RowProblem(Reason.MALFORMED_JSON, f"{what} is nested too deeply to parse") from None
    except ValueError as exc:
        raise _RowProblem(Reason.MALFORMED_JSON, f"{what} is not JSON: {exc}") from None


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} has a non-text part ({kind!r})")
        return " ".join(parts)
    raise _RowProblem(Reason.NON_TEXT_CONTENT, f"{where} is a JSON {_json_type(value)}, expected text")


class _RowProblem(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _normalize_message(m: Any, i: int, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _RowProblem(Reason.MISSING_MESSAGES, f"message {i} is a JSON {_json_type(m)}, expected an object")
    if sharegpt:
        raw_role = m.get("from", m.get("role"))
        role = SHAREGPT_ROLES.get(str(raw_role).lower()) if raw_role is not None else None
        content = m.get("value", m.get("content"))
    else:
        raw_role = m.get("role")
        role = raw_role if raw_role in ROLES else None
        content = m.get("content")
    if role is None:
        raise _RowProblem(Reason.UNKNOWN_ROLE, f"message {i} has role {raw_role!r}; expected one of {list(ROLES)}")
    out = {k: v for k, v in m.items() if k not in ("from", "value")}
    out["role"] = role
    out["content"] = _text(content, f"message {i} content")
    if "reasoning_content" in m and m["reasoning_content"] is not None:
        out["reasoning_content"] = _text(m["reasoning_content"], f"message {i} reasoning_content")
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if isinstance(calls, str):
            calls = _loads(calls, f"message {i} tool_calls")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, f"message {i} tool_calls must be a list of objects")
        out["tool_calls"] = calls
    return out


def normalize(raw: RawRow, fmt: str = "auto") -> Conversation | Reject:
    """Turn one raw row into a conversation the chat template can render, or a reject."""
    if raw.error is not None:
        return Reject(raw.row, raw.error[0], raw.error[1], raw.line, raw.file_row, raw.file)
    rec = raw.record
    try:
        if not isinstance(rec, dict):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row is a JSON {_json_type(rec)}, expected an object "
                                                       "with 'messages' or 'conversations'")
        if fmt == "messages" or (fmt == "auto" and "messages" in rec):
            msgs, sharegpt = rec.get("messages"), False
        elif fmt == "sharegpt" or (fmt == "auto" and "conversations" in rec):
            msgs, sharegpt = rec.get("conversations"), True
        else:
            raise _RowProblem(Reason.MISSING_MESSAGES, f"row has neither 'messages' nor 'conversations' "
                                                       f"(keys: {sorted(rec)[:8]})")
        if not isinstance(msgs, list):
            raise _RowProblem(Reason.MISSING_MESSAGES, f"'messages' is a JSON {_json_type(msgs)}, expected an array")
        if not msgs:
            raise _RowProblem(Reason.EMPTY_CONVERSATION, "the conversation has no messages")
        _check_unicode(msgs, "conversations" if sharegpt else "messages")
        _check_unicode(rec.get("tools"), "tools")
        messages = [_normalize_message(m, i, sharegpt) for i, m in enumerate(msgs)]
        if not any(m["role"] == "assistant" for m in messages):
            raise _RowProblem(Reason.NO_ASSISTANT_TURN, "the conversation has no assistant message to supervise")
        tools = rec.get("tools")
        if isinstance(tools, str):
            tools = _loads(tools, "'tools' (a string)") if tools.strip() else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _RowProblem(Reason.NON_TEXT_CONTENT, "'tools' must be a list of function schemas")
        return Conversation(messages=messages, tools=tools or None)
    except _RowProblem as exc:
        return Reject(raw.row, exc.reason, str(exc), raw.line, raw.file_row, raw.file)
