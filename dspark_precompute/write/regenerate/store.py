"""Resume by content: an append-only, fsynced log of finished rows keyed by content, and the ordered output.

Each finished row (regenerated, or finally rejected) is one JSON line of ``<output>.parts/log.jsonl``
keyed by :func:`row_key` (the source row's bytes and the sampling settings), written and fsynced
as it completes, in completion order. A kill at any moment leaves at most a torn last line, which
the next open cuts off; that run asks only the rows whose keys are missing. The output file is
built from the log in source order at the end, through a temporary file and an atomic rename, so
it holds exactly one row per source row or is the previous whole file. ``settings.json`` records
what the rows were made with; a run with other settings is refused, naming each change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dspark_precompute.contract.lock import WriterLock
from dspark_precompute.contract.store import write_atomically
from dspark_precompute.errors import RegenerateError, RegenerateResumeError, StorageWriteError
from dspark_precompute.faults import fault_point

log = logging.getLogger(__name__)

LOG = "log.jsonl"
SETTINGS = "settings.json"


def canonical(value: Any) -> bytes:
    """Sorted-key, compact JSON bytes (the same value gives the same bytes on every machine)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def row_key(record: Any, settings_sha: str) -> str:
    """The key of a source row under these settings: sha256 of its canonical JSON and of the settings."""
    return hashlib.sha256(canonical(record) + b"\0" + settings_sha.encode()).hexdigest()


def atomic_write(path: Path, lines: Iterable[bytes]) -> None:
    """Write ``path`` whole or not at all (:func:`~dspark_precompute.contract.store.write_atomically`)."""
    try:
        write_atomically(path, lines, tmp=path.with_name(f".{path.name}.tmp-{os.getpid()}"))
    except OSError as exc:
        raise StorageWriteError(f"cannot write {path}: {exc}; free space or fix the permissions, then run the same "
                                "command again (finished rows are kept)") from None


def _key_of(line: bytes, path: Path, n: int) -> str:
    """The key of one whole log line; a line that is not a record of ours is refused, naming it."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise RegenerateError(
            f"{path}: line {n} is not a finished row's record ({line[:80]!r}): the log was damaged or is not this "
            "tool's. Delete that line (the row is asked again) or the whole .parts directory (every row is), then "
            "run the same command again.")
    return str(record["key"])


class ResumeStore:
    """The finished rows of one output file (``parts`` directory beside it).

    Only where each finished row's line lies in the log is held in memory (a key and two numbers
    a row), never the rows: the paper's 1.3M rows stay a few hundred MB whatever their length.
    """

    def __init__(self, output: Path, settings: dict[str, Any]):
        self.output = output
        self.parts = output.with_name(output.name + ".parts")
        self.settings = json.loads(json.dumps(settings))
        self.settings_sha = hashlib.sha256(canonical(self.settings)).hexdigest()
        self._where: dict[str, tuple[int, int]] = {}  # key -> (offset, length) of its line in the log
        self._fh: BinaryIO | None = None
        self._lock = WriterLock(self.parts)

    def open(self) -> ResumeStore:
        """Take the parts directory's lock, read what earlier runs finished (refusing other settings) and open
        the log for appending. A second run on the same output while one runs is a :class:`LockedError`:
        two appenders would interleave their rows."""
        self._lock.acquire()
        try:
            return self._open()
        except BaseException:
            self._lock.release()
            raise

    def _open(self) -> ResumeStore:
        recorded = self.parts / SETTINGS
        if recorded.is_file():
            old = json.loads(recorded.read_text(encoding="utf-8"))
            diffs = [(k, old.get(k), self.settings.get(k)) for k in sorted(set(old) | set(self.settings))
                     if old.get(k) != self.settings.get(k)]
            if diffs:
                raise RegenerateResumeError(str(self.parts), diffs)
        else:
            atomic_write(recorded, [canonical(self.settings) + b"\n"])
        self._load()
        self._fh = open(self.parts / LOG, "ab")
        return self

    def _load(self) -> None:
        """Index the log line by line; a kill mid-line leaves a torn tail, which is cut off."""
        path = self.parts / LOG
        if not path.is_file():
            return
        offset = 0
        with open(path, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break
                self._where[_key_of(line, path, n)] = (offset, len(line))
                offset += len(line)
            torn = fh.seek(0, os.SEEK_END) - offset
        if torn:
            log.info("cutting a torn last line (%d bytes) off %s", torn, path)
            with open(path, "r+b") as fh:
                fh.truncate(offset)
                os.fsync(fh.fileno())

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def records(self, keys: Iterable[str]) -> Iterator[dict[str, Any]]:
        """The logged records of ``keys`` in that order (one open file for all of them)."""
        path = self.parts / LOG
        with open(path, "rb") as fh:
            for key in keys:
                offset, length = self._where[key]
                fh.seek(offset)
                line = fh.read(length)
                try:
                    record = json.loads(line)
                except ValueError:
                    record = {}
                if not isinstance(record, dict) or record.get("key") != key:
                    raise RegenerateError(
                        f"{path}: the {length} bytes at offset {offset} are not the logged row {key[:16]}...: the "
                        "log was changed while this run read it. Run the same command again (the log is read "
                        "afresh), and never run two regenerations on one output at once.")
                yield record

    def append(self, record: dict[str, Any]) -> None:
        """Make one finished row durable (it counts as done only once fsynced)."""
        assert self._fh is not None, "open() first"
        line = canonical(record) + b"\n"
        offset = self._fh.seek(0, os.SEEK_END)
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._where[record["key"]] = (offset, len(line))
        fault_point("regenerate_row")

    def close(self) -> None:
        """Close the log and drop the lock (the rows stay readable: :meth:`records` opens the log itself)."""
        try:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
        finally:
            self._lock.release()

    def build(self, keys: list[str], seen: Callable[[dict[str, Any]], None] | None = None) -> int:
        """Write the output: the regenerated row of each key, in this (source) order; the rows written.

        ``seen`` gets every logged record of ``keys`` as it is read (rejected rows too): the counts come
        from the same pass over the log as the output."""
        written = 0

        def lines() -> Iterator[bytes]:
            nonlocal written
            for record in self.records(k for k in keys if k in self._where):
                if seen is not None:
                    seen(record)
                if record.get("row") is not None:
                    written += 1
                    yield canonical(record["row"]) + b"\n"

        atomic_write(self.output, lines())
        return written
