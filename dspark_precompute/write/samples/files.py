"""Finding the data: a file, a directory read whole, a saved dataset or a hub id, and the hash of its bytes.

What ``data.path`` names becomes a :class:`DataSource`: the files read (sorted relative-path order,
metadata and split-named files sorted out), their kind by suffix, and a content hash that enters the cache
identity. Files that are not UTF-8 text (compressed, UTF-16/32) are refused before any row is read.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dspark_precompute.errors import DataError
from dspark_precompute.write.config.schema import EMBEDDED

log = logging.getLogger(__name__)


# File types read as data (by suffix), in a directory or as data.path itself.
DATA_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


# Files in a data directory that are plainly not data: skipped with a log line.
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


# Names that mark a file as belonging to one split (train-00000-of-00001.parquet, test/x.jsonl).
SPLIT_WORDS = ("train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval", "evaluation")


COMPRESSED_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".zstd", ".zip", ".lz4", ".7z", ".tar", ".tgz"}


UTF8_BOM = b"\xef\xbb\xbf"


READ_CHUNK = 1 << 20


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


def sniff(head: bytes, rel: str) -> None:
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
            sniff(fh.read(4096), rel)
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
